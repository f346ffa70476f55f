"""The lane-order q8_0 kernel's C text (ggml_patch.py item 3, where it is spliced into arch/x86/quants.c):
every q8_0 product of 1-16 rows on a CPU with AVX-512 VNNI, 1-token steps and prefills included. Kept apart so
each patch module stays small; ggml_patch.PATCHES holds the whole text, so editing this rebuilds the library.
"""

from __future__ import annotations

LANES_KERNEL = (
    "// fimble (engine/runtimes/ggml_patch.py): q8_0 products in the lane order, on CPUs with AVX-512 VNNI (256-bit\n"
    r"""// vectors; the build stays AVX2). ggml_vec_dot_q8_0_q8_0 sums a block's 32 products in eight float lanes and
// FMAs them into eight accumulators: a float operation per lane per block for every activation row, which put an
// 8-row verify pass at ~2.9x a step here. The lane order instead gives each of eight consecutive blocks one lane:
// a block's 32 products are summed in integers (exact, in any order), so a row needs one vpdpbusd per block and
// one convert, multiply and FMA per eight blocks. Lane j of the accumulator adds blocks j, j+8, j+16, ... in order
// (fmaf(dx*dy, isum, acc): dx*dy is exact, two halves' product), then ggml's hsum_float_8. Every row, in a pass of
// 1 to 16, runs exactly these operations: a verify block's rows equal 1-token steps bit for bit, and 1-token
// steps take this kernel too (an order of fimble's own, so near-ties may resolve unlike stock llama.cpp).
// Weights are used as unsigned (w + 128, an xor): dpbusd(w + 128, y) = w.y + 128 * sum(y), and each activation
// row's -128 * sum(y) per block starts its integer sum.
#define FIMBLE_LANES_T __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

// Eight consecutive blocks' quants transposed: lane j of c[k] holds bytes 4k..4k+3 of block j. Blocks at or past
// m (1..8) read as zero.
// (These helpers are plain AVX2, inlined into the AVX2 lane kernel too: ggml_patch_lanes_avx2.py.)
static inline __attribute__((always_inline)) void fimble_lanes_transpose(
        const block_q8_0 * GGML_RESTRICT x, const int m, __m256i c[8]) {
    const __m256i z = _mm256_setzero_si256();
#define FIMBLE_LD(j) (m > j ? _mm256_loadu_si256((const __m256i *) x[j].qs) : z)
    const __m256i r0 = FIMBLE_LD(0), r1 = FIMBLE_LD(1), r2 = FIMBLE_LD(2), r3 = FIMBLE_LD(3);
    const __m256i r4 = FIMBLE_LD(4), r5 = FIMBLE_LD(5), r6 = FIMBLE_LD(6), r7 = FIMBLE_LD(7);
#undef FIMBLE_LD
    const __m256i t0 = _mm256_unpacklo_epi32(r0, r1), t1 = _mm256_unpackhi_epi32(r0, r1);
    const __m256i t2 = _mm256_unpacklo_epi32(r2, r3), t3 = _mm256_unpackhi_epi32(r2, r3);
    const __m256i t4 = _mm256_unpacklo_epi32(r4, r5), t5 = _mm256_unpackhi_epi32(r4, r5);
    const __m256i t6 = _mm256_unpacklo_epi32(r6, r7), t7 = _mm256_unpackhi_epi32(r6, r7);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    c[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
    c[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    c[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
    c[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    c[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
    c[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    c[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
    c[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// A group of at most four blocks (the last of a 28-block row, 896 columns: most of the default model's products)
// is packed into four vectors, not eight: lane j (j < 4) of u[k] holds bytes 4k..4k+3 of block j, lane j + 4 bytes
// 16+4k..16+4k+3 of block j (fimble_lanes_transpose's first two steps). Each row then adds its low and high
// halves into the four blocks' exact sums: half the multiplies, the same sums, and the FMA leaves lanes 4-7 as the
// eight-lane kernel's FMA with zero scales does (acc + 0 = acc: acc is never -0, it starts at +0).
static inline __attribute__((always_inline)) void fimble_lanes_transpose4(
        const block_q8_0 * GGML_RESTRICT x, const int m, __m256i u[4]) {
    const __m256i z = _mm256_setzero_si256();
#define FIMBLE_LD(j) (m > j ? _mm256_loadu_si256((const __m256i *) x[j].qs) : z)
    const __m256i r0 = FIMBLE_LD(0), r1 = FIMBLE_LD(1), r2 = FIMBLE_LD(2), r3 = FIMBLE_LD(3);
#undef FIMBLE_LD
    const __m256i t0 = _mm256_unpacklo_epi32(r0, r1), t1 = _mm256_unpackhi_epi32(r0, r1);
    const __m256i t2 = _mm256_unpacklo_epi32(r2, r3), t3 = _mm256_unpackhi_epi32(r2, r3);
    u[0] = _mm256_unpacklo_epi64(t0, t2), u[1] = _mm256_unpackhi_epi64(t0, t2);
    u[2] = _mm256_unpacklo_epi64(t1, t3), u[3] = _mm256_unpackhi_epi64(t1, t3);
}

// The eight blocks' scales as floats (zero at or past m).
static inline __attribute__((always_inline)) __m256 fimble_lanes_scales(
        const block_q8_0 * GGML_RESTRICT x, const int m) {
    if (m == 8) {
        return _mm256_cvtph_ps(_mm_setr_epi16(x[0].d, x[1].d, x[2].d, x[3].d, x[4].d, x[5].d, x[6].d, x[7].d));
    }
    ggml_half h[8] = {0};
    for (int j = 0; j < m; ++j) {
        h[j] = x[j].d;
    }
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) h));
}

// A group of weight blocks in lane order (fimble_lanes_transpose) and their scales (fimble_lanes_scales), m of 8 there.
static inline __attribute__((always_inline)) __m256 fimble_lanes_weights(
        const block_q8_0 * GGML_RESTRICT x, const int m, __m256i c[8]) {
    if (m == 8) {  // (a constant for the inlined loads: no test per block)
        fimble_lanes_transpose(x, 8, c);
        return fimble_lanes_scales(x, 8);
    }
    fimble_lanes_transpose(x, m, c);
    return fimble_lanes_scales(x, m);
}

// A group of one to four blocks in four vectors (fimble_lanes_transpose4's layout) and its scales: loaded where PACKED
// and the group is four (fimble_q8_0_pack wrote 4 scales, then the vectors), else gathered and transposed from blocks.
// (Both lane kernels read a row's last, short group through this.)
static inline __attribute__((always_inline)) __m128 fimble_lanes_group4(
        const block_q8_0 * GGML_RESTRICT x, const int m, const int PACKED, __m256i c[4]) {
    if (PACKED && m == 4) {
        const uint8_t * gp = (const uint8_t *) x;
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
            c[k] = _mm256_loadu_si256((const __m256i *) (gp + 8 + 32*k));
        }
        return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *) gp));
    }
    fimble_lanes_transpose4(x, m, c);
    return _mm256_castps256_ps128(fimble_lanes_scales(x, m));
}

// The float part of a group of at most four blocks in four vectors (fimble_lanes_transpose4): lanes j and j + 4 of is
// hold block j's two halves' exact sums; their sum's FMA goes to lanes 0-3 of acc, lanes 4-7 stay as they are.
static inline __attribute__((always_inline)) __m256 fimble_lanes_fma4(
        const __m256i is, const __m128 dx4, const float * GGML_RESTRICT dy, const __m256 acc) {
    const __m128i i4 = _mm_add_epi32(_mm256_castsi256_si128(is), _mm256_extracti128_si256(is, 1));
    const __m128 d = _mm_mul_ps(dx4, _mm_load_ps(dy));
    const __m128 lo = _mm_fmadd_ps(d, _mm_cvtepi32_ps(i4), _mm256_castps256_ps128(acc));
    return _mm256_blend_ps(acc, _mm256_castps128_ps256(lo), 0x0F);
}

// The activation rows in lane order, per row and group of eight blocks: 256 bytes of quants (fimble_lanes_transpose),
// eight scales and eight -128 * sum(quants). The VNNI kernel's rows are stored group by group, a group's rows side
// by side where the kernel reads them together: each row's address is a constant offset and a span's rows are
// contiguous (C harness, 1 thread, 896-column weights in L2: 8 rows 15.8 -> 13.7 ms); the AVX2 kernel's row by row.
// Kept per thread, grown as needed (never freed: ggml's threads persist), and prepared once per product: every call
// of a product reads the same rows (src1 is quantised before its chunks run), so the rows' key (where, how many, how
// long) is valid until ggml_compute_forward_mul_mat's next call (fimble_q8_0_lanes_forget), where the same memory
// may hold other rows.
typedef struct {
    int8_t * q; float * d; int32_t * c; size_t cap;  // the rows
    const char * vy; int nr, nb; size_t by;          // their key
    int layout;  // and which prepare wrote them (FIMBLE_ROWS_*: the kernels lay out a short group differently)
} fimble_lanes_rows_t;
#define FIMBLE_ROWS_VNNI 1         // fimble_lanes_prepare_vnni: every group in eight vectors, -128 * sum(quants)
#define FIMBLE_ROWS_AVX2 2         // fimble_lanes2_prepare: a group of at most four blocks in four vectors
#define FIMBLE_ROWS_VNNI_PACKED 3  // fimble_lanes_prepare_vnni: AVX2's layout, with -128 * sum(quants)
static __thread fimble_lanes_rows_t fimble_lanes_buf;

void fimble_q8_0_lanes_forget(void) {
    fimble_lanes_buf.vy = NULL;
}

// Room for `groups` groups of eight blocks of rows in b.
static void fimble_lanes_reserve(fimble_lanes_rows_t * b, const size_t groups) {
    if (groups > b->cap) {
        free(b->q); free(b->d); free(b->c);
        b->q = aligned_alloc(32, groups * 256);
        b->d = aligned_alloc(32, groups * 32);
        b->c = aligned_alloc(32, groups * 32);
        b->cap = groups;
        if (!b->q || !b->d || !b->c) {  // (another kernel would sum in another order: no fallback)
            GGML_ABORT("fimble: out of memory for the q8_0 lane-order rows");
        }
    }
}

// The VNNI kernels' rows: each group's quants in lane order, eight scales and each lane's -128 * sum(quants). LAYOUT
// FIMBLE_ROWS_VNNI: every group in eight vectors; FIMBLE_ROWS_VNNI_PACKED: a group of at most four blocks in four
// (fimble_lanes_transpose4), as packed weights hold it.
static inline __attribute__((always_inline)) FIMBLE_LANES_T void fimble_lanes_prepare_vnni(
        const int nb, const int nr, const char * GGML_RESTRICT vy, const size_t by, const int LAYOUT) {
    fimble_lanes_rows_t * b = &fimble_lanes_buf;
    if (b->vy == vy && b->nr == nr && b->nb == nb && b->by == by && b->layout == LAYOUT) {
        return;  // this product's rows, prepared by an earlier call
    }
    const int ng = (nb + 7) / 8;
    fimble_lanes_reserve(b, (size_t) nr * ng);
    const __m256i ones = _mm256_set1_epi8(1);
    for (int r = 0; r < nr; ++r) {
        const block_q8_0 * GGML_RESTRICT y = (const block_q8_0 *) (vy + r*by);
        for (int g = 0; g < ng; ++g) {
            const size_t at = (size_t) g*nr + r;
            const int m = nb - 8*g < 8 ? nb - 8*g : 8;
            __m256i c[8];
            int nv = 8;
            if (m == 8) {
                fimble_lanes_transpose(y + 8*g, 8, c);
            } else if (m > 4 || LAYOUT == FIMBLE_ROWS_VNNI) {
                fimble_lanes_transpose(y + 8*g, m, c);
            } else {
                fimble_lanes_transpose4(y + 8*g, m, c);
                nv = 4;
            }
            __m256i sum = _mm256_setzero_si256();
            for (int k = 0; k < nv; ++k) {
                _mm256_store_si256((__m256i *) (b->q + 256*at + 32*k), c[k]);
                sum = _mm256_dpbusd_epi32(sum, ones, c[k]);
            }
            _mm256_store_si256((__m256i *) (b->c + 8*at), _mm256_sub_epi32(_mm256_setzero_si256(),
                                                                           _mm256_slli_epi32(sum, 7)));
            _mm256_store_ps(b->d + 8*at, fimble_lanes_scales(y + 8*g, m));
        }
    }
    b->vy = vy, b->nr = nr, b->nb = nb, b->by = by, b->layout = LAYOUT;
}

// One row's exact lane sums over a group's NV (4 or 8) weight vectors c (w + 128): from the row's -128 * sum(quants)
// start, dpbusd(w + 128, y) per vector (q: the row's quants of the group).
static inline __attribute__((always_inline)) FIMBLE_LANES_T __m256i fimble_lanes_vnni_sums(
        const int NV, const __m256i * c, const int8_t * GGML_RESTRICT q, const int32_t * GGML_RESTRICT start) {
    __m256i i0 = _mm256_load_si256((const __m256i *) start);
    __m256i i1 = _mm256_setzero_si256();
#pragma GCC unroll 4  // (unrolled, c[] stays in registers)
    for (int k = 0; k < NV; k += 2) {
        i0 = _mm256_dpbusd_epi32(i0, c[k], _mm256_load_si256((const __m256i *) (q + 32*k)));
        i1 = _mm256_dpbusd_epi32(i1, c[k + 1], _mm256_load_si256((const __m256i *) (q + 32*k + 32)));
    }
    return _mm256_add_epi32(i0, i1);
}

// PACKED (a constant): x's row is in fimble_q8_0_pack's layout (ggml_patch_packed.py), whose groups of eight and of
// four blocks hold their scales and lane-order quants as this loop uses them: loaded, not gathered and transposed; the
// rows then hold a group of at most four blocks in four vectors too (FIMBLE_ROWS_VNNI_PACKED). The same integer sums
// and float operations lane for lane either way (a short group's FMA on lanes 0-3, where eight vectors add +0 to
// lanes 4-7), so the same bits.
static inline __attribute__((always_inline)) FIMBLE_LANES_T void fimble_lanes_rows(
        const int NR, const int nb, float * GGML_RESTRICT s, const size_t bs, const block_q8_0 * GGML_RESTRICT x,
        const int PACKED, const int g0, const int g1, __m256 * GGML_RESTRICT io, const size_t ahead) {
    const int8_t * GGML_RESTRICT bq = fimble_lanes_buf.q;  // (locals: the loop never reads thread-local memory)
    const float * GGML_RESTRICT bd = fimble_lanes_buf.d;
    const int32_t * GGML_RESTRICT bc = fimble_lanes_buf.c;
    const int ng = (nb + 7) / 8;
    const __m256i sign = _mm256_set1_epi8((char) 0x80);
    __m256 acc[16];
    for (int r = 0; r < NR; ++r) {
        acc[r] = g0 > 0 ? io[r] : _mm256_setzero_ps();  // a later span goes on from the earlier spans' sums
    }
    for (int g = g0; g < g1; ++g) {
        const int m = nb - 8*g < 8 ? nb - 8*g : 8;
        const uint8_t * gp = (const uint8_t *) (x + 8*g);
        if (NR >= 5) {  // the weights stream from memory while many rows compute: prefetched `ahead` bytes on
#pragma GCC unroll 5
            for (int p = 0; p < 5; ++p) {
                _mm_prefetch((const char *) gp + ahead + 64*p, _MM_HINT_T0);
            }
        }
        __m256i c[8];
        if (PACKED && m <= 4) {  // a group of one to four blocks in four vectors: packed when four, else blocks
            const __m128 dx4 = fimble_lanes_group4(x + 8*g, m, PACKED, c);
#pragma GCC unroll 4
            for (int k = 0; k < 4; ++k) {
                c[k] = _mm256_xor_si256(c[k], sign);
            }
#pragma GCC unroll 16
            for (int r = 0; r < NR; ++r) {
                const size_t at = (size_t) g*NR + r;
                const __m256i is = fimble_lanes_vnni_sums(4, c, bq + 256*at, bc + 8*at);
                acc[r] = fimble_lanes_fma4(is, dx4, bd + 8*at, acc[r]);
            }
            continue;
        }
        __m256 dx;
        if (PACKED && m == 8) {  // 8 scales, then the eight vectors
            dx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) gp));
#pragma GCC unroll 8
            for (int k = 0; k < 8; ++k) {
                c[k] = _mm256_loadu_si256((const __m256i *) (gp + 16 + 32*k));
            }
        } else {
            dx = fimble_lanes_weights(x + 8*g, m, c);
        }
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
            c[k] = _mm256_xor_si256(c[k], sign);
        }
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) {
            const size_t at = (size_t) g*NR + r;
            const __m256 d = _mm256_mul_ps(dx, _mm256_load_ps(bd + 8*at));
            const __m256i is = fimble_lanes_vnni_sums(8, c, bq + 256*at, bc + 8*at);
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(is), acc[r]);
        }
    }
    for (int r = 0; r < NR; ++r) {
        if (g1 == ng) {
            s[r*bs] = hsum_float_8(acc[r]);
        } else {
            io[r] = acc[r];
        }
    }
}

// A rows kernel ROWS(NR, nb, s, bs, x) called with the row count nr (1..16) as a constant, so each count keeps its
// accumulators in registers (both lane kernels use it).
#define FIMBLE_LANES_DISPATCH(ROWS, nr, ...) switch (nr) { \
        case 1: ROWS(1, __VA_ARGS__); break; case 2: ROWS(2, __VA_ARGS__); break; \
        case 3: ROWS(3, __VA_ARGS__); break; case 4: ROWS(4, __VA_ARGS__); break; \
        case 5: ROWS(5, __VA_ARGS__); break; case 6: ROWS(6, __VA_ARGS__); break; \
        case 7: ROWS(7, __VA_ARGS__); break; case 8: ROWS(8, __VA_ARGS__); break; \
        case 9: ROWS(9, __VA_ARGS__); break; case 10: ROWS(10, __VA_ARGS__); break; \
        case 11: ROWS(11, __VA_ARGS__); break; case 12: ROWS(12, __VA_ARGS__); break; \
        case 13: ROWS(13, __VA_ARGS__); break; case 14: ROWS(14, __VA_ARGS__); break; \
        case 15: ROWS(15, __VA_ARGS__); break; default: ROWS(16, __VA_ARGS__); break; }

// The rows kernel over nx weight rows (C harness figures: 256 MB of packed weights, 1 thread, this Zen 4).
// - Up to four activation rows leave the weights' stream to the hardware's prefetcher. A software prefetch 2 KB
//   ahead made 1-4-row passes 10-25% slower (a plain stream of loads read 30.6 GB/s, 24.7 GB/s with it); from five
//   rows on, where the rows' multiplies outrun the stream, it saves 10-30%.
// - Five or more rows over long weight rows (the 4,864-column down projection) outgrow L1: nr x 320 bytes of
//   prepared rows a group, re-read for every weight row, came from L2 at ~2x the in-L1 cost (8 rows of 4,864-column
//   weights took 35 ms, of 896-column ones 18-21). So their groups are taken in spans whose rows fit L1 (15-20 KB),
//   every weight row one span at a time, its accumulators kept in fimble_lanes_io between spans: each lane's FMAs
//   run in the same order, so the same bits (8 rows: 25 ms). The weights are then read in span-long pieces a row
//   apart, so each is prefetched three rows ahead. Fewer rows keep one pass a row: the strided stream cost more
//   there than L1 saved (3-4 rows 15-25% slower).
static __thread __m256 fimble_lanes_io[64 * 16];
static inline __attribute__((always_inline)) FIMBLE_LANES_T void fimble_lanes_vnni_rows(
        const int nb, const int nx, const int nr, float * GGML_RESTRICT s, const size_t bs,
        const char * GGML_RESTRICT vx, const size_t bx, const int PACKED) {
    const int ng = (nb + 7) / 8;
    const int span = nr <= 12 ? 48 / nr : 4;  // groups whose rows take 15-20 KB (320 bytes a row and group)
    if (nr < 5 || nr * ng * 320 <= 24 * 1024) {
        for (int i = 0; i < nx; ++i) {
            FIMBLE_LANES_DISPATCH(fimble_lanes_rows, nr, nb, s + i, bs, (const block_q8_0 *) (vx + i*bx), PACKED,
                                  0, ng, NULL, 2048)
        }
        return;
    }
    for (int i0 = 0; i0 < nx; i0 += 64) {
        const int n = nx - i0 < 64 ? nx - i0 : 64;
        for (int g0 = 0; g0 < ng; g0 += span) {
            const int g1 = g0 + span < ng ? g0 + span : ng;
            for (int i = i0; i < i0 + n; ++i) {
                FIMBLE_LANES_DISPATCH(fimble_lanes_rows, nr, nb, s + i, bs, (const block_q8_0 *) (vx + i*bx),
                                      PACKED, g0, g1, fimble_lanes_io + 16*(i - i0), 3*bx)
            }
        }
    }
}

// nx weight rows of vx (bx bytes apart) against nr (1..16) activation rows of vy (by bytes apart) in the lane order:
// s[i + r*bs].
static FIMBLE_LANES_T __attribute__((noinline)) void fimble_lanes_all(
        const int nb, const int nx, const int nr, float * GGML_RESTRICT s, const size_t bs,
        const char * GGML_RESTRICT vx, const size_t bx, const char * GGML_RESTRICT vy, const size_t by) {
    fimble_lanes_prepare_vnni(nb, nr, vy, by, FIMBLE_ROWS_VNNI);
    fimble_lanes_vnni_rows(nb, nx, nr, s, bs, vx, bx, 0);
}

"""
)
