"""The active requests of a scheduler (engine/scheduler.py) and the rounds that advance them.

A round: drafts, then one target pass for every active request, then each one's next pass is prepared.
With ``overlap`` the passes are launched first; while they run (on CUDA), every request streams the text of
its previous step (STREAM_NOW/AWAIT, engine/steps.py) and waiting requests are admitted; then the logits are
collected and each request verifies. Without, the text is streamed before the launch and requests are admitted
between rounds, so the GPU wait leaves the interpreter to fimble serve's websocket thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from engine.api import CompletionRequest, CompletionStream, Delta
from engine.counters import Counters
from engine.decoding.passes import DraftNeed, Forward
from engine.errors import FimbleError
from engine.runner import PassRunner
from engine.steps import STREAM_NOW

# A round this long holds back every active request's next delta by about that much: under fimble serve a round is
# 2-10 ms, so one of 25 ms or more is a stall (a collection, a capture, a slow admission), counted apart.
SLOW_ROUND_MS = 25.0


@dataclass
class _Seq:
    request: CompletionRequest
    stream: CompletionStream
    steps: Generator  # the request's generator (engine/steps.py)
    key: str
    pending: Forward | DraftNeed | None = None
    admitted_at: float = field(default_factory=time.monotonic)


class Rounds:
    def __init__(self, passes: PassRunner, counts: Counters, overlap: bool, error_detail: bool):
        self.passes, self.counts = passes, counts
        self.overlap, self.error_detail = overlap, error_detail
        self.active: list[_Seq] = []

    def keys(self) -> list[str]:
        """Document keys of the active requests."""
        return [s.key for s in self.active]

    def start(self, request: CompletionRequest, stream: CompletionStream, steps: Generator, key: str) -> None:
        """Run the request up to its first need; it is active from then on, unless it ended already."""
        seq = _Seq(request, stream, steps, key)
        if self.advance(seq, None):
            self.active.append(seq)

    def cancel_all(self) -> None:
        """The engine closes: every active request ends, cancelled."""
        for seq in self.active:
            seq.steps.close()  # releases each document (the generators' finally)
            seq.stream.push(Delta("", True, "cancelled"))
        self.active = []

    def run(self, admit: Callable[[], None]) -> bool:
        """One round (see the module docstring); ``admit`` admits waiting requests (called while the passes run,
        with overlap). True when a request ended."""
        t0 = time.perf_counter()
        self._drafts()
        seqs = [s for s in self.active if isinstance(s.pending, Forward)]
        calls = [s.pending for s in seqs]
        self.passes.shorten(calls)
        if not self.overlap:
            ended = {id(seq) for seq in seqs if not self.advance(seq, STREAM_NOW)}
        t1 = time.perf_counter()
        launched = self.passes.launch(calls)
        t2 = time.perf_counter()
        if self.overlap:
            ended = {id(seq) for seq in seqs if not self.advance(seq, STREAM_NOW)}
            # New requests are admitted here too, while the GPU runs: building a prompt costs ~1 ms of Python,
            # and 32 editors' keystrokes arriving together would otherwise stall every sequence ~30-50 ms
            # between two rounds. Their first passes join the next round.
            admit()
        t3 = time.perf_counter()
        logits = self.passes.collect(launched)
        t4 = time.perf_counter()
        c = self.counts
        c.add("sched_pass_ms", (t2 - t1 + t4 - t3) * 1e3)
        c.add("sched_launch_ms", (t2 - t1) * 1e3)
        c.add("sched_overlap_ms", (t3 - t2) * 1e3)
        c.add("sched_rounds")
        c.add("sched_batched_rows", sum(len(call.tokens) for call in calls))
        c.peak("sched_max_batch", len(calls))
        for seq, out in zip(seqs, logits, strict=True):
            if id(seq) not in ended and not self.advance(seq, out):
                ended.add(id(seq))
        self.active = [s for s in self.active if id(s) not in ended]
        self._round_times(t0, t1, t2, t3, t4)
        return bool(ended)

    def _round_times(self, t0: float, t1: float, t2: float, t3: float, t4: float) -> None:
        """Count a round's time: started t0, drafted and chose blocks by t1, launched by t2, streamed and admitted
        by t3, read the passes by t4, advanced by now."""
        c = self.counts
        c.add("sched_advance_ms", (time.perf_counter() - t4) * 1e3)
        round_ms = (time.perf_counter() - t0) * 1e3
        c.add("sched_round_ms", round_ms)
        if round_ms >= SLOW_ROUND_MS:  # where a stall's time went
            c.add("sched_slow_rounds")
            c.add("sched_slow_round_ms", round_ms)
            c.add("sched_slow_drafts_ms", (t1 - t0) * 1e3)
            c.add("sched_slow_overlap_ms", (t3 - t2) * 1e3)
            c.add("sched_slow_advance_ms", round_ms - (t4 - t0) * 1e3)
        self.passes.round_done(round_ms)

    def _drafts(self) -> None:
        """Answer every request waiting for greedy draft tokens: token i of all drafts in one pass."""
        waiting = [s for s in self.active if isinstance(s.pending, DraftNeed)]
        if not waiting:
            return
        drafts = self.passes.drafts([s.pending for s in waiting])
        done = {id(s) for s, tokens in zip(waiting, drafts, strict=True) if not self.advance(s, tokens)}
        if done:
            self.active = [s for s in self.active if id(s) not in done]

    def advance(self, seq: _Seq, value) -> bool:
        """Send ``value`` (logits, draft tokens, STREAM_NOW) to the request; True while it wants another pass."""
        try:
            seq.pending = seq.steps.send(value)
            return True
        except StopIteration:
            pass
        except FimbleError as exc:
            self.counts.add("failed")
            seq.stream.push(Delta("", True, "error", str(exc), type(exc).__name__))
        except Exception as exc:  # one request must never take the others down, nor the worker
            self.counts.add("failed")
            detail = f": {exc}" if self.error_detail else ""
            seq.stream.push(Delta("", True, "error", f"internal error: {type(exc).__name__}{detail}"))
        seq.pending = None
        return False
