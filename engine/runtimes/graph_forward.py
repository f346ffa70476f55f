"""The forward passes that CUDA graphs capture (engine/runtimes/cuda_graphs.py ``GraphRuntime``, engine/runtimes/
slot_graphs.py ``SlotGraphs``): block and key-length buckets, static inputs, the batched forward over padded
blocks with its attention kernels ("invariant-cublas", "invariant", "fused", "sdpa", "matmul"), and capture."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:  # (annotations only: compact.py imports this module for its invariant forward)
    from engine.runtimes.compact import CompactTransformer, KVCache


BLOCKS = (1, 2, 4, 8, 16)
MIN_KEYS = 256  # smallest attended key length; doubling buckets above it


def block_bucket(t: int) -> int | None:
    return next((b for b in BLOCKS if b >= t), None)


def _min_block(block: int | None, attention: str) -> int | None:
    """``block``, raised to the cuBLAS kernel set's row multiple (engine/runtimes/gpu_kernels.py CUBLAS_ROWS)."""
    if block is None or attention != "invariant-cublas":
        return block
    from engine.runtimes.gpu_kernels import CUBLAS_ROWS

    return max(block, min(CUBLAS_ROWS, max(BLOCKS)))


def key_bucket(end: int, max_len: int) -> int:
    length = MIN_KEYS
    while length < end:
        length *= 2
    return min(length, max_len)


class StaticInputs:
    """Inputs every graph of one runtime reads: token ids and the start position."""

    def __init__(self, device: torch.device, size: int = max(BLOCKS)):
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.offsets = torch.arange(size, device=device)


def _rope_tables(model: CompactTransformer, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sign-folded sin at ``positions``: rotate(x) = x*cos + swap_halves(x)*sin_signed.

    Folding rotate()'s negation into the table saves a kernel and changes no bit: -(a*b) == (-a)*b.
    """
    cos = model.rope_cos.index_select(0, positions.reshape(-1))
    sin = model.rope_sin.index_select(0, positions.reshape(-1))
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    shape = (*positions.shape, 1, cos.shape[-1])
    return cos.view(shape), sin.view(shape)


def forward_batch(
    model: CompactTransformer,
    keys: Tensor,
    values: Tensor,
    tokens: Tensor,
    starts: Tensor,
    keys_len: int,
    last: Tensor | None = None,
    attention: str = "sdpa",
) -> Tensor:
    """``tokens`` [S, T]: T tokens for each of S sequences, sequence s at positions starts[s]..; static shapes.

    ``keys``/``values``: [layers, S, kv_heads, max_len, head_dim]. Attention runs over the first
    ``keys_len`` slots, masked by position, so neither growth nor rollback needs a new graph. Rows past a
    sequence's real tokens are padding: their keys/values land past its end, where no real query looks
    and the next pass overwrites them. ``last`` [S]: return only that row of each sequence.
    Returns float32 logits, [S, vocab] with ``last``, else [S * T, vocab].
    """
    cfg = model.cfg
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group, half = heads // kv_heads, hd // 2
    s, t = tokens.shape
    dev = tokens.device
    positions = starts[:, None] + torch.arange(t, device=dev)[None, :]  # [S, T]
    if attention in ("invariant", "invariant-cublas"):
        return _forward_invariant(model, keys, values, tokens, positions, keys_len, last, attention)
    if attention == "fused":
        return _forward_fused(model, keys, values, tokens, positions, keys_len, last)
    cos, sin = _rope_tables(model, positions)  # [S, T, 1, hd]
    # Additive mask, rows ordered (group member, token) as the queries below; built once, not per layer.
    # Its storage is padded to 16 columns so the attention kernel needs no aligned copy per layer.
    padded = -(-keys_len // 16) * 16
    visible = torch.arange(padded, device=dev)[None, None, :] <= positions[:, :, None]  # [S, T, padded]
    mask_dtype = model.dtype if attention == "sdpa" else torch.float32  # matmul scores are added in fp32
    mask = torch.zeros(visible.shape, dtype=mask_dtype, device=dev).masked_fill_(~visible, float("-inf"))
    mask = mask.repeat(1, group, 1)[:, None, :, :keys_len]  # [S, 1, G*T, keys_len]
    rows = torch.arange(s, device=dev)
    x = model.embed(tokens).view(s * t, -1)
    for i, layer in enumerate(model.layers):
        qkv = layer.qkv(layer.attn_norm(x)).view(s, t, heads + 2 * kv_heads, hd)
        qk = qkv[:, :, : heads + kv_heads]
        qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin  # q and k rotated together
        q, k, v = qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv_heads :]
        if s == 1:
            keys[i, 0].index_copy_(1, positions[0], k[0].transpose(0, 1))
            values[i, 0].index_copy_(1, positions[0], v[0].transpose(0, 1))
        else:
            keys[i][rows[:, None], :, positions] = k
            values[i][rows[:, None], :, positions] = v
        kc, vc = keys[i, :, :, :keys_len], values[i, :, :, :keys_len]
        # Grouped-query attention as plain attention: the query heads sharing a kv head become rows.
        qg = q.reshape(s, t, kv_heads, group, hd).permute(0, 2, 3, 1, 4).reshape(s, kv_heads, group * t, hd)
        if attention == "sdpa":
            attn = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask)
        else:  # plain matmuls: parallel over keys, where a fused kernel may get few blocks at batch 1
            scores = torch.add(mask, torch.matmul(qg, kc.transpose(-1, -2)), alpha=hd**-0.5)
            attn = torch.matmul(torch.softmax(scores.float(), dim=-1).to(qg.dtype), vc)
        attn = attn.view(s, kv_heads, group, t, hd).permute(0, 3, 1, 2, 4).reshape(s * t, heads * hd)
        x = torch.addmm(x, attn, layer.o_proj.weight.t())
        gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
        x = torch.addmm(x, F.silu(gate) * up, layer.down.weight.t())
    if last is not None:
        x = x.view(s, t, -1)[rows, last]
    return model.lm_head(model.norm(x)).float()


def _forward_fused(
    model: CompactTransformer,
    keys: Tensor,
    values: Tensor,
    tokens: Tensor,
    positions: Tensor,
    keys_len: int,
    last: Tensor | None,
) -> Tensor:
    """``forward_batch`` with RoPE, the cache writes and attention in Triton kernels (engine/runtimes/gpu_kernels.py):
    about half a layer's kernels. The same computation, rounded differently: RoPE in fp32 rounded once (torch's
    ops round three times); attention sums in fp32 in another order (the matmul path rounds scores to bf16)."""
    from engine.runtimes import gpu_kernels

    cfg = model.cfg
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    s, t = tokens.shape
    flat = positions.reshape(-1)
    x = model.embed(tokens).view(s * t, -1)
    scratch = None
    for i, layer in enumerate(model.layers):
        qkv = layer.qkv(layer.attn_norm(x))
        q = gpu_kernels.rope_store(qkv, keys[i], values[i], model.rope_cos, model.rope_sin, flat, s, heads, kv_heads)
        if scratch is None:  # one buffer of partial sums for every layer's attention
            scratch = gpu_kernels.attention_scratch(q, keys_len, s, kv_heads, cfg.head_dim)
        attn = gpu_kernels.attention(q, keys[i], values[i], flat, keys_len, s, kv_heads, scratch)
        x = torch.addmm(x, attn, layer.o_proj.weight.t())
        gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
        x = torch.addmm(x, F.silu(gate) * up, layer.down.weight.t())
    if last is not None:
        x = x.view(s, t, -1)[torch.arange(s, device=x.device), last]
    return model.lm_head(model.norm(x)).float()


def invariant_layers(
    model: CompactTransformer,
    keys: Tensor,
    values: Tensor,
    x: Tensor,
    positions: Tensor,
    keys_len: int,
    seqs: int,
    kernels: str = "invariant",
) -> Tensor:
    """The decoder layers in batch-invariant kernels (engine/runtimes/gpu_kernels.py): ``x`` [S*T, hidden], the
    rows of S sequences of T tokens each at ``positions`` [S*T]; ``keys``/``values`` [layers, S, kv_heads, max_len,
    head_dim]. Returns the last layer's hidden states (before the final norm). Every reduction runs in an order
    fixed by the weights' shapes and the key positions, so a row's bits depend on its own tokens and cache only:
    not on T, S, ``keys_len`` (any length covering the rows' positions) or a graph capture.

    ``kernels``: "invariant", the projections in ``gpu_kernels.linear`` (invariant for any row count by
    construction); or "invariant-cublas", torch's projections and norms on a whole multiple of
    ``gpu_kernels.CUBLAS_ROWS`` rows (zero rows pad the pass; their keys/values are never written): a pass of 1-16
    tokens meets one cuBLAS shape per weight, so it is invariant by construction too, and a batched round's products
    keep to the row counts where cuBLAS computes a row as in that pass (engine/runtimes/row_limits.py: pieces, or a
    larger base for every pass), so its rows are the same bits too (tests/gpu checks both)."""
    from engine.runtimes import gpu_kernels as gk
    from engine.runtimes import row_limits as rl

    cfg = model.cfg
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    triton_gemms = kernels == "invariant"
    if not triton_gemms:
        lim = rl.limits(model, gk.CUBLAS_ROWS)  # rows per product where cuBLAS keeps its 16-row kernel
        rows = x.shape[0]
        pad = -rows % gk.CUBLAS_ROWS
        if pad:  # every product on a multiple of CUBLAS_ROWS rows; the padding rows' keys/values are never written
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    scratch = None
    for i, layer in enumerate(model.layers):
        if triton_gemms:  # the product, RoPE and the cache writes in one kernel (the same bits as rope_store)
            norm = layer.attn_norm
            rope = gk.RopeStore(keys[i], values[i], model.rope_cos, model.rope_sin, positions, seqs, heads, kv_heads)
            q = gk.linear(x, layer.qkv.weight, bias=layer.qkv.bias, norm=norm.weight, eps=norm.eps, rope=rope)
        else:
            qkv = rl.qkv_rows(layer, lim, x)
            if pad:
                qkv = qkv[:rows]
            q = gk.rope_store(qkv, keys[i], values[i], model.rope_cos, model.rope_sin, positions, seqs, heads, kv_heads)
        if scratch is None:  # one buffer of partial sums for every layer's attention
            scratch = gk.attention_scratch(q, keys_len, seqs, kv_heads, cfg.head_dim)
        attn = gk.attention(q, keys[i], values[i], positions, keys_len, seqs, kv_heads, scratch, ordered=True)
        if triton_gemms:
            x = gk.linear(attn, layer.o_proj.weight, residual=x)
            gate_up = gk.linear(x, layer.gate_up.weight, norm=layer.mlp_norm.weight, eps=layer.mlp_norm.eps)
            x = gk.linear(gate_up, layer.down.weight, residual=x, gated=True)
        else:
            if pad:
                attn = torch.cat((attn, attn.new_zeros(pad, attn.shape[1])))
            x = rl.mlp_rows(layer, lim, x, attn)
    return x[:rows] if not triton_gemms and pad else x


def invariant_logits(model: CompactTransformer, x: Tensor, kernels: str = "invariant") -> Tensor:
    """The final norm and the LM head: with Triton projections one kernel, float32 logits straight from its
    accumulators; with cuBLAS ones torch's norm and product, then float32."""
    from engine.runtimes import gpu_kernels as gk
    from engine.runtimes import row_limits as rl

    if kernels != "invariant":
        rows = x.shape[0]
        pad = -rows % gk.CUBLAS_ROWS
        if pad:
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
        return rl.head_rows(model, rl.limits(model, gk.CUBLAS_ROWS), x)[:rows].float()
    return gk.linear(x, model.lm_head.weight, norm=model.norm.weight, eps=model.norm.eps, out_dtype=torch.float32)


def _forward_invariant(
    model: CompactTransformer,
    keys: Tensor,
    values: Tensor,
    tokens: Tensor,
    positions: Tensor,
    keys_len: int,
    last: Tensor | None,
    kernels: str = "invariant",
) -> Tensor:
    """``forward_batch`` in batch-invariant kernels (``invariant_layers``): a row's logits are the same bits in any
    block or batch, replayed or not, and equal ``invariant_forward``'s (the eager path's) for the same row."""
    s, t = tokens.shape
    x = model.embed(tokens).view(s * t, -1)
    x = invariant_layers(model, keys, values, x, positions.reshape(-1), keys_len, s, kernels)
    if last is not None:
        x = x.view(s, t, -1)[torch.arange(s, device=x.device), last]
    return invariant_logits(model, x, kernels)


INVARIANT_CHUNK = 512  # rows per eager invariant pass: bounds attention's split scratch on a long prompt


def invariant_forward(model: CompactTransformer, tokens: Tensor, cache: KVCache, start: int, num_logits: int) -> Tensor:
    """``CompactTransformer.forward`` in batch-invariant kernels (its CUDA default): any number of tokens, attention
    over exactly the positions written (the cuBLAS set pads the products with zero rows, not the pass with tokens).
    Float32 logits of the last ``num_logits`` tokens.

    A long prompt runs in chunks of ``INVARIANT_CHUNK`` tokens, which changes no bit: a row's result depends on its
    own token and the keys/values at its positions and before, which the earlier chunks wrote as one pass would."""
    from engine.runtimes import gpu_kernels as gk

    kernels = (
        model.invariant if model.invariant in gk.INVARIANT_SETS else gk.invariant_default() or gk.DEFAULT_INVARIANT
    )
    t = tokens.shape[0]
    n = min(num_logits, t)
    keys, values = cache.keys.unsqueeze(1), cache.values.unsqueeze(1)
    wanted = []
    for lo in range(0, t, INVARIANT_CHUNK):
        hi = min(t, lo + INVARIANT_CHUNK)
        positions = torch.arange(start + lo, start + hi, device=tokens.device)
        x = invariant_layers(model, keys, values, model.embed(tokens[lo:hi]), positions, start + hi, 1, kernels)
        if hi > t - n:
            wanted.append(x[max(lo, t - n) - lo :])
    cache.length = start + t
    return invariant_logits(model, wanted[0] if len(wanted) == 1 else torch.cat(wanted), kernels)


def default_attention() -> str:
    """The graph path's kernels where Triton runs on CUDA: batch-invariant, "invariant" by default (Triton
    projections) or "invariant-cublas" (FIMBLE_CUDA_INVARIANT=cublas, fimble serve's default: cuBLAS on fixed 16-row
    passes); FIMBLE_CUDA_INVARIANT=0: "fused" (Triton attention, cuBLAS at the pass's own row count). Elsewhere
    torch's sdpa."""
    from engine.runtimes import gpu_kernels

    if not gpu_kernels.available():
        return "sdpa"
    return gpu_kernels.invariant_default() or "fused"


def static_forward(
    model: CompactTransformer,
    cache: KVCache,
    inp: StaticInputs,
    block: int,
    keys_len: int,
    attention: str = "sdpa",
    fn: Callable[..., Tensor] = forward_batch,
) -> Tensor:
    """One sequence: ``block`` tokens at positions inp.start..; float32 logits [block, vocab].

    ``fn``: forward_batch itself, or a torch.compile'd forward_batch (fused elementwise kernels)."""
    return fn(
        model,
        cache.keys.unsqueeze(1),
        cache.values.unsqueeze(1),
        inp.tokens[:block].view(1, -1),
        inp.start.view(1),
        keys_len,
        attention=attention,
    )


def capture(fn: Callable[[], Tensor], pool) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """Run ``fn`` once for real on a side stream (warm-up: cuBLAS handles, allocations), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
