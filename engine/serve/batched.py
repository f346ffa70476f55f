"""One target forward pass over several sequences, each with its own KV cache and cache length.

``CompactTransformer.forward`` (engine/runtimes/compact.py) runs one sequence. The serve scheduler
(engine/serve/scheduler.py) steps many sequences at once, so this module runs their blocks
(a prefill, a 1-token step, an 8-token verify, each at its own start position) through
every weight matrix together: the tokens of all sequences are stacked as rows, the
projections and the MLP read each weight once per step for all of them, and only
attention, which needs each sequence's own cache, runs per sequence, exactly as
``Block.forward`` does it.

Lossless: a row's result must not depend on the other rows. CPU fp32 GEMM (MKL) picks its
kernel by the matrix's size (measured: rows of 1-3-row matmuls differ in the last bit from the
same rows in a 4+ row matmul; on an AVX-512 Xeon a 65-row pass differed from an 8-row one), so
every projection here runs as GEMMs of exactly ``MIN_ROWS`` rows (zero rows pad the last). With one intra-op thread (the
daemon's default on CPU) a sequence's logits are then the same bit for bit whether it runs alone
or among others (tests/serve/test_batched.py). With several threads MKL splits the rows between
them, and a thread's share of fewer than 4 rows takes the other kernel again (measured: 2 threads,
a 9-row pass, one row differs), so batched results may then differ from solo ones in the last bit,
which changes a greedy token only at a fp32 tie, as a verify block against a 1-token step does.
On CUDA the model's batch-invariant kernels (engine/runtimes/gpu_kernels.py ``linear``, its default) fix every
reduction's order by the weight's shape, whatever the row count: no padding is needed there, and batched rows
are bit-identical to the same rows alone (``_batched_invariant``).
int8 weights (engine/runtimes/quant.py) are batch-invariant by construction and are not padded.
They are not bit-identical to ``CompactTransformer.forward`` on one row (that takes the
1-row kernel): like a verify block against a 1-token step, they may differ at a fp32 tie.

The attention code mirrors ``Block.forward``; if that changes, change this too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.decoding.passes import DraftNeed, Forward, run_one
from engine.runtimes.compact import CompactTransformer, rotate, row_attention

__all__ = ["DraftNeed", "Forward", "batched_forward", "batched_greedy_drafts", "run_one", "supports_batch"]

MIN_ROWS = 8  # CPU GEMMs run on exactly this many rows: one kernel for every batch size (see above)


def supports_batch(runtime: object) -> bool:
    """Whether ``runtime`` can run a batch here (the compact runtime, also under CUDA graphs; transformers
    models cannot)."""
    return isinstance(eager_model(runtime), CompactTransformer)


def eager_model(runtime: object) -> object:
    """The ``CompactTransformer`` under a ``GraphRuntime`` (CUDA), else ``runtime``: batched passes run eagerly.

    A graph bakes in one cache's addresses, and each sequence has its own cache, so a batch of them runs
    the eager batched forward below (on CUDA: bf16, one kernel per projection for all sequences). The
    scheduler's slotted rounds (engine/serve/scheduler.py, cuda_graphs.SlotGraphs) avoid this on CUDA by
    moving running sequences' caches into slots of one batched cache; this path stays for the CPU, for
    sequences without a slot, and for draft-model passes.
    """
    from engine.runtimes.cuda_graphs import GraphRuntime  # no torch.cuda use at import

    return runtime.model if isinstance(runtime, GraphRuntime) else runtime


def _linear(lin: nn.Module, x: Tensor) -> Tensor:
    rows = x.shape[0]
    if not isinstance(lin, nn.Linear):
        return lin(x)
    if x.is_cuda:  # (GPU batch invariance is the fused kernels' job, not padding's)
        if rows >= MIN_ROWS:
            return lin(x)
        return lin(torch.cat((x, x.new_zeros(MIN_ROWS - rows, x.shape[1]))))[:rows]
    # CPU: every GEMM has exactly MIN_ROWS rows, so no row's bits depend on how many others share the
    # pass. One shape per weight leaves MKL no size-dependent kernel choice (a 65-row pass and an 8-row
    # pass differed in the last bit on an AVX-512 Xeon, though they agreed on other machines).
    pad = -rows % MIN_ROWS
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    out = torch.cat([lin(chunk) for chunk in x.split(MIN_ROWS)])
    return out[:rows]


@torch.inference_mode()
def batched_forward(model: CompactTransformer, calls: list[Forward]) -> list[Tensor]:
    """Run every call's tokens in one pass; return each call's last ``num_logits`` logits (float32)."""
    model = eager_model(model)
    cfg = model.cfg
    spans, pos = [], 0
    for c in calls:
        t = len(c.tokens)
        end = c.start + t
        if c.start > c.cache.length:
            raise ValueError(f"position {c.start} leaves a gap after cache length {c.cache.length}")
        if end > c.cache.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache's {c.cache.max_len}")
        spans.append((pos, pos + t))
        pos += t
    if hasattr(model, "_use_invariant") and model._use_invariant(model.embed.weight):  # CUDA's default
        return _batched_invariant(model, calls, spans)
    x = model.embed(torch.cat([c.tokens for c in calls]))
    ropes, masks = [], []
    for c, (a, b) in zip(calls, spans, strict=True):
        t, end = b - a, c.start + b - a
        ropes.append((model.rope_cos[c.start : end], model.rope_sin[c.start : end]))
        masks.append(
            torch.ones(t, end, dtype=torch.bool, device=model.device).tril(diagonal=c.start)
            if t > 1 and c.start > 0
            else None
        )
    gqa = cfg.num_kv_heads != cfg.num_heads
    for li, layer in enumerate(model.layers):
        qkv = _linear(layer.qkv, layer.attn_norm(x))
        outs = []
        for c, (a, b), (cos, sin), mask in zip(calls, spans, ropes, masks, strict=True):
            t, start = b - a, c.start
            q, k, v = qkv[a:b].split(layer.splits, dim=-1)
            q = rotate(q.view(t, cfg.num_heads, cfg.head_dim).transpose(0, 1), cos, sin)
            k = rotate(k.view(t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1), cos, sin)
            v = v.view(t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
            end = start + t
            c.cache.keys[li, :, start:end] = k
            c.cache.values[li, :, start:end] = v
            keys, values = c.cache.keys[li, :, :end], c.cache.values[li, :, :end]
            if 1 < t <= layer.row_attention_max and start > 0:  # as Block.forward (int8 mode)
                attn = row_attention(q, keys, values, start, gqa)
            else:
                attn = F.scaled_dot_product_attention(
                    q.unsqueeze(0),
                    keys.unsqueeze(0),
                    values.unsqueeze(0),
                    attn_mask=mask,
                    is_causal=mask is None and t > 1,
                    enable_gqa=gqa,
                )[0]
            outs.append(attn.transpose(0, 1).reshape(t, -1))
        x = x + _linear(layer.o_proj, torch.cat(outs))
        gate, up = _linear(layer.gate_up, layer.mlp_norm(x)).chunk(2, dim=-1)
        x = x + _linear(layer.down, F.silu(gate) * up)
    for c, (a, b) in zip(calls, spans, strict=True):
        c.cache.length = c.start + b - a
    wanted = [(b - min(c.num_logits, b - a), b) for c, (a, b) in zip(calls, spans, strict=True)]
    logits = _linear(model.lm_head, model.norm(torch.cat([x[a:b] for a, b in wanted]))).float()
    out, pos = [], 0
    for a, b in wanted:
        out.append(logits[pos : pos + b - a])
        pos += b - a
    return out


def _batched_invariant(model: CompactTransformer, calls: list[Forward], spans: list[tuple[int, int]]) -> list[Tensor]:
    """``batched_forward`` in the batch-invariant CUDA kernels (engine/runtimes/gpu_kernels.py): the projections of
    every call's rows in one kernel each, attention per call over its own cache. A row's logits are the same bits as
    the model's own forward (``cuda_graphs.invariant_forward``) gives it alone, so batched equals unbatched exactly."""
    from engine.runtimes import gpu_kernels as gk
    from engine.runtimes import row_limits as rl
    from engine.runtimes.cuda_graphs import invariant_logits

    kernels = (
        model.invariant if model.invariant in gk.INVARIANT_SETS else gk.invariant_default() or gk.DEFAULT_INVARIANT
    )
    triton_gemms = kernels == "invariant"
    cfg = model.cfg
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    dev = model.embed.weight.device
    tokens = [c.tokens if isinstance(c.tokens, Tensor) else torch.tensor(c.tokens, dtype=torch.long) for c in calls]
    x = model.embed(torch.cat([t.to(dev) for t in tokens]))
    rows = x.shape[0]
    pad = 0 if triton_gemms else -rows % gk.CUBLAS_ROWS  # cuBLAS products on whole multiples of CUBLAS_ROWS rows
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    lim = None if triton_gemms else rl.limits(model, gk.CUBLAS_ROWS)  # engine/runtimes/row_limits.py
    positions = [torch.arange(c.start, c.start + b - a, device=dev) for c, (a, b) in zip(calls, spans, strict=True)]
    for li, layer in enumerate(model.layers):
        if not triton_gemms:
            qkv = rl.qkv_rows(layer, lim, x)
        outs = []
        for c, (a, b), pos in zip(calls, spans, positions, strict=True):
            keys, values = c.cache.keys[li].unsqueeze(0), c.cache.values[li].unsqueeze(0)
            if triton_gemms:  # the qkv product with its RoPE epilogue, as the graph path runs it (the same bits)
                norm = layer.attn_norm
                rope = gk.RopeStore(keys, values, model.rope_cos, model.rope_sin, pos, 1, heads, kv_heads)
                q = gk.linear(x[a:b], layer.qkv.weight, bias=layer.qkv.bias, norm=norm.weight, eps=norm.eps, rope=rope)
            else:
                q = gk.rope_store(qkv[a:b], keys, values, model.rope_cos, model.rope_sin, pos, 1, heads, kv_heads)
            outs.append(gk.attention(q, keys, values, pos, c.start + b - a, 1, kv_heads, ordered=True))
        if triton_gemms:
            x = gk.linear(torch.cat(outs), layer.o_proj.weight, residual=x)
            gate_up = gk.linear(x, layer.gate_up.weight, norm=layer.mlp_norm.weight, eps=layer.mlp_norm.eps)
            x = gk.linear(gate_up, layer.down.weight, residual=x, gated=True)
        else:
            if pad:
                outs.append(x.new_zeros(pad, outs[0].shape[1]))
            x = rl.mlp_rows(layer, lim, x, torch.cat(outs))
    for c, (a, b) in zip(calls, spans, strict=True):
        c.cache.length = c.start + b - a
    wanted = [(b - min(c.num_logits, b - a), b) for c, (a, b) in zip(calls, spans, strict=True)]
    logits = invariant_logits(model, torch.cat([x[a:b] for a, b in wanted]), kernels)
    out, pos = [], 0
    for a, b in wanted:
        out.append(logits[pos : pos + b - a])
        pos += b - a
    return out


def batched_greedy_drafts(runtime, needs: list[DraftNeed]) -> list[list[int]]:
    """``ModelDrafter.propose`` (greedy) for many sequences at once: draft token i of every sequence
    in one pass, so a round costs the longest draft's passes instead of the sum of all of them.

    Same choices as ``propose`` (argmax; after the first token, stop below the confidence gate)
    and the same cache bookkeeping (``drafter.ids`` holds what the draft cache holds).
    """
    from engine.caching.kv_store import common_prefix

    calls = []
    for need in needs:  # bring each draft cache up to its context (usually the 1-2 tokens just committed)
        d, ctx = need.drafter, need.context
        common = common_prefix(d.ids, ctx, len(ctx) - 1)  # always re-run at least the last token
        d.cache.rollback(common)
        calls.append(Forward(torch.tensor(ctx[common:], dtype=torch.long, device=runtime.device), d.cache, common, 1))
        d.ids = list(ctx)
    logits = [out[-1] for out in batched_forward(runtime, calls)] if calls else []
    tokens: list[list[int]] = [[] for _ in needs]
    live, i = list(range(len(needs))), 0
    while live:
        nxt, step = [], []
        for j in live:
            conf = torch.softmax(logits[j], -1)
            tok = int(conf.argmax())
            if i > 0 and float(conf[tok]) < needs[j].gate:
                continue
            tokens[j].append(tok)
            if i + 1 < needs[j].k:
                d = needs[j].drafter
                step.append(Forward(torch.tensor([tok], device=runtime.device), d.cache, d.cache.length, 1))
                d.ids.append(tok)
                nxt.append(j)
        if step:
            for j, out in zip(nxt, batched_forward(runtime, step), strict=True):
                logits[j] = out[-1]
        live, i = nxt, i + 1
    return tokens
