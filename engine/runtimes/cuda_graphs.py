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

import time
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.caching.kv_store import common_prefix
from engine.decoding.passes import RowSpan, rows_tensor
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
    tokens meets one cuBLAS shape per weight, so it is invariant by construction too, while a batched round's rows
    are the same bits only where cuBLAS keeps its kernel at the round's row count (tests/gpu checks both)."""
    from engine.runtimes import gpu_kernels as gk

    cfg = model.cfg
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    triton_gemms = kernels == "invariant"
    if not triton_gemms:
        rows = x.shape[0]
        pad = -rows % gk.CUBLAS_ROWS
        if pad:  # every product on a multiple of CUBLAS_ROWS rows; the padding rows' keys/values are never written
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    scratch = None
    for i, layer in enumerate(model.layers):
        if triton_gemms:
            norm = layer.attn_norm
            qkv = gk.linear(x, layer.qkv.weight, bias=layer.qkv.bias, norm=norm.weight, eps=norm.eps)
        else:
            qkv = layer.qkv(layer.attn_norm(x))
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
            x = torch.addmm(x, attn, layer.o_proj.weight.t())
            gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
            x = torch.addmm(x, F.silu(gate) * up, layer.down.weight.t())
    return x[:rows] if not triton_gemms and pad else x


def invariant_logits(model: CompactTransformer, x: Tensor, kernels: str = "invariant") -> Tensor:
    """The final norm and the LM head: with Triton projections one kernel, float32 logits straight from its
    accumulators; with cuBLAS ones torch's norm and product, then float32."""
    from engine.runtimes import gpu_kernels as gk

    if kernels != "invariant":
        rows = x.shape[0]
        pad = -rows % gk.CUBLAS_ROWS
        if pad:
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
        return model.lm_head(model.norm(x))[:rows].float()
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

    kernels = model.invariant if model.invariant in gk.INVARIANT_SETS else gk.DEFAULT_INVARIANT
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
    """The graph path's kernels where Triton runs on CUDA: batch-invariant, "invariant-cublas" by default (cuBLAS on
    fixed 16-row passes) or "invariant" (FIMBLE_CUDA_INVARIANT=triton: Triton projections); FIMBLE_CUDA_INVARIANT=0:
    "fused" (Triton attention, cuBLAS at the pass's own row count). Elsewhere torch's sdpa."""
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


class GraphRuntime:
    """A ``CompactTransformer`` on CUDA whose short passes replay captured graphs.

    Same call interface as the model: ``runtime(tokens, cache, start, num_logits)``. Returned logits
    are a view of the graph's static output: valid until the next call on this runtime.
    """

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
    model: CompactTransformer,
    cache: BatchedCache,
    tokens: Tensor,
    positions: Tensor,
    keys_len: int,
    last: Tensor | None = None,
    attention: str = "sdpa",
) -> Tensor:
    """Every stream of ``cache`` at once: ``tokens`` [S] (one each) or [S, T]; stream i starts at positions[i]."""
    tokens = tokens if tokens.dim() == 2 else tokens[:, None]
    return forward_batch(model, cache.keys, cache.values, tokens, positions, keys_len, last, attention)


SLOT_SCRATCH = 128  # positions past each slot's end that padding rows may write (the longest slotted pass)


def batch_bucket(n: int, streams: int) -> int:
    """Graph batch size for the ``n`` lowest slots: a power of two, at most ``streams``."""
    b = 1
    while b < n:
        b *= 2
    return min(b, streams)


class SlotGraphs:
    """Served sequences' caches as slots of one ``BatchedCache``; a round of short passes replays one graph.

    ``fimble serve`` (engine/serve/scheduler.py) hands each running sequence a slot: ``take`` copies the
    valid part of its document's cache into the slot and returns a ``KVCache`` view of it (same
    ``max_len``), which the sequence then uses for everything (prefill chunks run eagerly into the view);
    ``give`` copies the slot back into the document's own cache and frees the slot (on finish, cancel or
    error). Rollback stays a change of the view's ``length``.

    ``run`` takes one pass of up to ``max(BLOCKS)`` tokens from each of several slotted sequences and
    replays the graph captured for (batch, block, key length): batch = the lowest ``2^k`` slots covering
    every caller (slots are handed out lowest first), block = the longest pass's bucket, key length = a
    bucket of the furthest position. Slots in the batch that have no pass this round (free ones, or
    sequences prefilling eagerly) get start = ``slot_len``: their padding rows write into a scratch tail of
    ``SLOT_SCRATCH`` positions past every view's end, so they never touch valid keys/values. A caller's own
    padding rows land past its end, as in ``GraphRuntime``. The graphs read token ids and starts from static
    buffers written before each replay. ``run`` is ``launch`` (the replay is started, no host sync) then
    ``collect`` (the round's one sync: every row's argmax, read back at once), so a caller can work between them.

    ``prefill`` runs longer chunks (up to ``SLOT_SCRATCH`` tokens, last logits only) of several slotted
    sequences in one eager ``forward_batch`` over the same slot range, padded to the longest chunk: one
    launch sequence for all of them instead of attention, RoPE and cache writes per sequence.

    Returned logits are views of the graph's static output: valid until the next ``run``.
    On a CPU (tests) the same forward runs without graphs.

    ``device=False`` builds the host side alone (slots, staging, hand-out; no slot cache, no graphs): a slot view
    then shares its document's cache, and a subclass supplies the device step (``replay_round``, ``wait_round``),
    as bench/serve_host.py's simulated GPU does.
    """

    def __init__(
        self, model: CompactTransformer, streams: int, slot_len: int, attention: str | None = None, device: bool = True
    ):
        import heapq

        self._heap = heapq
        self.model = model
        self.streams, self.slot_len = streams, slot_len
        self.cache = BatchedCache(model, streams, slot_len + SLOT_SCRATCH) if device else None
        self.attention = attention or default_attention()  # the GraphRuntime's kernels (the scheduler passes them)
        self.use_graphs = device and model.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        dev = model.device
        self.tokens = torch.zeros(streams * max(BLOCKS), dtype=torch.long, device=dev)
        self.starts = torch.full((streams,), slot_len, dtype=torch.long, device=dev)
        # Host side of a round: token ids and starts staged in pinned memory (copied without a sync), and every
        # row's argmax copied back into pinned memory by the round's stream; GPU time per graph from events.
        pinned = self.use_graphs
        self._stage = torch.zeros(streams * (max(BLOCKS) + 1), dtype=torch.long, pin_memory=pinned)
        self._stage_np = self._stage.numpy()
        self.argmax_host = torch.zeros(streams * max(BLOCKS), dtype=torch.long, pin_memory=pinned)
        if self.use_graphs:
            self._began = torch.cuda.Event(enable_timing=True)
            self._ended = torch.cuda.Event(enable_timing=True)
        self._cost: dict[tuple[int, int, int], float] = {}  # graph key -> fastest replay seen, ms of GPU time
        self._free = list(range(streams))  # a heap: the lowest free slot first
        self._slot: dict[int, int] = {}  # id(view) -> slot
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph | None, Tensor | None]] = {}
        self.captures = 0
        self.replays = 0

    # -- slots ----------------------------------------------------------------------------
    def holds(self, cache: object) -> bool:
        return id(cache) in self._slot

    def in_use(self) -> int:
        return len(self._slot)

    @torch.inference_mode()
    def take(self, cache: KVCache) -> KVCache | None:
        """A slot view holding ``cache``'s valid positions, or None (no free slot, or ``cache`` is too long)."""
        if not self._free or cache.max_len > self.slot_len or not isinstance(cache, KVCache):
            return None
        view = KVCache.__new__(KVCache)
        view.max_len, view.length = cache.max_len, cache.length
        if self.cache is None:  # the host side alone: the view is the document's own cache
            view.keys, view.values = cache.keys, cache.values
            self._slot[id(view)] = self._heap.heappop(self._free)
            return view
        if cache.keys.dtype != self.cache.keys.dtype or cache.keys.device != self.cache.keys.device:
            return None
        slot = self._heap.heappop(self._free)
        view.keys = self.cache.keys[:, slot, :, : cache.max_len]
        view.values = self.cache.values[:, slot, :, : cache.max_len]
        n = cache.length
        if n:
            view.keys[:, :, :n].copy_(cache.keys[:, :, :n])
            view.values[:, :, :n].copy_(cache.values[:, :, :n])
        self._slot[id(view)] = slot
        return view

    @torch.inference_mode()
    def give(self, view: KVCache, into: KVCache) -> None:
        """Copy the slot's valid positions back into ``into`` (its own cache) and free the slot."""
        slot = self._slot.pop(id(view))
        n = min(view.length, into.max_len)
        if n and self.cache is not None:  # (the host side alone: the view was ``into`` itself)
            into.keys[:, :, :n].copy_(view.keys[:, :, :n])
            into.values[:, :, :n].copy_(view.values[:, :, :n])
        into.length = n
        self._heap.heappush(self._free, slot)

    def fits(self, tokens: int, cache: object, start: int) -> bool:
        """Whether a pass of ``tokens`` at ``start`` into ``cache`` can run in a slot graph."""
        return (
            id(cache) in self._slot
            and 0 < tokens <= max(BLOCKS)
            and start <= cache.length
            and start + tokens <= cache.max_len
        )

    def fits_prefill(self, tokens: int, cache: object, start: int, num_logits: int) -> bool:
        """Whether a chunk of ``tokens`` at ``start`` (last logits only) can run in ``prefill``."""
        return (
            id(cache) in self._slot
            and 0 < tokens <= SLOT_SCRATCH
            and num_logits == 1
            and start <= cache.length
            and start + tokens <= cache.max_len
        )

    @torch.inference_mode()
    def prefill(self, passes: list[tuple[Tensor, KVCache, int, int]], best: list | None = None) -> list[Tensor]:
        """Eager pass of several slotted chunks (each ``fits_prefill``), padded to the longest; like ``run``."""
        slots = [self._slot[id(c)] for _, c, _, _ in passes]
        lens = [len(t) for t, _, _, _ in passes]
        block = -(-max(lens) // 16) * 16
        batch = batch_bucket(max(slots) + 1, self.streams)
        keys_len = key_bucket(max(s + block for _, _, s, _ in passes), self.slot_len + SLOT_SCRATCH)
        dev = self.tokens.device
        tokens = torch.zeros(batch, block, dtype=torch.long)
        starts = [self.slot_len] * batch
        last = [0] * batch
        for slot, n, (t, _, start, _) in zip(slots, lens, passes, strict=True):
            tokens[slot, :n] = torch.as_tensor(t) if isinstance(t, list) else t.cpu()
            starts[slot], last[slot] = start, n - 1
        logits = forward_batch(
            self.model,
            self.cache.keys[:, :batch],
            self.cache.values[:, :batch],
            tokens.to(dev),
            torch.tensor(starts, dtype=torch.long).to(dev),
            keys_len,
            last=torch.tensor(last, dtype=torch.long).to(dev),
            attention=self.attention,
        )
        host = logits.argmax(-1).tolist() if best is not None else None
        out = []
        for slot, n, (_, cache, start, _) in zip(slots, lens, passes, strict=True):
            cache.length = start + n
            out.append(logits[slot : slot + 1])
            if host is not None:
                best.append(host[slot : slot + 1])
        return out

    # -- passes ---------------------------------------------------------------------------
    def _forward(self, batch: int, block: int, keys_len: int) -> tuple[Tensor, Tensor]:
        logits = forward_batch(
            self.model,
            self.cache.keys[:, :batch],
            self.cache.values[:, :batch],
            self.tokens[: batch * block].view(batch, block),
            self.starts[:batch],
            keys_len,
            attention=self.attention,
        )
        return logits, logits.argmax(-1)  # every row's greedy choice, read back in one copy (``run``)

    @torch.inference_mode()
    def run(self, passes: list[tuple[Tensor | list[int], KVCache, int, int]], best: list | None = None) -> list[Tensor]:
        """``passes``: (tokens, slotted cache, start, num_logits) each, every one ``fits``. Returns each
        pass's last ``num_logits`` float32 logits, as ``runtime(tokens, cache, start, num_logits)`` would.

        ``best``: a list to receive each pass's argmax per returned row (host ints, one device-to-host copy
        for the whole round instead of one argmax and sync per sequence). ``launch`` + ``collect``."""
        return self.collect(self.launch(passes), best)

    def shape(self, passes: list[tuple[Tensor | list[int], KVCache, int, int]]) -> tuple[int, int, int]:
        """The graph key (batch, block, key length) these passes would replay."""
        # Blocks stay as they are: with cuBLAS projections a round's rows match the same rows alone only where cuBLAS
        # keeps its kernel at the round's row count (padding each slot to 16 rows would not change that), and 32
        # streams' 1-token steps would multiply 512 rows instead of 32. invariant_layers pads to 16-row multiples.
        block = block_bucket(max(len(t) for t, _, _, _ in passes))
        batch = batch_bucket(max(self._slot[id(c)] for _, c, _, _ in passes) + 1, self.streams)
        keys_len = key_bucket(max(s + block for _, _, s, _ in passes), self.slot_len + SLOT_SCRATCH)
        return batch, block, keys_len

    def pass_ms(self, key: tuple[int, int, int]) -> float | None:
        """The GPU time of one replay of ``key``'s graph (the fastest seen), None before it ran."""
        return self._cost.get(key)

    @torch.inference_mode()
    def launch(self, passes: list[tuple[Tensor | list[int], KVCache, int, int]]) -> tuple:
        """Start the round's graph on the GPU and return at once; ``collect`` waits for it. Tokens are
        written through pinned host buffers (two asynchronous copies, no sync)."""
        slots, key = self._stage_passes(passes)
        return passes, slots, key, self.replay_round(key)

    def replay_round(self, key: tuple[int, int, int]) -> Tensor:
        """The device step of ``launch``: the staged token ids and starts to the device, ``key``'s graph replayed
        (captured on its first use), every row's argmax into ``argmax_host``; no host sync on CUDA. Returns the
        graph's static logits."""
        batch, block, keys_len = key
        rows = batch * block
        if self.use_graphs:
            self.tokens[:rows].copy_(self._stage[:rows], non_blocking=True)
            self.starts[:batch].copy_(self._stage[rows : rows + batch], non_blocking=True)
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._graphs[key] = capture(lambda: self._forward(batch, block, keys_len), self.pool)
                self.captures += 1
            graph, (logits, argmax) = entry
            self._began.record()
            graph.replay()
            self.replays += 1
            self.argmax_host[:rows].copy_(argmax, non_blocking=True)
            self._ended.record()
        else:  # CPU (tests): the same forward, synchronous, timed on the wall clock
            t0 = time.perf_counter()
            self.tokens[:rows].copy_(self._stage[:rows])
            self.starts[:batch].copy_(self._stage[rows : rows + batch])
            logits, argmax = self._forward(batch, block, keys_len)
            self.argmax_host[:rows].copy_(argmax)
            ms = (time.perf_counter() - t0) * 1e3
            self._cost[key] = min(ms, self._cost.get(key, ms))
        return logits

    def _stage_passes(self, passes: list[tuple[Tensor | list[int], KVCache, int, int]]) -> tuple[list[int], tuple]:
        """Write the passes' token ids and starts into the host staging buffer; (their slots, the graph key)."""
        slots = [self._slot[id(c)] for _, c, _, _ in passes]
        key = batch, block, _ = self.shape(passes)
        rows = batch * block
        stage = self._stage_np
        stage[:rows] = 0
        stage[rows : rows + batch] = self.slot_len
        for slot, (t, _, start, _) in zip(slots, passes, strict=True):
            at = slot * block
            stage[at : at + len(t)] = t if isinstance(t, list) else t.tolist()
            stage[rows + slot] = start
        return slots, key

    def collect(self, launched: tuple, best: list | None = None, lazy: bool = False) -> list:
        """Wait for ``launch``'s graph (the round's one sync; the GIL is free meanwhile) and hand out the logits.
        ``lazy``: each pass's rows as a ``RowSpan`` (sliced when read), for a caller that mostly needs ``best``."""
        passes, slots, key, logits = launched
        self.wait_round(key)
        return self._hand_out(passes, slots, key, logits, best, lazy)

    def wait_round(self, key: tuple[int, int, int]) -> None:
        """Wait for ``replay_round``'s graph (the GIL is free meanwhile) and note its GPU time."""
        if self.use_graphs:
            self._ended.synchronize()
            ms = self._began.elapsed_time(self._ended)
            self._cost[key] = min(ms, self._cost.get(key, ms))

    def _hand_out(
        self, passes: list, slots: list[int], key: tuple, logits: Tensor, best: list | None, lazy: bool
    ) -> list:
        """Each pass's rows of a finished round (and their argmax into ``best``); the caches' lengths move on."""
        block = key[1]
        host = self.argmax_host[: key[0] * block].tolist() if best is not None else None
        out = []
        for slot, (t, cache, start, num_logits) in zip(slots, passes, strict=True):
            n = len(t)
            cache.length = start + n
            k = min(num_logits, n)
            lo, hi = slot * block + n - k, slot * block + n
            out.append(RowSpan(logits, lo, hi) if lazy else logits[lo:hi])
            if host is not None:
                best.append(host[slot * block + n - k : slot * block + n])
        return out

    def warm(self, batches: tuple[int, ...], blocks: tuple[int, ...], keys: tuple[int, ...]) -> None:
        """Capture graphs ahead of traffic (each capture runs the forward once on scratch positions)."""
        if not self.use_graphs:
            return
        with torch.inference_mode():
            self.starts.fill_(self.slot_len)
            for b in batches:
                for t in blocks:
                    for k in keys:
                        key = (min(b, self.streams), t, min(k, self.slot_len + SLOT_SCRATCH))
                        if key not in self._graphs:
                            self._graphs[key] = capture(lambda key=key: self._forward(*key), self.pool)
                            self.captures += 1


__all__ = [
    "BLOCKS",
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
]
