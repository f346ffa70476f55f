"""Batched rounds against each sequence alone, on CUDA: what tests/gpu/test_row_limits_gpu.py asserts and
bench/gpu_row_limits.py reports (engine/runtimes/row_limits.py keeps a batched round's rows equal to them)."""

from __future__ import annotations

import torch

from engine.runtimes.compact import CompactTransformer, KVCache
from engine.runtimes.cuda_graphs import SlotGraphs
from engine.serve.batched import Forward, batched_forward


def _copy(dst: KVCache, src: KVCache) -> None:
    dst.keys.copy_(src.keys)
    dst.values.copy_(src.values)
    dst.length = src.length


@torch.inference_mode()
def rows_differing(
    model: CompactTransformer, streams: int, block: int, max_len: int = 640, seed: int = 0
) -> dict[str, int]:
    """``streams`` sequences at random depths, ``block`` random tokens each: one slotted round (a captured graph,
    replayed twice) and the eager batched pass against each sequence's own pass, row by row, bit for bit.
    Returns the rows and the rows that differ in either, with the model's current row limits."""
    dev = model.device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    depths = [int(d) for d in torch.randint(16, max_len - 64, (streams,), generator=gen)]
    bases = []
    for d in depths:
        cache = model.new_cache(max_len)
        model(torch.randint(0, vocab, (d,), generator=gen).to(dev), cache, 0, 1)
        bases.append(cache)
    toks = [torch.randint(0, vocab, (block,), generator=gen).to(dev) for _ in depths]
    tmp = model.new_cache(max_len)
    alone = []
    for c, d, t in zip(bases, depths, toks, strict=True):
        _copy(tmp, c)
        alone.append(model(t, tmp, d, block).clone())
    slots = SlotGraphs(model, streams, max_len, attention="invariant-cublas")
    views = [slots.take(c) for c in bases]
    for _ in range(2):  # the first run captures, the second replays
        for v, d in zip(views, depths, strict=True):
            v.length = d
        got = [g.clone() for g in slots.run([(t, v, d, block) for t, v, d in zip(toks, views, depths, strict=True)])]
    del slots, views
    calls = []
    for c, d, t in zip(bases, depths, toks, strict=True):
        fresh = model.new_cache(max_len)
        _copy(fresh, c)
        calls.append(Forward(t, fresh, d, block))
    eager = batched_forward(model, calls)
    slot = sum(int((a != g).any(-1).sum()) for a, g in zip(alone, got, strict=True))
    batched = sum(int((a != e).any(-1).sum()) for a, e in zip(alone, eager, strict=True))
    return {"rows": streams * block, "slot_round": slot, "batched_pass": batched}
