"""The edits fimble makes to llama.cpp's source before building it (engine/runtimes/ggml_build.py applies
them and says why): (file, text there, its replacement). Each text must occur exactly once.

All serve one rule: for 1 to 32 rows, every f32 and f16 product runs ggml's own path, whose sums are
stock's 1-row sums, so a verify block's rows equal 1-token steps' bit for bit (fimble is lossless) and a
1-token step runs stock's kernel at stock's speed. The one exception: q8_0 on an x86 CPU with AVX2 runs
fimble's own lane order at every row count (item 3), faster, blocks still equal steps.
1. sgemm.cpp: llamafile's tinyBLAS takes f32 and f16 products from 33 rows only (stock: from 2); q8_0
   never where a lane kernel runs (FIMBLE_Q8_0_AVX2=1: from 33).
2. ggml-cpu.c: ggml's own product reads each weight row once for two rows of a block (f32 and f16) or
   three (f32), where stock reads it once per row. Each sum runs in exactly ggml_vec_dot_f32's or
   ggml_vec_dot_f16's order: the same four accumulators over the same steps, the same reduction. Only
   for rows with no leftover elements (vec_dot sums those in scalar code, which a compiler may contract
   differently), and only where ggml's generic SIMD code is the vec_dot (not SVE or RISC-V vectors).
   On x86 with F16C, attention's products take every src1 row of a block that reads the same key/value
   head at once: Qwen's query heads of one key/value head (GQA) and a verify block's rows. A key row (one or
   two SIMD steps: a head's 64 keys) is loaded and converted once for all of them; a value row (n_kv long)
   once for two of them. Each sum in ggml_vec_dot_f16's order, so the results are stock's bit for bit
   (ggml_patch_heads.py). A block's keys (64 halves each, AVX2) are converted once and met by each query row held in
   registers, the last horizontal adds of eight sums done as vectors; the rows' indices are stepped, not divided out.
3. quants.h, arch/x86/quants.c, ggml-cpu.c: q8_0 weights against the q8_0 rows ggml quantises the
   activations to.
   - On every AVX2 CPU, every such product, 1-token steps and prefills included (tinyBLAS declines q8_0),
     takes fimble_vec_dot_q8_0_q8_0_lanes, 16 rows at a time: with AVX-512 VNNI (checked at run time; the
     build stays AVX2) ggml_patch_lanes.py's kernel, else ggml_patch_lanes_avx2.py's (the same sums and
     float operations by AVX2's instructions: the two agree bit for bit). fimble's lane order, where each of
     eight consecutive blocks owns one float lane and a block's 32 products are summed in integers (exact), so
     a row costs one vpdpbusd per block and one convert, multiply and FMA per eight blocks (stock: a float FMA
     per block and lane). Every row runs the same operations whatever the pass's size, so blocks equal steps
     bit for bit, and a prefill's q8_0 sums are a step's too (as stock's gemv and tinyBLAS agree; attention's
     kernels still differ between prefills and steps, as in llama.cpp). Its sums are not stock's:
     fimble's greedy output can differ from stock llama.cpp's where two logits nearly tie (llama.cpp through
     this library, llama-cpp-python, runs the same kernel). Measured at 1 thread with VNNI
     (bench/reports/verify-rows-lanes-2026-12-05.txt): a 1-token step 23% faster (13% at 2 threads), 4 and 8
     rows 25% and 31% faster than the exact-stock-order kernel before it, a 1,024-token prefill 1.9x faster
     than tinyBLAS; on AVX2 alone (bench/reports/verify-rows-lanes-avx2-2026-12-05.txt) a step ~20% faster.
   - With FIMBLE_Q8_0_AVX2=1 (stock's order), fimble_vec_dot_q8_0_q8_0_rows takes 1 to 16 rows of a block at
     once: each weight block is loaded once for every row, and each row's sum is ggml_vec_dot_q8_0_q8_0's AVX2
     loop (the same scale product, the same integer lane sums, one FMA a block in order, the same reduction); a
     1-token step's weight rows go four at a time (four FMA chains, where stock's loop waits on one: the step at
     the lane kernel's speed, its sums stock's). tinyBLAS's q8_0 tiles (4 weight rows x 2 activation rows) also
     equal vec_dot bit for bit, but cost about 0.8 of a step per extra row here (the probe before this kernel:
     2/4/8/16 rows 1.86/3.30/6.10/11.93 steps).
4. ggml-cpu.c: a product of 2-16 activation rows (a verify block) is split among the threads in 64-row chunks, as a
   1-token step is (stock: 16-row chunks whenever there is more than one activation row). At 2 threads a verify block
   then costs 10-13% less (CHUNK_OLD's comment says why); which weight rows one call takes never changes a row's sum.
5. repack.cpp (ggml_patch_packed.py): on either lane kernel, q8_0 weights are packed in the lane order when the
   model loads (ggml's CPU_REPACK buffer type, asked for transparent huge pages), so the kernel loads each group's
   scales and quants instead of gathering and transposing them in every pass; the same arithmetic, the same bits.
6. ops.cpp (ggml_patch_softmax.py): attention's softmax copies, scales and masks a row of scores and finds its
   maximum in one vectorised pass (stock: four loops, two of them scalar), with the same operations on each element:
   the same probabilities, bit for bit.
"""

from __future__ import annotations

from engine.runtimes import ggml_patch_packed, ggml_patch_softmax
from engine.runtimes.ggml_patch_heads import HEADS_KERNEL, HEADS_LOOP
from engine.runtimes.ggml_patch_lanes import LANES_KERNEL
from engine.runtimes.ggml_patch_lanes_avx2 import LANES_AVX2_KERNEL

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
    // once for up to 16 rows (quants.c, fimble_vec_dot_q8_0_q8_0_rows), where tinyBLAS's 4x2 tiles cost
    // about a step per extra row here.
    // Where the CPU has AVX-512 VNNI, q8_0 never takes tinyBLAS: every row count runs fimble's lane order
    // (quants.c, fimble_vec_dot_q8_0_q8_0_lanes), so a prefill's rows equal 1-token steps' bit for bit, as
    // stock's gemv and tinyBLAS do.
#if defined(__GNUC__)
    if (Atype == GGML_TYPE_Q8_0 && (n <= 32 || fimble_q8_0_lanes()))
        return false;
#else
    if (n <= 32 && Atype == GGML_TYPE_Q8_0)
        return false;
#endif
#endif
#endif"""

SGEMM_DECL_OLD = '#include "simd-mappings.h"\n'
SGEMM_DECL_NEW = """#include "simd-mappings.h"
#if defined(__AVX2__) && defined(__GNUC__) && !defined(__MMA__)
extern "C" int fimble_q8_0_lanes(void);  // fimble (engine/runtimes/ggml_patch.py): quants.c
#endif
"""

KERNELS_BEFORE = "static void ggml_compute_forward_mul_mat_one_chunk("
# The two- and three-row f32 kernels are written out, not one loop over a row count: each must keep its
# 8 or 12 accumulators in AVX2's 16 registers, and a generic version (up to four rows) measured slower
# here. This text is part of the build's stamp: editing it rebuilds the library.
KERNELS = (
    """// fimble (engine/runtimes/ggml_patch.py): one src0 row against two or three src1 rows per pass.
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
"""
    + HEADS_KERNEL
    + """#endif

"""
)

TMP_OLD = "    float tmp[32];\n"
TMP_NEW = (
    "    float tmp[32];\n    float fimble_tmp[256];  // fimble: up to sixteen rows of 16 results\n"
    "#if defined(FIMBLE_GQA)\n"
    "    float fimble_heads[16 * 2 * GGML_F16_DOT_STEP];  // fimble: up to sixteen rows as floats\n"
    "#endif\n"
)

LOOP_OLD = """                //for (int64_t ir0 = iir0; ir0 < iir0 + blck_0 && ir0 < ir0_end; ++ir0) {
                //    vec_dot(ne00, &dst_col[ir0], src0_row + ir0*nb01, src1_col);
                //}
"""
LOOP_NEW = (
    LOOP_OLD
    + HEADS_LOOP
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
                // fimble: q8_0 weights against up to FIMBLE_Q8_0_ROWS (16) rows of this block at once, each weight
                // block loaded once for all; every row count, 1-token steps included (the lane-order kernel, or in
                // stock's order the rows kernel, which takes a 1-token step's weight rows four at a time).
                const int fimble_lanes = type == GGML_TYPE_Q8_0 && fimble_q8_0_lanes();
                if (type == GGML_TYPE_Q8_0 && vec_dot_type == GGML_TYPE_Q8_0 && fimble_left >= 1 &&
                    ne00 <= FIMBLE_Q8_0_MAX_N && num_rows_per_vec_dot == 1 &&
                    (src1_cont || src1->type != vec_dot_type)) {
                    const int64_t fimble_q8 = fimble_left <= FIMBLE_Q8_0_ROWS ? fimble_left
                                            : MIN((fimble_left + 1) / 2, FIMBLE_Q8_0_ROWS);
                    const int64_t fimble_nx = MIN(iir0 + blck_0, ir0_end) - iir0;
                    (fimble_lanes ? fimble_vec_dot_q8_0_q8_0_lanes : fimble_vec_dot_q8_0_q8_0_rows)(
                        (int) ne00, (int) fimble_nx, (int) fimble_q8, fimble_tmp, 16, src0_row + iir0 * nb01, nb01,
                        src1_col, row_size);
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
// fimble (engine/runtimes/ggml_patch.py): nx q8_0 rows of vx (bx bytes apart) against nr (1..FIMBLE_Q8_0_ROWS)
// q8_0 rows of vy (by bytes apart), row length n <= FIMBLE_Q8_0_MAX_N; s[i + r*bs] = x row i . y row r, each
// exactly ggml_vec_dot_q8_0_q8_0's result.
#define FIMBLE_Q8_0_ROWS 16
#define FIMBLE_Q8_0_MAX_N 32768
void fimble_vec_dot_q8_0_q8_0_rows(int n, int nx, int nr, float * GGML_RESTRICT s, size_t bs,
                                   const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by);
// Where the CPU has AVX-512 VNNI: every q8_0 product of 1..FIMBLE_Q8_0_ROWS rows in fimble's lane order (the same
// arguments, nr >= 1), 1-token steps included. fimble_q8_0_lanes says whether this CPU takes it;
// fimble_q8_0_lanes_forget starts a product (the rows a thread prepared may be overwritten from here on).
int fimble_q8_0_lanes(void);
void fimble_q8_0_lanes_forget(void);
void fimble_vec_dot_q8_0_q8_0_lanes(int n, int nx, int nr, float * GGML_RESTRICT s, size_t bs,
                                    const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by);
"""
    + ggml_patch_packed.PACKED_DECL
    + "#endif\n"
)

Q8_KERNEL_BEFORE = "void ggml_vec_dot_tq1_0_q8_K("
# Each kernel's loop is written once and inlined for each row count, so every count keeps its accumulators in
# registers (a runtime count would keep them in memory). The scale products and integer lane sums are the
# 1-row loop's values, formed fewer times: that is where a row's cost went (per row and weight block the old
# kernel ran six vector operations, two of them on the multiply ports only to rebuild the scale).
Q8_KERNEL_HEAD = r"""#if defined(__AVX2__) && defined(__GNUC__)
// fimble (engine/runtimes/ggml_patch.py): ggml_vec_dot_q8_0_q8_0's AVX2 loop for up to 16 activation rows at once.
// Each weight block is loaded once for every row; row r keeps its own accumulator, updated with the 1-row
// loop's arithmetic in its order: the scale product dx*dy in single precision (the same value whether
// multiplied as scalars or in vectors), the block's eight integer lane sums (each exact: four int8 products),
// converted to float exactly, one FMA per block, hsum_float_8. So every row equals a 1-row product bit for bit.

// Rows of up to FIMBLE_Q8_0_FAST_NB blocks against FIMBLE_Q8_0_FAST_ROWS or more rows take the kernels below (their
// scale tables live on the stack; with two rows, forming the scales a block ahead costs more than it saves).
#define FIMBLE_Q8_0_FAST_NB 256
#define FIMBLE_Q8_0_FAST_ROWS 3
#define FIMBLE_Q8_0_PREFETCH 2048

// The scale products of weight block ib against every activation row, dd[r] = dx_ib * dy_r,ib (dyT holds the rows'
// scales block-major, 16 a block): eight rows in one multiply. The kernels form them one block ahead, into the
// other half of a two-block ring, so that the broadcasts that read them back never wait for the store.
static inline __attribute__((always_inline)) void fimble_q8_0_scales(
        const int NR, float * GGML_RESTRICT dd, const block_q8_0 * GGML_RESTRICT x, const float * GGML_RESTRICT dyT) {
    const __m256 dx = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x->d));
    _mm256_store_ps(dd, _mm256_mul_ps(dx, _mm256_loadu_ps(dyT)));
    if (NR > 8) {
        _mm256_store_ps(dd + 8, _mm256_mul_ps(dx, _mm256_loadu_ps(dyT + 8)));
    }
}

// AVX2: NR (<= 8) rows, the 1-row loop's own instructions (mul_sum_us8_pairs_float), the weight block's
// absolute value taken once for all rows. dyT: the rows' scales (row r0 first).
static inline __attribute__((always_inline)) void fimble_q8_0_rows_avx2(
        const int NR, const int nb, float * GGML_RESTRICT s, const size_t bs, const block_q8_0 * GGML_RESTRICT x,
        const char * GGML_RESTRICT vy, const size_t by, const float * GGML_RESTRICT dyT) {
    float dd[32] __attribute__((aligned(32)));
    fimble_q8_0_scales(NR, dd, x, dyT);
    __m256 acc[8];
    for (int r = 0; r < NR; ++r) {
        acc[r] = _mm256_setzero_ps();
    }
    for (int ib = 0; ib < nb; ++ib) {
        // The weights stream from memory while the rows compute: ask for them 2 KB (60 blocks) ahead, into the
        // next weight rows (measured in the model, 3 and 4 rows: 7-8% faster than 1 KB ahead, 4 KB no better).
        _mm_prefetch((const char *)(x + ib) + FIMBLE_Q8_0_PREFETCH, _MM_HINT_T0);
        const float * d = dd + 16*(ib & 1);
        if (ib + 1 < nb) {
            fimble_q8_0_scales(NR, dd + 16*((ib + 1) & 1), x + ib + 1, dyT + 16*(ib + 1));
        }
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[ib].qs);
#if !__AVXVNNIINT8__
        const __m256i ax = _mm256_sign_epi8(qx, qx);  // mul_sum_i8_pairs_float's first step, for every row
#endif
        for (int r = 0; r < NR; ++r) {
            const __m256i qy = _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)(vy + r*by) + ib)->qs);
#if __AVXVNNIINT8__
            const __m256 q = mul_sum_i8_pairs_float(qx, qy);
#else
            const __m256 q = mul_sum_us8_pairs_float(ax, _mm256_sign_epi8(qy, qx));
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(d + r), q, acc[r]);
        }
    }
    for (int r = 0; r < NR; ++r) {
        s[r*bs] = hsum_float_8(acc[r]);
    }
}

"""
# (here: the lane-order kernel, engine/runtimes/ggml_patch_lanes.py)
Q8_KERNEL_TAIL = (
    "// Which lane-order kernel this CPU takes for every q8_0 product of 1 to 16 rows: 2 with AVX-512 VNNI, 1 on\n"
    r"""// AVX2, 0 for none (FIMBLE_Q8_0_AVX2=1: ggml's own 1-row loop and the AVX2 rows kernel; FIMBLE_Q8_0_LANES=avx2:
// the AVX2 lane kernel on a VNNI CPU; both to test them there). None in a build with AVX-VNNI-INT8, whose 1-row
// loop the AVX2 rows kernel would have to follow.
int fimble_q8_0_lanes(void) {
#if __AVXVNNIINT8__
    return 0;
#endif
    static int known = -1;  // every thread computes the same value
    int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (v < 0) {
        const char * avx2 = getenv("FIMBLE_Q8_0_AVX2");
        __builtin_cpu_init();
        const int vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f");
        const char * lanes = getenv("FIMBLE_Q8_0_LANES");
        v = avx2 && avx2[0] == '1' ? 0 : vnni && !(lanes && strcmp(lanes, "avx2") == 0) ? 2 : 1;
        __atomic_store_n(&known, v, __ATOMIC_RELAXED);
    }
    return v;
}

// Longer rows (past FIMBLE_Q8_0_FAST_NB blocks), and two rows: up to 8 rows, the scale products formed per block.
static inline __attribute__((always_inline)) void fimble_q8_0_rows_long(
        const int NR, const int nb, float * GGML_RESTRICT s, const size_t bs, const block_q8_0 * GGML_RESTRICT x,
        const char * GGML_RESTRICT vy, const size_t by) {
    __m256 acc[8];
    for (int r = 0; r < NR; ++r) {
        acc[r] = _mm256_setzero_ps();
    }
    for (int ib = 0; ib < nb; ++ib) {
        const float dx = GGML_CPU_FP16_TO_FP32(x[ib].d);
        _mm_prefetch((const char *)(x + ib) + FIMBLE_Q8_0_PREFETCH, _MM_HINT_T0);
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[ib].qs);
#if !__AVXVNNIINT8__
        const __m256i ax = _mm256_sign_epi8(qx, qx);
#endif
        for (int r = 0; r < NR; ++r) {
            const block_q8_0 * GGML_RESTRICT y = (const block_q8_0 *)(vy + r*by) + ib;
            const __m256 d = _mm256_set1_ps(dx * GGML_CPU_FP16_TO_FP32(y->d));
            const __m256i qy = _mm256_loadu_si256((const __m256i *)y->qs);
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

// One activation row (a 1-token step) against NX (1..4) weight rows at once: for each weight row, ggml's 1-row loop
// in its order (dx*dy as a scalar product, mul_sum_i8_pairs_float, one FMA per block into that row's accumulator,
// hsum_float_8), so each result is ggml_vec_dot_q8_0_q8_0's bit for bit. The 1-row loop waits on its one FMA chain
// (a block per FMA latency); four independent chains keep the multiply pipes busy instead, and the step streams its
// weights at the lane kernel's rate (this project's Zen 3, one thread: 14.0 GB/s against stock's 10.7; the lane
// kernel 14.8).
// The group's rows lie one after another, so the prefetch runs ahead of them linearly, 4 KB ahead (2 KB: 12%
// slower on 28-block rows).
#define FIMBLE_Q8_0_STEP_PREFETCH 4096
static inline __attribute__((always_inline)) void fimble_q8_0_step(
        const int NX, const int nb, float * GGML_RESTRICT s, const char * GGML_RESTRICT vx, const size_t bx,
        const block_q8_0 * GGML_RESTRICT y) {
    __m256 acc[4];
    for (int i = 0; i < NX; ++i) {
        acc[i] = _mm256_setzero_ps();
    }
    for (int ib = 0; ib < nb; ++ib) {
        const char * pf = vx + FIMBLE_Q8_0_STEP_PREFETCH + ib * (NX * (int) sizeof(block_q8_0));
        _mm_prefetch(pf, _MM_HINT_T0);
        _mm_prefetch(pf + 64, _MM_HINT_T0);
        if (NX > 2) {
            _mm_prefetch(pf + 128, _MM_HINT_T0);
        }
        const float dy = GGML_CPU_FP16_TO_FP32(y[ib].d);
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[ib].qs);
        for (int i = 0; i < NX; ++i) {
            const block_q8_0 * GGML_RESTRICT x = (const block_q8_0 *)(vx + i*bx) + ib;
            const __m256 d = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x->d) * dy);
            const __m256i qx = _mm256_loadu_si256((const __m256i *)x->qs);
            acc[i] = _mm256_fmadd_ps(d, mul_sum_i8_pairs_float(qx, qy), acc[i]);
        }
    }
    for (int i = 0; i < NX; ++i) {
        s[i] = hsum_float_8(acc[i]);
    }
}

#define FIMBLE_SWITCH8(F, nr, ...) switch (nr) { \
        case 1: F(1, __VA_ARGS__); break; case 2: F(2, __VA_ARGS__); break; case 3: F(3, __VA_ARGS__); break; \
        case 4: F(4, __VA_ARGS__); break; case 5: F(5, __VA_ARGS__); break; case 6: F(6, __VA_ARGS__); break; \
        case 7: F(7, __VA_ARGS__); break; default: F(8, __VA_ARGS__); break; }

void fimble_vec_dot_q8_0_q8_0_rows(int n, int nx, int nr, float * GGML_RESTRICT s, size_t bs,
                                   const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by) {
    assert(n % QK8_0 == 0 && n <= FIMBLE_Q8_0_MAX_N && nr >= 1 && nr <= FIMBLE_Q8_0_ROWS);
    const int nb = n / QK8_0;
    const char * GGML_RESTRICT y = vy;
    if (nr == 1) {  // a 1-token step: its weight rows four at a time
        int i = 0;
        for (; i + 4 <= nx; i += 4) {
            fimble_q8_0_step(4, nb, s + i, (const char *) vx + i*bx, bx, vy);
        }
        switch (nx - i) {
            case 3: fimble_q8_0_step(3, nb, s + i, (const char *) vx + i*bx, bx, vy); break;
            case 2: fimble_q8_0_step(2, nb, s + i, (const char *) vx + i*bx, bx, vy); break;
            case 1: fimble_q8_0_step(1, nb, s + i, (const char *) vx + i*bx, bx, vy); break;
            default: break;
        }
        return;
    }
    const int h = nr <= 8 ? nr : (nr + 1) / 2;  // 9-16 rows on AVX2: two groups, the weight row still in cache
    if (nb > FIMBLE_Q8_0_FAST_NB || nr < FIMBLE_Q8_0_FAST_ROWS) {
        for (int i = 0; i < nx; ++i) {
            const block_q8_0 * GGML_RESTRICT x = (const block_q8_0 *)((const char *) vx + i*bx);
            FIMBLE_SWITCH8(fimble_q8_0_rows_long, h, nb, s + i, bs, x, y, by)
            if (nr > h) {
                FIMBLE_SWITCH8(fimble_q8_0_rows_long, nr - h, nb, s + i + h*bs, bs, x, y + h*by, by)
            }
        }
        return;
    }
    float dyT[16 * FIMBLE_Q8_0_FAST_NB] __attribute__((aligned(32)));
    for (int ib = 0; ib < nb; ++ib) {  // the rows' scales, 8 or 16 a block (unused lanes zero)
        _mm256_store_ps(dyT + 16*ib, _mm256_setzero_ps());
        if (nr > 8) {
            _mm256_store_ps(dyT + 16*ib + 8, _mm256_setzero_ps());
        }
        for (int r = 0; r < nr; ++r) {
            dyT[16*ib + r] = GGML_CPU_FP16_TO_FP32(((const block_q8_0 *)(y + r*by) + ib)->d);
        }
    }
    for (int i = 0; i < nx; ++i) {
        const block_q8_0 * GGML_RESTRICT x = (const block_q8_0 *)((const char *) vx + i*bx);
        FIMBLE_SWITCH8(fimble_q8_0_rows_avx2, h, nb, s + i, bs, x, y, by, dyT)
        if (nr > h) {
            FIMBLE_SWITCH8(fimble_q8_0_rows_avx2, nr - h, nb, s + i + h*bs, bs, x, y + h*by, by, dyT + h)
        }
    }
}
#undef FIMBLE_SWITCH8
#endif

"""
)
Q8_KERNEL = Q8_KERNEL_HEAD + LANES_KERNEL + LANES_AVX2_KERNEL + ggml_patch_packed.PACKED_KERNEL + Q8_KERNEL_TAIL

# Each product starts with its threads' lane-order rows forgotten (quants.c, fimble_q8_0_lanes_forget): the rows a
# thread prepared belong to one product's src1, and the next product may quantise other rows into the same memory.
# (ggml_compute_forward_mul_mat's chunk loop; mul_mat_id's is indented deeper.)
FORGET_OLD = "\n    int current_chunk = ith;\n"
FORGET_NEW = """
#if defined(FIMBLE_Q8_0_ROWS)
    fimble_q8_0_lanes_forget();  // fimble (engine/runtimes/ggml_patch.py)
#endif
    int current_chunk = ith;
"""

# A verify block (2-16 src1 rows) is split among the threads in the 1-token step's 64-row chunks, not stock's 16: the
# rows' kernel streams each chunk's weights once for every row, and a 16-row chunk (15 KB of the 0.5B's q8_0 weights)
# hands each thread a short stream that restarts at every chunk. Chunks change which weight rows one call takes,
# never a row's arithmetic (the probe checks blocks = steps bit for bit).
CHUNK_OLD = """    int chunk_size = 16;

    // We need to step up the size if it's small
    if (nr0 == 1 || nr1 == 1) {
        chunk_size = 64;
    }
"""
CHUNK_NEW = (
    CHUNK_OLD
    + """#if defined(FIMBLE_Q8_0_ROWS)
    if (nr1 <= FIMBLE_Q8_0_ROWS) {
        chunk_size = 64;  // fimble (engine/runtimes/ggml_patch.py): a verify block in the step's chunks
    }
#endif
"""
)

PATCHES: tuple[tuple[str, str, str], ...] = (
    (SGEMM, SGEMM_DECL_OLD, SGEMM_DECL_NEW),
    (SGEMM, SGEMM_OLD, SGEMM_NEW),
    (GGML_CPU, KERNELS_BEFORE, KERNELS + KERNELS_BEFORE),
    (GGML_CPU, TMP_OLD, TMP_NEW),
    (GGML_CPU, LOOP_OLD, LOOP_NEW),
    (GGML_CPU, FORGET_OLD, FORGET_NEW),
    (GGML_CPU, CHUNK_OLD, CHUNK_NEW),
    (QUANTS_H, Q8_DECL_OLD, Q8_DECL_NEW),
    (QUANTS_X86, Q8_KERNEL_BEFORE, Q8_KERNEL + Q8_KERNEL_BEFORE),
    *ggml_patch_packed.PATCHES,
    *ggml_patch_softmax.PATCHES,
)
