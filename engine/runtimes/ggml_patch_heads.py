"""ggml_patch.py item 2's attention part: key and value rows shared by the query heads that read them.

The default model is grouped-query (14 query heads over 2 key/value heads), and ggml's 1-row path runs QK^T as one
vec_dot_f16 call per key and query head, each loading and converting both 64-half operands for 64 multiply-adds.
HEADS_KERNEL (spliced into ggml-cpu.c with the two- and three-row kernels) takes a key row once for every src1 row of
a block that reads the same key head (its query heads, and a verify block's rows), each sum in ggml_vec_dot_f16's
order, so the results are stock's bit for bit. HEADS_LOOP is its branch in ggml_compute_forward_mul_mat_one_chunk,
which also sends the value product's rows (n_kv long) two query heads at a time through the two-row f16 kernel.
On AVX2 builds (64-half keys) fimble_keys_block takes a whole block of keys for each row (2026-12-07): profiled at 1
thread, 8 verify rows over 1,250 cached positions, the product loop's share of the pass fell from 16.7% to 11.9%,
most of it from stepping the rows' indices instead of dividing them out (two 64-bit divisions a row, as costly as the
row's dots). Tried and not taken: the value rows against the src1 rows converted to floats once, three at a time; the
floats (16 rows x n_kv) left L1, and the loop's share rose (22.8% to 25.4%).
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
#if GGML_F16_DOT_EPR == 8 && GGML_F16_DOT_ARR == 4 && GGML_F16_DOT_STEP == 32
#define FIMBLE_KEYS_BLOCK 1
// A block of nk (1..16) key rows of 64 halves (nb01 bytes apart) against nr query rows y (64 floats each, n apart):
// s[16*r + k] = ggml_vec_dot_f16(key k, row r), each sum in its order (four accumulators of eight lanes over two
// steps, then GGML_F32x8_REDUCE's adds), as fimble_vec_dot_f16_heads computes it. The keys are converted once into
// floats; each row is held in eight registers while the block's keys stream past it two at a time, and the last
// horizontal steps of eight sums (the 128-bit halves' add, two hadds) run as vectors over eight keys at once: the
// same additions of the same operands, so the same bits, at about half the instructions a sum.
static inline __m256 fimble_keys_vsum(const __m256 * a) {  // GGML_F32x8_REDUCE's vertical adds
    return _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
}
static void fimble_keys_block(const int nk, const int64_t nr, float * s, const char * k0, const size_t nb01,
                              const float * y, const int64_t n) {
    float kf[16 * 64] __attribute__((aligned(32)));
    for (int k = 0; k < 16; k++) {
        const ggml_fp16_t * x = (const ggml_fp16_t *) (k0 + (k < nk ? k : 0) * nb01);  // (past nk: key 0, unused)
        for (int t = 0; t < 64; t += 8) {
            _mm256_store_ps(kf + 64*k + t, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x + t))));
        }
    }
    const __m256 z = _mm256_setzero_ps();
    for (int64_t r = 0; r < nr; r++) {
        const float * yr = y + r*n;
        __m256 q[8];
        for (int t = 0; t < 8; t++) {
            q[t] = _mm256_loadu_ps(yr + 8*t);
        }
        for (int k8 = 0; k8 < nk; k8 += 8) {
            __m256 t2[4];  // keys k8+2p and k8+2p+1: [their 128-bit halves' sums]
            for (int p = 0; p < 4; p++) {
                const float * ka = kf + 64*(k8 + 2*p), * kb = ka + 64;
                __m256 a[4], b[4];
                for (int j = 0; j < 4; j++) {
                    a[j] = _mm256_fmadd_ps(_mm256_load_ps(ka + 8*j), q[j], z);
                    b[j] = _mm256_fmadd_ps(_mm256_load_ps(kb + 8*j), q[j], z);
                }
                for (int j = 0; j < 4; j++) {
                    a[j] = _mm256_fmadd_ps(_mm256_load_ps(ka + 32 + 8*j), q[4 + j], a[j]);
                    b[j] = _mm256_fmadd_ps(_mm256_load_ps(kb + 32 + 8*j), q[4 + j], b[j]);
                }
                const __m256 va = fimble_keys_vsum(a), vb = fimble_keys_vsum(b);
                t2[p] = _mm256_add_ps(_mm256_permute2f128_ps(va, vb, 0x20), _mm256_permute2f128_ps(va, vb, 0x31));
            }
            // hadd, hadd: lane 0 holds keys 0, 2, 4, 6 of the eight, lane 1 keys 1, 3, 5, 7
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(t2[0], t2[1]), _mm256_hadd_ps(t2[2], t2[3]));
            const __m256 o = _mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            if (nk - k8 >= 8) {
                _mm256_storeu_ps(s + 16*r + k8, o);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, o);
                memcpy(s + 16*r + k8, tmp, (nk - k8) * sizeof(float));
            }
        }
    }
}
#endif
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
                    {  // (their indices stepped, not divided out: a division a row cost as much as the row's dots)
                        int64_t j11 = i11, j12 = i12, j13 = i13;
                        const int64_t j12_end = (i02 + 1) * r2;
                        while (ir1 + fimble_m < fimble_end) {
                            if (++j11 == ne1) {
                                j11 = 0;
                                if (++j12 == ne12) {
                                    j12 = 0;
                                    ++j13;
                                }
                            }
                            if (j13 != i13 ? j12 / r2 != i02 || j13 / r3 != i03 : j12 >= j12_end) {
                                break;
                            }
                            fimble_m++;
                        }
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
#if defined(FIMBLE_KEYS_BLOCK)
                        if (ne00 == 2*GGML_F16_DOT_STEP) {  // the block's keys at once (the same sums)
                            fimble_keys_block((int) (MIN(iir0 + blck_0, ir0_end) - iir0), fimble_m, fimble_tmp,
                                              src0_row + iir0 * nb01, nb01, fimble_heads, ne00);
                        } else
#endif
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
                        int64_t j11 = i11, j12 = i12, j13 = i13;  // row ir1 + r's indices, stepped
                        for (int64_t r = 0; r < fimble_m; r++) {
                            float * d = (float *) ((char *) dst->data + (j11 * nb1 + j12 * nb2 + j13 * nb3));
                            memcpy(&d[iir0], fimble_tmp + 16 * r, (MIN(iir0 + blck_0, ir0_end) - iir0) * sizeof(float));
                            if (++j11 == ne1) {
                                j11 = 0;
                                if (++j12 == ne12) {
                                    j12 = 0;
                                    ++j13;
                                }
                            }
                        }
                        ir1 += fimble_m - 1;  // and the loop's own step: the next rows
                        continue;
                    }
                }
#endif
"""
