"""q8_0 weights packed in the lane order at load (ggml_patch.py item 5): the lane kernels' weights as they read them.

The AVX2 lane kernel (ggml_patch_lanes_avx2.py) spends ~1.3 ns a weight block, shared by the pass's rows, gathering
eight blocks' scales and transposing their quants into lane order: at 1 thread about a fifth of a 4-row verify
pass. Weights never change, so this does it once, when the model loads: ggml's CPU_REPACK buffer type (repack.cpp,
the mechanism stock uses for its q4_0 8x8 layouts) takes every 2-D q8_0 weight of a product, packs each row in place
of its blocks (the same bytes: a group of eight blocks is 8 scales then 256 bytes of lane-order quants, a last group
of four 4 scales then 128 bytes; anything else stays blocks), and runs its products through the same kernel with the
loads swapped (``PACKED``). The arithmetic is the lane kernel's, so every row's bits are unchanged: packed and
unpacked products, 1-token steps and verify blocks, agree bit for bit (tests/engine/test_q8_packed.py).
The VNNI kernel (ggml_patch_lanes.py) gathered and transposed too, and on a Zen 4 (AVX-512 VNNI) that work was not
hidden under the weights' stream even in a 1-token step: its rows function (``fimble_lanes_rows``, ``PACKED``) now
reads the same packed layout (2026-12-07: bench/reports/vnni-packed-2026-12-07/).

Where: x86 with AVX2 on either lane kernel (``fimble_q8_0_lanes() >= 1``), rows of at most FIMBLE_Q8_0_MAX_N columns.
FIMBLE_Q8_0_PACK=0 leaves the weights as blocks (benchmarks compare the two); fimble_q8_0_packed_rows counts the rows
packed (tests read it).
Cost: a tied output head is a second, packed copy of the token embeddings (llama.cpp loads a duplicated tensor into the
product's buffer type); 136 MB for the default model, whose embeddings stay as they were for the lookups.
"""

from __future__ import annotations

REPACK = "vendor/llama.cpp/ggml/src/ggml-cpu/repack.cpp"

# quants.c (after the AVX2 lane kernel, whose helpers and row buffer it uses)
PACKED_KERNEL = r"""// fimble (engine/runtimes/ggml_patch_packed.py): q8_0 weights packed in the lane order at load.
int fimble_q8_0_packs(void) {
    static int known = -1;  // every thread computes the same value
    int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (v < 0) {
        const char * pack = getenv("FIMBLE_Q8_0_PACK");
        v = fimble_q8_0_lanes() >= 1 && !(pack && pack[0] == '0');  // either lane kernel
        __atomic_store_n(&known, v, __ATOMIC_RELAXED);
    }
    return v;
}

static int64_t fimble_packed_rows;  // rows packed in this process (tests read it: fimble_q8_0_packed_rows)

int64_t fimble_q8_0_packed_rows(void) {
    return __atomic_load_n(&fimble_packed_rows, __ATOMIC_RELAXED);
}

void fimble_q8_0_pack(const void * GGML_RESTRICT src, void * GGML_RESTRICT dst, const int64_t nrows, const int n) {
    __atomic_add_fetch(&fimble_packed_rows, nrows, __ATOMIC_RELAXED);
    const int nb = n / QK8_0;
    const size_t bx = (size_t) nb * sizeof(block_q8_0);
    for (int64_t i = 0; i < nrows; ++i) {
        const block_q8_0 * GGML_RESTRICT x = (const block_q8_0 *) ((const char *) src + i*bx);
        uint8_t * GGML_RESTRICT p = (uint8_t *) dst + i*bx;
        for (int g = 0; g < (nb + 7) / 8; ++g) {
            const int m = nb - 8*g < 8 ? nb - 8*g : 8;
            uint8_t * gp = p + 8*g*sizeof(block_q8_0);
            if (m == 8 || m == 4) {  // m scales, then the group's vectors (fimble_lanes2_rows's PACKED loads)
                __m256i c[8];
                if (m == 8) {
                    fimble_lanes_transpose(x + 8*g, 8, c);
                } else {
                    fimble_lanes_transpose4(x + 8*g, 4, c);
                }
                for (int j = 0; j < m; ++j) {
                    memcpy(gp + 2*j, &x[8*g + j].d, sizeof(ggml_half));
                }
                for (int k = 0; k < m; ++k) {
                    _mm256_storeu_si256((__m256i *) (gp + 2*m + 32*k), c[k]);
                }
            } else {
                memcpy(gp, x + 8*g, m * sizeof(block_q8_0));
            }
        }
    }
}

static __attribute__((noinline)) void fimble_packed_all(
        const int nb, const int nx, const int nr, float * GGML_RESTRICT s, const size_t bs,
        const char * GGML_RESTRICT vx, const size_t bx, const char * GGML_RESTRICT vy, const size_t by) {
    fimble_lanes2_prepare(nb, nr, vy, by);
    for (int i = 0; i < nx; ++i) {
        FIMBLE_LANES_DISPATCH(fimble_lanes2_rows, nr, nb, s + i, bs, (const block_q8_0 *) (vx + i*bx), 1)
    }
}

// On a CPU with AVX-512 VNNI: the VNNI kernel (ggml_patch_lanes.py, fimble_lanes_rows with PACKED) on packed weights,
// which it would otherwise gather and transpose in every pass (~24 shuffles and eight scale loads per group of eight
// blocks, shared by the pass's rows but not hidden under the weights' stream: in a C harness of 256 MB of weights,
// 1 thread, a 1-row pass ~25% faster at 896 columns, ~14% at 4,864).
static FIMBLE_LANES_T __attribute__((noinline)) void fimble_packed_vnni_all(
        const int nb, const int nx, const int nr, float * GGML_RESTRICT s, const size_t bs,
        const char * GGML_RESTRICT vx, const size_t bx, const char * GGML_RESTRICT vy, const size_t by) {
    fimble_lanes_prepare_vnni(nb, nr, vy, by, FIMBLE_ROWS_VNNI_PACKED);
    fimble_lanes_vnni_rows(nb, nx, nr, s, bs, vx, bx, 1);
}

void fimble_vec_dot_q8_0_q8_0_packed(int n, int nx, int nr, float * GGML_RESTRICT s, size_t bs,
                                     const void * GGML_RESTRICT vx, size_t bx,
                                     const void * GGML_RESTRICT vy, size_t by) {
    assert(n % QK8_0 == 0 && n <= FIMBLE_Q8_0_MAX_N && nr >= 1 && nr <= FIMBLE_Q8_0_ROWS);
    (fimble_q8_0_lanes() == 2 ? fimble_packed_vnni_all : fimble_packed_all)(
        n / QK8_0, nx, nr, s, bs, (const char *) vx, bx, (const char *) vy, by);
}

"""

# quants.h (inside Q8_DECL_NEW's AVX2 block)
PACKED_DECL = """// fimble_q8_0_packs: whether q8_0 weights are packed at load (ggml_patch_packed.py): the AVX2 lane
// kernel, unless FIMBLE_Q8_0_PACK=0. fimble_q8_0_pack writes nrows rows of n columns in the packed layout (the
// same size); fimble_vec_dot_q8_0_q8_0_packed is fimble_vec_dot_q8_0_q8_0_lanes on packed weights, with the same
// results.
int fimble_q8_0_packs(void);
void fimble_q8_0_pack(const void * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int n);
int64_t fimble_q8_0_packed_rows(void);
void fimble_vec_dot_q8_0_q8_0_packed(int n, int nx, int nr, float * GGML_RESTRICT s, size_t bs,
                                     const void * GGML_RESTRICT vx, size_t bx,
                                     const void * GGML_RESTRICT vy, size_t by);
"""

TRAITS_BEFORE = (
    "static const ggml::cpu::tensor_traits * ggml_repack_get_optimal_repack_type(const struct ggml_tensor * cur) {"
)
TRAITS = r"""#include "quants.h"
#if defined(FIMBLE_Q8_0_ROWS) && defined(__linux__)
#include <sys/mman.h>  // (madvise: the packed weights' huge pages)
#endif
#if defined(FIMBLE_Q8_0_ROWS)
// fimble (engine/runtimes/ggml_patch_packed.py): q8_0 weights packed in the lane order, their products.
namespace ggml::cpu::repack {
class fimble_q8_0_packed : public tensor_traits_base {
    bool work_size(int /* n_threads */, const struct ggml_tensor * op, size_t & size) override {
        if (op->op != GGML_OP_MUL_MAT) {
            return false;
        }
        size = ggml_row_size(GGML_TYPE_Q8_0, ggml_nelements(op->src[1]));  // the activations as q8_0 rows
        return true;
    }

    bool compute_forward(struct ggml_compute_params * params, struct ggml_tensor * op) override {
        if (op->op != GGML_OP_MUL_MAT) {
            return false;
        }
        forward_mul_mat(params, op);
        return true;
    }

    // ggml_compute_forward_mul_mat's work for this weight: the activations quantised to q8_0 by ggml's own
    // from_float, then 64-weight-row chunks handed out to the threads, each against up to 16 activation rows a
    // call, as the unpacked path does (ggml_patch.py items 3 and 4). Which rows share a call never changes a sum.
    void forward_mul_mat(ggml_compute_params * params, ggml_tensor * op) {
        const ggml_tensor * src0 = op->src[0];
        const ggml_tensor * src1 = op->src[1];
        ggml_tensor * dst = op;
        GGML_TENSOR_BINARY_OP_LOCALS
        const int ith = params->ith;
        const int nth = params->nth;
        GGML_ASSERT(src1->type == GGML_TYPE_F32 && nb10 == sizeof(float) && ne00 == ne10);
        GGML_ASSERT(ne0 == ne01 && ne1 == ne11 && ne2 == ne12 && ne3 == ne13 && ne02 == 1 && ne03 == 1);
        GGML_ASSERT(nb0 == sizeof(float) && nb2 == nb1 * ne1 && nb3 == nb2 * ne2);  // rows one stride apart
        fimble_q8_0_lanes_forget();  // this product's rows are not any earlier product's
        const size_t nbw1 = ggml_row_size(GGML_TYPE_Q8_0, ne10);
        char * wdata = (char *) params->wdata;
        const int64_t rows = ne11 * ne12 * ne13;
        GGML_ASSERT(params->wsize >= nbw1 * rows);
        const ggml_from_float_t from_float = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0)->from_float;
        for (int64_t r = ith; r < rows; r += nth) {
            const int64_t i11 = r % ne11, i12 = (r / ne11) % ne12, i13 = r / (ne11 * ne12);
            from_float((const float *) ((const char *) src1->data + i11*nb11 + i12*nb12 + i13*nb13),
                       wdata + r*nbw1, ne10);
        }
        const int64_t chunk = 64;
        const int64_t chunks = (ne01 + chunk - 1) / chunk;
        if (ith == 0) {
            ggml_threadpool_chunk_set(params->threadpool, nth);  // each thread starts at its own chunk
        }
        ggml_barrier(params->threadpool);
        for (int64_t c = ith; c < chunks; c = ggml_threadpool_chunk_add(params->threadpool, 1)) {
            const int64_t i0 = c * chunk;
            const int nx = (int) MIN(chunk, ne01 - i0);
            for (int64_t r = 0; r < rows;) {
                const int64_t left = rows - r;
                const int nr = (int) (left <= FIMBLE_Q8_0_ROWS ? left : MIN((left + 1) / 2, FIMBLE_Q8_0_ROWS));
                fimble_vec_dot_q8_0_q8_0_packed((int) ne00, nx, nr, (float *) ((char *) dst->data + r*nb1) + i0,
                                                nb1 / sizeof(float), (const char *) src0->data + i0*nb01, nb01,
                                                wdata + r*nbw1, nbw1);
                r += nr;
            }
        }
    }

    int repack(struct ggml_tensor * t, const void * data, size_t data_size) override {
        GGML_ASSERT(t->type == GGML_TYPE_Q8_0 && data_size == ggml_nbytes(t) && ggml_is_contiguous(t));
        fimble_q8_0_pack(data, t->data, ggml_nrows(t), (int) t->ne[0]);
        return 0;
    }
};
}  // namespace ggml::cpu::repack
#endif

"""

OPTIMAL_OLD = "    } else if (cur->type == GGML_TYPE_Q8_0) {\n"
OPTIMAL_NEW = r"""    } else if (cur->type == GGML_TYPE_Q8_0) {
#if defined(FIMBLE_Q8_0_ROWS)
        // fimble (engine/runtimes/ggml_patch_packed.py): on the AVX2 lane kernel, every 2-D q8_0 weight packed
        static const ggml::cpu::repack::fimble_q8_0_packed fimble_packed;
        if (fimble_q8_0_packs() && ggml_n_dims(cur) == 2 && cur->ne[0] % QK8_0 == 0 &&
            cur->ne[0] <= FIMBLE_Q8_0_MAX_N) {
            return &fimble_packed;
        }
#endif
"""

# The packed weights live in memory the repack buffer allocates (posix_memalign: 4 KB pages), where the unpacked ones
# were the model file's mapped pages. A 1-token step streams all of them, so their pages' size shows: in a C harness
# (the VNNI kernel, 256 MB of packed weights, 1 thread, fastest of 15) a 1-row pass took 11.1 ms on transparent huge
# pages against 13.1 ms on 4 KB pages, a 4-row pass 15.4 against 18.9 (Zen 4). So the buffer asks for huge pages
# before anything is written to it: a hint (MADV_HUGEPAGE), taken where transparent huge pages are "always" or
# "madvise" and ignored elsewhere; it changes where bytes live, never what they are.
HUGE_OLD = (
    "    buffer->buft              = buft;\n"
    "    buffer->iface.init_tensor = ggml_backend_cpu_repack_buffer_init_tensor;\n"
)
HUGE_NEW = (
    r"""#if defined(FIMBLE_Q8_0_ROWS) && defined(__linux__) && defined(MADV_HUGEPAGE)
    {  // fimble (engine/runtimes/ggml_patch_packed.py): the packed weights on huge pages where the kernel allows
        const uintptr_t huge = (uintptr_t) 2 << 20, base = (uintptr_t) ggml_backend_buffer_get_base(buffer);
        const uintptr_t first = (base + huge - 1) & ~(huge - 1), last = (base + size) & ~(huge - 1);
        if (last > first) {
            madvise((void *) first, last - first, MADV_HUGEPAGE);  // (a hint: its failure changes nothing)
        }
    }
#endif
"""
    + HUGE_OLD
)

PATCHES: tuple[tuple[str, str, str], ...] = (
    (REPACK, TRAITS_BEFORE, TRAITS + TRAITS_BEFORE),
    (REPACK, OPTIMAL_OLD, OPTIMAL_NEW),
    (REPACK, HUGE_OLD, HUGE_NEW),
)
