"""CUDA-graph decode for the compact runtime (engine/compact.py): the same calls, replayed graphs.

On a GPU a decode step of a small model is launch-bound: hundreds of tiny kernels, each costing more
to launch from Python than to run. ``GraphRuntime`` wraps a ``CompactTransformer`` and replays a
captured graph for every pass of up to ``max(BLOCKS)`` tokens (a 1-token step, a verify block, a
draft step); longer passes (prefills) run eagerly. A graph bakes in its tensors' addresses and
shapes, so:

- the block is padded to a bucket size (1, 2, 4, 8, 16); padding rows write keys/values past the
  sequence's end, which no real query attends to and the next pass overwrites;
- the start position lives in a device tensor, written before each replay;
- attention runs over a static key length (a power-of-two bucket of the cache, 256 at least), masked
  by position, so the graph needs no new capture as the cache grows inside its bucket;
- graphs belong to one cache (its key/value tensors): they are captured on first use and kept for the
  last ``max_caches`` caches.

Rollback stays a change of ``KVCache.length``. No host sync happens inside a pass; the caller's one
read of the chosen tokens is the step's only sync. Greedy drafting (``propose_greedy``) keeps the
drafted tokens on the device until the whole draft is made: one sync per draft, not one per token.
CPU models are never wrapped (``maybe_wrap``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.compact import CompactTransformer, KVCache, rotate
from engine.kv_store import common_prefix

BLOCKS = (1, 2, 4, 8, 16)
MIN_KEYS = 256  # smallest attended key length; doubling buckets above it


def block_bucket(t: int) -> int | None:
    return next((b for b in BLOCKS if b >= t), None)


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


def static_forward(model: CompactTransformer, cache: KVCache, inp: StaticInputs, block: int, keys_len: int) -> Tensor:
    """One pass over ``block`` tokens at positions start.. with attention over ``keys_len`` keys.

    Shapes depend only on (block, keys_len); positions only on device tensors. Elementwise math is
    the eager path's (engine/compact.py Block.forward); attention is masked instead of sliced.
    Returns float32 logits for every row, shape [block, vocab].
    """
    cfg = model.cfg
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = heads // kv_heads
    positions = inp.start + inp.offsets[:block]
    cos = model.rope_cos.index_select(0, positions)
    sin = model.rope_sin.index_select(0, positions)
    # Key j is visible to the query at position p when j <= p; rows ordered (group member, query).
    visible = torch.arange(keys_len, device=positions.device)[None, :] <= positions[:, None]
    mask = visible.repeat(group, 1)
    x = model.embed(inp.tokens[:block])
    for i, layer in enumerate(model.layers):
        q, k, v = layer.qkv(layer.attn_norm(x)).split(layer.splits, dim=-1)
        q = rotate(q.view(block, heads, hd).transpose(0, 1), cos, sin)
        k = rotate(k.view(block, kv_heads, hd).transpose(0, 1), cos, sin)
        v = v.view(block, kv_heads, hd).transpose(0, 1)
        cache.keys[i].index_copy_(1, positions, k)
        cache.values[i].index_copy_(1, positions, v)
        keys, values = cache.keys[i, :, :keys_len], cache.values[i, :, :keys_len]
        # Grouped-query attention as plain attention: the query heads sharing a kv head become rows.
        qg = q.reshape(kv_heads, group * block, hd)
        attn = F.scaled_dot_product_attention(qg.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask)[
            0
        ]
        attn = attn.view(heads, block, hd)
        x = x + layer.o_proj(attn.transpose(0, 1).reshape(block, -1))
        gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
        x = x + layer.down(F.silu(gate) * up)
    return model.lm_head(model.norm(x)).float()


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


class GraphRuntime:
    """A ``CompactTransformer`` on CUDA whose short passes replay captured graphs.

    Same call interface as the model: ``runtime(tokens, cache, start, num_logits)``. Returned logits
    are a view of the graph's static output: valid until the next call on this runtime.
    """

    def __init__(self, model: CompactTransformer, max_caches: int = 4):
        self.model = model
        self.max_caches = max_caches
        # On a CPU (tests only: maybe_wrap never wraps a CPU model) the static passes run without graphs.
        self.use_graphs = model.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.inp = StaticInputs(model.device)
        # id(cache) -> (cache, {(block, keys_len): (graph, logits)}); the cache is kept alive with its graphs.
        self._graphs: OrderedDict[int, tuple[KVCache, dict]] = OrderedDict()
        self.captures = 0
        self.replays = 0

    def __getattr__(self, name: str):  # cfg, device, dtype, inv_freq, rope tables...: the model's
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return self.model.new_cache(max_len)

    def forward_at(self, tokens: Tensor, positions: list[int], cache: KVCache) -> Tensor:
        return self.model.forward_at(tokens, positions, cache)

    def parameters(self):
        return self.model.parameters()

    def _graph(self, cache: KVCache, block: int, keys_len: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        entry = self._graphs.get(id(cache))
        if entry is None or entry[0] is not cache:
            entry = (cache, {})
            self._graphs[id(cache)] = entry
            while len(self._graphs) > self.max_caches:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(id(cache))
        graphs = entry[1]
        key = (block, keys_len)
        if key not in graphs:
            graphs[key] = capture(lambda: static_forward(self.model, cache, self.inp, block, keys_len), self.pool)
            self.captures += 1
        return graphs[key]

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, cache: KVCache, start: int | None = None, num_logits: int = 1) -> Tensor:
        start = cache.length if start is None else start
        t = tokens.shape[0]
        block = block_bucket(t)
        if block is None or start > cache.length or start + block > cache.max_len:
            return self.model(tokens, cache, start, num_logits)  # prefill, or too near the cache's end
        self.inp.tokens[:t].copy_(tokens, non_blocking=True)
        self.inp.start.fill_(start)
        keys_len = key_bucket(start + block, cache.max_len)
        if self.use_graphs:
            graph, logits = self._graph(cache, block, keys_len)
            graph.replay()
            self.replays += 1
        else:
            logits = static_forward(self.model, cache, self.inp, block, keys_len)
        cache.length = start + t
        n = min(num_logits, t)
        return logits[t - n : t]

    @torch.inference_mode()
    def propose_greedy(
        self, cache: KVCache, ids: list[int], context: list[int], k: int, gate: float
    ) -> tuple[list[int], list[int]]:
        """Greedy drafting as ``ModelDrafter.propose`` does it, with one host sync for the whole draft.

        The cache holds ``ids``; the draft model is brought to ``context`` and drafts up to ``k`` tokens,
        each fed back on the device. The confidence gate is applied afterwards: tokens past the first
        one under ``gate`` are dropped, exactly the ones the eager loop would not have drafted.
        Returns (draft tokens, the ids the cache now holds).
        """
        common = common_prefix(ids, context, len(context) - 1)  # always re-run at least the last token
        cache.rollback(common)
        new = torch.tensor(context[common:], dtype=torch.long, device=self.model.device)
        logits = self(new, cache, common, 1)[-1]
        toks = torch.empty(k, dtype=torch.long, device=self.model.device)
        confs = torch.empty(k, dtype=torch.float32, device=self.model.device)
        pos = len(context)
        for i in range(k):
            conf = torch.softmax(logits, -1)
            toks[i] = conf.argmax()  # the eager loop's choice, on the device
            confs[i : i + 1] = conf.gather(0, toks[i : i + 1])
            if i + 1 < k:
                logits = self(toks[i : i + 1], cache, pos, 1)[-1]
                pos += 1
        tokens, top = toks.tolist(), confs.tolist()  # the one sync
        kept = 1 + next((i - 1 for i in range(1, k) if top[i] < gate), k - 1)
        tokens = tokens[:kept]
        held = tokens[: min(kept, k - 1)]  # the last drafted token was never run through the model
        cache.rollback(len(context) + len(held))
        return tokens, list(context) + held


def maybe_wrap(runtime, enabled: bool = True):
    """Wrap a compact runtime on CUDA in a ``GraphRuntime``; anything else is returned unchanged."""
    if not enabled or not isinstance(runtime, CompactTransformer) or runtime.device.type != "cuda":
        return runtime
    return GraphRuntime(runtime)


class BatchedCache:
    """Keys/values of ``streams`` sequences, one slot each: [layers, streams, kv_heads, max_len, head_dim].

    ``slot(i)`` is a ``KVCache`` view of one stream, so the eager path (a prefill) writes into it.
    """

    def __init__(self, model: CompactTransformer, streams: int, max_len: int):
        cfg = model.cfg
        model._ensure_rope(max_len)
        shape = (cfg.num_layers, streams, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.values = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.streams, self.max_len = streams, max_len

    def slot(self, i: int) -> KVCache:
        view = KVCache.__new__(KVCache)
        view.keys, view.values = self.keys[:, i], self.values[:, i]
        view.max_len, view.length = self.max_len, 0
        return view


@torch.inference_mode()
def batched_forward(
    model: CompactTransformer, cache: BatchedCache, tokens: Tensor, positions: Tensor, keys_len: int
) -> Tensor:
    """One token for each of the cache's streams, stream i at ``positions[i]`` (device tensors).

    Static shapes, so one graph serves every step while all positions stay under ``keys_len``.
    Returns float32 logits [streams, vocab].
    """
    cfg = model.cfg
    s, heads, kv_heads, hd = tokens.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rows = torch.arange(s, device=tokens.device)
    cos = model.rope_cos.index_select(0, positions)[:, None, :]
    sin = model.rope_sin.index_select(0, positions)[:, None, :]
    mask = (torch.arange(keys_len, device=tokens.device)[None, :] <= positions[:, None])[:, None, None, :]
    x = model.embed(tokens)
    for i, layer in enumerate(model.layers):
        q, k, v = layer.qkv(layer.attn_norm(x)).split(layer.splits, dim=-1)
        q = rotate(q.view(s, heads, hd), cos, sin)
        k = rotate(k.view(s, kv_heads, hd), cos, sin)
        cache.keys[i][rows, :, positions] = k
        cache.values[i][rows, :, positions] = v.view(s, kv_heads, hd)
        keys, values = cache.keys[i, :, :, :keys_len], cache.values[i, :, :, :keys_len]
        attn = F.scaled_dot_product_attention(q.view(s, kv_heads, heads // kv_heads, hd), keys, values, attn_mask=mask)
        x = x + layer.o_proj(attn.reshape(s, heads * hd))
        gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
        x = x + layer.down(F.silu(gate) * up)
    return model.lm_head(model.norm(x)).float()


__all__ = [
    "BLOCKS",
    "BatchedCache",
    "GraphRuntime", "StaticInputs",
    "batched_forward",
    "block_bucket",
    "capture",
    "key_bucket",
    "maybe_wrap",
    "static_forward",
]
