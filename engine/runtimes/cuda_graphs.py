"""CUDA-graph decode for the compact runtime (engine/runtimes/compact.py): the same calls, replayed graphs.

On a GPU a decode step of a small model is launch-bound: hundreds of tiny kernels, each costing more
to launch from Python than to run. ``GraphRuntime`` wraps a ``CompactTransformer`` and replays a
captured graph for every pass of up to ``max(BLOCKS)`` tokens (a 1-token step, a verify block, a
draft step); longer passes (prefills) run eagerly. A graph bakes in its tensors' addresses and
shapes, so:

- the block is padded to a bucket size (1, 2, 4, 8, 16; always 16 with the default "invariant-cublas" kernels, so
  every pass meets one cuBLAS shape: batch invariance, gpu_kernels.py); padding rows write keys/values past the
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

import torch
from torch import Tensor

from engine.caching.kv_store import common_prefix
from engine.decoding.passes import RowSpan, rows_tensor
from engine.runtimes.compact import CompactTransformer, KVCache
from engine.runtimes.graph_forward import (  # the forward passes the graphs capture
    BLOCKS,
    INVARIANT_CHUNK,
    MIN_KEYS,
    StaticInputs,
    _forward_fused,
    _forward_invariant,
    _min_block,
    _rope_tables,
    block_bucket,
    capture,
    default_attention,
    forward_batch,
    invariant_forward,
    invariant_layers,
    invariant_logits,
    key_bucket,
    static_forward,
)


class GraphRuntime:
    """A ``CompactTransformer`` on CUDA whose short passes replay captured graphs.

    Same call interface as the model: ``runtime(tokens, cache, start, num_logits)``. Returned logits
    are a view of the graph's static output: valid until the next call on this runtime.
    """

    # capabilities (engine/runtimes/protocol.py); the model's inv_freq and forward_at are reached through it
    numpy_rows = False
    greedy_drafts = True
    cost_aware_drafting = False
    shift_reuse = True

    def __init__(
        self, model: CompactTransformer, max_caches: int = 4, attention: str | None = None, compile: bool = False
    ):
        self.model = model
        # "invariant-cublas", "invariant", "fused", "sdpa" or "matmul" (forward_batch)
        self.attention = attention or default_attention()
        # torch.compile fuses the elementwise work between the matmuls (one compile per captured shape:
        # minutes, so opt-in; bench/gpu.py --compile measures it).
        self.fn = torch.compile(forward_batch, dynamic=False) if compile else forward_batch
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

    def _block(self, t: int) -> int | None:
        return _min_block(block_bucket(t), self.attention)

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
            graphs[key] = capture(
                lambda: static_forward(self.model, cache, self.inp, block, keys_len, self.attention, self.fn), self.pool
            )
            self.captures += 1
        return graphs[key]

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, cache: KVCache, start: int | None = None, num_logits: int = 1) -> Tensor:
        start = cache.length if start is None else start
        t = tokens.shape[0]
        block = self._block(t)
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
            logits = static_forward(self.model, cache, self.inp, block, keys_len, self.attention, self.fn)
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


def eager_runtime(runtime):
    """The model under a ``GraphRuntime`` (engine/loader.py wraps compact models on CUDA), else ``runtime``."""
    return runtime.model if isinstance(runtime, GraphRuntime) else runtime


def maybe_wrap(runtime, enabled: bool = True):
    """Wrap a compact runtime on CUDA in a ``GraphRuntime``; anything else is returned unchanged."""
    if not enabled or not isinstance(runtime, CompactTransformer) or runtime.device.type != "cuda":
        return runtime
    return GraphRuntime(runtime)


# fimble serve's slotted rounds (engine/runtimes/slot_graphs.py), named here too: callers import them from here
from engine.runtimes.slot_graphs import SLOT_SCRATCH, BatchedCache, SlotGraphs, batch_bucket, batched_forward  # noqa: E402

__all__ = [
    "BLOCKS",
    "INVARIANT_CHUNK",
    "MIN_KEYS",
    "RowSpan",
    "rows_tensor",
    "BatchedCache",
    "GraphRuntime",
    "SLOT_SCRATCH",
    "SlotGraphs",
    "batch_bucket",
    "StaticInputs",
    "batched_forward",
    "forward_batch",
    "block_bucket",
    "default_attention",
    "invariant_forward",
    "invariant_layers",
    "invariant_logits",
    "eager_runtime",
    "capture",
    "key_bucket",
    "maybe_wrap",
    "static_forward",
    "_forward_fused",
    "_forward_invariant",
    "_min_block",
    "_rope_tables",
]
