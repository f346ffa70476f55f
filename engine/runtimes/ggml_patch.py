"""The edits fimble makes to llama.cpp's source before building it (engine/runtimes/ggml_build.py applies
them and says why): (file, text there, its replacement). Each text must occur exactly once.

Both serve one rule: for 1 to 32 rows, every f32 and f16 product runs ggml's own path, stock's 1-row
path, so a verify block's rows equal 1-token steps' bit for bit (fimble is lossless) and a 1-token step
runs stock's kernel at stock's speed.
1. sgemm.cpp: llamafile's tinyBLAS takes f32 and f16 products from 33 rows only (stock: from 2).
2. ggml-cpu.c: ggml's own f32 product reads each weight row once for two rows of the block, where
   stock reads it once per row; each sum runs in exactly ggml_vec_dot_f32's order.
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

X2_ANCHOR = "static void ggml_compute_forward_mul_mat_one_chunk("
X2_KERNEL = """// fimble (engine/runtimes/ggml_patch.py): one f32 src0 row against two src1 rows per pass.
// Each sum runs in exactly ggml_vec_dot_f32's order (the same accumulators, the same
// reduction), so a block's rows equal the 1-row path bit for bit, while the src0 row is
// read once for two outputs instead of twice.
#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
#define FIMBLE_F32_X2 1
static void fimble_vec_dot_f32_x2(int n, float * s0, float * s1, const float * x, const float * y0, const float * y1) {
    GGML_F32_VEC sum0[GGML_F32_ARR] = { GGML_F32_VEC_ZERO };
    GGML_F32_VEC sum1[GGML_F32_ARR] = { GGML_F32_VEC_ZERO };
    for (int i = 0; i < n; i += GGML_F32_STEP) {
        for (int j = 0; j < GGML_F32_ARR; j++) {
            const GGML_F32_VEC ax = GGML_F32_VEC_LOAD(x + i + j*GGML_F32_EPR);
            sum0[j] = GGML_F32_VEC_FMA(sum0[j], ax, GGML_F32_VEC_LOAD(y0 + i + j*GGML_F32_EPR));
            sum1[j] = GGML_F32_VEC_FMA(sum1[j], ax, GGML_F32_VEC_LOAD(y1 + i + j*GGML_F32_EPR));
        }
    }
    float r0, r1;
    GGML_F32_VEC_REDUCE(r0, sum0);
    GGML_F32_VEC_REDUCE(r1, sum1);
    *s0 = r0;
    *s1 = r1;
}
#endif

"""

X2_LOOP_OLD = """                //for (int64_t ir0 = iir0; ir0 < iir0 + blck_0 && ir0 < ir0_end; ++ir0) {
                //    vec_dot(ne00, &dst_col[ir0], src0_row + ir0*nb01, src1_col);
                //}
"""
X2_LOOP_NEW = X2_LOOP_OLD + """#if defined(FIMBLE_F32_X2)
                // fimble: two rows of the same src1 matrix in one pass over the src0 rows (no leftovers:
                // ggml_vec_dot_f32 sums those in scalar code, which the compiler may contract differently)
                if (type == GGML_TYPE_F32 && num_rows_per_vec_dot == 1 && src1_cont && ne00 % GGML_F32_STEP == 0 &&
                    ir1 + 1 < iir1 + blck_1 && ir1 + 1 < ir1_end && i11 + 1 < ne11) {
                    const float * y1 = (const float *)(src1_col + row_size);
                    float * dst_col1 = (float *)((char *)dst_col + nb1);
                    for (int64_t ir0 = iir0; ir0 < iir0 + blck_0 && ir0 < ir0_end; ++ir0) {
                        fimble_vec_dot_f32_x2(ne00, &tmp[ir0 - iir0], &tmp[16 + ir0 - iir0],
                            (const float *)(src0_row + ir0 * nb01), (const float *)src1_col, y1);
                    }
                    memcpy(&dst_col[iir0], tmp, (MIN(iir0 + blck_0, ir0_end) - iir0) * sizeof(float));
                    memcpy(&dst_col1[iir0], tmp + 16, (MIN(iir0 + blck_0, ir0_end) - iir0) * sizeof(float));
                    ir1 += 1;  // and the loop's own step: the next pair
                    continue;
                }
#endif
"""

PATCHES: tuple[tuple[str, str, str], ...] = (
    (SGEMM, SGEMM_OLD, SGEMM_NEW),
    (GGML_CPU, X2_ANCHOR, X2_KERNEL + X2_ANCHOR),
    (GGML_CPU, X2_LOOP_OLD, X2_LOOP_NEW),
)
