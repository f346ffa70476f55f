"""ggml_patch.py item 6: attention's softmax prepares each row in one vectorised pass (ops.cpp, soft_max_f32).

Stock copies a row of scores, scales it, adds the mask in a scalar loop and finds the maximum in another (a chain of
one compare a score: at 1,250 cached positions ~2 cycles an element), before ggml_vec_soft_max_f32. Every verify row
pays this for every query head of every layer: at 1 thread, 8 rows over 1,250 cached positions spent ~4% of the pass
in those loops. FIMBLE_SOFTMAX_PREP does the copy, scale, mask and maximum in one pass of 8-wide vectors, with the same
operations on each element (w = s*scale, rounded, then w + mask, rounded: stock's slope*mask is the mask itself when
slope is 1, so its add, fused or not, rounds once too), and a maximum, which does not depend on order. So every
probability is stock's bit for bit; rows whose slope is not 1 (ALiBi) or whose mask is f16 take stock's loops.
"""

from __future__ import annotations

OPS = "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp"

# Before soft_max_f32 (ops.cpp is C++: the helper is static there).
PREP_BEFORE = "static void ggml_compute_forward_soft_max_f32(\n"
PREP = r"""#if defined(__AVX2__)
// fimble (engine/runtimes/ggml_patch_softmax.py): w = s*scale + m (two roundings, never fused: stock scales the row in
// one loop and adds the mask in another) and the row's maximum, in one pass; m may be NULL (no mask).
__attribute__((optimize("fp-contract=off")))
static void fimble_soft_max_prep(const int n, float * w, const float * s, const float scale, const float * m,
                                 float * max) {
    const __m256 vs = _mm256_set1_ps(scale);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 7 < n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + i), vs);
        if (m) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(m + i));
        }
        _mm256_storeu_ps(w + i, v);
        vmax = _mm256_max_ps(vmax, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    float mx = -INFINITY;
    for (int k = 0; k < 8; ++k) {
        mx = MAX(mx, lanes[k]);
    }
    for (; i < n; ++i) {
        float v = s[i]*scale;
        if (m) {
            v = v + m[i];
        }
        w[i] = v;
        mx = MAX(mx, v);
    }
    *max = mx;
}
#endif

"""

# Stock's loops, kept as they are for the rows the one pass does not take.
STOCK_PREP = """                ggml_vec_cpy_f32  (ne00, wp, sp);
                ggml_vec_scale_f32(ne00, wp, scale);
                if (mp_f32) {
                    if (use_f16) {
                        for (int i = 0; i < ne00; ++i) {
                            wp[i] += slope*GGML_CPU_FP16_TO_FP32(mp_f16[i]);
                        }
                    } else {
                        for (int i = 0; i < ne00; ++i) {
                            wp[i] += slope*mp_f32[i];
                        }
                    }
                }

#ifndef NDEBUG
                for (int i = 0; i < ne00; ++i) {
                    //printf("p[%d] = %f\\n", i, p[i]);
                    assert(!isnan(wp[i]));
                }
#endif // NDEBUG
"""
LOOPS_OLD = (
    STOCK_PREP
    + """
                float max = -INFINITY;
                ggml_vec_max_f32(ne00, &max, wp);
"""
)
LOOPS_NEW = (
    """                float max = -INFINITY;
#if defined(__AVX2__)
                if (slope == 1.0f && !use_f16) {  // fimble: one pass (ggml_patch_softmax.py)
                    fimble_soft_max_prep((int) ne00, wp, sp, scale, mp_f32, &max);
                } else
#endif
                {
"""
    + STOCK_PREP
    + """
                ggml_vec_max_f32(ne00, &max, wp);
                }
"""
)

PATCHES: tuple[tuple[str, str, str], ...] = (
    (OPS, PREP_BEFORE, PREP + PREP_BEFORE),
    (OPS, LOOPS_OLD, LOOPS_NEW),
)
