"""ggml_patch.py item 2's attention part: key and value rows shared by the query heads that read them.

The default model is grouped-query (14 query heads over 2 key/value heads), and ggml's 1-row path runs QK^T as one
vec_dot_f16 call per key and query head, each loading and converting both 64-half operands for 64 multiply-adds.
HEADS_KERNEL (spliced into ggml-cpu.c with the two- and three-row kernels) takes a key row once for every src1 row of
a block that reads the same key head (its query heads, and a verify block's rows), each sum in ggml_vec_dot_f16's
order, so the results are stock's bit for bit. HEADS_LOOP is its branch in ggml_compute_forward_mul_mat_one_chunk,
which also sends the value product's rows (n_kv long) two query heads at a time through the two-row f16 kernel.
"""

from __future__ import annotations

HEADS_KERNEL = r"""#if defined(__F16C__) && defined(__AVX2__) && GGML_F16_DOT_EPR == GGML_F32_EPR
#define FIMBLE_GQA 1
// One f16 row x of STEPS * GGML_F16_DOT_STEP halves (an attention head's keys: 64 on AVX2) against nr rows y, n
// floats apart (src1's f16 rows converted to floats: exact), each sum in ggml_vec_dot_f16's order (its four
// accumulators over the same steps, the same FMAs on the same values, its reduction): s[16*r]. x is loaded and
// converted once for all the rows, where the 1-row path loads and converts both operands for every product.
static inline __attribute__((always_inline)) void fimble_vec_dot_f16_heads(
        const int STEPS, float * s, const ggml_fp16_t * x, const float * y, const int64_t nr, const int64_t n) {
    GGML_F16_DOT_VEC ax[2][GGML_F16_DOT_ARR];
    for (int i = 0; i < STEPS; i++) {
        for (int j = 0; j < GGML_F16_DOT_ARR; j++) {
            ax[i][j] = GGML_F16_DOT_VEC_LOAD(x + i*GGML_F16_DOT_STEP + j*GGML_F16_DOT_EPR, j);
        }
    }
    for (int64_t r = 0; r < nr; r++) {
        const float * yr = y + r*n;
        GGML_F16_DOT_VEC sum[GGML_F16_DOT_ARR] = { GGML_F16_DOT_VEC_ZERO };
        for (int i = 0; i < STEPS; i++) {
            for (int j = 0; j < GGML_F16_DOT_ARR; j++) {
                sum[j] = GGML_F16_DOT_VEC_FMA(sum[j], ax[i][j],
                                              GGML_F32_VEC_LOAD(yr + i*GGML_F16_DOT_STEP + j*GGML_F16_DOT_EPR));
            }
        }
        ggml_float sumf;  // as ggml_vec_dot_f16's
        GGML_F16_DOT_VEC_REDUCE(sumf, sum);
        s[16*r] = sumf;
    }
}
#endif
"""

HEADS_LOOP = """#if defined(FIMBLE_GQA)
                // fimble: an attention product (f16 rows: a head's keys, or its values' rows n_kv long) against every
                // src1 row of this block that reads the same src0 matrix: the query heads of one key/value head
                // (GQA), and a verify block's rows. Each sum in ggml_vec_dot_f16's order, so the results are the
                // 1-row path's, bit for bit. Keys (one or two steps): each src0 row loaded once for all the rows;
                // values: for two rows at a time (fimble_vec_dot_f16_x2), the odd one by ggml's own vec_dot.
                if (type == GGML_TYPE_F16 && vec_dot_type == GGML_TYPE_F16 && num_rows_per_vec_dot == 1 &&
                    src1->type != vec_dot_type && ne00 % GGML_F16_DOT_STEP == 0) {
                    const int64_t fimble_end = MIN(iir1 + blck_1, ir1_end);
                    int64_t fimble_m = 1;  // rows ir1.. sharing src0_row: consecutive rows of wdata
                    while (ir1 + fimble_m < fimble_end) {
                        const int64_t j = ir1 + fimble_m;
                        const int64_t j13 = j / (ne12 * ne1);
                        const int64_t j12 = (j - j13 * ne12 * ne1) / ne1;
                        if (j12 / r2 != i02 || j13 / r3 != i03) {
                            break;
                        }
                        fimble_m++;
                    }
                    const bool fimble_keys = ne00 <= 2*GGML_F16_DOT_STEP;
                    if (fimble_m >= 2 && !fimble_keys) {
                        for (int64_t ir0 = iir0; ir0 < iir0 + blck_0 && ir0 < ir0_end; ++ir0) {
                            const char * x = src0_row + ir0 * nb01;
                            for (int64_t r = 0; r < fimble_m; r += 2) {
                                float * s = &fimble_tmp[16 * r + (ir0 - iir0)];
                                if (r + 1 < fimble_m) {
                                    fimble_vec_dot_f16_x2((int) ne00, s, (const ggml_fp16_t *) x,
                                                          src1_col + r * row_size, row_size);
                                } else {
                                    vec_dot(ne00, s, 0, x, 0, src1_col + r * row_size, 0, 1);
                                }
                            }
                        }
                    } else if (fimble_m >= 2) {
                        for (int64_t r = 0; r < fimble_m; r++) {  // the rows as floats (exact)
                            const ggml_fp16_t * yh = (const ggml_fp16_t *) (src1_col + r * row_size);
                            for (int64_t k = 0; k < ne00; k += GGML_F16_DOT_EPR) {
                                GGML_F32_VEC_STORE(fimble_heads + r * ne00 + k, GGML_F16_DOT_VEC_LOAD(yh + k, 0));
                            }
                        }
                        for (int64_t ir0 = iir0; ir0 < iir0 + blck_0 && ir0 < ir0_end; ++ir0) {
                            const ggml_fp16_t * x = (const ggml_fp16_t *) (src0_row + ir0 * nb01);
                            float * s = &fimble_tmp[ir0 - iir0];
                            if (ne00 == GGML_F16_DOT_STEP) {
                                fimble_vec_dot_f16_heads(1, s, x, fimble_heads, fimble_m, ne00);
                            } else {
                                fimble_vec_dot_f16_heads(2, s, x, fimble_heads, fimble_m, ne00);
                            }
                        }
                    }
                    if (fimble_m >= 2) {
                        for (int64_t r = 0; r < fimble_m; r++) {
                            const int64_t j = ir1 + r;
                            const int64_t j13 = j / (ne12 * ne1);
                            const int64_t j12 = (j - j13 * ne12 * ne1) / ne1;
                            const int64_t j11 = j - j13 * ne12 * ne1 - j12 * ne1;
                            float * d = (float *) ((char *) dst->data + (j11 * nb1 + j12 * nb2 + j13 * nb3));
                            memcpy(&d[iir0], fimble_tmp + 16 * r, (MIN(iir0 + blck_0, ir0_end) - iir0) * sizeof(float));
                        }
                        ir1 += fimble_m - 1;  // and the loop's own step: the next rows
                        continue;
                    }
                }
#endif
"""
