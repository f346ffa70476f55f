"""The lane-order q8_0 kernel for AVX2 CPUs without AVX-512 VNNI (ggml_patch.py item 3; spliced into
arch/x86/quants.c after ggml_patch_lanes.LANES_KERNEL, whose helpers and row buffer it shares). It forms the
same exact integer block sums as the VNNI kernel with AVX2's instructions, then the same float operations in the
same order, so its results equal the VNNI kernel's bit for bit: a verify block equals 1-token steps on either CPU,
and the two CPUs give the same logits.
"""

from __future__ import annotations

LANES_AVX2_KERNEL = (
    "// fimble (engine/runtimes/ggml_patch_lanes_avx2.py): the lane order on AVX2 without VNNI.\n"
    r"""#include <string.h>  // (strcmp, in fimble_q8_0_lanes)
// A block's 32 products in integers: vpmaddubsw(|w|, sign(y, w)) (pairs, exact: |w| <= 128, |y| <= 127, as in
// ggml's own AVX2 loop: any weight, and activations as ggml quantises them, never -128), vpmaddwd(., 1) (quads),
// summed over the group's eight quants vectors. A row costs 16 multiplies per eight blocks (stock's loop: the same
// 16, plus eight converts and eight FMAs); the weights' transpose, |w| and scales are formed once per eight blocks for
// every row of the pass. On this project's Zen 3 the sign and both multiplies share two pipes, so a block-row takes
// about 2 cycles (bench/q8_kernel.py). The float part is the VNNI kernel's: dx*dy, one convert, one FMA per eight
// blocks, hsum_float_8.

static inline __attribute__((always_inline)) void fimble_lanes2_prepare(
        const int nb, const int nr, const char * GGML_RESTRICT vy, const size_t by) {
    fimble_lanes_rows_t * b = &fimble_lanes_buf;
    if (b->vy == vy && b->nr == nr && b->nb == nb && b->by == by && b->layout == FIMBLE_ROWS_AVX2) {
        return;  // this product's rows, prepared by an earlier call
    }
    const int ng = (nb + 7) / 8;
    fimble_lanes_reserve(b, (size_t) nr * ng);
    for (int r = 0; r < nr; ++r) {
        const block_q8_0 * GGML_RESTRICT y = (const block_q8_0 *) (vy + r*by);
        for (int g = 0; g < ng; ++g) {
            const size_t at = (size_t) r*ng + g;
            const int m = nb - 8*g < 8 ? nb - 8*g : 8;
            __m256i c[8];
            int nv = 8;
            if (m == 8) {
                fimble_lanes_transpose(y + 8*g, 8, c);
            } else if (m > 4) {
                fimble_lanes_transpose(y + 8*g, m, c);
            } else {
                fimble_lanes_transpose4(y + 8*g, m, c);
                nv = 4;
            }
            for (int k = 0; k < nv; ++k) {
                _mm256_store_si256((__m256i *) (b->q + 256*at + 32*k), c[k]);
            }
            _mm256_store_ps(b->d + 8*at, fimble_lanes_scales(y + 8*g, m));
        }
    }
    b->vy = vy, b->nr = nr, b->nb = nb, b->by = by, b->layout = FIMBLE_ROWS_AVX2;
}

// PACKED (a constant): x's row is in fimble_q8_0_pack's layout (ggml_patch_packed.py), whose groups of eight and of
// four blocks hold their scales and lane-order quants as this loop uses them: loaded, not gathered and transposed.
// The same bytes per group, so a group starts where its blocks did in either layout; other groups are blocks in both.
// The integer sums run quants-vector outer, rows inner (up to eight rows' sums in registers): each weight vector and
// its |w| are formed once and used by every row straight away, and a row's only load is its own activations. The
// sums are exact integers, so their order is free; the float part (dx*dy, convert, FMA per group) is unchanged.
static inline __attribute__((always_inline)) void fimble_lanes2_sums(
        const int NV, const int nc, const __m256i * w, const int8_t * GGML_RESTRICT q, const size_t stride,
        __m256i is[8]) {
    // nc rows' exact sums over NV weight vectors: row j's activations start at q + j*stride
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < nc; ++j) {
        is[j] = _mm256_setzero_si256();
    }
#pragma GCC unroll 8
    for (int k = 0; k < NV; ++k) {
        const __m256i wk = w[k], ak = _mm256_abs_epi8(wk);  // (-128 gives 0x80: 128 unsigned, right)
#pragma GCC unroll 8
        for (int j = 0; j < nc; ++j) {
            const __m256i y = _mm256_load_si256((const __m256i *) (q + j*stride + 32*k));
            is[j] = _mm256_add_epi32(is[j], _mm256_madd_epi16(_mm256_maddubs_epi16(ak, _mm256_sign_epi8(y, wk)), ones));
        }
    }
}

static inline __attribute__((always_inline)) void fimble_lanes2_rows(
        const int NR, const int nb, float * GGML_RESTRICT s, const size_t bs, const block_q8_0 * GGML_RESTRICT x,
        const int PACKED) {
    const int8_t * GGML_RESTRICT bq = fimble_lanes_buf.q;  // (locals: the loop never reads thread-local memory)
    const float * GGML_RESTRICT bd = fimble_lanes_buf.d;
    const int ng = (nb + 7) / 8;
    __m256i w[8];  // the group's weights, transposed
    __m256 acc[16];
    for (int r = 0; r < NR; ++r) {
        acc[r] = _mm256_setzero_ps();
    }
    for (int g = 0; g < ng; ++g) {
        const int m = nb - 8*g < 8 ? nb - 8*g : 8;
#pragma GCC unroll 5
        for (int p = 0; p < 5; ++p) {  // the weights stream from memory while the rows compute: 2 KB ahead
            _mm_prefetch((const char *) (x + 8*g) + 2048 + 64*p, _MM_HINT_T0);
        }
        if (m <= 4) {  // the packed group of one to four blocks (only a row's last group can be one)
            const __m128 dx4 = fimble_lanes_group4(x + 8*g, m, PACKED, w);
            for (int r0 = 0; r0 < NR; r0 += 8) {
                const int nc = NR - r0 < 8 ? NR - r0 : 8;
                __m256i is[8];
                fimble_lanes2_sums(4, nc, w, bq + 256*((size_t) r0*ng + g), 256*(size_t) ng, is);
                for (int j = 0; j < nc; ++j) {
                    const int r = r0 + j;
                    acc[r] = fimble_lanes_fma4(is[j], dx4, bd + 8*((size_t) r*ng + g), acc[r]);
                }
            }
            continue;
        }
        __m256 dx;
        if (PACKED && m == 8) {  // 8 scales, then the eight vectors
            const uint8_t * gp = (const uint8_t *) (x + 8*g);
            dx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) gp));
#pragma GCC unroll 8
            for (int k = 0; k < 8; ++k) {
                w[k] = _mm256_loadu_si256((const __m256i *) (gp + 16 + 32*k));
            }
        } else {
            dx = fimble_lanes_weights(x + 8*g, m, w);
        }
        for (int r0 = 0; r0 < NR; r0 += 8) {
            const int nc = NR - r0 < 8 ? NR - r0 : 8;
            __m256i is[8];
            fimble_lanes2_sums(8, nc, w, bq + 256*((size_t) r0*ng + g), 256*(size_t) ng, is);
            for (int j = 0; j < nc; ++j) {
                const int r = r0 + j;
                const __m256 d = _mm256_mul_ps(dx, _mm256_load_ps(bd + 8*((size_t) r*ng + g)));
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(is[j]), acc[r]);
            }
        }
    }
    for (int r = 0; r < NR; ++r) {
        s[r*bs] = hsum_float_8(acc[r]);
    }
}

static __attribute__((noinline)) void fimble_lanes2_all(
        const int nb, const int nx, const int nr, float * GGML_RESTRICT s, const size_t bs,
        const char * GGML_RESTRICT vx, const size_t bx, const char * GGML_RESTRICT vy, const size_t by) {
    fimble_lanes2_prepare(nb, nr, vy, by);
    for (int i = 0; i < nx; ++i) {
        FIMBLE_LANES_DISPATCH(fimble_lanes2_rows, nr, nb, s + i, bs, (const block_q8_0 *) (vx + i*bx), 0)
    }
}

// Both lane kernels' entry: VNNI's where the CPU has it (fimble_q8_0_lanes() == 2), else AVX2's.
void fimble_vec_dot_q8_0_q8_0_lanes(int n, int nx, int nr, float * GGML_RESTRICT s, size_t bs,
                                    const void * GGML_RESTRICT vx, size_t bx,
                                    const void * GGML_RESTRICT vy, size_t by) {
    assert(n % QK8_0 == 0 && n <= FIMBLE_Q8_0_MAX_N && nr >= 1 && nr <= FIMBLE_Q8_0_ROWS);
    (fimble_q8_0_lanes() == 2 ? fimble_lanes_all : fimble_lanes2_all)(
        n / QK8_0, nx, nr, s, bs, (const char *) vx, bx, (const char *) vy, by);
}

"""
)
