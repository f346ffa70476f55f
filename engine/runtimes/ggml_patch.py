"""The edits fimble makes to llama.cpp's source before building it (engine/runtimes/ggml_build.py applies
them and says why): (file, text there, its replacement). Each text must occur exactly once.

All serve one rule: for 1 to 32 rows, every f32 and f16 product runs ggml's own path, whose sums are
stock's 1-row sums, so a verify block's rows equal 1-token steps' bit for bit (fimble is lossless) and
a 1-token step runs stock's kernel at stock's speed.
1. sgemm.cpp: llamafile's tinyBLAS takes f32 and f16 products from 33 rows only (stock: from 2).
2. ggml-cpu.c: ggml's own product reads each weight row once for two rows of a block (f32 and f16) or
   three (f32), where stock reads it once per row. Each sum runs in exactly ggml_vec_dot_f32's or
   ggml_vec_dot_f16's order: the same four accumulators over the same steps, the same reduction. Only
   for rows with no leftover elements (vec_dot sums those in scalar code, which a compiler may contract
   differently), and only where ggml's generic SIMD code is the vec_dot (not SVE or RISC-V vectors).
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
TMP_NEW = "    float tmp[32];\n    float fimble_tmp[48];  // fimble: up to three rows of 16 results\n"

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
#endif
"""
)

PATCHES: tuple[tuple[str, str, str], ...] = (
    (SGEMM, SGEMM_OLD, SGEMM_NEW),
    (GGML_CPU, KERNELS_BEFORE, KERNELS + KERNELS_BEFORE),
    (GGML_CPU, TMP_OLD, TMP_NEW),
    (GGML_CPU, LOOP_OLD, LOOP_NEW),
)
