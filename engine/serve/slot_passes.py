"""fimble serve's slotted rounds on CUDA: every running sequence's target cache in a slot of one batched cache,
and a round's short passes in one captured graph (engine/runtimes/cuda_graphs.py ``SlotGraphs``).

A running sequence's target cache is copied into a slot when it starts and back into its document's cache when
it ends (finish, cancel, error). Every round replays one captured batched graph for all passes of up to 16
tokens (steps, verify blocks, short prefill chunks), with one host copy of every row's argmax; longer prefill
chunks of slotted sequences run in one eager pass over the slot range. Without a slot (no free one, a document
longer than a slot) a sequence runs as ``PassRunner`` runs it.
"""

from __future__ import annotations

import contextlib
import time

from engine import env_settings
from engine.decoding.passes import FedPass, Forward
from engine.decoding.spec_policy import MIN_GAIN
from engine.runner import PassRunner
from engine.runtimes.cuda_graphs import BLOCKS, SLOT_SCRATCH, batch_bucket, block_bucket, key_bucket
from engine.runtimes.slot_graphs import SIDE_ROWS

HOST_MS_WEIGHT = 0.1  # the running mean's step: about the last ten rounds


def graph_attention(runtime) -> str:
    """The GraphRuntime's graph kernels ("invariant-cublas", "invariant", "fused", "sdpa" or "matmul"), for the
    slot graphs too."""
    attention = getattr(runtime, "attention", None)
    return attention if attention in ("invariant", "invariant-cublas", "fused", "sdpa", "matmul") else "sdpa"


class SlottedPasses(PassRunner):
    can_feed = True  # rounds launched ahead, fed on the device (engine/fed_rounds.py)

    def __init__(self, target_runtime, draft_runtime, counters, max_active: int, slot_len: int):
        super().__init__(target_runtime, draft_runtime, counters, batched=True)
        from engine.runtimes.cuda_graphs import SlotGraphs, eager_runtime

        self.slots = SlotGraphs(eager_runtime(target_runtime), max_active, slot_len, graph_attention(target_runtime))
        self.max_active = max_active
        self._tail_rows = env_settings.read("FIMBLE_SERVE_TAIL_ROWS")
        self._host_ms = 0.0  # running mean of a graph round's wall time beyond its graph's GPU time
        self._last_round = None  # the last graph launched, and each of its passes' last row (fed rounds read them)
        self._last_rows: dict[int, int] = {}
        self.ahead_ok = True  # whether the last launch kept aside every row the host may read (launch)
        self._last_gpu_ms: float | None = None

    def warm(self, announce=None) -> int:
        """Capture the slotted rounds' graphs before traffic (CUDA only; else nothing to do): every batch bucket up
        to ``max_active``, block and key length up to 2,048 (longer caches capture on first use). On a GPU this
        takes seconds (Triton compiles its kernels once, then ~140 captures), which a first keystroke would
        otherwise wait for. Returns the number captured."""
        slots = self.slots
        if not slots.use_graphs:
            return 0
        batches = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= batch_bucket(self.max_active, slots.streams))
        keys = tuple(k for k in (256, 512, 1024, 2048) if k <= slots.slot_len)
        if announce is not None:
            announce(f"fimble: capturing {len(batches) * len(BLOCKS) * len(keys)} CUDA graphs for batched rounds...")
        t0 = time.perf_counter()
        before = slots.captures
        slots.warm(batches, BLOCKS, keys)
        if announce is not None:
            announce(f"fimble: {slots.captures - before} graphs captured in {time.perf_counter() - t0:.1f} s")
        return slots.captures - before

    def take_slot(self, doc) -> object | None:
        own = doc.target
        view = self.slots.take(own)
        if view is None:
            return None
        doc.target = view
        return own

    def give_slot(self, doc, own) -> None:
        if own is not None and self.slots.holds(doc.target):
            self.slots.give(doc.target, own)
            doc.target = own

    def fits_heal_draft(self, rows: int) -> bool:
        return rows <= max(BLOCKS)

    def tail_rows(self) -> int:
        return self._tail_rows

    def launch(self, calls: list[Forward], fed: list[FedPass] = (), keep_rows: bool = False) -> tuple:
        """Slotted passes of up to 16 tokens in one graph replay, started and not waited for; slotted prefill
        chunks in one eager slot pass (``SlotGraphs.prefill``) and the others (sequences without a slot) as
        ``PassRunner.run``, run here. The graph's logits are views of its output, read by the scheduler before the
        next round replays anything, unless ``keep_rows``: then the rows the host may read as logits are copied aside
        (a fed round is launched before this one is read; engine/fed_rounds.py). ``fed``: 1-token passes fed from
        the round launched just before this one (each ``FedPass.source`` was in it)."""
        slots = self.slots
        fast = [i for i, c in enumerate(calls) if slots.fits(len(c.tokens), c.cache, c.start)]
        in_graph = set(fast)
        out: list = [None] * len(calls)
        graph = None
        if fast or fed:
            passes = [(calls[i].tokens, calls[i].cache, calls[i].start, calls[i].num_logits) for i in fast]
            passes += [([0], f.cache, f.start, 1) for f in fed]
            rows = self._last_rows if fed else {}
            feeds = [(len(fast) + j, rows[id(f.source)]) for j, f in enumerate(fed)]
            keep, kept = [], 0
            for j, i in enumerate(fast) if keep_rows else ():
                c = calls[i]
                if c.reads_logits:
                    kept += min(c.num_logits, len(c.tokens))
                    keep.append(j)
            self.ahead_ok = kept <= SIDE_ROWS  # more than the side buffer holds: read it before the next launch
            graph = slots.launch(passes, feeds, self._last_round if fed else None, keep if self.ahead_ok else ())
            self._last_round = graph
            batch, block, keys = graph.key  # (means over rounds: bench/serve_load.py)
            self.counts.add("sched_graph_batch", batch)
            self.counts.add("sched_graph_block", block)
            self.counts.add("sched_graph_keys", keys)
            objs = [calls[i] for i in fast] + list(fed)
            self._last_rows = {
                id(o): slot * block + len(p[0]) - 1 for o, slot, p in zip(objs, graph.slots, passes, strict=True)
            }
            self.counts.add("sched_passes")
            self.counts.add("sched_graph_rounds")
        chunks = [
            i
            for i, c in enumerate(calls)
            if i not in in_graph and slots.fits_prefill(len(c.tokens), c.cache, c.start, c.num_logits)
        ]
        if chunks:  # longer prefill chunks of slotted sequences: one eager pass over the slot range
            best: list[list[int]] = []
            got = slots.prefill([(calls[i].tokens, calls[i].cache, calls[i].start, 1) for i in chunks], best)
            for i, logits, row_best in zip(chunks, got, best, strict=True):
                out[i] = logits
                calls[i].best = row_best
            self.counts.add("sched_passes")
        rest = [i for i in range(len(calls)) if out[i] is None and i not in in_graph]
        if rest:
            for i, logits in zip(rest, self.run([calls[i] for i in rest]), strict=True):
                out[i] = logits
        return calls, fast, graph, out, list(fed)

    def collect(self, launched: tuple) -> list:
        """Each call's logits (in order); each fed pass's best and logits onto the pass (none for dropped ones)."""
        calls, fast, graph, out, fed = launched
        if graph is not None:
            best: list[list[int]] = []
            skip = {len(fast) + j for j, f in enumerate(fed) if f.dropped}
            got = self.slots.collect(graph, best, lazy=True, skip=skip)  # rows sliced only where read (RowSpan)
            n = len(fast)
            for i, logits, row_best in zip(fast, got[:n], best[:n], strict=True):
                out[i] = logits
                calls[i].best = row_best
            for f, logits, row_best in zip(fed, got[len(fast) :], best[len(fast) :], strict=True):
                f.best, f.logits = row_best, logits
            gpu = self.slots.pass_ms(graph.key)
            if gpu is not None:
                self.counts.add("sched_gpu_ms", gpu)
                self._last_gpu_ms = gpu
        return out

    def reading(self, launched: tuple):
        """The host's reads of a collected round's kept rows (a healed or sampled choice) go to a side stream on CUDA,
        so they do not queue behind the round launched after it (SlotGraphs.reading)."""
        graph = launched[2]
        return self.slots.reading(graph) if graph is not None else contextlib.nullcontext()

    def round_done(self, round_ms: float) -> None:
        gpu_ms, self._last_gpu_ms = self._last_gpu_ms, None
        if gpu_ms is not None:  # the host's share of a graph round, for the block choice (shorten)
            self._host_ms += HOST_MS_WEIGHT * (max(0.0, round_ms - gpu_ms) - self._host_ms)

    def shorten(self, calls: list[Forward]) -> None:
        """Choose the round's block length: cut verify blocks so the graph's rows buy the most tokens per ms.

        A slotted round pads every pass to the longest one's bucket, and a graph of 32 sequences x 16 rows
        costs several times one of 32 x 1 (H200, 1.5B shape: ~3.3 ms against ~7). So each candidate bucket
        is scored by the tokens the round commits on average (each decoder's running acceptance of its
        drafter) over that graph's measured GPU time plus the round's host time (a running mean: the host work
        around a graph hardly depends on its block); a bucket not measured yet counts as free, so it is tried
        once and learnt. Only drafts are cut; prefill chunks and unslotted passes keep their length."""
        slots = self.slots
        fast = [c for c in calls if slots.fits(len(c.tokens), c.cache, c.start)]
        verify = [c for c in fast if c.decoder is not None and len(c.tokens) > 1]
        if not verify:
            return
        floor = max((len(c.tokens) for c in fast if c.decoder is None or len(c.tokens) == 1), default=1)
        longest = block_bucket(max(len(c.tokens) for c in fast))
        passes = [(c.tokens, c.cache, c.start, c.num_logits) for c in fast]
        batch = slots.shape(passes)[0]
        furthest = max(c.start for c in fast)
        curves = [c.decoder.expected_tokens() for c in verify]
        best_rate, best_rows = -1.0, longest
        for rows in BLOCKS:
            if rows < floor or rows > longest:
                continue
            cost = slots.pass_ms((batch, rows, key_bucket(furthest + rows, slots.slot_len + SLOT_SCRATCH)))
            if cost is None:
                best_rows = rows  # unmeasured: tried once (the smallest such), its time decides afterwards
                break
            tokens = sum(curve[min(rows - 1, len(curve) - 1)] for curve in curves)
            # A round costs its graph plus the host work around it, which hardly depends on the block: with that
            # counted, a longer block's extra tokens are weighed against the whole round, not the graph alone.
            rate = tokens / max(cost + self._host_ms, 1e-3)
            if rate > best_rate * MIN_GAIN:  # a longer block must pay for itself by a margin: timings are noisy
                best_rate, best_rows = rate, rows
        if best_rows < longest:
            for c in verify:
                if len(c.tokens) > best_rows:
                    c.decoder.shorten(best_rows)
                    self.counts.add("sched_shortened")
