"""Triton kernels for the CUDA path (engine/runtimes/cuda_graphs.py: "fused", "invariant-cublas", "invariant").

A decode step of a small model is a few hundred tiny kernels (bench/reports/gpu-profile-h200-*.txt: 548
for the 0.5B shape, ~23 a layer, median 1.6 us each), so the step costs several times its weights' read
time. Three kernels here replace about a dozen of a layer's:

- ``rope_store``: RoPE on the query and key heads of one ``qkv`` projection row, the rotated query
  written out, the rotated key and the value stored into the cache at the row's position (torch: a
  concatenation, two products and a sum per head group, two cache writes and their layout copies).
  It computes in fp32 and rounds once, where torch's three bf16 ops round three times: the same rotation,
  within bf16's rounding of torch's (tests/engine/test_gpu_kernels.py bounds both against exact fp32).
- ``attention``: grouped-query attention of each query row over the cache's first ``keys_len``
  positions, masked by position (key p is visible to the row at position q when p <= q), as a split-key
  flash-decoding pass (online softmax per ``SPLIT_KEYS`` keys, fp32 accumulators) and a combine: ordered (the
  batch-invariant sets), in the split kernel by each block's last split to finish; otherwise a combine kernel.
  torch: the mask add, a product, softmax, a cast, a product and the layout copies.

Every query row is computed on its own with the same tile shapes whatever the block or batch size
(``BLOCK_M`` rows of one kv head, the split layout fixed by key position), so a row's attention does not
depend on which rows share its pass. Splits past a row's position do no work and add exact zeros.

Batch invariance: a row's logits must be the same bits in a 1-token step, a verify block and a batched
round, eagerly or replayed from a graph, so that greedy speculative output equals plain output exactly. Two kernel
sets give it (cuda_graphs ``invariant_layers``; ``invariant_default`` picks one):

- "invariant-cublas", ``fimble serve``'s default (FIMBLE_CUDA_INVARIANT=cublas): the projections stay cuBLAS's, but
  every single-sequence pass runs on exactly ``CUBLAS_ROWS`` (16) rows (graph blocks are raised to 16, eager passes
  padded with zero rows), so each weight meets one cuBLAS shape, hence one kernel and one reduction order; norms and
  the MLP gate are per row. On the H200 this costs 3-5% of a graph step (cuBLAS prices 16 rows like 1). A batched
  round multiplies 16 x b rows, and cuBLAS picks another kernel for some b (the 0.5B/1.5B down projections from
  144-160 rows, 7B's from 32): engine/runtimes/row_limits.py probes where, per model, and runs such products in pieces
  (or every pass of one on 32-64 rows), so batched rounds equal their sequences alone at any batch size
  (bench/reports/gpu-row-limits-h200-2026-12-03.txt).
- "invariant", the default of every other CUDA engine (FIMBLE_CUDA_INVARIANT=triton): ``linear`` below for every
  projection, its config (tile, slabs of K, K splits, rows a program) a function of the weight's shape alone
  (``linear_config``), the row count never specialised, so one compiled kernel serves every M and a row's bits never
  depend on the rows beside it, batched rounds included. A row is one program's (BM 1: fp32 products summed by a fixed
  tree, a GEMV) or one of 16 rows of a tensor-core tile; a split K is summed in split order by the tile's last
  program. Fused into it: the RMSNorm before a projection (the norm weight scales the activation as it is loaded,
  1/rms the accumulator at the end), the residual add and bias (rounded once), the MLP's ``silu(gate) * up`` as the
  down projection's prologue, RoPE and the cache writes after the qkv product (``RopeStore``: rope_store's
  arithmetic), float32 logits straight from the LM head's accumulators. ``linear``'s swap-AB tiles read the weight
  once for 16 rows, so a verify block costs about a step: on an H100 with MEASURED_CONFIGS (2026-12-06,
  bench/reports/gpu-tests-h100-2026-12-06.txt) its graph step is 1.101 ms at 0.5B and 2.098 ms at 1.5B (the cuBLAS
  set: 1.701, 2.569), an 8-row verify 1.172 and 2.126 ms; against llama-server's CUDA build on the same GPU the 1.5B
  step is 0.775x the server's (the cuBLAS set's about 0.97x); launched as programmatic dependents (gpu_linear.PDL_ENV,
  2026-12-06) 1.94 ms, 0.74x. A pass of more than 64 rows (a prefill chunk, a large batched round) takes
  ``wide_config``'s tile where this GPU gives it the 16-row tile's bits (gpu_linear.py says why that holds and how it
  is checked). Through fimble serve with 32 editors its batched rounds take 1.2x the cuBLAS
  set's GPU time (0.80-0.84x the tok/s) and its cold prompts 1.13-1.18x as long
  (bench/reports/gpu-wide-tiles-h100-2026-12-06.txt); the GPU suite passes with it (200/200).

Which set a process runs follows its workload (``invariant_default``): one editor's engine decodes one stream, where
the step is what the user waits for (a 1,024-token cold prompt costs the Triton set ~3 ms more, 16 tokens save ~8),
so it runs "invariant"; ``fimble serve`` batches many streams a round, where the cuBLAS set's rounds are 1.2x
faster, so engine/serve/scheduler.py ``open_serve_engine`` sets FIMBLE_CUDA_INVARIANT=cublas unless the user set it.
Every pass of one process uses one set, so speculative = plain and batched = unbatched hold within it; two processes
on different sets may differ at near ties, as two GPUs may.

Both sets run ``attention`` with ``ordered=True``: the split combine sums the splits one by one in split order, so
trailing splits that hold no visible key (a longer key bucket) add exact zeros whatever their number, and the
combine no longer depends on the key bucket's size (eager passes attend over exactly their positions, graphs over
a power-of-two bucket).

Triton is imported lazily: CPU machines (CI) never load it, and ``available()`` says whether it is there.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from engine import env_settings
from engine.runtimes.gpu_linear import (  # the projections (re-exported: callers use gpu_kernels.linear)
    LINEAR_ROWS,
    MEASURED_CONFIGS,
    SM_TARGET,
    RopeStore,
    _split_locks,
    linear,
    linear_config,
    rope_config,
    triton_cdiv,
    use_pdl,
)

# Query rows of one kv head of one sequence per program (tl.dot needs 16). 32 would let a 3-5-token serve pass of the
# 1.5B shape (18-30 rows) read each kv head's keys once instead of twice, but it measured slower wherever it was tried
# (H100, bench/reports/gpu-attention-geometry-h100-2026-12-07/: the kernel 1.11-1.26x at 1-2 tokens, 0.97x at 4; 32
# editors 7,232 tok/s against 7,530 at 16), so 16 it stays.
BLOCK_M = 16
# Keys per inner iteration. 128 makes a single sequence's step ~7-9% faster in this kernel (1.5B 10.3 against 11.2 us a
# layer, 0.5B 8.7 against 9.7) but fimble serve's 32-sequence rounds 7-34% slower (same report): not taken, a process
# would need its own geometry per workload, and the GPU suite to pass on each.
BLOCK_N = 64
SPLIT_KEYS = 256  # keys per split: the split layout depends on positions only, never on the batch
ATTENTION_WARPS = 4  # warps of a split program (Triton's default; bench/gpu_attention.py compares others)
MIN_SPLITS_TILE = 64  # the combine kernel's split tile: one compiled variant up to 16,384 keys
# Ordered attention combines its splits in the split kernel (the block's last split to finish, summing in split order:
# the same arithmetic as attention_combine_ordered_kernel, one launch fewer a layer); the
# separate combine kernel when False (tests and benchmarks compare the two: the same bits).
COMBINE_IN_SPLIT = True
# A split's keys in a loop of SPLIT_KEYS // BLOCK_N trips fixed at compile time, the tiles past the split's last visible
# key masked (exact no-ops: weight 0, scale 1), so Triton's pipeliner can overlap a tile's loads with the last one's
# arithmetic; the same tiles in the same order as the bounded while loop. On an H100 (2026-12-06,
# bench/reports/gpu-swap-h100-2026-12-06.txt) the two gave the same bits (tests/engine/test_gpu_kernels.py) and the
# 0.5B graph step 8% faster; on 2026-12-06 the GPU suite counted it (tests/gpu on an H100, the Triton set: speculative =
# plain 200/200 in every path, batched = unbatched 32/32; bench/reports/gpu-tests-h100-2026-12-06.txt), and with the
# swap configs it took the Triton set's step from 1.191 to 1.101 ms (0.5B) and 2.227 to 2.098 ms (1.5B). Both kernel
# sets run it. On by default; FIMBLE_ATTENTION_FIXED_TRIPS=0 runs the bounded loop (the same bits, for comparison).
FIXED_TRIPS = env_settings.read("FIMBLE_ATTENTION_FIXED_TRIPS")  # a bad value: SettingError (a ValueError)


INVARIANT_SETS = ("invariant", "invariant-cublas")  # the default first (see invariant_default)
DEFAULT_INVARIANT = "invariant"
SET_NAMES = {"triton": "invariant", "cublas": "invariant-cublas"}  # FIMBLE_CUDA_INVARIANT's values
SERVE_SET = "cublas"  # fimble serve's default (open_serve_engine): its batched rounds are faster on cuBLAS
# "invariant-cublas": every projection runs on a whole multiple of this many rows (zero rows pad it; graph blocks are
# raised to it), so a pass of 1-16 tokens meets exactly one cuBLAS shape per weight (FIMBLE_CUDA_INVARIANT_ROWS).
CUBLAS_ROWS = env_settings.read("FIMBLE_CUDA_INVARIANT_ROWS")  # 1..256 (engine/env_settings.py)


def invariant_default() -> str | bool:
    """The batch-invariant kernel set CUDA passes use by default (where Triton runs), or False.

    ``FIMBLE_CUDA_INVARIANT``: unset or 1 = ``DEFAULT_INVARIANT``, "invariant" (every projection in ``linear``:
    invariant for any row count by construction, batched rounds included; the faster step); ``cublas`` =
    "invariant-cublas" (cuBLAS's projections on fixed 16-row passes, Triton attention combined in order: a 1-token
    step, a verify block, eager or graph, a batched serve round, the same bits, within
    engine/runtimes/row_limits.py's probed row counts; the faster batched rounds, so ``fimble serve``'s default);
    ``triton`` = "invariant"; 0 = off ("fused": a row's bits depend on its pass's shape). Any other value is an
    error: a typo must not silently pick a set."""
    if not available():
        return False
    value = env_settings.read("FIMBLE_CUDA_INVARIANT")  # "0", "1", "triton" or "cublas"; else SettingError
    if value == "0":
        return False
    return DEFAULT_INVARIANT if value == "1" else SET_NAMES[value]


@functools.cache
def available() -> bool:
    """Triton importable and a CUDA device present (the fused path's requirements)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # an ImportError, or a Triton that cannot find its compiler
        return False
    return True


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])
    def rope_store_kernel(
        qkv, q_out, keys, values, cos, sin, positions,
        T, qkv_stride, q_stride,
        k_s, k_h, k_p, v_s, v_h, v_p,
        H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr,
        QKP: tl.constexpr, VP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # see gpu_linear.PDL_ENV: the kernel before has finished before any buffer is touched
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)  # one token row: sequence row // T, position positions[row]
        s = row // T
        pos = tl.load(positions + row)
        d = tl.arange(0, HD)
        half: tl.constexpr = HD // 2
        swapped = (d + half) % HD
        c = tl.load(cos + pos * HD + d).to(tl.float32)
        # torch's sign-folded table: -sin on the first half, sin on the second (negation is exact)
        sn = tl.load(sin + pos * HD + d).to(tl.float32)
        sn = tl.where(d < half, -sn, sn)
        heads = tl.arange(0, QKP)[:, None]
        live = heads < H + KV
        base = qkv + row * qkv_stride + heads * HD
        x = tl.load(base + d[None, :], mask=live, other=0.0).to(tl.float32)
        xs = tl.load(base + swapped[None, :], mask=live, other=0.0).to(tl.float32)
        r = (x * c[None, :] + xs * sn[None, :]).to(q_out.dtype.element_ty)  # in fp32, rounded once
        tl.store(q_out + row * q_stride + heads * HD + d[None, :], r, mask=heads < H)
        kh = heads - H
        kptr = keys + s * k_s + kh * k_h + pos * k_p + d[None, :]
        tl.store(kptr, r, mask=(heads >= H) & live)
        vh = tl.arange(0, VP)[:, None]
        v = tl.load(qkv + row * qkv_stride + (H + KV + vh) * HD + d[None, :], mask=vh < KV, other=0.0)
        tl.store(values + s * v_s + vh * v_h + pos * v_p + d[None, :], v, mask=vh < KV)

    global _attend_tile  # a module global: Triton resolves a kernel's callees in its module, not in this closure

    @triton.jit
    def _attend_tile(qt, keys, values, k_base, v_base, k_p, v_p, key, hi, pos, d, m, l, acc, scale):  # noqa: E741
        # One tile of keys into the online softmax. A tile wholly at or past hi (or past every row's position)
        # changes nothing: its scores are -inf, so p = 0 and alpha = exp(0) = 1 (m, l, acc kept exactly).
        inside = key < hi
        kt = tl.load(keys + k_base + key[:, None] * k_p + d[None, :], mask=inside[:, None], other=0.0)
        scores = tl.dot(qt, tl.trans(kt)) * scale
        visible = (key[None, :] <= pos[:, None]) & inside[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        vt = tl.load(values + v_base + key[:, None] * v_p + d[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        return m_new, l, acc

    # T, keys_len and the split count are plain arguments (not specialised), so one compiled kernel serves every
    # block size and cache length: a new variant mid-decode would stall a step for a compile.
    @triton.jit(do_not_specialize=["T", "keys_len", "SPLITS"])
    def attention_split_kernel(
        q, keys, values, positions, out, part_acc, part_ml, lock,
        T, keys_len, q_stride, out_stride,
        k_s, k_h, k_p, v_s, v_h, v_p,
        scale, SPLITS,
        KV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, COMBINE: tl.constexpr, FIXED: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # see gpu_linear.PDL_ENV: the kernel before has finished before any buffer is touched
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)  # (sequence, kv head, block of BM query rows)
        split = tl.program_id(1)
        blocks = tl.cdiv(G * T, BM)
        mb = pid % blocks
        h = (pid // blocks) % KV
        s = pid // (blocks * KV)
        r = mb * BM + tl.arange(0, BM)  # query row r = token * G + group member
        live = r < G * T
        t = r // G
        head = h * G + r % G
        pos = tl.load(positions + s * T + t, mask=live, other=-1)
        d = tl.arange(0, HD)
        qrow = s * T + t
        qt = tl.load(q + qrow[:, None] * q_stride + head[:, None] * HD + d[None, :], mask=live[:, None], other=0.0)
        lo = split * SPLIT
        hi = tl.minimum(tl.minimum(lo + SPLIT, keys_len), tl.max(pos, axis=0) + 1)  # keys past every row: skipped
        m = tl.full((BM,), -1.0e30, tl.float32)
        l = tl.zeros((BM,), tl.float32)  # noqa: E741
        acc = tl.zeros((BM, HD), tl.float32)
        n = tl.arange(0, BN)
        if FIXED:  # SPLIT // BN trips whatever hi is: tiles at or past hi load nothing and change nothing
            for k0 in range(0, SPLIT, BN):
                m, l, acc = _attend_tile(  # noqa: E741
                    qt, keys, values, s * k_s + h * k_h, s * v_s + h * v_h, k_p, v_p, lo + k0 + n, hi, pos, d,
                    m, l, acc, scale,
                )  # fmt: skip
        else:
            start = lo
            while start < hi:  # a while loop: bounds that are tensors (Triton's interpreter needs it for range)
                m, l, acc = _attend_tile(  # noqa: E741
                    qt, keys, values, s * k_s + h * k_h, s * v_s + h * v_h, k_p, v_p, start + n, hi, pos, d,
                    m, l, acc, scale,
                )  # fmt: skip
                start += BN
        if SPLITS == 1:  # one split: normalise and write the rows here
            res = acc / tl.where(l > 0, l, 1.0)[:, None]
            optr = out + qrow[:, None] * out_stride + head[:, None] * HD + d[None, :]
            tl.store(optr, res.to(out.dtype.element_ty), mask=live[:, None])
        else:
            slot = (pid * SPLITS + split) * BM
            tl.store(part_acc + (slot + tl.arange(0, BM))[:, None] * HD + d[None, :], acc)
            tl.store(part_ml + (slot + tl.arange(0, BM)) * 2, m)
            tl.store(part_ml + (slot + tl.arange(0, BM)) * 2 + 1, l)
            if COMBINE:  # the block's last split to finish combines all of them, as attention_combine_ordered_kernel
                tl.debug_barrier()  # every thread's partials are written before the count says so (released below)
                last = tl.atomic_add(lock + pid, 1, sem="acq_rel") == SPLITS - 1
                tl.debug_barrier()
                rows = pid * SPLITS * BM + tl.arange(0, BM)  # split 0's slots of the block's rows
                top = tl.load(part_ml + rows * 2, mask=last, other=0.0, cache_modifier=".cg")
                sp = 1
                while sp < SPLITS:
                    top = tl.maximum(top, tl.load(part_ml + (rows + sp * BM) * 2, mask=last, other=0.0,
                                                  cache_modifier=".cg"))  # fmt: skip
                    sp += 1
                total = tl.zeros((BM,), tl.float32)
                res = tl.zeros((BM, HD), tl.float32)
                sp = 0
                while sp < SPLITS:  # in split order: each row's sums as the ordered combine kernel forms them
                    at = rows + sp * BM
                    w = tl.exp(tl.load(part_ml + at * 2, mask=last, other=0.0, cache_modifier=".cg") - top)
                    total += tl.load(part_ml + at * 2 + 1, mask=last, other=0.0, cache_modifier=".cg") * w
                    res += tl.load(part_acc + at[:, None] * HD + d[None, :], mask=last, other=0.0,
                                   cache_modifier=".cg") * w[:, None]  # fmt: skip
                    sp += 1
                tl.atomic_xchg(lock + pid, 0, mask=last)  # back to 0 for the next kernel that counts on it
                res = res / tl.where(total > 0, total, 1.0)[:, None]
                optr = out + qrow[:, None] * out_stride + head[:, None] * HD + d[None, :]
                tl.store(optr, res.to(out.dtype.element_ty), mask=live[:, None] & last)

    @triton.jit(do_not_specialize=["T", "SPLITS"])
    def attention_combine_kernel(
        out, part_acc, part_ml, T, out_stride, SPLITS,
        KV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # see gpu_linear.PDL_ENV: the kernel before has finished before any buffer is touched
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        row = tl.program_id(1)  # one query row of the program's block
        blocks = tl.cdiv(G * T, BM)
        mb = pid % blocks
        h = (pid // blocks) % KV
        s = pid // (blocks * KV)
        r = mb * BM + row
        if r < G * T:
            sp = tl.arange(0, SP)
            used = sp < SPLITS
            slot = (pid * SPLITS + sp) * BM + row
            m = tl.load(part_ml + slot * 2, mask=used, other=-1.0e30)
            l = tl.load(part_ml + slot * 2 + 1, mask=used, other=0.0)  # noqa: E741
            top = tl.max(m, axis=0)
            w = tl.exp(m - top)  # a split with no visible key: m = -1e30, weight and sums exactly 0
            d = tl.arange(0, HD)
            acc = tl.load(part_acc + slot[:, None] * HD + d[None, :], mask=used[:, None], other=0.0)
            total = tl.sum(l * w, axis=0)
            res = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
            t = r // G
            head = h * G + r % G
            tl.store(out + (s * T + t) * out_stride + head * HD + d, res.to(out.dtype.element_ty))

    @triton.jit(do_not_specialize=["T", "SPLITS"])
    def attention_combine_ordered_kernel(
        out, part_acc, part_ml, T, out_stride, SPLITS,
        KV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # see gpu_linear.PDL_ENV: the kernel before has finished before any buffer is touched
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # As attention_combine_kernel, but the splits are summed one at a time in split order: a split with no
        # visible key has weight exactly 0 and adds exact zeros, so the result does not depend on how many such
        # splits follow (the key bucket), and one live split gives acc / l exactly as the one-split path does.
        pid = tl.program_id(0)
        row = tl.program_id(1)
        blocks = tl.cdiv(G * T, BM)
        mb = pid % blocks
        h = (pid // blocks) % KV
        s = pid // (blocks * KV)
        r = mb * BM + row
        if r < G * T:
            d = tl.arange(0, HD)
            base = pid * SPLITS * BM + row
            top = tl.load(part_ml + base * 2)
            sp = 1
            while sp < SPLITS:  # while loops: Triton's interpreter cannot range() over an argument
                top = tl.maximum(top, tl.load(part_ml + (base + sp * BM) * 2))
                sp += 1
            total = 0.0
            acc = tl.zeros((HD,), tl.float32)
            sp = 0
            while sp < SPLITS:
                slot = base + sp * BM
                w = tl.exp(tl.load(part_ml + slot * 2) - top)
                total += tl.load(part_ml + slot * 2 + 1) * w
                acc += tl.load(part_acc + slot * HD + d) * w
                sp += 1
            res = acc / tl.where(total > 0, total, 1.0)
            t = r // G
            head = h * G + r % G
            tl.store(out + (s * T + t) * out_stride + head * HD + d, res.to(out.dtype.element_ty))

    return (
        rope_store_kernel,
        attention_split_kernel,
        attention_combine_kernel,
        attention_combine_ordered_kernel,
    )


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def rope_store(
    qkv: Tensor, keys: Tensor, values: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
    seqs: int, heads: int, kv_heads: int,
) -> Tensor:  # fmt: skip
    """``qkv`` [S*T, (heads + 2*kv_heads) * hd] → the rotated queries [S*T, heads * hd]; keys/values
    [S, kv_heads, max_len, hd] get the rotated keys and the values at ``positions`` ([S*T], flattened)."""
    rows, hd = qkv.shape[0], keys.shape[-1]
    q = torch.empty(rows, heads * hd, dtype=qkv.dtype, device=qkv.device)
    rope_kernel = _kernels()[0]
    pdl = use_pdl(qkv.device, heads * hd)
    rope_kernel[(rows,)](
        qkv, q, keys, values, cos, sin, positions,
        rows // seqs, qkv.stride(0), q.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        H=heads, KV=kv_heads, HD=hd, QKP=_pow2(heads + kv_heads), VP=_pow2(kv_heads),
        PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return q


def attention(
    q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, keys_len: int, seqs: int, kv_heads: int,
    scratch: tuple[Tensor, Tensor] | None = None, ordered: bool = False,
) -> Tensor:  # fmt: skip
    """Attention of ``q`` [S*T, heads * hd] over ``keys``/``values`` [S, kv_heads, max_len, hd], first
    ``keys_len`` positions, masked by ``positions`` [S*T]. Returns [S*T, heads * hd] in q's dtype.

    ``scratch``: ``attention_scratch``'s buffers, made once for all layers of a pass. ``ordered``: combine the
    splits in split order (batch-invariant mode: a row's bits do not depend on ``keys_len``)."""
    _, split_kernel, combine_kernel, ordered_kernel = _kernels()
    rows, width = q.shape
    hd = keys.shape[-1]
    group = width // hd // kv_heads
    t = rows // seqs
    blocks = -(-(group * t) // BLOCK_M)
    programs = seqs * kv_heads * blocks
    splits = -(-keys_len // SPLIT_KEYS)
    out = torch.empty_like(q)
    if scratch is None:
        scratch = attention_scratch(q, keys_len, seqs, kv_heads, hd)
    part_acc, part_ml = scratch
    combine_in_split = ordered and COMBINE_IN_SPLIT
    pdl = use_pdl(q.device, width)
    split_kernel[(programs, splits)](
        q, keys, values, positions, out, part_acc, part_ml,
        _split_locks(q.device, programs) if combine_in_split and splits > 1 else part_ml,
        t, keys_len, q.stride(0), out.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        hd**-0.5, splits,
        KV=kv_heads, G=group, HD=hd, BM=BLOCK_M, BN=BLOCK_N, SPLIT=SPLIT_KEYS, COMBINE=combine_in_split,
        FIXED=FIXED_TRIPS, PDL=pdl, launch_pdl=pdl, num_warps=ATTENTION_WARPS,
    )  # fmt: skip
    if splits > 1 and ordered and not combine_in_split:
        ordered_kernel[(programs, BLOCK_M)](
            out, part_acc, part_ml, t, out.stride(0), splits, KV=kv_heads, G=group, HD=hd, BM=BLOCK_M,
            PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    elif splits > 1 and not combine_in_split:  # (combined in the split kernel: a second combine would only redo it)
        combine_kernel[(programs, BLOCK_M)](
            out, part_acc, part_ml, t, out.stride(0), splits,
            KV=kv_heads, G=group, HD=hd, BM=BLOCK_M, SP=max(MIN_SPLITS_TILE, _pow2(splits)), PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out


def attention_scratch(q: Tensor, keys_len: int, seqs: int, kv_heads: int, hd: int) -> tuple[Tensor, Tensor]:
    """Per-split partial sums for ``attention`` (fp32), sized for one pass's shapes."""
    rows, width = q.shape
    group = width // hd // kv_heads
    blocks = -(-(group * (rows // seqs)) // BLOCK_M)
    splits = max(1, -(-keys_len // SPLIT_KEYS))
    n = seqs * kv_heads * blocks * splits * BLOCK_M
    return (
        torch.empty(n, hd, dtype=torch.float32, device=q.device),
        torch.empty(n, 2, dtype=torch.float32, device=q.device),
    )


__all__ = [
    "BLOCK_M",
    "MEASURED_CONFIGS",
    "SM_TARGET",
    "rope_config",
    "triton_cdiv",
    "RopeStore",
    "LINEAR_ROWS",
    "SPLIT_KEYS",
    "attention",
    "attention_scratch",
    "available",
    "INVARIANT_SETS",
    "invariant_default",
    "linear",
    "linear_config",
    "rope_store",
]
