"""Row limits for the "invariant-cublas" kernel set (engine/runtimes/graph_forward.py ``invariant_layers``).

That set runs every single-sequence pass on 16 rows, so a 1-token step and a verify block meet one cuBLAS kernel
per weight. A batched round or pass multiplies 16 x b (or b x block) rows, and cuBLAS picks its kernel, with its
reduction order, by row count: on the H200 a round of 32 sequences x 16 tokens differed from the sequences alone
in every row on the 0.5B and 1.5B shapes, and 32 x 1 on the 7B shape (bench/reports/gpu-row-limits-h200-*.txt).
torch's RMSNorm may change its reduction layout with the row count too.

So each row-wise stage of a layer (the norm, and each product: qkv, o with its residual, gate_up, down with its
residual, the LM head) is probed once per model with seeded random rows. For a base row count B (16, 32 or 64) a
stage's limit L is the largest multiple of 16 such that the stage on any multiple M of 16 rows, B <= M <= L, gives
the same bits as the same rows in 16-row pieces each padded with zero rows to B. The smallest base whose limit
reaches 128 rows (or the largest limit found) wins. The forward then pads a product of fewer than B rows to B and
runs one of more than L rows in pieces of L, so every row is computed as in a B-row pass, in any pass of any batch.
Where cuBLAS keeps one kernel from 16 rows up (most products) that is B = 16 and costs nothing below L; where it
takes another kernel at 16 rows than above (the 7B shape's down projection) B = 32 or 64: a 1-token step then runs
that product on B rows.

Why a probe and not a table: the kernel choice belongs to the cuBLAS version, the GPU and the shapes. The same
kernel on the same shape is deterministic, and two kernels that reduce in different orders differ on random rows
of hundreds of terms. FIMBLE_CUDA_ROW_LIMITS=0 turns the pieces and the base padding off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from engine import env_settings

if TYPE_CHECKING:
    from engine.runtimes.compact import Block, CompactTransformer

PROBE_ROWS = 512  # the largest row count probed; bigger products run in pieces of a limit found below it
BASES = (16, 32, 64)
ENOUGH = 128  # rows per piece that make a base good enough: 8 sequences' 16-row blocks, 128 streams' steps
STAGES = ("norm", "qkv", "o", "gate_up", "down", "lm_head")
UNBOUNDED = 1 << 62
OFF = (0, UNBOUNDED)  # (base, limit): no padding, no pieces

Limit = tuple[int, int]


def enabled() -> bool:
    return env_settings.read("FIMBLE_CUDA_ROW_LIMITS")


def addmm(weight: Tensor, x: Tensor, a: Tensor) -> Tensor:
    """``x + a @ weight.T``: the o and down projections with their residual, rounded once."""
    return torch.addmm(x, a, weight.t())


def _padded(fn: Callable[..., Tensor], base: int, rows: Sequence[Tensor]) -> Tensor:
    m = rows[0].shape[0]
    if m >= base:
        return fn(*rows)
    return fn(*(torch.cat((r, r.new_zeros(base - m, *r.shape[1:]))) for r in rows))[:m]


def pieces(fn: Callable[..., Tensor], limit: Limit, *rows: Tensor) -> Tensor:
    """``fn(*rows)`` on at least ``base`` rows (zero rows pad it) and at most ``limit`` rows a call (in pieces)."""
    base, most = limit
    m = rows[0].shape[0]
    if m <= most:
        return _padded(fn, base, rows)
    return torch.cat([_padded(fn, base, [r[lo : lo + most] for r in rows]) for lo in range(0, m, most)])


def find_limit(fn: Callable[..., Tensor], rows: Sequence[Tensor], step: int, base: int) -> int:
    """The largest multiple L of ``step`` (at most the rows given) such that ``fn`` on the first m rows equals ``fn``
    on the same rows in ``step``-row pieces padded to ``base`` rows, bit for bit, for every multiple m of ``step``
    from ``base`` to L; 0 when not even ``base`` rows do."""
    total = rows[0].shape[0] // step * step
    ref = pieces(fn, (base, step), *(r[:total] for r in rows))
    limit = 0
    for m in range(base, total + 1, step):
        if not torch.equal(fn(*(r[:m] for r in rows)), ref[:m]):
            break
        limit = m
    return limit


def best_limit(fn: Callable[..., Tensor], rows: Sequence[Tensor], step: int) -> Limit:
    """(base, limit): the smallest base in ``BASES`` whose limit reaches ``ENOUGH`` rows or the largest limit found.
    A larger base costs every single-sequence pass its padding rows; a small limit costs batched rounds pieces."""
    found = [(base, find_limit(fn, rows, step, base)) for base in BASES if base % step == 0]
    most = max(limit for _, limit in found)
    if not most:
        raise RuntimeError("a stage gave other bits for the same rows at every base: not deterministic")
    return next((base, limit) for base, limit in found if limit >= min(most, ENOUGH))


@torch.inference_mode()
def probe(model: CompactTransformer, step: int, max_rows: int = PROBE_ROWS) -> dict[str, Limit]:
    """Each stage's (base, limit) on this model's first layer (every layer has its shapes), from seeded random rows."""
    cfg = model.cfg
    dev, dtype = model.device, model.dtype
    gen = torch.Generator(device=dev).manual_seed(0)
    n = max(max(BASES), max_rows // step * step)

    def rand(width: int) -> Tensor:
        return torch.randn(n, width, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    layer = model.layers[0]
    x, h = rand(cfg.hidden_size), rand(cfg.hidden_size)
    stages: dict[str, tuple[Callable[..., Tensor], tuple[Tensor, ...]]] = {
        "norm": (layer.attn_norm, (x,)),
        "qkv": (layer.qkv, (h,)),
        "o": (lambda a, b: addmm(layer.o_proj.weight, a, b), (x, rand(cfg.num_heads * cfg.head_dim))),
        "gate_up": (layer.gate_up, (h,)),
        "down": (lambda a, b: addmm(layer.down.weight, a, b), (x, rand(cfg.intermediate_size))),
        "lm_head": (model.lm_head, (h,)),
    }
    return {name: best_limit(fn, rows, step) for name, (fn, rows) in stages.items()}


def limits(model: CompactTransformer, step: int) -> dict[str, Limit]:
    """The model's stage limits, probed at its first use (outside any graph capture: the capture's warm-up run, or
    an eager pass, comes first) and kept on the model."""
    if not enabled():
        return dict.fromkeys(STAGES, OFF)
    found = getattr(model, "row_limits", None)
    if found is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("row limits must be probed before a graph capture")
        found = model.row_limits = probe(model, step)
    return found


def qkv_rows(layer: Block, lim: dict[str, Limit], x: Tensor) -> Tensor:
    """The qkv projection of ``x``'s normed rows, stage by stage within the limits."""
    return pieces(layer.qkv, lim["qkv"], pieces(layer.attn_norm, lim["norm"], x))


def mlp_rows(layer: Block, lim: dict[str, Limit], x: Tensor, attn: Tensor) -> Tensor:
    """The attention output projection (residual added), then the gated MLP (residual added), within the limits."""
    x = pieces(functools.partial(addmm, layer.o_proj.weight), lim["o"], x, attn)
    gate, up = pieces(layer.gate_up, lim["gate_up"], pieces(layer.mlp_norm, lim["norm"], x)).chunk(2, dim=-1)
    return pieces(functools.partial(addmm, layer.down.weight), lim["down"], x, F.silu(gate) * up)


def head_rows(model: CompactTransformer, lim: dict[str, Limit], x: Tensor) -> Tensor:
    """The final norm and the LM head within the limits (model dtype; the caller casts)."""
    return pieces(model.lm_head, lim["lm_head"], pieces(model.norm, lim["norm"], x))
