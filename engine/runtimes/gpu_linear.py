"""The batch-invariant projection of the CUDA path's Triton kernel set ("invariant"; engine/runtimes/gpu_kernels.py
says what the sets are): ``x @ W.T`` with its fused prologue (RMSNorm, the MLP's silu gate) and epilogue (bias,
residual, RoPE and the cache writes, float32 logits), every row's reduction in an order fixed by the weight's shape.

A row is one program's (BM 1: fp32 products summed by a fixed tree per slab of K, a GEMV), one of a few rows sharing
a program's weight slab (BM 2-8, each row's tree as alone), or one of 16 rows of a tensor-core tile (BM 16): either
the rows are the product's M side, or (``swap``) the weight's BN outputs are, so the weight tile is the wide operand
(the small-batch decode layout: 64-128 weight rows against 16 activation rows, each output element an MMA dot of its
own row and column, whatever the other rows hold). K may be split; the tile's last program to arrive (an atomic count)
adds the splits' partial sums in split order. The config comes from the weight's shape alone (``linear_config``),
never from the row count, so a row's bits are the same in a 1-token step, a verify block and a batched round
(tests/engine/test_gpu_kernels.py; on the H200,
bench/reports/gpu-linear-h200-2026-12-05.txt). Triton is imported lazily, as in gpu_kernels.py.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from engine import env_settings


@functools.cache
def _linear_kernel():
    import triton
    import triton.language as tl

    # M (the row count) is not specialised: one compiled kernel for every pass size, so a row's arithmetic is the
    # same whatever rows share its pass (Triton would otherwise compile M == 1 apart).
    @triton.jit(do_not_specialize=["M"])
    def linear_kernel(
        x, w, out, bias, res, nw, part, lock,
        M, N, x_stride, res_stride, out_stride, eps,
        cos, sin, positions, keys, values, T, k_s, k_h, k_p, v_s, v_h, v_p,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
        ROPE: tl.constexpr, H: tl.constexpr, KV: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr,
        PREFETCH: tl.constexpr, LINE: tl.constexpr,
    ):  # fmt: skip
        KS: tl.constexpr = tl.cdiv(tl.cdiv(K, BK), SPLITS) * BK
        if PDL:  # launched while the kernel before finishes: nothing but the weights is touched before it is done
            if PREFETCH > 0:  # the program's first weight slabs into L2 meanwhile (constants: safe to read early)
                p0 = tl.program_id(0)
                pcols = tl.minimum((p0 // SPLITS // tl.cdiv(M, BM)) * BN + tl.arange(0, BN), N - 1)
                pk = tl.minimum((p0 % SPLITS) * KS + tl.arange(0, PREFETCH * BK // LINE) * LINE, K - 1)
                lines = w + pcols[:, None].to(tl.int64) * K + pk[None, :]
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
                    "=r,l",
                    [lines.to(tl.int64)],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # K is a weight's own size (a constant): the slab loop has a fixed trip count, and Triton's interpreter can
        # range() over it. SPLITS > 1 (split-K): program `split` reduces its own K range (KS, whole slabs); the last
        # program of a tile to finish adds the SPLITS partial sums in split order, so the order is fixed by the
        # weight's shape alone, never by timing or the row count. (KS: the split's share of K, above.)
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
        acc_t = tl.zeros((BN, BM), tl.float32)  # SWAP's accumulator: the weight's outputs down, the rows across
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
            elif SWAP:  # the weight tile as the MMA's wide side: out^T = W x^T, one dot per (output, row) element
                acc_t = tl.dot(b, tl.trans(a), acc_t, input_precision=PRECISION)
            elif BM < 16:  # a few rows a program, the weight slab read once for them; each row's tree as its own
                acc += tl.sum(b.to(tl.float32)[None, :, :] * a.to(tl.float32)[:, None, :], axis=2)
            else:
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        if SWAP:
            acc = tl.trans(acc_t)
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

    return linear_kernel


# Programmatic dependent launch (Hopper and later; FIMBLE_CUDA_PDL): each Triton kernel of a pass is launched while
# the kernel before it is still running, waits (griddepcontrol.wait) before its first memory access until that kernel
# has completed and its writes are visible, then lets its own successor launch; meanwhile a projection prefetches its
# first FIMBLE_CUDA_PREFETCH weight slabs into L2 (weights are constants: safe to read early). The arithmetic is
# untouched: the same bits on or off (tests/engine/test_gpu_kernels.py; the GPU suite passed with it, 70 tests, H100,
# 2026-12-06). Every kernel waits before it reads or writes any buffer, so a buffer the kernel before still reads is
# never overwritten early (a graph's pool reuses freed buffers); a torch kernel between two Triton ones is launched as
# usual and waits for its predecessor. Measured on an H100 (bench/reports/gpu-pdl-h100-2026-12-06.txt): the 1.5B
# shape's graph step 5-10% faster (2.05-2.17 to 1.94-1.96 ms) and its 8-token verify 2%; the 0.5B shape's step 3-6%
# slower without the prefetch, even with it, and its 8-token verify 15-19% slower (kernels of 5-10 us, where a waiting
# dependent only takes room). So "auto" (the default) launches as dependents the kernels of layers at least
# PDL_MIN_WIDTH wide (Qwen2.5 1.5B and up), "on" every kernel, "off" none.
PDL_ENV = "FIMBLE_CUDA_PDL"
PDL_MIN_WIDTH = 1536  # hidden size (min of a projection's sides; attention's query width) from which auto is on
PREFETCH_ENV = "FIMBLE_CUDA_PREFETCH"  # weight slabs a dependent projection prefetches into L2 while it waits


def pdl_mode() -> str:
    """FIMBLE_CUDA_PDL: "auto" (default), "on" or "off" (1 and 0 say the same); anything else is an error."""
    value = env_settings.read(PDL_ENV)  # a bad value: SettingError (a ValueError)
    return {"1": "on", "0": "off"}.get(value, value)


@functools.cache
def prefetch_slabs() -> int:
    """FIMBLE_CUDA_PREFETCH: 0, 1, 2 or 4 slabs of K (default 2), taken only by kernels launched as dependents."""
    return env_settings.read(PREFETCH_ENV)  # a bad value: SettingError (a ValueError)


@functools.cache
def use_pdl(device: torch.device, width: int) -> bool:
    """Whether a kernel of a layer ``width`` wide on ``device`` launches as a programmatic dependent (compute
    capability 9.0 or later; ``pdl_mode``)."""
    mode = pdl_mode()
    if device.type != "cuda" or mode == "off" or (mode == "auto" and width < PDL_MIN_WIDTH):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


LINEAR_ROWS = 16  # rows of one output tile (tl.dot needs 16): the only tile size a pass's row count meets
# A swap tile's activation rows: 16 in every config the engine takes; wider ones only where a probe on the device
# finds a row's bits the same as in the 16-row tile (``wide_config``; bench/gpu_prefill_tiles.py measures them).
SWAP_ROWS = (16, 32, 64, 128)
SM_TARGET = 132  # the H200's streaming multiprocessors: a decode product wants at least this many programs


class LinearConfig(NamedTuple):
    """``linear``'s kernel config: column tile, slab of K, warps, pipeline stages, K splits, rows a program (1, 2-8
    or ``LINEAR_ROWS``) and ``swap`` (with BM ``LINEAR_ROWS``: the weight tile is the tensor-core product's M side).
    Plain 5- or 6-tuples are read with BM ``LINEAR_ROWS`` and ``swap`` False."""

    bn: int
    bk: int
    warps: int
    stages: int
    splits: int
    bm: int = 16
    swap: bool = False

    @classmethod
    def of(cls, config: tuple) -> LinearConfig:
        cfg = cls(*config)
        if cfg.swap and (cfg.bm not in SWAP_ROWS or cfg.bn < 16):
            raise ValueError(f"linear: swap needs BM in {SWAP_ROWS} and BN >= 16, not {tuple(cfg)}")
        return cfg

    @classmethod
    def checked(cls, config) -> LinearConfig:
        """``of`` for a config from outside the code (FIMBLE_LINEAR_CONFIGS): every field range-checked."""
        if not isinstance(config, (list, tuple)) or not 5 <= len(config) <= 7:
            raise ValueError(
                f"linear: a config is 5-7 fields (BN, BK, warps, stages, splits[, BM[, swap]]), not {config!r}"
            )
        if not all(isinstance(v, int) for v in config):
            raise ValueError(f"linear: config fields are integers (swap 0/1 or true/false), not {config!r}")
        cfg = cls.of(tuple(config))
        powers = {"bn": (8, 256), "bk": (32, 1024), "warps": (1, 16), "bm": (1, LINEAR_ROWS)}
        for name, (lo, hi) in powers.items():
            v = getattr(cfg, name)
            if not lo <= v <= hi or v & (v - 1):
                raise ValueError(f"linear: {name} must be a power of two in {lo}..{hi}, not {v}")
        if not 1 <= cfg.stages <= 8 or not 1 <= cfg.splits <= 64:
            raise ValueError(f"linear: stages 1..8 and splits 1..64, not {cfg.stages} and {cfg.splits}")
        return cfg._replace(swap=bool(cfg.swap))


# (BN, BK, warps, stages, splits, BM, swap) per weight shape (n, k) of the Qwen2.5 0.5B and 1.5B shapes: the best of
# bench/gpu_linear.py's sweep (a 1-token step plus an 8-row verify block) on an H100 (2026-12-06,
# bench/reports/gpu-swap-sweep-h100-2026-12-06.json; the device tool lent no H200 that day), each with its rows equal in
# any pass. The wide products take swap-AB tensor-core tiles (16 rows read the weight once: an 8-row verify costs
# what a step does); the 0.5B's qkv and o stay one row a program (BM 1), where the GEMV is faster at 1 and 8 rows.
# With them and attention's fixed trips the Triton set's graph step is 1.10 ms (0.5B) and 2.10 ms (1.5B) on the H100,
# against the cuBLAS set's 1.70 and 2.57. The GPU suite passed with them (its 1.5B slot-graph test runs them; its
# 200 prompts run the embedded pair, whose shapes take the rule below: bench/gpu_kernels_h200.sh swaptests counts
# those on swap tiles).
MEASURED_CONFIGS: dict[tuple[int, int], tuple] = {
    (1152, 896): (8, 512, 4, 4, 1, 1, False),  # 0.5B qkv
    (896, 896): (8, 512, 4, 4, 1, 1, False),  # 0.5B o
    (9728, 896): (64, 64, 4, 4, 1, 16, True),  # 0.5B gate_up
    (896, 4864): (64, 64, 4, 4, 10, 16, True),  # 0.5B down
    (151936, 896): (64, 128, 4, 3, 1, 16, True),  # 0.5B LM head
    (2048, 1536): (64, 256, 8, 3, 3, 16, True),  # 1.5B qkv
    (1536, 1536): (64, 64, 4, 4, 6, 16, True),  # 1.5B o
    (17920, 1536): (64, 128, 4, 3, 1, 16, True),  # 1.5B gate_up
    (1536, 8960): (128, 128, 8, 3, 10, 16, True),  # 1.5B down
    (151936, 1536): (128, 256, 4, 3, 1, 16, True),  # 1.5B LM head
}


def linear_config(n: int, k: int) -> LinearConfig:
    """``LinearConfig`` (BN, BK, warps, stages, splits, BM, swap) of ``linear`` for a weight of ``n`` outputs by ``k``
    inputs: a function of the weight's shape alone, never of the row count, so a row's reduction order is the same in
    every pass (batch invariance).

    Decode passes are 1-16 rows and reading the weight is the cost: one row a program (BM 1, a GEMV), narrow column
    tiles (many programs streaming the weight at once) and wide slabs of K (bytes in flight); where the column tiles
    are still too few to keep every multiprocessor reading, K is split (summed in split order by the tile's last
    program). Shapes measured on the GPU take their measured configs (``MEASURED_CONFIGS``; FIMBLE_LINEAR_CONFIGS goes
    first), others this rule (GEMV tiles and slabs; splits only as many as fill the GPU once)."""
    swept = swept_configs()
    if (n, k) in swept:
        return swept[(n, k)]
    if (n, k) in MEASURED_CONFIGS:
        return LinearConfig.of(MEASURED_CONFIGS[(n, k)])
    bn = 8 if n <= 4096 else 16
    bk = 512 if n <= 4096 and k <= 2048 else 256
    return LinearConfig(bn, bk, 4, 4, _splits(-(-n // bn), -(-k // bk)), 1)


CONFIGS_ENV = "FIMBLE_LINEAR_CONFIGS"


@functools.cache
def swept_configs() -> dict[tuple[int, int], LinearConfig]:
    """Configs from a sweep of bench/gpu_linear.py (its --json: ``{"sweep": [{"n", "k", "best"}, ...]}``) named by
    FIMBLE_LINEAR_CONFIGS, ahead of MEASURED_CONFIGS: another GPU's own tuning, or a new sweep counted by the
    lossless suite before its figures enter the code. Read once per process, so every pass of the process uses the
    same configs (batch invariance holds within a process whatever the file says). A weight whose best config had
    rows unequal in the sweep (``best_rows_equal`` false) keeps the code's config. A bad file is an error at the
    first product, never a silent fallback."""
    path = env_settings.read(CONFIGS_ENV)  # None when unset; a path that names no file: SettingError
    if not path:
        return {}
    try:
        rows = json.loads(Path(path).read_text())["sweep"]
        return {
            (int(r["n"]), int(r["k"])): LinearConfig.checked(r["best"])
            for r in rows
            if r.get("best_rows_equal", True) is not False
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{CONFIGS_ENV}={path}: not a bench/gpu_linear.py sweep ({exc})") from None


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
        # Never inside a CUDA graph capture: the buffer would live in that graph's pool and be reused once the
        # graph is freed. Captures run their pass once first (graph_forward.capture), which allocates it here.
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K counters must be allocated before a CUDA graph capture (run the pass once)")
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


def rope_config(n: int, k: int, hd: int) -> LinearConfig:
    """``linear_config`` for a qkv weight with its RoPE epilogue: a column tile is one head (BN = ``hd``); K is split
    until the heads' tiles fill the GPU (a function of the weight's shape alone, as ``linear_config``)."""
    base = linear_config(n, k)
    bk = 128  # a 128-column head tile and 128-wide slabs: 4 stages fit the shared memory (256 would not)
    return LinearConfig(hd, bk, base.warps, 4 if hd <= 64 else 3, _splits(-(-n // hd), -(-k // bk)), base.bm, base.swap)


# -- wide tiles -----------------------------------------------------------------------------------------------------
# A swap config's tile is built for one sequence's decode: 16 activation rows against 64-128 weight rows. A pass of
# many rows runs many row tiles per column strip, each reading the strip's weights again: a 512-row prefill chunk took
# 4-7x cuBLAS's time per product on an H100 (bench/reports/gpu-wide-tiles-h100-2026-12-06.txt). A tensor-core dot's
# element (i, j) is the same chain of 16-wide K steps whatever the tile's other sides are: on that H100 a row's bits
# were equal with 16, 32, 64 and 128 activation rows a program and 64-256 weight rows, on every swap weight of both
# shapes (bench/gpu_prefill_tiles.py). So a pass of more than WIDE_ROWS rows takes a wider tile (the same K slab,
# splits and split order: the same reduction chain per element), but only where this process has checked, on this
# GPU, that it gives the 16-row tile's bits (``_wide_equal``); anywhere else the 16-row tile runs, which is always
# right. With it the 1.5B's 512-row products took 3.6-4.1x cuBLAS's time instead of 5.1-5.7x. Above 64 rows only: at
# 17-64 rows (a batched round) the wide tile gained nothing per product and the serve ratio to the cuBLAS set fell
# from 0.84 to 0.81 (the same report).
WIDE_ROWS = 64  # passes of more rows than this take the wide tile (prefill chunks, large batched rounds)
WIDE_SMEM = 200 * 1024  # shared memory the wide tile's pipeline stages may take (the H100/H200 allow 227 KB)
WIDE_PROBE_ROWS = 96  # rows of the equality probe: one and a half wide tiles (a partial tile's masks too)
WIDE_ENV = "FIMBLE_WIDE_TILES"  # 0: every pass on the 16-row tile (benchmarks compare the two)
_wide_checks = {"equal": 0, "unequal": 0, "taken": 0}  # counters: probes and products (tests read them)


def wide_config(cfg: LinearConfig, rope: bool = False) -> LinearConfig | None:
    """The tile a pass of more than WIDE_ROWS rows on ``cfg``'s weight may take (None for a GEMV config: its tree
    has no tile to widen): 64 activation rows and at least 128 weight rows a program (a RoPE tile stays one head
    wide), 8 warps, ``cfg``'s K slab and splits, as many pipeline stages (at most 3) as WIDE_SMEM holds."""
    if not cfg.swap or not env_settings.read(WIDE_ENV):
        return None
    bn = cfg.bn if rope else max(cfg.bn, 128)
    bm = 64
    stages = max(1, min(3, WIDE_SMEM // ((bn + bm) * cfg.bk * 2)))
    return cfg._replace(bn=bn, bm=bm, warps=8, stages=stages)


def _wide_equal(weight: Tensor, cfg: LinearConfig, wide: LinearConfig) -> bool:
    """Whether ``wide`` gives ``cfg``'s bits for every row of a pass on this weight's shape, dtype and GPU: checked
    once per process (random rows; a row's bits depend on the tile's K chain, not on the values) and remembered."""
    key = (tuple(weight.shape), weight.dtype, weight.device, cfg, wide)
    known = _WIDE_KNOWN.get(key)
    if known is not None:
        return known
    if weight.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False  # never probe inside a graph capture (it allocates): the decode tile, always right
    gen = torch.Generator(device=weight.device).manual_seed(7)
    x = torch.randn(WIDE_PROBE_ROWS, weight.shape[1], device=weight.device, dtype=weight.dtype, generator=gen)
    try:
        equal = torch.equal(_launch(x, weight, cfg), _launch(x, weight, wide))
    except Exception:  # noqa: BLE001 - a tile this GPU cannot build (shared memory): the decode tile runs
        equal = False
    _WIDE_KNOWN[key] = equal
    _wide_checks["equal" if equal else "unequal"] += 1
    return equal


_WIDE_KNOWN: dict[tuple, bool] = {}


def _launch(x: Tensor, weight: Tensor, cfg: LinearConfig) -> Tensor:
    """A plain product at ``cfg`` (the wide-tile probe's two sides)."""
    return linear(x, weight, config=cfg)


def linear(
    x: Tensor, weight: Tensor, *, bias: Tensor | None = None, residual: Tensor | None = None,
    norm: Tensor | None = None, eps: float = 0.0, gated: bool = False, out_dtype: torch.dtype | None = None,
    config: tuple | None = None, rope: RopeStore | None = None,
) -> Tensor:  # fmt: skip
    """``x @ weight.T`` (+ ``bias``) (+ ``residual``), batch-invariant: row i of the result has the same bits
    whatever the other rows are and however many there are.

    ``x`` [M, K] (rows contiguous); ``weight`` [N, K] contiguous (an nn.Linear's). ``norm``: an RMSNorm weight [K]
    applied to ``x`` first (eps ``eps``). ``gated``: ``x`` is [M, 2K], gate then up, and the product's input is
    ``silu(gate) * up``. ``out_dtype``: the result's dtype (x's by default; float32 for logits, which then skip a
    rounding to bf16). ``config``: a ``LinearConfig`` or its tuple (BN, BK, warps, stages, splits[, BM[, swap]]),
    ``linear_config``'s by default (benchmarks and tests; BM 16 where left out); without one, a pass of more than
    ``WIDE_ROWS`` rows may take the config's wide tile (``wide_config``, where checked equal). ``rope``:
    ``weight`` is a qkv projection; the result is the rotated queries, the keys and values go to the cache
    (``RopeStore``)."""
    kernel = _linear_kernel()
    m = x.shape[0]
    n, k = weight.shape
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.stride(0) != k:
        raise ValueError("linear needs rows with unit stride and a contiguous weight")
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"linear: x has {x.shape[1]} columns for a weight of {k} inputs{' (gated)' if gated else ''}")
    chosen = config is None  # the engine's own config (a caller's explicit one is taken as it is)
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
    cfg = LinearConfig.of(config) if config else linear_config(n, k)
    if chosen and m > WIDE_ROWS:
        wide = wide_config(cfg, rope is not None)
        if wide is not None and _wide_equal(weight, cfg, wide):
            cfg = wide
            _wide_checks["taken"] += 1
    bn, bk, warps, stages, splits, bm, swap = cfg
    tiles = triton_cdiv(m, bm) * triton_cdiv(n, bn)
    if splits > 1:
        part = torch.empty(tiles * splits * bm * bn, dtype=torch.float32, device=x.device)
        lock = _split_locks(x.device, tiles)
    else:
        part = lock = out
    pdl = use_pdl(x.device, min(n, k))
    kernel[(tiles * splits,)](
        x, weight, out,
        bias if bias is not None else weight, residual if residual is not None else out,
        norm if norm is not None else weight, part, lock,
        m, n, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), float(eps),
        r.cos, r.sin, r.positions, r.keys, r.values, m // r.seqs, *cache_strides,
        K=k, HAS_BIAS=bias is not None, HAS_RES=residual is not None, NORM=norm is not None, GATED=gated,
        BM=bm, BN=bn, BK=bk, SPLITS=splits, num_warps=warps, num_stages=stages,
        ROPE=rope is not None, H=r.heads, KV=r.kv_heads, SWAP=swap, PDL=pdl, launch_pdl=pdl,
        PREFETCH=prefetch_slabs() if pdl else 0, LINE=128 // weight.element_size(),
        # float32 weights: true fp32 products (a dot's default there is tf32, ~1e-3); bf16/fp16 ignore it
        PRECISION="ieee" if weight.dtype == torch.float32 else None,
    )  # fmt: skip
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
