"""Step-level scheduling for the shared engine: every active sequence advances one step per round.

``ServeEngine`` is a ``LocalEngine`` (same submit/prewarm/forget/counters API, same prompt
layout, KV store and reuse rules) whose worker loop runs many requests at once instead of
one after another. Each request becomes a generator (``_steps``) that yields the target pass
it needs next (its prefill, then one verify block per step) and is sent back the logits. A
round collects one pass from every active sequence and runs them together:

- batched (``batch=True``, the compact runtime): one forward for all of them
  (engine/serve/batched.py), each sequence with its own cache and cache length;
- round-robin (``batch=False``, or a transformers runtime): one after another.

On CUDA the compact runtime sits under a ``GraphRuntime`` (engine/runtimes/cuda_graphs.py). There the
rounds are slotted (``SlotGraphs``): a running sequence's target cache is copied into a slot of one
``BatchedCache`` when it starts and back into its document's cache when it ends (finish, cancel, error),
and every round replays one captured batched graph for all passes of up to 16 tokens (steps, verify
blocks, short prefill chunks), with one host copy of every row's argmax; longer prefill chunks of slotted
sequences run in one eager pass over the slot range. Without a slot (no free one, a document longer than a
slot, ``FIMBLE_SERVE_SLOTS=0``) a sequence runs as before: the eager batched forward on the model under the
``GraphRuntime``, or alone through its own graph. Draft-model passes still run eagerly (batched).

Each sequence drafts into its own draft cache (its own ``ModelDrafter``); greedy model drafts of
all sequences run together too, token i of every draft in one draft-model pass
(``batched_greedy_drafts``: 1.33x tok/s at 16 sequences decoding on the 2-core CPU, measured).
Each sequence keeps its own accepted length, cache and detokeniser.

Fairness: a new request is admitted at the next round and prefills ``PREFILL_CHUNK`` tokens
per round alongside the others' steps, so neither a long completion nor a long prompt holds
back another editor's first token for more than a round.
Cancellation is checked before every step of every sequence (stops within one step); a
request that waits is finished at once when cancelled. Two requests for the same document
never run together (they share a cache): the newer waits for the older, which the editor
has usually cancelled already.
"""

from __future__ import annotations

import os
import queue
import time
from collections import OrderedDict
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from engine.api import CompletionRequest, CompletionStream, Delta
from engine.caching.kv_store import session_of
from engine.decoding.detok import IncrementalDetokenizer, StopRules
from engine.decoding.drafters import Draft, ModelDrafter, NgramDrafter
from engine.decoding.healing import unheal
from engine.decoding.spec_policy import MIN_GAIN
from engine.decoding.speculative import SpeculativeDecoder
from engine.errors import FimbleError, PromptError
from engine.local import _WAKE, REUSE_MODES, LocalEngine
from engine.runtimes.cuda_graphs import (
    BLOCKS,
    SLOT_SCRATCH,
    batch_bucket,
    block_bucket,
    key_bucket,
    rows_tensor,
)
from engine.serve import prompt_bound
from engine.serve.batched import (
    DraftNeed,
    Forward,
    batched_forward,
    batched_greedy_drafts,
    run_one,
    supports_batch,
)

# A round's two-phase handshake with each sequence's generator: having yielded its pass, the generator is sent
# STREAM_NOW and streams the text of its previous step (it then yields AWAIT); the logits come with the next
# send. With overlap (the default) STREAM_NOW is sent once the round's passes are launched, so that work runs
# while the GPU does; without, before they are launched (the order of the plain decode loop).
STREAM_NOW = object()
AWAIT = object()

SCHED_COUNTERS = (
    "sched_rounds",
    "sched_passes",
    "sched_batched_rows",
    "sched_max_batch",
    "sched_active",
    "sched_waiting",
    "sched_admitted",
    "sched_graph_rounds",
    "sched_round_ms",  # wall time in rounds (drafts, passes, advancing every sequence)
    "sched_pass_ms",  # of which launching the target passes and waiting for them (not the overlapped work)
    "sched_launch_ms",  # of pass_ms: starting the passes (slotted: staging and the graph's launch; eager: all of it)
    "sched_overlap_ms",  # of which streaming text and admitting requests while the passes run (overlap)
    "sched_advance_ms",  # of which verifying every sequence's logits and preparing its next pass (after the wait)
    "sched_gpu_ms",  # slotted rounds: GPU time of their graph replays
    "sched_shortened",  # verify blocks cut by the round's block choice (_shorten_drafts)
    "sched_prebuilt",  # prompts built while their document was busy (_admit)
    "sched_admitted_early",  # of those, admitted in the round that freed their document (_admit(ready_only))
    "sched_refused_unfit",  # prompts refused as too long for the context before being tokenised whole
)
MAX_ACTIVE = 64  # sequences stepped together; more wait their turn
# Prompt tokens a sequence prefills per round. A new request's prompt (often 1,000+ tokens on its
# first keystroke in a file) then costs the others' step at most this many rows per round.
PREFILL_CHUNK = 128
MAX_SESSIONS_REMEMBERED = 1024  # per-session n-gram drafters kept (least recently used dropped)
SLOT_LEN = 4096  # positions per slot of the slotted (CUDA graph) rounds; longer documents run eagerly
# After a completion's first text, deltas go out at most this often (_TextOut.emit): ~80 a second, more than an
# editor redraws ghost text, against one per round (400+ a second for one editor on the H200).
STREAM_INTERVAL_S = 0.012
HOST_MS_WEIGHT = 0.1  # the running mean's step: about the last ten rounds


class StepDecoder(SpeculativeDecoder):
    """``SpeculativeDecoder`` split around its target pass, so a scheduler can batch the passes.

    ``begin_step`` drafts and returns the pass; ``end_step`` verifies its logits. Together they
    do exactly what ``step`` does (``next_draft`` mirrors ``_draft``, cost-aware gamma included: if
    either changes, change the other).
    """

    _pending: tuple[Draft, int, Forward] | None = None
    # Slotted rounds: the scheduler's host copy of each returned row's argmax (Forward.best), used for
    # greedy choices without a forced prefix or a trace (the same tokens ``_choose``/``_verify`` would pick
    # from the same logits: argmax of each row). ``host_tokens``: build pass blocks on the host (one
    # copy to the device per round instead of one per sequence).
    _best: list[int] | None = None
    host_tokens = False

    def _greedy_best(self) -> list[int] | None:
        if self._best is None or self.opt.temperature > 0 or self.trace is not None or self.forced:
            return None
        return self._best

    def _choose(self, logits: torch.Tensor) -> int:
        best = self._greedy_best()
        return best[-1] if best is not None else super()._choose(logits)  # called with the last row only

    def _verify(self, draft: Draft, logits: torch.Tensor) -> list[int]:
        best = self._greedy_best()
        if best is None:
            return super()._verify(draft, rows_tensor(logits))
        d, n = draft.tokens, 0  # (no draft: the one row's argmax, with no tensor indexed)
        while n < len(d) and d[n] == best[n]:
            n += 1
        return d[:n] + [best[n]]

    def prefill_done(
        self, prompt: list[int], logits: torch.Tensor, best: list[int] | None = None, draft: list[int] | None = None
    ) -> list[int]:
        """The prompt's last pass is back (``draft``: the heal draft it carried): commit its first tokens."""
        self._best = best
        try:
            return self.prefill_verified(prompt, draft or [], logits)
        finally:
            self._best = None

    def next_draft(self) -> Draft | DraftNeed | None:
        """The next step's draft, a DraftNeed where the draft model must run it, or None when decoding is over.

        ``SpeculativeDecoder._draft``'s choice, with greedy model drafts left to the scheduler, which
        runs those of all sequences together (``batched_greedy_drafts``).
        """
        if self.done:
            return None
        if len(self.ids) >= self.cache.max_len:
            self.done, self.finish_reason = True, "context"
            return None
        self._kind, self._shadow = "", []
        if self.forced:  # healing: one constrained token at a time
            return Draft([])
        plan = self._plan_draft()  # SpeculativeDecoder's rule: n-gram draft, or a draft-model length
        if isinstance(plan, Draft):
            return plan
        if self.opt.temperature > 0:  # sampled drafts carry their distributions: drafted here, alone
            return self.model_drafter.propose(
                self.ids, plan, self.opt.temperature, self.opt.top_p, self.opt.confidence_gate, self.gen
            )
        return DraftNeed(self.model_drafter, self.ids, plan, self.opt.confidence_gate)

    def begin_step(self, draft: Draft) -> Forward:
        """The verify pass of the next step, for ``draft``."""
        k = len(draft.tokens)
        start = len(self.ids) - 1
        block = [self.ids[-1]] + draft.tokens
        if not self.host_tokens:
            block = torch.tensor(block, dtype=torch.long, device=self.runtime.device)
        fwd = Forward(block, self.cache, start, k + 1, decoder=self)
        self._pending = (draft, start, fwd)
        return fwd

    def shorten(self, rows: int) -> None:
        """Cut the pending verify block to ``rows`` rows (its draft to ``rows - 1`` tokens) before it runs.

        Lossless: the committed tokens are still the target's own choices; only fewer drafts are checked."""
        assert self._pending is not None
        draft, start, fwd = self._pending
        if rows >= len(fwd.tokens):
            return
        g = rows - 1
        draft = Draft(draft.tokens[:g], draft.probs[:g] if draft.probs is not None else None)
        fwd.tokens, fwd.num_logits = fwd.tokens[:rows], rows
        self._pending = (draft, start, fwd)

    def expected_tokens(self) -> list[float]:
        """Tokens the pending step commits on average with its first g drafts, for g = 0..len(draft)
        (spec_policy's running acceptance of this round's drafter, per draft position)."""
        assert self._pending is not None
        k = len(self._pending[0].tokens)
        curve = [1.0]
        if not self._kind:
            return curve * (k + 1)
        acceptance, survive = self.acceptance[self._kind], 1.0
        for i in range(k):
            survive *= acceptance.rate(i)
            curve.append(curve[-1] + survive)
        return curve

    def abandon_step(self) -> None:
        """Drop the pending pass (its text hit a stop meanwhile): the cache goes back to the committed tokens."""
        assert self._pending is not None
        _, start, _ = self._pending
        self._pending = None
        self.cache.rollback(start)

    def end_step(self, logits: torch.Tensor) -> list[int]:
        assert self._pending is not None
        draft, start, fwd = self._pending
        self._pending = None
        self._best = fwd.best
        try:
            return self._finish_round(draft, start, logits)
        finally:
            self._best = None


@dataclass
class _Seq:
    request: CompletionRequest
    stream: CompletionStream
    steps: Generator
    key: str
    pending: Forward | DraftNeed | None = None
    admitted_at: float = field(default_factory=time.monotonic)


class ServeEngine(LocalEngine):
    """A LocalEngine that steps up to ``max_active`` requests together (see the module docstring)."""

    def __init__(
        self,
        target,
        draft=None,
        *,
        batch: bool = True,
        max_active: int = MAX_ACTIVE,
        slots: bool | None = None,
        slot_len: int | None = None,
        overlap: bool | None = None,
        **kw,
    ):
        kw["start_thread"] = False  # the daemon runs serve_forever() in its main thread (CPU speed)
        super().__init__(target, draft, **kw)
        self.batched = batch and supports_batch(target.runtime)
        # On CUDA (GraphRuntime) without slots, a lone sequence's pass replays its captured graph (1.7-2.8 ms
        # a step, against 8-11 ms eager); two or more run the eager batched forward together (batched.py).
        self._graphs = hasattr(target.runtime, "propose_greedy")
        self.max_active = max_active
        # Slotted rounds (CUDA): each running sequence's target cache lives in a slot of one BatchedCache and
        # a round's short passes (steps, verify blocks, short prefill chunks) replay one captured batched
        # graph (engine/runtimes/cuda_graphs.py SlotGraphs). ``slots``: None = on CUDA with graphs when
        # batching (FIMBLE_SERVE_SLOTS=0 turns it off); True forces it (the CPU runs it without graphs: tests).
        if slots is None:
            slots = self.batched and self._graphs and os.environ.get("FIMBLE_SERVE_SLOTS", "1") != "0"
        self.slots = None
        if slots and self.batched:
            from engine.runtimes.cuda_graphs import SlotGraphs, eager_runtime

            length = slot_len or min(target.max_len, SLOT_LEN)
            self.slots = SlotGraphs(eager_runtime(target.runtime), max_active, length, self._attention(target.runtime))
        # Overlap: a round's host work (streaming text, admitting requests) runs while its passes do. Only graph
        # rounds run asynchronously (CUDA); elsewhere a pass has finished when _launch returns, so overlap would
        # only hold each delta back a round. FIMBLE_SERVE_OVERLAP=0 turns it off on CUDA too: on the H200 at 32
        # editors this session's changes doubled tok/s (2,504 -> 5,279) while p95 first delta grew (92 -> 342
        # ms); whether overlap (the decode loop keeping the interpreter through the GPU wait) caused the tail is
        # not measured yet, and this switch is there to measure it.
        if overlap is None:
            asynchronous = self.slots is not None and self.slots.use_graphs
            overlap = asynchronous and os.environ.get("FIMBLE_SERVE_OVERLAP", "1") != "0"
        self.overlap = overlap
        self._counters.update(dict.fromkeys(SCHED_COUNTERS, 0))
        self._active: list[_Seq] = []
        self._held: list[tuple[CompletionRequest, CompletionStream]] = []  # submitted, not yet admitted
        # Prompts built ahead for held requests whose document is busy (id(request) -> PromptPlan): built while a
        # round's pass runs, so the request is admitted the moment its document is free (_admit(ready_only)).
        self._plans: dict[int, tuple[CompletionRequest, object]] = {}
        self._host_ms = 0.0  # running mean of a graph round's wall time beyond its graph's GPU time
        self._last_gpu_ms: float | None = None
        self._forgets: list[str] = []  # forget requests for documents in use: done when they are free
        # Prompt lookup remembers recent completions: one drafter per client session, so one user's
        # completions never shape (nor, by acceptance, time) another's drafts.
        self._ngrams: OrderedDict[str, NgramDrafter] = OrderedDict()
        self._unfit = prompt_bound.UnfitCheck(target, self.prompts)  # refuses before tokenising a whole prompt

    @staticmethod
    def _attention(runtime) -> str:
        """The GraphRuntime's graph kernels ("invariant-cublas", "invariant", "fused", "sdpa" or "matmul"), for the
        slot graphs too."""
        attention = getattr(runtime, "attention", None)
        return attention if attention in ("invariant", "invariant-cublas", "fused", "sdpa", "matmul") else "sdpa"

    def info(self) -> dict:
        return {
            **super().info(),
            "scheduler": ("batched-graphs" if self.slots is not None else "batched") if self.batched else "round-robin",
            "max_active": self.max_active,
        }

    def warm_graphs(self, announce=None) -> int:
        """Capture the slotted rounds' graphs before traffic (CUDA only; else nothing to do): every batch bucket up
        to ``max_active``, block and key length up to 2,048 (longer caches capture on first use). On a GPU this
        takes seconds (Triton compiles its kernels once, then ~140 captures), which a first keystroke would
        otherwise wait for. Returns the number captured."""
        slots = self.slots
        if slots is None or not slots.use_graphs:
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

    def active_documents(self) -> list[str]:
        """Document keys of the sequences running now (for tests and the daemon's counters)."""
        return [s.key for s in self._active]

    # -- the worker loop ------------------------------------------------------------------
    def _run(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        while True:
            idle = not self._active and not self._held and not self._forgets
            if not self._take(block=idle and not self._prewarms):
                break  # close()
            if not self._active or not self.overlap:  # with overlap, requests arriving while sequences run are
                self._admit()  # admitted during a round's pass (_round)
            if not self._active:
                if not self._held and self._prewarms:
                    self._next_prewarm()
                continue
            self._round()

    def _take(self, block: bool) -> bool:
        """Move queued items in; False once close() was called."""
        while True:
            try:
                item = self._queue.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is None:
                for seq in self._active:
                    seq.steps.close()  # releases each document (the generators' finally)
                    seq.stream.push(Delta("", True, "cancelled"))
                for _, stream in self._held:
                    stream.push(Delta("", True, "cancelled"))
                self._plans.clear()
                return False
            if item is _WAKE:
                continue
            if item[0] == "forget":
                self._forgets.append(item[1])
            else:
                self._held.append(item)

    def _admit(self, ready_only: bool = False) -> None:
        """Start held requests whose document is free (up to ``max_active``); answer cancelled ones. A held request
        whose document is busy (its previous completion has not seen the cancel yet) gets its prompt built now.

        ``ready_only``: only requests whose prompt is built already (cheap: no tokenising), for the end of a round,
        where the ones just freed by a cancelled sequence can join the next round's pass instead of the one after."""
        busy = {s.key for s in self._active}
        for doc_id in list(self._forgets):
            if doc_id not in busy:
                self._forgets.remove(doc_id)
                self._handle(("forget", doc_id))
        keep = []
        for request, stream in self._held:
            key = request.document_id or ""
            if stream.cancelled:  # cancelled while waiting: answer now, without a pass
                self._prebuilt(request)
                with self._lock:
                    self._waiting -= 1
                self._finish(stream, "", "cancelled", 0, {"queue_ms": 0.0})
            elif key in busy or len(self._active) >= self.max_active or (ready_only and id(request) not in self._plans):
                if not ready_only and key in busy and id(request) not in self._plans:
                    self._prebuild(request)
                keep.append((request, stream))
            else:
                with self._lock:
                    self._waiting -= 1
                busy.add(key)
                seq = _Seq(request, stream, self._steps(request, stream), key)
                self._count("sched_admitted")
                if ready_only:
                    self._count("sched_admitted_early")
                if self._advance(seq, None):
                    self._active.append(seq)
        self._held = keep
        self._gauges()

    def _refuse_unfit(self, request: CompletionRequest) -> None:
        """PromptError if the prompt cannot fit the context, found cheaply (engine/serve/prompt_bound.py)."""
        reason = self._unfit.reason(request)
        if reason is not None:
            self._count("sched_refused_unfit")
            raise PromptError(reason)

    def _prebuild(self, request: CompletionRequest) -> None:
        try:
            self._refuse_unfit(request)
            self._plans[id(request)] = (request, self.prompts.build(request))
            self._count("sched_prebuilt")
        except Exception:  # the request's own error is raised (and answered) when it is admitted
            pass

    def _prebuilt(self, request: CompletionRequest):
        """The plan built ahead for ``request`` (removed), or None. The request is kept with it: an id alone could
        name a later request once this one is gone."""
        entry = self._plans.pop(id(request), None)
        return entry[1] if entry is not None and entry[0] is request else None

    def _round(self) -> None:
        """Drafts, then one target pass for every active sequence, then each one's next step is prepared.

        With ``overlap`` the passes are launched first; while they run (on CUDA), every sequence streams the
        text of its previous step (STREAM_NOW/AWAIT) and waiting requests are admitted; then the logits are
        collected and each sequence verifies. Without, the text is streamed before the launch and requests
        are admitted between rounds, so the GPU wait leaves the interpreter to the daemon's websocket thread."""
        t0 = time.perf_counter()
        self._drafts()
        seqs = [s for s in self._active if isinstance(s.pending, Forward)]
        calls = [s.pending for s in seqs]
        if self.slots is not None:
            self._shorten_drafts(calls)
        if not self.overlap:
            ended = {id(seq) for seq in seqs if not self._advance(seq, STREAM_NOW)}
        t1 = time.perf_counter()
        launched = self._launch(calls)
        t2 = time.perf_counter()
        if self.overlap:
            ended = {id(seq) for seq in seqs if not self._advance(seq, STREAM_NOW)}
            # New requests are admitted here too, while the GPU runs: building a prompt costs ~1 ms of Python,
            # and 32 editors' keystrokes arriving together would otherwise stall every sequence ~30-50 ms
            # between two rounds. Their first passes join the next round.
            self._admit()
        t3 = time.perf_counter()
        logits = self._collect(launched)
        t4 = time.perf_counter()
        gpu_ms = self._last_gpu_ms
        self._last_gpu_ms = None
        self._count("sched_pass_ms", (t2 - t1 + t4 - t3) * 1e3)
        self._count("sched_launch_ms", (t2 - t1) * 1e3)
        self._count("sched_overlap_ms", (t3 - t2) * 1e3)
        self._count("sched_rounds")
        self._count("sched_batched_rows", sum(len(c.tokens) for c in calls))
        with self._lock:
            self._counters["sched_max_batch"] = max(self._counters["sched_max_batch"], len(calls))
        for seq, out in zip(seqs, logits, strict=True):
            if id(seq) not in ended and not self._advance(seq, out):
                ended.add(id(seq))
        self._active = [s for s in self._active if id(s) not in ended]
        self._count("sched_advance_ms", (time.perf_counter() - t4) * 1e3)
        if ended and self._plans:  # a keystroke's new request, waiting for its cancelled predecessor: in now
            self._admit(ready_only=True)
        self._snapshot_kv()
        self._gauges()
        round_ms = (time.perf_counter() - t0) * 1e3
        self._count("sched_round_ms", round_ms)
        if gpu_ms is not None:  # the host's share of a graph round, for the block choice (_shorten_drafts)
            self._host_ms += HOST_MS_WEIGHT * (max(0.0, round_ms - gpu_ms) - self._host_ms)

    def _launch(self, calls: list[Forward]) -> tuple:
        if self.slots is None:
            return ("done", self._eager(calls))
        return ("slotted", self._slotted_launch(calls))

    def _collect(self, launched: tuple) -> list:
        kind, value = launched
        return value if kind == "done" else self._slotted_collect(*value)

    def _eager(self, calls: list[Forward]) -> list[torch.Tensor]:
        runtime = self.target.runtime
        device = getattr(runtime, "device", None)
        for c in calls:  # blocks built on the host for a slotted round that runs eagerly after all
            if isinstance(c.tokens, list):
                c.tokens = torch.tensor(c.tokens, dtype=torch.long)
            if device is not None and c.tokens.device != torch.device(device):
                c.tokens = c.tokens.to(device)
        if self.batched and len(calls) > 0 and not (len(calls) == 1 and self._graphs):
            self._count("sched_passes")
            return batched_forward(runtime, calls)
        self._count("sched_passes", len(calls))
        return [run_one(runtime, c) for c in calls]

    def _slotted_launch(self, calls: list[Forward]) -> tuple:
        """Slotted passes of up to 16 tokens in one graph replay, started and not waited for; slotted prefill
        chunks in one eager slot pass (``SlotGraphs.prefill``) and the others (sequences without a slot) as
        ``_eager``, run here. The graph's logits are views of its output, read by ``_advance`` before the next
        round replays anything."""
        slots = self.slots
        fast = [i for i, c in enumerate(calls) if slots.fits(len(c.tokens), c.cache, c.start)]
        in_graph = set(fast)
        out: list = [None] * len(calls)
        graph = None
        if fast:
            graph = slots.launch([(calls[i].tokens, calls[i].cache, calls[i].start, calls[i].num_logits) for i in fast])
            self._count("sched_passes")
            self._count("sched_graph_rounds")
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
            self._count("sched_passes")
        rest = [i for i in range(len(calls)) if out[i] is None and i not in in_graph]
        if rest:
            for i, logits in zip(rest, self._eager([calls[i] for i in rest]), strict=True):
                out[i] = logits
        return calls, fast, graph, out

    def _slotted_collect(self, calls: list[Forward], fast: list[int], graph, out: list) -> list:
        if graph is not None:
            best: list[list[int]] = []
            got = self.slots.collect(graph, best, lazy=True)  # rows sliced only where read (RowSpan)
            for i, logits, row_best in zip(fast, got, best, strict=True):
                out[i] = logits
                calls[i].best = row_best
            gpu = self.slots.pass_ms(graph[2])
            if gpu is not None:
                self._count("sched_gpu_ms", gpu)
                self._last_gpu_ms = gpu
        return out

    def _shorten_drafts(self, calls: list[Forward]) -> None:
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
                    self._count("sched_shortened")

    def _take_slot(self, doc) -> object | None:
        """Move the document's target cache into a slot for the run (None: it stays where it is)."""
        if self.slots is None:
            return None
        own = doc.target
        view = self.slots.take(own)
        if view is None:
            return None
        doc.target = view
        return own

    def _give_slot(self, doc, own) -> None:
        if own is not None and self.slots is not None and self.slots.holds(doc.target):
            self.slots.give(doc.target, own)
            doc.target = own

    def _drafts(self) -> None:
        """Answer every sequence waiting for greedy draft tokens: token i of all drafts in one pass."""
        waiting = [s for s in self._active if isinstance(s.pending, DraftNeed)]
        if not waiting:
            return
        needs = [s.pending for s in waiting]
        if self.batched and supports_batch(self.draft.runtime) and not (len(needs) == 1 and self._graphs):
            drafts = batched_greedy_drafts(self.draft.runtime, needs)
        else:  # round-robin: each drafter on its own, exactly as SpeculativeDecoder would
            drafts = [n.drafter.propose(n.context, n.k, 0.0, 1.0, n.gate, None).tokens for n in needs]
        done = {id(s) for s, tokens in zip(waiting, drafts, strict=True) if not self._advance(s, tokens)}
        if done:
            self._active = [s for s in self._active if id(s) not in done]

    def _advance(self, seq: _Seq, logits) -> bool:
        """Send ``logits`` (or draft tokens) to the sequence; True while it wants another pass."""
        try:
            seq.pending = seq.steps.send(logits)
            return True
        except StopIteration:
            pass
        except FimbleError as exc:
            self._count("failed")
            seq.stream.push(Delta("", True, "error", str(exc), type(exc).__name__))
        except Exception as exc:  # one request must never take the others down
            self._count("failed")
            seq.stream.push(Delta("", True, "error", f"internal error: {type(exc).__name__}"))
        seq.pending = None
        return False

    def _gauges(self) -> None:
        with self._lock:
            self._counters["sched_active"] = len(self._active)
            self._counters["sched_waiting"] = len(self._held)

    def _ngram_drafter(self, doc_id: str) -> NgramDrafter:
        key = session_of(doc_id)
        drafter = self._ngrams.pop(key, None) or NgramDrafter()
        self._ngrams[key] = drafter  # most recently used last
        while len(self._ngrams) > MAX_SESSIONS_REMEMBERED:
            self._ngrams.popitem(last=False)
        return drafter

    # -- one request as a generator of passes --------------------------------------------
    def _steps(self, request: CompletionRequest, stream: CompletionStream) -> Generator[Forward, torch.Tensor, None]:
        """``LocalEngine._serve`` with its target passes handed to the scheduler (``yield``)."""
        t0 = time.perf_counter()
        plan = self._prebuilt(request)
        if stream.cancelled:
            self._finish(stream, "", "cancelled", 0, {"queue_ms": 0.0})
            return
        opt = request.options
        opt.validate()
        if request.reuse not in REUSE_MODES:
            raise PromptError(f"unknown reuse mode {request.reuse!r}: use {', '.join(REUSE_MODES)}")
        if plan is None:
            self._refuse_unfit(request)
            plan = self.prompts.build(request)
        prompt, heal, constrained = plan.ids, plan.heal, plan.constrained
        t_prompt = time.perf_counter()
        doc = self._open_document(request, plan)
        drafter = ModelDrafter(self.draft.runtime, 0) if self.draft is not None else None
        ngram = self._ngram_drafter(request.document_id or "")
        reuse = 0
        own = None  # the document's own target cache while a slot holds it (slotted rounds)
        try:
            reuse, runs, shifted = self._reuse(doc, plan, request.reuse)
            own = self._take_slot(doc)
            prefilled = sum(b - a for a, b in runs) if runs is not None else len(prompt) - reuse
            decoder = StepDecoder(
                self.target.runtime,
                doc.target,
                self.target.stop_ids,
                opt,
                drafter,
                ngram,
                heal if constrained else "",
                self.target.token_index if constrained else None,
            )
            decoder.host_tokens = own is not None  # slotted: blocks go to the device once per round
            if drafter is not None:
                drafter.bind(doc.draft, doc.draft_ids)
            doc.ids = []  # the cache is about to change; valid again after prefill
            if runs:  # shift reuse: scattered positions, its own pass (compact runtime)
                first = decoder.prefill(prompt, reuse, runs)
            else:
                if reuse < doc.target.length:
                    doc.target.rollback(reuse)
                pos, logits, draft = reuse, None, []
                while pos < len(prompt):  # a chunk per round: a long prompt never stalls the others' steps
                    if stream.cancelled and pos > reuse:  # typed on: keep what is computed for the next keystroke
                        doc.ids, doc.exact_len = list(prompt[:pos]), pos
                        self._finish(stream, "", "cancelled", 0, {"prompt_tokens": len(prompt)})
                        return
                    end = min(len(prompt), pos + PREFILL_CHUNK)
                    if end == len(prompt):  # the last chunk carries the heal draft, where it stays a short pass
                        draft = decoder.prefill_draft(len(prompt))
                        if own is not None and end - pos + len(draft) > max(BLOCKS):
                            draft = []  # slotted: a longer chunk runs in SlotGraphs.prefill, last logits only
                    chunk = prompt[pos:end] + draft  # slotted: host ids, staged with the round's others
                    if own is None:
                        chunk = torch.tensor(chunk, dtype=torch.long, device=self.target.runtime.device)
                    fwd = Forward(chunk, doc.target, pos, 1 + len(draft))
                    yield fwd  # answered STREAM_NOW: nothing to stream yet
                    logits = yield AWAIT
                    pos = end
                first = decoder.prefill_done(prompt, logits, fwd.best, draft)
            self._count("tokens_prefilled", prefilled)
            self._count("tokens_reused", len(prompt) - prefilled)
            self._count("tokens_shifted", shifted)
            t_first = time.perf_counter()
            text, shown, reason = yield from self._decode_steps(decoder, stream, first, heal, constrained)
            doc.ids = decoder.ids[: doc.target.length]
            doc.exact_len = len(doc.ids) if runs is None or not shifted else reuse
        finally:
            self._give_slot(doc, own)
            if drafter is not None:
                doc.draft_ids = drafter.ids if doc.ids else []
            self.store.release(doc, plan, reuse)
        ngram.remember(decoder.output)
        t_end = time.perf_counter()
        s = decoder.stats
        stats = {
            "prompt_tokens": len(prompt),
            "reused_tokens": len(prompt) - prefilled,
            "prefilled_tokens": prefilled,
            "shifted_tokens": shifted,
            "truncated_tokens": plan.truncated,
            "prompt_ms": (t_prompt - t0) * 1e3,
            "first_token_ms": (t_first - t0) * 1e3,
            "total_ms": (t_end - t0) * 1e3,
            "new_tokens": len(decoder.output),
            "steps": s.steps,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "mean_accepted": s.mean_accepted,
        }
        self._finish(stream, text[:shown], reason or "stop", len(decoder.output), stats)

    def _decode_steps(
        self, decoder: StepDecoder, stream: CompletionStream, first: list[int], heal: str, constrained: bool
    ) -> Generator[object, object, tuple[str, int, str | None]]:
        """``LocalEngine._decode`` with each verify pass yielded to the scheduler.

        The text of a step's tokens is streamed while the next step's pass runs (at STREAM_NOW), so the host
        work of detokenising and sending overlaps the GPU. If that text hits a stop string or the line limit,
        the pass in flight is dropped (``abandon_step``): one wasted row, never a wrong token."""
        out = _TextOut(self, decoder, stream, heal, constrained)
        pending = first  # committed tokens whose text is not streamed yet
        reason = None
        while True:
            if decoder.done or stream.cancelled:
                if out.emit(pending):
                    reason = "stop"
                elif not decoder.done:
                    reason = "cancelled"
                break
            draft = decoder.next_draft()
            if draft is None:  # decoding is over (the context is full): loop to stream the rest
                continue
            if isinstance(draft, DraftNeed):  # the scheduler drafts for every sequence at once
                draft = Draft((yield draft))
            yield decoder.begin_step(draft)  # answered STREAM_NOW (the pass is launched, or about to be)
            hit = out.emit(pending)
            logits = yield AWAIT
            if hit:
                decoder.abandon_step()
                reason = "stop"
                break
            pending = decoder.end_step(logits)
            self._count("decode_steps")
        if decoder.done and not reason:
            reason = out.finish()
        return out.text, out.shown, reason


class _TextOut:
    """A sequence's streamed text: detokeniser, stop rules, what was shown (``ServeEngine._decode_steps``)."""

    clock = staticmethod(time.monotonic)  # the pacing's clock (a test sets its own)

    def __init__(
        self, engine: ServeEngine, decoder: StepDecoder, stream: CompletionStream, heal: str, constrained: bool
    ):
        self.engine, self.decoder, self.stream = engine, decoder, stream
        self.heal, self.constrained = heal, constrained
        self.detok = IncrementalDetokenizer(engine.target.tokenizer)
        self.rules = StopRules(decoder.opt.stop, decoder.opt.max_lines)
        self.text, self.shown = "", 0
        self._pushed_at: float | None = None

    def emit(self, tokens: list[int]) -> bool:
        """Stream the text of ``tokens``; True when it hit a stop string or the line limit.

        The first text goes out at once; later text at most every ``STREAM_INTERVAL_S`` (held text joins the
        next delta, and the last one always goes): an editor cannot show 400 updates a second, and every delta
        costs the daemon's websocket thread the interpreter the decode loop needs."""
        self.engine._count("tokens_generated", len(tokens))
        self.detok.add(tokens)
        self.text, hit = self.rules.cut(unheal(self.detok.text, self.heal, self.constrained))
        final = hit or self.decoder.done
        safe = len(self.text) if final else self.rules.safe_length(self.text)
        if safe > self.shown:
            now = self.clock()
            if final or self._pushed_at is None or now - self._pushed_at >= STREAM_INTERVAL_S:
                self.stream.push(Delta(self.text[self.shown : safe]))
                self.shown, self._pushed_at = safe, now
        return hit

    def finish(self) -> str:
        """The decoder is done: stream what the detokeniser held back; the finish reason."""
        self.detok.flush()
        self.text, _ = self.rules.cut(unheal(self.detok.text, self.heal, self.constrained))
        if len(self.text) > self.shown:
            self.stream.push(Delta(self.text[self.shown :]))
            self.shown = len(self.text)
        return "eos" if self.decoder.finish_reason == "stop" else self.decoder.finish_reason


def open_serve_engine(
    model: str | None = None,
    draft: str | None = None,
    *,
    device: str = "cpu",
    use_draft: bool = True,
    batch: bool = True,
    max_active: int = MAX_ACTIVE,
    kv_budget_bytes: int | None = None,
    threads: int | None = None,
) -> ServeEngine:
    """Load the models as ``engine.local.open_engine`` does, into a ServeEngine."""
    from engine.local import open_engine

    # Step-level batching runs many sequences through one forward of the compact runtime; the ggml runtime
    # (the CPU default elsewhere) keeps one llama.cpp context per document and could only take turns. So a
    # batching engine loads compact unless FIMBLE_RUNTIME asks otherwise.
    runtime = None if (os.environ.get("FIMBLE_RUNTIME", "").strip() or not batch) else "compact"
    loaded = open_engine(
        model,
        draft,
        device=device,
        use_draft=use_draft,
        start_thread=False,
        kv_budget_bytes=kv_budget_bytes,
        runtime=runtime,
    )
    return ServeEngine(
        loaded.target,
        loaded.draft,
        batch=batch,
        max_active=max_active,
        threads=threads,
        kv_budget_bytes=loaded.store.budget,
    )
