"""Slotted rounds for fimble serve on CUDA (engine/serve/slot_passes.py): running sequences' caches in slots of
one batched cache, and one captured graph per round for all of their short passes."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.decoding.passes import RowSpan
from engine.runtimes.compact import CompactTransformer, KVCache
from engine.runtimes.graph_forward import (
    BLOCKS,
    block_bucket,
    capture,
    default_attention,
    forward_batch,
    key_bucket,
)


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
# Rows of a round whose logits the host may read after the next round was launched (a prompt's last pass, a sampled
# or healed step): copied aside per round. At 151,936 tokens of vocabulary, 64 rows are 39 MB (twice: two turns).
SIDE_ROWS = 64


@dataclass
class LaunchedRound:
    """A round started by ``SlotGraphs.launch``: its passes (fed rows included), their slots, the graph key, which of
    the two buffer sets it uses; once replayed, the graph's logits and argmax (device) and the kept rows' copy."""

    passes: list
    slots: list[int]
    key: tuple[int, int, int]
    turn: int
    logits: Tensor | None = None
    argmax: Tensor | None = None
    kept: dict[int, int] = field(default_factory=dict)  # pass index -> its first row in ``side``
    side: Tensor | None = None
    ready_at: float = 0.0  # (a simulated device: when it is done)


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
        # Two of each (``_turn``): a fed round is launched before the one in flight is collected (engine/fed_rounds.py),
        # so a buffer is written again only once the round that used it two launches ago has been collected.
        pinned = self.use_graphs
        stage_len = streams * (max(BLOCKS) + 3) + SIDE_ROWS  # tokens, starts, fed rows' two indices, kept rows
        self._stages = [torch.zeros(stage_len, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._stage_np = [s.numpy() for s in self._stages]
        self._hosts = [torch.zeros(streams * max(BLOCKS), dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._index = torch.zeros(2 * streams + SIDE_ROWS, dtype=torch.long, device=dev)
        self._side: list[Tensor | None] = [None, None]  # kept rows (launch's ``keep``), allocated on first use
        self._turn = 0
        if self.use_graphs:
            self._began = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            self._ended = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        # Reads of a collected round's rows while the next round runs (``reading``): on the round's stream they would
        # wait for that next round (a healed first token held every fed round's launch by a whole graph on an H100).
        self.reader = torch.cuda.Stream(device=model.device) if self.use_graphs else None
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

    def prefill(self, passes: list[tuple[Tensor, KVCache, int, int]], best: list | None = None) -> list[Tensor]:
        """Eager pass of several slotted chunks (each ``fits_prefill``), padded to the longest; like ``run``."""
        return prefill_slots(self, passes, best)

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
        # Blocks stay as they are: 32 streams' 1-token steps would multiply 512 rows instead of 32. invariant_layers
        # pads to 16-row multiples and keeps each product within the row counts engine/runtimes/row_limits.py found.
        block = block_bucket(max(len(t) for t, _, _, _ in passes))
        batch = batch_bucket(max(self._slot[id(c)] for _, c, _, _ in passes) + 1, self.streams)
        keys_len = key_bucket(max(s + block for _, _, s, _ in passes), self.slot_len + SLOT_SCRATCH)
        return batch, block, keys_len

    def pass_ms(self, key: tuple[int, int, int]) -> float | None:
        """The GPU time of one replay of ``key``'s graph (the fastest seen), None before it ran."""
        return self._cost.get(key)

    @torch.inference_mode()
    def launch(
        self,
        passes: list[tuple[Tensor | list[int], KVCache, int, int]],
        feeds: list[tuple[int, int]] = (),
        after: LaunchedRound | None = None,
        keep: list[int] = (),
    ) -> LaunchedRound:
        """Start the round's graph on the GPU and return at once; ``collect`` waits for it. Tokens are
        written through pinned host buffers (asynchronous copies, no sync).

        Fed rounds (engine/fed_rounds.py) launch a round before the one in flight (``after``) is collected:
        ``feeds`` (pass index here, row of ``after``) are 1-token passes whose token is that row's argmax, copied on
        the device, so no host round trip sits between the two graphs. ``keep``: passes whose rows the host may read
        as logits (not only their argmax): copied aside once the graph has run, since the next round's replay
        overwrites the graph's output before this round is read (at most ``SIDE_ROWS`` rows)."""
        self._turn ^= 1  # staging, argmax copy, kept rows and events alternate: two rounds may be in flight
        rnd = LaunchedRound(passes, [], (0, 0, 0), self._turn)
        rnd.slots, rnd.key = self._stage_passes(passes, rnd.turn)
        kept = _stage_indices(self._stage_np[rnd.turn], rnd, feeds, keep)
        self.replay_round(rnd, len(feeds), kept, after)
        return rnd

    def replay_round(self, rnd: LaunchedRound, feeds: int, kept: int, after: LaunchedRound | None) -> None:
        """The device step of ``launch``: the staged token ids, starts and index lists to the device, ``feeds`` fed
        tokens from ``after``'s argmax, ``rnd.key``'s graph replayed (captured on its first use), every row's argmax
        into the host buffer, ``kept`` rows aside; no host sync on CUDA. Sets ``rnd.logits`` and ``rnd.argmax``."""
        batch, block, keys_len = key = rnd.key
        rows = batch * block
        stage, extra = self._stages[rnd.turn], 2 * feeds + kept
        if self.use_graphs:
            self.tokens[:rows].copy_(stage[:rows], non_blocking=True)
            self.starts[:batch].copy_(stage[rows : rows + batch], non_blocking=True)
            if extra:
                self._index[:extra].copy_(stage[rows + batch : rows + batch + extra], non_blocking=True)
            _feed(self.tokens, self._index, feeds, after)
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._graphs[key] = capture(lambda: self._forward(batch, block, keys_len), self.pool)
                self.captures += 1
            graph, (logits, argmax) = entry
            self._began[rnd.turn].record()
            graph.replay()
            self.replays += 1
            self._hosts[rnd.turn][:rows].copy_(argmax, non_blocking=True)
            _keep_aside(self._side, self._index, rnd, logits, feeds, kept)
            self._ended[rnd.turn].record()
        else:  # CPU (tests): the same forward, synchronous, timed on the wall clock
            t0 = time.perf_counter()
            self.tokens[:rows].copy_(stage[:rows])
            self.starts[:batch].copy_(stage[rows : rows + batch])
            if extra:
                self._index[:extra].copy_(stage[rows + batch : rows + batch + extra])
            _feed(self.tokens, self._index, feeds, after)
            logits, argmax = self._forward(batch, block, keys_len)
            self._hosts[rnd.turn][:rows].copy_(argmax)
            _keep_aside(self._side, self._index, rnd, logits, feeds, kept)
            ms = (time.perf_counter() - t0) * 1e3
            self._cost[key] = min(ms, self._cost.get(key, ms))
        rnd.logits, rnd.argmax = logits, argmax

    def _stage_passes(
        self, passes: list[tuple[Tensor | list[int], KVCache, int, int]], turn: int = 0
    ) -> tuple[list[int], tuple]:
        """Write the passes' token ids and starts into the host staging buffer; (their slots, the graph key)."""
        slots = [self._slot[id(c)] for _, c, _, _ in passes]
        key = batch, block, _ = self.shape(passes)
        rows = batch * block
        stage = self._stage_np[turn]
        stage[:rows] = 0
        stage[rows : rows + batch] = self.slot_len
        for slot, (t, _, start, _) in zip(slots, passes, strict=True):
            at = slot * block
            stage[at : at + len(t)] = t if isinstance(t, list) else t.tolist()
            stage[rows + slot] = start
        return slots, key

    def collect(self, rnd: LaunchedRound, best: list | None = None, lazy: bool = False, skip=()) -> list:
        """Wait for ``launch``'s graph (the round's one sync; the GIL is free meanwhile) and hand out the logits.
        ``lazy``: each pass's rows as a ``RowSpan`` (sliced when read), for a caller that mostly needs ``best``.
        ``skip``: passes whose rows nobody takes (fed rows guessed wrong): None for them, their caches untouched."""
        self.wait_round(rnd)
        return self._hand_out(rnd, best, lazy, skip)

    def wait_round(self, rnd: LaunchedRound) -> None:
        """Wait for ``replay_round``'s graph (the GIL is free meanwhile) and note its GPU time."""
        if self.use_graphs:
            self._ended[rnd.turn].synchronize()
            ms = self._began[rnd.turn].elapsed_time(self._ended[rnd.turn])
            self._cost[rnd.key] = min(ms, self._cost.get(rnd.key, ms))

    @contextlib.contextmanager
    def reading(self, rnd: LaunchedRound):
        """A context for the host's reads of ``rnd``'s rows (collected) as logits: on CUDA its device work runs on a
        side stream that waits for ``rnd`` alone, and the round's stream waits for those reads before anything it
        queues next (the next launch of ``rnd``'s turn rewrites the rows kept aside)."""
        if self.reader is None:
            yield
            return
        main = torch.cuda.current_stream(self.reader.device)
        self.reader.wait_event(self._ended[rnd.turn])
        try:
            with torch.cuda.stream(self.reader):
                yield
        finally:
            main.wait_stream(self.reader)

    def _hand_out(self, rnd: LaunchedRound, best: list | None, lazy: bool, skip=()) -> list:
        return _rows_of(self, rnd, best, lazy, skip)  # (a method: bench/serve_timers.py times it)

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


@torch.inference_mode()
def prefill_slots(
    graphs: SlotGraphs, passes: list[tuple[Tensor, KVCache, int, int]], best: list | None = None
) -> list[Tensor]:
    """``SlotGraphs.prefill``: one eager ``forward_batch`` over the slot range for several slotted chunks."""
    slots = [graphs._slot[id(c)] for _, c, _, _ in passes]
    lens = [len(t) for t, _, _, _ in passes]
    block = -(-max(lens) // 16) * 16
    batch = batch_bucket(max(slots) + 1, graphs.streams)
    keys_len = key_bucket(max(s + block for _, _, s, _ in passes), graphs.slot_len + SLOT_SCRATCH)
    dev = graphs.tokens.device
    tokens = torch.zeros(batch, block, dtype=torch.long)
    starts = [graphs.slot_len] * batch
    last = [0] * batch
    for slot, n, (t, _, start, _) in zip(slots, lens, passes, strict=True):
        tokens[slot, :n] = torch.as_tensor(t) if isinstance(t, list) else t.cpu()
        starts[slot], last[slot] = start, n - 1
    logits = forward_batch(
        graphs.model,
        graphs.cache.keys[:, :batch],
        graphs.cache.values[:, :batch],
        tokens.to(dev),
        torch.tensor(starts, dtype=torch.long).to(dev),
        keys_len,
        last=torch.tensor(last, dtype=torch.long).to(dev),
        attention=graphs.attention,
    )
    host = logits.argmax(-1).tolist() if best is not None else None
    out = []
    for slot, n, (_, cache, start, _) in zip(slots, lens, passes, strict=True):
        cache.length = start + n
        out.append(logits[slot : slot + 1])
        if host is not None:
            best.append(host[slot : slot + 1])
    return out


def _rows_of(graphs: SlotGraphs, rnd: LaunchedRound, best: list | None, lazy: bool, skip=()) -> list:
    """Each pass's rows of a finished round (and their argmax into ``best``); the caches' lengths move on."""
    block = rnd.key[1]
    host = graphs._hosts[rnd.turn][: rnd.key[0] * block].tolist() if best is not None else None
    out = []
    for i, (slot, (t, cache, start, num_logits)) in enumerate(zip(rnd.slots, rnd.passes, strict=True)):
        if i in skip:
            out.append(None)
            if host is not None:
                best.append(None)
            continue
        n = len(t)
        cache.length = start + n
        k = min(num_logits, n)
        lo, hi = slot * block + n - k, slot * block + n
        aside = rnd.kept.get(i)
        if aside is not None:  # copied aside: the graph's output may hold a later round's rows by now
            out.append(RowSpan(rnd.side, aside, aside + k) if lazy else rnd.side[aside : aside + k])
        else:
            out.append(RowSpan(rnd.logits, lo, hi) if lazy else rnd.logits[lo:hi])
        if host is not None:
            best.append(host[lo:hi])
    return out


def _feed(tokens: Tensor, index: Tensor, feeds: int, after: LaunchedRound | None) -> None:
    """Fed rows' tokens: the argmax of their sources in the round before (queued behind it on the stream)."""
    if feeds:
        tokens.index_copy_(0, index[:feeds], after.argmax.index_select(0, index[feeds : 2 * feeds]))


def _keep_aside(
    sides: list[Tensor | None], index: Tensor, rnd: LaunchedRound, logits: Tensor, feeds: int, kept: int
) -> None:
    """Copy the round's kept rows (their indices after the fed rows') into its turn's side buffer."""
    if kept:
        side = sides[rnd.turn]
        if side is None or side.dtype != logits.dtype or side.shape[1] != logits.shape[1]:
            side = sides[rnd.turn] = logits.new_empty((SIDE_ROWS, logits.shape[1]))
        torch.index_select(logits, 0, index[2 * feeds : 2 * feeds + kept], out=side[:kept])
        rnd.side = side


def _stage_indices(stage, rnd: LaunchedRound, feeds: list[tuple[int, int]], keep: list[int]) -> int:
    """Stage the device's index lists after the round's starts: fed rows' destinations and sources, then the kept
    rows (noted in ``rnd.kept``); the number of kept rows."""
    passes, block = rnd.passes, rnd.key[1]
    kept = 0
    for i in keep:
        rnd.kept[i] = kept
        kept += min(passes[i][3], len(passes[i][0]))
    if kept > SIDE_ROWS:
        raise ValueError(f"{kept} rows to keep aside, at most {SIDE_ROWS}")
    at = rnd.key[0] * block + rnd.key[0]
    for i, src in feeds:
        stage[at] = rnd.slots[i] * block
        stage[at + len(feeds)] = src
        at += 1
    at += len(feeds)
    for i in keep:
        n = len(passes[i][0])
        k = min(passes[i][3], n)
        lo = rnd.slots[i] * block + n - k
        stage[at : at + k] = range(lo, lo + k)
        at += k
    return kept
