"""The edits fimble makes to llama.cpp's source before building it (engine/runtimes/ggml_build.py applies
them and says why): (file, text there, its replacement). Each text must occur exactly once.

All serve one rule: for 1 to 32 rows, every f32 and f16 product (and q8_0 on AVX2) runs ggml's own
path, whose sums are stock's 1-row sums, so a verify block's rows equal 1-token steps' bit for bit
(fimble is lossless) and a 1-token step runs stock's kernel at stock's speed.
1. sgemm.cpp: llamafile's tinyBLAS takes f32 and f16 products (and q8_0 on AVX2) from 33 rows only
   (stock: from 2).
2. ggml-cpu.c: ggml's own product reads each weight row once for two rows of a block (f32 and f16) or
   three (f32), where stock reads it once per row. Each sum runs in exactly ggml_vec_dot_f32's or
   ggml_vec_dot_f16's order: the same four accumulators over the same steps, the same reduction. Only
   for rows with no leftover elements (vec_dot sums those in scalar code, which a compiler may contract
   differently), and only where ggml's generic SIMD code is the vec_dot (not SVE or RISC-V vectors).
3. quants.h, arch/x86/quants.c, ggml-cpu.c: on AVX2, q8_0 weights (against the q8_0 rows ggml quantises
   the activations to) take fimble_vec_dot_q8_0_q8_0_rows for 2 to 8 rows of a block at once (9-16 in two
   groups): each weight block is loaded once for every row, and each row's sum is ggml_vec_dot_q8_0_q8_0's
   AVX2 loop (the same scale product, integer sums, one FMA a block in order, the same reduction).
   tinyBLAS's q8_0 tiles (4 weight rows x 2 activation rows) also equal vec_dot bit for bit, but cost
   about 0.8 of a step per extra row here (the probe before this kernel: 2/4/8/16 rows 1.86/3.30/6.10/11.93 steps).
"""

from __future__ import annotations

SGEMM = "vendor/llama.cpp/ggml/src/ggml-cpu/llamafile/sgemm.cpp"
GGML_CPU = "vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c"

SGEMM_OLD = """#if !defined(__MMA__)
    if (n < 2)
        return false;
#endif"""
SGEMM_NEW = """#if !defined(__MMA__)
    // fimble (engine/runtimes/ggml_patch.py): one kernel path per product for every row count up to 32,
    // so a 1-token step's logits equal a verify block's rows bit for bit: f32 weights and f16 products
    // (attention's keys and values) take ggml's own path, stock's 1-row path, up to 32 rows.
    if (n < 2)
        return false;
    if (n <= 32 && (Atype == GGML_TYPE_F32 || Atype == GGML_TYPE_F16))
        return false;
#if defined(__AVX2__)
    // q8_0 weights too (with q8_0 activations): ggml's own path has a kernel that reads each weight block
    // once for up to 8 rows (quants.c, fimble_vec_dot_q8_0_q8_0_rows), where tinyBLAS's 4x2 tiles cost
    // about a step per extra row here.
    if (n <= 32 && Atype == GGML_TYPE_Q8_0)
        return false;
#endif
#endif"""

KERNELS_BEFORE = "static void ggml_compute_forward_mul_mat_one_chunk("
# The two- and three-row f32 kernels are written out, not one loop over a row count: each must keep its
# 8 or 12 accumulators in AVX2's 16 registers, and a generic version (up to four rows) measured slower
# here. This text is part of the build's stamp: editing it rebuilds the library.
KERNELS = """// fimble (engine/runtimes/ggml_patch.py): one src0 row against two or three src1 rows per pass.
// Each sum runs in exactly ggml_vec_dot_f32's / ggml_vec_dot_f16's order (the same accumulators,
// the same reduction), so a block's rows equal the 1-row path bit for bit, while the src0 row is
// read once for two or three outputs.
#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
#define FIMBLE_ROWS 1
static void fimble_vec_dot_f32_x2(int n, float * s, const float * x, const char * y, size_t y_stride) {
    const float * y0 = (const float *) y;
    const float * y1 = (const float *) (y + y_stride);
    GGML_F32_VEC sum0[GGML_F32_ARR] = { GGML_F32_VEC_ZERO };
    GGML_F32_VEC sum1[GGML_F32_ARR] = { GGML_F32_VEC_ZERO };
    for (int i = 0; i < n; i += GGML_F32_STEP) {
        for (int j = 0; j < GGML_F32_ARR; j++) {
            const GGML_F32_VEC ax = GGML_F32_VEC_LOAD(x + i + j*GGML_F32_EPR);
            sum0[j] = GGML_F32_VEC_FMA(sum0[j], ax, GGML_F32_VEC_LOAD(y0 + i + j*GGML_F32_EPR));
            sum1[j] = GGML_F32_VEC_FMA(sum1[j], ax, GGML_F32_VEC_LOAD(y1 + i + j*GGML_F32_EPR));
        }
    }
    float r0, r1;  // as ggml_vec_dot_f32's sumf
    GGML_F32_VEC_REDUCE(r0, sum0);
    GGML_F32_VEC_REDUCE(r1, sum1);
    s[0] = r0;
    s[16] = r1;
}
static void fimble_vec_dot_f32_x3(int n, float * s, const float * x, const char * y, size_t y_stride) {
    const float * y0 = (const float *) y;
    const float * y1 = (const float *) (y + y_stride);
    const float * y2 = (const float *) (y + 2*y_stride);
    GGML_F32_VEC sum0[GGML_F32_ARR] = { GGML_F32_VEC_ZERO };
    GGML_F32_VEC sum1[GGML_F32_ARR] = { GGML_F32_VEC_ZERO };
    GGML_F32_VEC sum2[GGML_F32_ARR] = { GGML_F32_VEC_ZERO };
    for (int i = 0; i < n; i += GGML_F32_STEP) {
        for (int j = 0; j < GGML_F32_ARR; j++) {
            const GGML_F32_VEC ax = GGML_F32_VEC_LOAD(x + i + j*GGML_F32_EPR);
            sum0[j] = GGML_F32_VEC_FMA(sum0[j], ax, GGML_F32_VEC_LOAD(y0 + i + j*GGML_F32_EPR));
            sum1[j] = GGML_F32_VEC_FMA(sum1[j], ax, GGML_F32_VEC_LOAD(y1 + i + j*GGML_F32_EPR));
            sum2[j] = GGML_F32_VEC_FMA(sum2[j], ax, GGML_F32_VEC_LOAD(y2 + i + j*GGML_F32_EPR));
        }
    }
    float r0, r1, r2;  // as ggml_vec_dot_f32's sumf
    GGML_F32_VEC_REDUCE(r0, sum0);
    GGML_F32_VEC_REDUCE(r1, sum1);
    GGML_F32_VEC_REDUCE(r2, sum2);
    s[0] = r0;
    s[16] = r1;
    s[32] = r2;
}
static void fimble_vec_dot_f16_x2(int n, float * s, const ggml_fp16_t * x, const char * y, size_t y_stride) {
    const ggml_fp16_t * y0 = (const ggml_fp16_t *) y;
    const ggml_fp16_t * y1 = (const ggml_fp16_t *) (y + y_stride);
    GGML_F16_DOT_VEC sum0[GGML_F16_DOT_ARR] = { GGML_F16_DOT_VEC_ZERO };
    GGML_F16_DOT_VEC sum1[GGML_F16_DOT_ARR] = { GGML_F16_DOT_VEC_ZERO };
    for (int i = 0; i < n; i += GGML_F16_DOT_STEP) {
        for (int j = 0; j < GGML_F16_DOT_ARR; j++) {
            const GGML_F16_DOT_VEC ax = GGML_F16_DOT_VEC_LOAD(x + i + j*GGML_F16_DOT_EPR, j);
            sum0[j] = GGML_F16_DOT_VEC_FMA(sum0[j], ax, GGML_F16_DOT_VEC_LOAD(y0 + i + j*GGML_F16_DOT_EPR, j));
            sum1[j] = GGML_F16_DOT_VEC_FMA(sum1[j], ax, GGML_F16_DOT_VEC_LOAD(y1 + i + j*GGML_F16_DOT_EPR, j));
        }
    }
    ggml_float r0, r1;  // as ggml_vec_dot_f16's sumf
    GGML_F16_DOT_VEC_REDUCE(r0, sum0);
    GGML_F16_DOT_VEC_REDUCE(r1, sum1);
    s[0] = r0;
    s[16] = r1;
}
#endif

"""

TMP_OLD = "    float tmp[32];\n"
TMP_NEW = "    float tmp[32];\n    float fimble_tmp[128];  // fimble: up to eight rows of 16 results\n"

LOOP_OLD = """                //for (int64_t ir0 = iir0; ir0 < iir0 + blck_0 && ir0 < ir0_end; ++ir0) {
                //    vec_dot(ne00, &dst_col[ir0], src0_row + ir0*nb01, src1_col);
                //}
"""
LOOP_NEW = (
    LOOP_OLD
    + """#if defined(FIMBLE_ROWS)
                // fimble: two or three rows of the same src1 matrix (rows ir1.. of this block) in one pass over
                // this block's src0 rows; f32 takes three where that leaves no single row behind.
                const int64_t fimble_left = MIN(MIN(iir1 + blck_1, ir1_end) - ir1, ne11 - i11);
                const bool fimble_f32 = type == GGML_TYPE_F32 && ne00 % GGML_F32_STEP == 0;
                const bool fimble_f16 = type == GGML_TYPE_F16 && vec_dot_type == GGML_TYPE_F16 &&
                                        ne00 % GGML_F16_DOT_STEP == 0;
                const int64_t fimble_nr = fimble_f32 && fimble_left >= 3 && fimble_left != 4 ? 3 : 2;
                if ((fimble_f32 || fimble_f16) && fimble_left >= 2 && num_rows_per_vec_dot == 1 &&
                    (src1_cont || src1->type != vec_dot_type)) {
                    for (int64_t ir0 = iir0; ir0 < iir0 + blck_0 && ir0 < ir0_end; ++ir0) {
                        const char * x = src0_row + ir0 * nb01;
                        float * s = &fimble_tmp[ir0 - iir0];
                        if (fimble_nr == 3) {
                            fimble_vec_dot_f32_x3((int) ne00, s, (const float *) x, src1_col, row_size);
                        } else if (fimble_f32) {
                            fimble_vec_dot_f32_x2((int) ne00, s, (const float *) x, src1_col, row_size);
                        } else {
                            fimble_vec_dot_f16_x2((int) ne00, s, (const ggml_fp16_t *) x, src1_col, row_size);
                        }
                    }
                    for (int64_t r = 0; r < fimble_nr; r++) {
                        memcpy((char *) &dst_col[iir0] + r*nb1, fimble_tmp + 16*r,
                               (MIN(iir0 + blck_0, ir0_end) - iir0) * sizeof(float));
                    }
                    ir1 += fimble_nr - 1;  // and the loop's own step: the next rows
                    continue;
                }
#if defined(FIMBLE_Q8_0_ROWS)
                // fimble: q8_0 weights against up to FIMBLE_Q8_0_ROWS rows of this block at once (9-16 rows in
                // two near-equal groups, never a single row left), each weight block loaded once for all.
                if (type == GGML_TYPE_Q8_0 && vec_dot_type == GGML_TYPE_Q8_0 && fimble_left >= 2 &&
                    ne00 <= FIMBLE_Q8_0_MAX_N && num_rows_per_vec_dot == 1 &&
                    (src1_cont || src1->type != vec_dot_type)) {
                    const int64_t fimble_q8 = fimble_left <= FIMBLE_Q8_0_ROWS ? fimble_left
                                            : MIN((fimble_left + 1) / 2, FIMBLE_Q8_0_ROWS);
                    const int64_t fimble_nx = MIN(iir0 + blck_0, ir0_end) - iir0;
                    fimble_vec_dot_q8_0_q8_0_rows((int) ne00, (int) fimble_nx, (int) fimble_q8, fimble_tmp, 16,
                                                  src0_row + iir0 * nb01, nb01, src1_col, row_size);
                    for (int64_t r = 0; r < fimble_q8; r++) {
                        memcpy((char *) &dst_col[iir0] + r*nb1, fimble_tmp + 16*r, fimble_nx * sizeof(float));
                    }
                    ir1 += fimble_q8 - 1;  // and the loop's own step: the next rows
                    continue;
                }
#endif
#endif
"""
)

QUANTS_H = "vendor/llama.cpp/ggml/src/ggml-cpu/quants.h"
QUANTS_X86 = "vendor/llama.cpp/ggml/src/ggml-cpu/arch/x86/quants.c"

Q8_DECL_OLD = (
    "void ggml_vec_dot_q8_0_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, "
    "size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);\n"
)
Q8_DECL_NEW = (
    Q8_DECL_OLD
    + """#if defined(__AVX2__) && defined(__GNUC__)
// fimble (engine/runtimes/ggml_patch.py): nx q8_0 rows of vx (bx bytes apart) against nr (2..FIMBLE_Q8_0_ROWS)
// q8_0 rows of vy (by bytes apart), row length n <= FIMBLE_Q8_0_MAX_N; s[i + r*bs] = x row i . y row r, each
// exactly ggml_vec_dot_q8_0_q8_0's result.
#define FIMBLE_Q8_0_ROWS 8
#define FIMBLE_Q8_0_MAX_N 32768
void fimble_vec_dot_q8_0_q8_0_rows(int n, int nx, int nr, float * GGML_RESTRICT s, size_t bs,
                                   const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by);
#endif
"""
)

Q8_KERNEL_BEFORE = "void ggml_vec_dot_tq1_0_q8_K("
# The rows' loop is written once and inlined for each row count, so every count keeps its accumulators in
# registers (a runtime count would keep them in memory). The per-row body is ggml_vec_dot_q8_0_q8_0's AVX2
# loop body, through the same helpers: the weight block's abs/sign work is shared by the compiler, the sums
# are not touched.
Q8_KERNEL = """#if defined(__AVX2__) && defined(__GNUC__)
// fimble (engine/runtimes/ggml_patch.py): ggml_vec_dot_q8_0_q8_0's AVX2 loop for NR activation rows at once.
// Each weight block is loaded (and its absolute value taken) once; row r keeps its own accumulator, updated
// with the 1-row loop's arithmetic in its order: the scale product dx*dy in single precision (the same value
// whether multiplied as scalars or as broadcast vectors), mul_sum_i8_pairs_float's integer sums, one FMA per
// block, hsum_float_8. So every row equals a 1-row product bit for bit. The activations' scales are converted
// once per call, not once per weight row.
static inline __attribute__((always_inline)) void fimble_q8_0_rows(
        const int NR, const int nb, float * GGML_RESTRICT s, const size_t bs, const block_q8_0 * GGML_RESTRICT x,
        const char * GGML_RESTRICT vy, const size_t by, const float * GGML_RESTRICT dy) {
    __m256 acc[FIMBLE_Q8_0_ROWS];
    for (int r = 0; r < NR; ++r) {
        acc[r] = _mm256_setzero_ps();
    }
    for (int ib = 0; ib < nb; ++ib) {
        const __m256 dx = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].d));
        // The weights stream from memory while the rows compute: ask for them ~30 blocks (a q8_0 row of 896
        // weights) ahead, past this row's end into the next one (measured: 4 rows 1.0-1.3x a 1-row pass
        // over 40 MB of weights where they cost 1.4-1.9x without it).
        _mm_prefetch((const char *)(x + ib) + 1024, _MM_HINT_T0);
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[ib].qs);
#if !__AVXVNNIINT8__
        const __m256i ax = _mm256_sign_epi8(qx, qx);  // mul_sum_i8_pairs_float's first step, for every row
#endif
        for (int r = 0; r < NR; ++r) {
            const __m256i qy = _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)(vy + r*by) + ib)->qs);
            const __m256 d = _mm256_mul_ps(dx, _mm256_broadcast_ss(dy + r*nb + ib));
#if __AVXVNNIINT8__
            const __m256 q = mul_sum_i8_pairs_float(qx, qy);
#else
            const __m256 q = mul_sum_us8_pairs_float(ax, _mm256_sign_epi8(qy, qx));
#endif
            acc[r] = _mm256_fmadd_ps(d, q, acc[r]);
        }
    }
    for (int r = 0; r < NR; ++r) {
        s[r*bs] = hsum_float_8(acc[r]);
    }
}

void fimble_vec_dot_q8_0_q8_0_rows(int n, int nx, int nr, float * GGML_RESTRICT s, size_t bs,
                                   const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by) {
    assert(n % QK8_0 == 0 && n <= FIMBLE_Q8_0_MAX_N && nr >= 2 && nr <= FIMBLE_Q8_0_ROWS);
    const int nb = n / QK8_0;
    const char * GGML_RESTRICT y = vy;
    float dy[FIMBLE_Q8_0_ROWS * (FIMBLE_Q8_0_MAX_N / QK8_0)];
    for (int r = 0; r < nr; ++r) {
        for (int ib = 0; ib < nb; ++ib) {
            dy[r*nb + ib] = GGML_CPU_FP16_TO_FP32(((const block_q8_0 *)(y + r*by) + ib)->d);
        }
    }
    for (int i = 0; i < nx; ++i) {
        const block_q8_0 * GGML_RESTRICT x = (const block_q8_0 *)((const char *) vx + i*bx);
        switch (nr) {
            case 2: fimble_q8_0_rows(2, nb, s + i, bs, x, y, by, dy); break;
            case 3: fimble_q8_0_rows(3, nb, s + i, bs, x, y, by, dy); break;
            case 4: fimble_q8_0_rows(4, nb, s + i, bs, x, y, by, dy); break;
            case 5: fimble_q8_0_rows(5, nb, s + i, bs, x, y, by, dy); break;
            case 6: fimble_q8_0_rows(6, nb, s + i, bs, x, y, by, dy); break;
            case 7: fimble_q8_0_rows(7, nb, s + i, bs, x, y, by, dy); break;
            default: fimble_q8_0_rows(8, nb, s + i, bs, x, y, by, dy); break;
        }
    }
}
#endif

"""

PATCHES: tuple[tuple[str, str, str], ...] = (
    (SGEMM, SGEMM_OLD, SGEMM_NEW),
    (GGML_CPU, KERNELS_BEFORE, KERNELS + KERNELS_BEFORE),
    (GGML_CPU, TMP_OLD, TMP_NEW),
    (GGML_CPU, LOOP_OLD, LOOP_NEW),
    (QUANTS_H, Q8_DECL_OLD, Q8_DECL_NEW),
    (QUANTS_X86, Q8_KERNEL_BEFORE, Q8_KERNEL + Q8_KERNEL_BEFORE),
)
