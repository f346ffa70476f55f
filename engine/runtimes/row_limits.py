"""Row limits for the "invariant-cublas" kernel set (engine/runtimes/graph_forward.py ``invariant_layers``).

That set runs every single-sequence pass on exactly 16 rows, so a 1-token step and a verify block meet one cuBLAS
kernel per weight. A batched round or pass multiplies 16 x b rows (or b x block rows), and cuBLAS may pick another
kernel, with another reduction order, for another row count (bench/reports/gpu-invariant-h200-2026-12-03.txt: the
0.5B/1.5B down projections from 256 rows, 7B's from 32). torch's RMSNorm may change its reduction layout with the
row count too. So the row-wise stages of a layer (norm + projection, the output projection with its residual, the
gated MLP, the final norm + LM head) are probed once per model: for each row count M, a multiple of 16 up to
``PROBE_ROWS``, the stage on M random rows must give the same bits as the same rows in 16-row pieces. A stage's
limit is the largest M up to which every probed count passed; a product of more rows runs in pieces of at most
that many, each of which then computes its rows exactly as a 16-row pass would. So a batched round's rows equal
the sequences' own passes for any batch size, at the cost of re-reading a weight once per piece where cuBLAS
would change its kernel.

Why a probe and not a fixed table: the kernel choice belongs to the cuBLAS version, the GPU and the shapes; a
kernel that gives the same bits is the same reduction order for every input (a different order differs on random
rows of hundreds of terms), and the same kernel on the same shape is deterministic. FIMBLE_CUDA_ROW_LIMITS=0
turns the pieces off (the limits become unbounded; bench/gpu_invariant.py compares both).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from engine.runtimes.compact import Block, CompactTransformer

PROBE_ROWS = 512  # the largest row count probed; bigger products run in pieces of a limit found below it
STAGES = ("attn_in", "attn_out", "mlp", "head")
UNBOUNDED = 1 << 62


def enabled() -> bool:
    return os.environ.get("FIMBLE_CUDA_ROW_LIMITS", "1").strip().lower() not in ("0", "off", "false", "no")


# The row-wise stages, each a function of row-aligned tensors only (every output row depends on its input rows).
def attn_in(layer: Block, x: Tensor) -> Tensor:
    return layer.qkv(layer.attn_norm(x))


def attn_out(layer: Block, x: Tensor, attn: Tensor) -> Tensor:
    return torch.addmm(x, attn, layer.o_proj.weight.t())


def mlp(layer: Block, x: Tensor) -> Tensor:
    gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
    return torch.addmm(x, F.silu(gate) * up, layer.down.weight.t())


def head(model: CompactTransformer, x: Tensor) -> Tensor:
    return model.lm_head(model.norm(x))


def pieces(fn: Callable[..., Tensor], limit: int, *rows: Tensor) -> Tensor:
    """``fn(*rows)``, in pieces of at most ``limit`` rows when there are more."""
    m = rows[0].shape[0]
    if m <= limit:
        return fn(*rows)
    return torch.cat([fn(*(r[lo : lo + limit] for r in rows)) for lo in range(0, m, limit)])


def find_limit(fn: Callable[..., Tensor], rows: Sequence[Tensor], step: int) -> int:
    """The largest multiple M of ``step`` (at most the rows given) such that ``fn`` on the first m rows equals ``fn``
    on the same rows in ``step``-row pieces, bit for bit, for every multiple m of ``step`` up to M."""
    total = rows[0].shape[0] // step * step
    ref = pieces(fn, step, *(r[:total] for r in rows))
    limit = step
    for m in range(2 * step, total + 1, step):
        if not torch.equal(fn(*(r[:m] for r in rows)), ref[:m]):
            break
        limit = m
    return limit


@torch.inference_mode()
def probe(model: CompactTransformer, step: int, max_rows: int = PROBE_ROWS) -> dict[str, int]:
    """Each stage's limit on this model's first layer (every layer has its shapes), from seeded random rows."""
    cfg = model.cfg
    dev, dtype = model.device, model.dtype
    gen = torch.Generator(device=dev).manual_seed(0)
    n = max(step, max_rows // step * step)

    def rand(width: int) -> Tensor:
        return torch.randn(n, width, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    x, attn = rand(cfg.hidden_size), rand(cfg.num_heads * cfg.head_dim)
    layer = model.layers[0]
    stages: dict[str, tuple[Callable[..., Tensor], tuple[Tensor, ...]]] = {
        "attn_in": (lambda a: attn_in(layer, a), (x,)),
        "attn_out": (lambda a, b: attn_out(layer, a, b), (x, attn)),
        "mlp": (lambda a: mlp(layer, a), (x,)),
        "head": (lambda a: head(model, a), (x,)),
    }
    return {name: find_limit(fn, rows, step) for name, (fn, rows) in stages.items()}


def limits(model: CompactTransformer, step: int) -> dict[str, int]:
    """The model's stage limits, probed at its first use (outside any graph capture: the capture's warm-up run, or
    an eager pass, comes first) and kept on the model."""
    if not enabled():
        return dict.fromkeys(STAGES, UNBOUNDED)
    found = getattr(model, "row_limits", None)
    if found is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("row limits must be probed before a graph capture")
        found = model.row_limits = probe(model, step)
    return found
