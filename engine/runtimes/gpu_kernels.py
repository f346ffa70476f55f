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

- "invariant-cublas", the CUDA default: the projections stay cuBLAS's, but every single-sequence pass runs on
  exactly ``CUBLAS_ROWS`` (16) rows (graph blocks are raised to 16, eager passes padded with zero rows), so each
  weight meets one cuBLAS shape, hence one kernel and one reduction order; norms and the MLP gate are per row.
  On the H200 this costs 3-5% of a graph step (cuBLAS prices 16 rows like 1). A batched round multiplies 16 x b
  rows, and cuBLAS picks another kernel for some b (the 0.5B/1.5B down projections from 144-160 rows, 7B's
  from 32): engine/runtimes/row_limits.py probes where, per model, and runs such products in pieces (or every
  pass of one on 32-64 rows), so batched rounds equal their sequences alone at any batch size
  (bench/reports/gpu-row-limits-h200-2026-12-03.txt).
- "invariant" (FIMBLE_CUDA_INVARIANT=triton): ``linear`` below for every projection, its config (tile, slabs of K,
  K splits, rows a program) a function of the weight's shape alone (``linear_config``), the row count never
  specialised, so one compiled kernel serves every M and a row's bits never depend on the rows beside it, batched
  rounds included. A row is one program's (BM 1: fp32 products summed by a fixed tree, a GEMV) or one of 16 rows of a
  tensor-core tile; a split K is summed in split order by the tile's last program. Fused into it: the RMSNorm before
  a projection (the norm weight scales the activation as it is loaded, 1/rms the accumulator at the end), the residual
  add and bias (rounded once), the MLP's ``silu(gate) * up`` as the down projection's prologue, RoPE and the cache
  writes after the qkv product (``RopeStore``: rope_store's arithmetic), float32 logits straight from the LM head's
  accumulators. On the H200 (bench/reports/gpu-linear-h200-2026-12-05.txt) its 1-token graph step is 1.4x faster
  than "invariant-cublas"'s (0.5B 1.15 ms, 1.5B 1.76 ms), but a verify block re-reads the weights per row: 8 rows
  cost 2-2.7x a step, where cuBLAS prices 16 rows like 1. So it stays opt-in.

Both sets run ``attention`` with ``ordered=True``: the split combine sums the splits one by one in split order, so
trailing splits that hold no visible key (a longer key bucket) add exact zeros whatever their number, and the
combine no longer depends on the key bucket's size (eager passes attend over exactly their positions, graphs over
a power-of-two bucket).

Triton is imported lazily: CPU machines (CI) never load it, and ``available()`` says whether it is there.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK_M = 16  # query rows of one kv head per program (tl.dot needs 16)
BLOCK_N = 64  # keys per inner iteration
SPLIT_KEYS = 256  # keys per split: the split layout depends on positions only, never on the batch
MIN_SPLITS_TILE = 64  # the combine kernel's split tile: one compiled variant up to 16,384 keys
# Ordered attention combines its splits in the split kernel (the block's last split to finish, summing in split order:
# the same arithmetic as attention_combine_ordered_kernel, one launch fewer a layer); the
# separate combine kernel when False (tests and benchmarks compare the two: the same bits).
COMBINE_IN_SPLIT = True


INVARIANT_SETS = ("invariant-cublas", "invariant")  # the default first (see invariant_default)
DEFAULT_INVARIANT = "invariant-cublas"
# "invariant-cublas": every projection runs on a whole multiple of this many rows (zero rows pad it; graph blocks are
# raised to it), so a pass of 1-16 tokens meets exactly one cuBLAS shape per weight (FIMBLE_CUDA_INVARIANT_ROWS).
CUBLAS_ROWS = max(1, int(os.environ.get("FIMBLE_CUDA_INVARIANT_ROWS", "16") or 16))


def invariant_default() -> str | bool:
    """The batch-invariant kernel set CUDA passes use by default (where Triton runs), or False.

    ``FIMBLE_CUDA_INVARIANT``: unset or 1 = "invariant-cublas" (cuBLAS's projections on fixed 16-row passes, Triton
    attention combined in order: a 1-token step, a verify block, eager or graph, a batched serve round, the same bits,
    within engine/runtimes/row_limits.py's probed row counts); ``triton`` = "invariant" (every projection in
    ``linear``: invariant for any row count by construction, batched rounds included; 2.4-3.3x the step time on the
    H200 today, bench/reports/gpu-invariant-h200-2026-12-03.txt); 0 = off ("fused": a row's bits depend on its pass's
    shape)."""
    if not available():
        return False
    value = os.environ.get("FIMBLE_CUDA_INVARIANT", "1").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    return {"cublas": "invariant-cublas", "triton": "invariant"}.get(value, DEFAULT_INVARIANT)


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
        QKP: tl.constexpr, VP: tl.constexpr,
    ):  # fmt: skip
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

    # T, keys_len and the split count are plain arguments (not specialised), so one compiled kernel serves every
    # block size and cache length: a new variant mid-decode would stall a step for a compile.
    @triton.jit(do_not_specialize=["T", "keys_len", "SPLITS"])
    def attention_split_kernel(
        q, keys, values, positions, out, part_acc, part_ml, lock,
        T, keys_len, q_stride, out_stride,
        k_s, k_h, k_p, v_s, v_h, v_p,
        scale, SPLITS,
        KV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, COMBINE: tl.constexpr,
    ):  # fmt: skip
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
        start = lo
        while start < hi:  # a while loop: bounds that are tensors (Triton's interpreter needs it for range)
            key = start + n
            inside = key < hi
            kt = tl.load(keys + s * k_s + h * k_h + key[:, None] * k_p + d[None, :], mask=inside[:, None], other=0.0)
            scores = tl.dot(qt, tl.trans(kt)) * scale
            visible = (key[None, :] <= pos[:, None]) & inside[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
            vt = tl.load(values + s * v_s + h * v_h + key[:, None] * v_p + d[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new
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
        KV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr, SP: tl.constexpr,
    ):  # fmt: skip
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
        KV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
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

    # M (the row count) is not specialised: one compiled kernel for every pass size, so a row's arithmetic is the
    # same whatever rows share its pass (Triton would otherwise compile M == 1 apart).
    @triton.jit(do_not_specialize=["M"])
    def linear_kernel(
        x, w, out, bias, res, nw, part, lock,
        M, N, x_stride, res_stride, out_stride, eps,
        cos, sin, positions, keys, values, T, k_s, k_h, k_p, v_s, v_h, v_p,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
        ROPE: tl.constexpr, H: tl.constexpr, KV: tl.constexpr,
    ):  # fmt: skip
        # K is a weight's own size (a constant): the slab loop has a fixed trip count, and Triton's interpreter can
        # range() over it. SPLITS > 1 (split-K): program `split` reduces its own K range (KS, whole slabs); the last
        # program of a tile to finish adds the SPLITS partial sums in split order, so the order is fixed by the
        # weight's shape alone, never by timing or the row count.
        KS: tl.constexpr = tl.cdiv(tl.cdiv(K, BK), SPLITS) * BK
        pid = tl.program_id(0)
        split = pid % SPLITS  # a tile's splits run side by side
        tile = pid // SPLITS
        tiles_m = tl.cdiv(M, BM)
        pid_m = tile % tiles_m  # row tiles of one column strip run side by side: the strip's weights are read once
        pid_n = tile // tiles_m
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        rmask = rows < M
        cmask = cols < N
        kk = tl.arange(0, BK)
        xrow = x + rows[:, None].to(tl.int64) * x_stride
        wrow = w + cols[:, None].to(tl.int64) * K
        acc = tl.zeros((BM, BN), tl.float32)
        ss = tl.zeros((BM, BK), tl.float32)  # squares summed per column slot, reduced once after the loop
        for k0 in range(0, KS, BK):  # constant bounds (the interpreter and the pipeliner want them), offset by split
            k = split * KS + k0 + kk
            if K % (BK * SPLITS) == 0:  # every split's slabs inside K: no mask on K
                amask = rmask[:, None]
                bmask = cmask[:, None]
            else:
                amask = rmask[:, None] & (k[None, :] < K)
                bmask = cmask[:, None] & (k[None, :] < K)
            if GATED:  # x holds [gate | up] (K columns each): the activation is silu(gate) * up, rounded once
                g = tl.load(xrow + k[None, :], mask=amask, other=0.0).to(tl.float32)
                u = tl.load(xrow + K + k[None, :], mask=amask, other=0.0).to(tl.float32)
                a = (g * tl.sigmoid(g) * u).to(w.dtype.element_ty)
            else:
                a = tl.load(xrow + k[None, :], mask=amask, other=0.0)
                if NORM:  # RMSNorm: sum of squares here, the norm weight on the activation, 1/rms at the end
                    af = a.to(tl.float32)
                    ss += af * af
                    g = tl.load(nw + k, mask=k < K, other=0.0).to(tl.float32)
                    a = (af * g[None, :]).to(w.dtype.element_ty)
            b = tl.load(wrow + k[None, :], mask=bmask, other=0.0)
            if BM == 1:  # one row a program: products in fp32 (exact for bf16), summed by a fixed tree per slab
                acc += tl.sum(b.to(tl.float32) * a.to(tl.float32), axis=1)[None, :]
            elif BM < 16:  # a few rows a program, the weight slab read once for them; each row's tree as its own
                acc += tl.sum(b.to(tl.float32)[None, :, :] * a.to(tl.float32)[:, None, :], axis=2)
            else:
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        last = True  # this program writes the tile (with splits: the last of its tile's programs to finish)
        if SPLITS > 1:
            sub = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
            tl.store(part + (tile * SPLITS + split) * (BM * BN) + sub, acc)
            tl.debug_barrier()  # every thread's partial is written before the count says so (released below)
            last = tl.atomic_add(lock + tile, 1, sem="acq_rel") == SPLITS - 1
            tl.debug_barrier()
            tile_part = part + tile * SPLITS * (BM * BN) + sub
            acc = tl.load(tile_part, mask=last, other=0.0, cache_modifier=".cg")
            for sp in tl.static_range(1, SPLITS):
                acc += tl.load(tile_part + sp * (BM * BN), mask=last, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(lock + tile, 0, mask=last)  # back to 0 for the next kernel that counts on this tile
            if NORM:  # the whole row's squares, in the one-split loop's order
                ss = tl.zeros((BM, BK), tl.float32)
                for k0 in range(0, K, BK):
                    k = k0 + kk
                    xm = last & rmask[:, None] & (k[None, :] < K)
                    af = tl.load(xrow + k[None, :], mask=xm, other=0.0).to(tl.float32)
                    ss += af * af
        if NORM:
            acc = acc * tl.rsqrt(tl.sum(ss, axis=1) / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        omask = rmask[:, None] & cmask[None, :] & last
        if HAS_RES:
            r = tl.load(res + rows[:, None].to(tl.int64) * res_stride + cols[None, :], mask=omask, other=0.0)
            acc += r.to(tl.float32)
        if ROPE:  # the qkv projection, a head per column tile (BN = head size): rope_store_kernel's work, same bits
            half: tl.constexpr = BN // 2
            xr = acc.to(out.dtype.element_ty).to(tl.float32)  # rounded as the product's output, then rotated
            x1, x2 = tl.split(tl.permute(tl.reshape(xr, (BM, 2, half)), (0, 2, 1)))  # a head's two halves
            dh = tl.arange(0, half)[None, :]
            hmask = rmask[:, None] & last
            pos = tl.load(positions + rows, mask=rmask, other=0)[:, None]
            if pid_n < H + KV:  # query or key: rotated (in fp32, rounded once), as x * c + swapped(x) * sign * sin
                c1 = tl.load(cos + pos * BN + dh, mask=hmask, other=0.0).to(tl.float32)
                c2 = tl.load(cos + pos * BN + half + dh, mask=hmask, other=0.0).to(tl.float32)
                s1 = -tl.load(sin + pos * BN + dh, mask=hmask, other=0.0).to(tl.float32)
                s2 = tl.load(sin + pos * BN + half + dh, mask=hmask, other=0.0).to(tl.float32)
                r1 = (x1 * c1 + x2 * s1).to(out.dtype.element_ty)
                r2 = (x2 * c2 + x1 * s2).to(out.dtype.element_ty)
                if pid_n < H:
                    qptr = out + rows[:, None].to(tl.int64) * out_stride + pid_n * BN + dh
                    tl.store(qptr, r1, mask=hmask)
                    tl.store(qptr + half, r2, mask=hmask)
                else:
                    kptr = keys + (rows // T)[:, None] * k_s + (pid_n - H) * k_h + pos * k_p + dh
                    tl.store(kptr, r1, mask=hmask)
                    tl.store(kptr + half, r2, mask=hmask)
            else:  # value: stored as it is
                vptr = values + (rows // T)[:, None] * v_s + (pid_n - H - KV) * v_h + pos * v_p + dh
                tl.store(vptr, x1.to(out.dtype.element_ty), mask=hmask)
                tl.store(vptr + half, x2.to(out.dtype.element_ty), mask=hmask)
        else:
            optr = out + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
            tl.store(optr, acc.to(out.dtype.element_ty), mask=omask)

    return (
        rope_store_kernel,
        attention_split_kernel,
        attention_combine_kernel,
        attention_combine_ordered_kernel,
        linear_kernel,
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
    rope_kernel[(rows,)](
        qkv, q, keys, values, cos, sin, positions,
        rows // seqs, qkv.stride(0), q.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        H=heads, KV=kv_heads, HD=hd, QKP=_pow2(heads + kv_heads), VP=_pow2(kv_heads),
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
    _, split_kernel, combine_kernel, ordered_kernel, _ = _kernels()
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
    split_kernel[(programs, splits)](
        q, keys, values, positions, out, part_acc, part_ml,
        _split_locks(q.device, programs) if combine_in_split and splits > 1 else part_ml,
        t, keys_len, q.stride(0), out.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        hd**-0.5, splits,
        KV=kv_heads, G=group, HD=hd, BM=BLOCK_M, BN=BLOCK_N, SPLIT=SPLIT_KEYS, COMBINE=combine_in_split,
    )  # fmt: skip
    if splits > 1 and ordered and not combine_in_split:
        ordered_kernel[(programs, BLOCK_M)](
            out, part_acc, part_ml, t, out.stride(0), splits, KV=kv_heads, G=group, HD=hd, BM=BLOCK_M,
        )  # fmt: skip
    elif splits > 1:
        combine_kernel[(programs, BLOCK_M)](
            out, part_acc, part_ml, t, out.stride(0), splits,
            KV=kv_heads, G=group, HD=hd, BM=BLOCK_M, SP=max(MIN_SPLITS_TILE, _pow2(splits)),
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


LINEAR_ROWS = 16  # rows of one output tile (tl.dot needs 16): the only tile size a pass's row count meets
SM_TARGET = 132  # the H200's streaming multiprocessors: a decode product wants at least this many programs


# (BN, BK, warps, stages, splits, BM) per weight shape (n, k) of the Qwen2.5 0.5B and 1.5B shapes: the fastest 1-row
# product of bench/gpu_linear.py's sweep on the H200 (bench/reports/gpu-linear-h200-2026-12-05-run2.json), each with
# its rows equal in any pass. All one row a program (BM 1): on these shapes 1.1-3.5x faster than 16-row tensor-core
# tiles and at or under cuBLAS's 16-row product.
MEASURED_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int, int, int]] = {
    (1152, 896): (8, 512, 4, 3, 1, 1),  # 0.5B qkv
    (896, 896): (8, 512, 4, 4, 1, 1),  # 0.5B o
    (9728, 896): (16, 256, 4, 5, 1, 1),  # 0.5B gate_up
    (896, 4864): (8, 256, 4, 5, 8, 1),  # 0.5B down
    (151936, 896): (16, 256, 4, 5, 1, 1),  # 0.5B LM head
    (2048, 1536): (8, 512, 4, 5, 1, 1),  # 1.5B qkv
    (1536, 1536): (8, 512, 4, 3, 1, 1),  # 1.5B o
    (17920, 1536): (32, 256, 4, 2, 1, 1),  # 1.5B gate_up
    (1536, 8960): (16, 256, 8, 4, 8, 1),  # 1.5B down
    (151936, 1536): (16, 256, 4, 4, 1, 1),  # 1.5B LM head
}


def linear_config(n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BN, BK, warps, stages, splits, BM) of ``linear`` for a weight of ``n`` outputs by ``k`` inputs: a function of
    the weight's shape alone, never of the row count, so a row's reduction order is the same in every pass (batch
    invariance).

    Decode passes are 1-16 rows and reading the weight is the cost: one row a program (BM 1, a GEMV), narrow column
    tiles (many programs streaming the weight at once) and wide slabs of K (bytes in flight); where the column tiles
    are still too few to keep every multiprocessor reading, K is split (summed in split order by the tile's last
    program). Shapes measured on the H200 take their measured configs (``MEASURED_CONFIGS``), others this rule (the
    measured ones' tiles and slabs; splits only as many as fill the GPU once)."""
    if (n, k) in MEASURED_CONFIGS:
        return MEASURED_CONFIGS[(n, k)]
    bn = 8 if n <= 4096 else 16
    bk = 512 if n <= 4096 and k <= 2048 else 256
    return bn, bk, 4, 4, _splits(-(-n // bn), -(-k // bk)), 1


def _splits(tiles: int, slabs: int) -> int:
    """K splits that bring ``tiles`` column tiles up to the multiprocessors' count, each the same whole number of
    the ``slabs`` slabs of K (the last one may hold fewer)."""
    want = -(-SM_TARGET // tiles)
    per = -(-slabs // min(want, slabs))
    return -(-slabs // per)


_LOCKS: dict[torch.device, Tensor] = {}


def _split_locks(device: torch.device, tiles: int) -> Tensor:
    """Per-tile arrival counters of split-K ``linear``, zero between kernels (each tile's last program resets its
    own). One buffer a device: the engine runs a device's kernels in one stream's order, so no two products count
    on it at once."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < tiles:
        locks = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


@dataclass(frozen=True)
class RopeStore:
    """``linear``'s qkv epilogue: rotate the query and key heads at ``positions`` ([S*T], flattened rows of ``seqs``
    sequences), store the keys and values into ``keys``/``values`` [S, kv_heads, max_len, hd], return the queries;
    what ``rope_store`` does after a plain product, in the same arithmetic."""

    keys: Tensor
    values: Tensor
    cos: Tensor
    sin: Tensor
    positions: Tensor
    seqs: int
    heads: int
    kv_heads: int


def rope_config(n: int, k: int, hd: int) -> tuple[int, int, int, int, int, int]:
    """``linear_config`` for a qkv weight with its RoPE epilogue: a column tile is one head (BN = ``hd``); K is split
    until the heads' tiles fill the GPU (a function of the weight's shape alone, as ``linear_config``)."""
    _, _, warps, _, _, bm = linear_config(n, k)
    bk = 128  # a 128-column head tile and 128-wide slabs: 4 stages fit the shared memory (256 would not)
    return hd, bk, warps, 4 if hd <= 64 else 3, _splits(-(-n // hd), -(-k // bk)), bm


def linear(
    x: Tensor, weight: Tensor, *, bias: Tensor | None = None, residual: Tensor | None = None,
    norm: Tensor | None = None, eps: float = 0.0, gated: bool = False, out_dtype: torch.dtype | None = None,
    config: tuple[int, ...] | None = None, rope: RopeStore | None = None,
) -> Tensor:  # fmt: skip
    """``x @ weight.T`` (+ ``bias``) (+ ``residual``), batch-invariant: row i of the result has the same bits
    whatever the other rows are and however many there are.

    ``x`` [M, K] (rows contiguous); ``weight`` [N, K] contiguous (an nn.Linear's). ``norm``: an RMSNorm weight [K]
    applied to ``x`` first (eps ``eps``). ``gated``: ``x`` is [M, 2K], gate then up, and the product's input is
    ``silu(gate) * up``. ``out_dtype``: the result's dtype (x's by default; float32 for logits, which then skip a
    rounding to bf16). ``config``: (BN, BK, warps, stages, splits[, BM]), ``linear_config``'s by default
    (benchmarks and tests; BM 16 where left out). ``rope``: ``weight`` is a qkv projection; the result is the
    rotated queries, the keys and values go to the cache (``RopeStore``)."""
    kernel = _kernels()[4]
    m = x.shape[0]
    n, k = weight.shape
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.stride(0) != k:
        raise ValueError("linear needs rows with unit stride and a contiguous weight")
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"linear: x has {x.shape[1]} columns for a weight of {k} inputs{' (gated)' if gated else ''}")
    if rope is not None:
        hd = rope.keys.shape[-1]
        if n != (rope.heads + 2 * rope.kv_heads) * hd or residual is not None or gated or out_dtype is not None:
            raise ValueError("linear: a RoPE epilogue needs a plain qkv weight of (heads + 2 kv_heads) x head size")
        out = torch.empty(m, rope.heads * hd, dtype=x.dtype, device=x.device)
        config = config or rope_config(n, k, hd)
        r = rope
    else:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
        r = RopeStore(out, out, out, out, out, 1, 0, 0)  # unused
    cache_strides = (*r.keys.stride()[:3], *r.values.stride()[:3]) if rope is not None else (0,) * 6
    if m == 0:
        return out
    bn, bk, warps, stages, splits, bm = (*config, LINEAR_ROWS)[:6] if config else linear_config(n, k)
    tiles = triton_cdiv(m, bm) * triton_cdiv(n, bn)
    if splits > 1:
        part = torch.empty(tiles * splits * bm * bn, dtype=torch.float32, device=x.device)
        lock = _split_locks(x.device, tiles)
    else:
        part = lock = out
    kernel[(tiles * splits,)](
        x, weight, out,
        bias if bias is not None else weight, residual if residual is not None else out,
        norm if norm is not None else weight, part, lock,
        m, n, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), float(eps),
        r.cos, r.sin, r.positions, r.keys, r.values, m // r.seqs, *cache_strides,
        K=k, HAS_BIAS=bias is not None, HAS_RES=residual is not None, NORM=norm is not None, GATED=gated,
        BM=bm, BN=bn, BK=bk, SPLITS=splits, num_warps=warps, num_stages=stages,
        ROPE=rope is not None, H=r.heads, KV=r.kv_heads,
        # float32 weights: true fp32 products (a dot's default there is tf32, ~1e-3); bf16/fp16 ignore it
        PRECISION="ieee" if weight.dtype == torch.float32 else None,
    )  # fmt: skip
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "BLOCK_M",
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
