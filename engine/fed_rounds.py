"""Fed rounds: fimble serve's next round launched before the one in flight is read, so the GPU never waits on the host.

A plain round (engine/rounds.py) launches its passes, streams and admits while they run, then waits, verifies every
sequence and only then knows the next round's passes: the GPU idles for that advance (1.0-1.3 ms of a ~5 ms round at
32 editors on an H100, around ~3.7 ms of graph time). Most of those passes are predictable: a greedy sequence that
drafts nothing steps one token at ``start + 1``, and that token is its pass's argmax, which sits on the device.

So each round, before reading the round in flight (R), ``FedRounds`` launches R+1 with:
- a *fed* row (``FedPass``) for every sequence whose pass in R is such a step: its token is copied on the device from
  R's argmax (engine/runtimes/slot_graphs.py ``launch``'s ``feeds``), queued behind R on the stream;
- the passes of the sequences waiting for one (new requests, draft blocks, prefill chunks, wrong guesses).
Then it reads R and advances its sequences: each yields its real next pass. At the next round that pass is checked
against the fed row (``FedPass.matches``): the same pass, so its row in R+1 is its answer; or not (the sequence
drafted, ended, or the guess was wrong), and the row is dropped (its key/value write lies past the sequence's length,
and a later pass overwrites it) while the real pass joins the next launch.

What stays true: every committed token is still the host's own choice from its own pass's rows, so output equals plain
rounds' token for token; a round's text streams and requests are admitted while the GPU runs; a cancel ends a sequence
within a round. A sequence that drafts sits out one round per draft, so under fed rounds a draft must be worth it
(draft_plan.FED_DRAFT_TOKENS). Where few sequences can be fed, the round in flight is read first, as a plain round.
FIMBLE_SERVE_FEED=0 turns fed rounds off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine import env_settings
from engine.decoding.passes import FedPass, Forward
from engine.rounds import Rounds, _Seq
from engine.steps import STREAM_NOW


def _feedable(fwd: Forward, decoder) -> bool:
    """Whether the step after ``fwd`` (its decoder's pending pass) may be fed: ``fwd`` is a 1-token greedy step
    verified from the host argmax alone, and committing its token leaves room and budget for another."""
    return (
        len(fwd.tokens) == 1
        and not fwd.reads_logits
        and not decoder.done
        and len(decoder.ids) + 2 <= decoder.cache.max_len
        and len(decoder.output) + 1 < decoder.opt.max_tokens
    )


# Launch ahead only where at least this share of the round in flight's sequences can be fed: the others get a pass
# every other round, which a round that is all host bubble, not GPU, does not buy back.
FED_SHARE = 0.5


@dataclass
class _Ahead:
    """A round in flight: what ``launch`` returned, and each of its rows' sequence and pass (Forward or FedPass)."""

    launched: object
    rows: list[tuple[_Seq, object]]
    readable_later: bool  # every row the host may read as logits survives the next launch


class FedRounds(Rounds):
    def __init__(self, passes, counts, overlap: bool, error_detail: bool, feed: bool):
        super().__init__(passes, counts, overlap, error_detail)
        self.feed = feed
        self.ahead: _Ahead | None = None

    def cancel_all(self) -> None:
        self._drain()
        super().cancel_all()

    def run(self, admit) -> bool:
        if not (self.feed and self.overlap and self.passes.can_feed):
            self._drain()
            return super().run(admit)
        t0 = time.perf_counter()
        c = self.counts
        ended: set[int] = set()
        ahead, self.ahead = self.ahead, None
        joined = self._match(ahead) if ahead is not None else []
        fed = self._guesses(ahead) if ahead is not None else []
        if ahead is not None and (not ahead.readable_later or len(fed) < FED_SHARE * len(self._live(ahead))):
            # Few to feed (or rows the next replay would overwrite): read the round in flight first, as a plain round.
            ended |= self._stream(joined)
            ended |= self._collect(ahead, ended)
            ahead, joined, fed = None, [], []
            self._keep(ended)
            # Those sequences are gone, and a sequence admitted below may be given one's freed address: their ids
            # must not be matched again (a newcomer dropped without an answer hung 32 editors on an H100).
            ended = set()
        self._drafts()
        in_flight = {id(s) for s in joined} | ({id(s) for s, _ in ahead.rows} if ahead is not None else set())
        waiting = [s for s in self.active if isinstance(s.pending, Forward) and id(s) not in in_flight]
        calls = [s.pending for s in waiting]
        self.passes.shorten(calls)
        t1 = time.perf_counter()
        launched = None
        if calls or fed:
            launched = self.passes.launch(calls, [f for _, f in fed], keep_rows=True)
            c.add("sched_rounds")
            c.add("sched_batched_rows", sum(len(call.tokens) for call in calls) + len(fed))
            c.add("sched_fed_rows", len(fed))
            c.peak("sched_max_batch", len(calls) + len(fed))
            if ahead is not None:
                c.add("sched_fed_rounds")
        t2 = time.perf_counter()
        ended |= self._stream(waiting + joined)
        admit()  # new requests' first passes join the next launch
        t3 = time.perf_counter()
        if ahead is not None:
            ended |= self._collect(ahead, ended)
        t4 = time.perf_counter()
        if launched is not None:
            rows = list(zip(waiting, calls, strict=True)) + fed
            self.ahead = _Ahead(launched, rows, self.passes.ahead_ok)
        self._keep(ended)
        if not self.active:
            self._drain()  # nothing left to run: the round in flight holds dropped rows only
        c.add("sched_pass_ms", (t2 - t1 + t4 - t3) * 1e3)
        c.add("sched_launch_ms", (t2 - t1) * 1e3)
        c.add("sched_overlap_ms", (t3 - t2) * 1e3)
        self._round_times(t0, t1, t2, t3, t4)
        return bool(ended)

    # -- the steps of a round ------------------------------------------------------------------------------------
    def _live(self, ahead: _Ahead) -> list[tuple[_Seq, object]]:
        """The round's rows that belong to a running sequence (not one that has ended, nor a dropped guess)."""
        active = {id(s) for s in self.active}
        return [(s, p) for s, p in ahead.rows if id(s) in active and not (isinstance(p, FedPass) and p.dropped)]

    def _match(self, ahead: _Ahead) -> list[_Seq]:
        """Check the round in flight's guesses against the passes their sequences now ask for; the sequences whose
        guess held (their pass is already running)."""
        joined, active = [], {id(s) for s in self.active}
        for seq, p in ahead.rows:
            if not isinstance(p, FedPass):
                continue
            if id(seq) in active and p.matches(seq.pending):
                p.forward = seq.pending
                joined.append(seq)
                self.counts.add("sched_fed_matched")
            else:
                p.dropped = True
                self.counts.add("sched_fed_dropped")
        return joined

    def _guesses(self, ahead: _Ahead) -> list[tuple[_Seq, FedPass]]:
        """A fed pass for every sequence whose pass in the round in flight is a plain greedy step."""
        fed = []
        for seq, p in self._live(ahead):
            fwd = p.forward if isinstance(p, FedPass) else p
            decoder = fwd.decoder
            if decoder is None:
                continue
            decoder.plan.fed = True  # from now on a draft must pay for the round it costs
            if _feedable(fwd, decoder):
                fed.append((seq, FedPass(p, fwd.cache, fwd.start + 1)))
        return fed

    def _stream(self, seqs: list[_Seq]) -> set[int]:
        """STREAM_NOW to sequences whose pass is running: they stream their previous text (or end)."""
        ended = set()
        for seq in seqs:
            if not self.advance(seq, STREAM_NOW):
                ended.add(id(seq))
        return ended

    def _collect(self, ahead: _Ahead, ended: set[int]) -> set[int]:
        """Wait for a round, hand each running sequence its rows; the sequences that ended."""
        live = {id(s) for s in self.active} - ended
        for seq, p in ahead.rows:
            if isinstance(p, FedPass) and (p.forward is None or id(seq) not in live):
                p.dropped = True  # a guess nobody claimed, or whose sequence has ended: its cache stays as it is
        logits = self.passes.collect(ahead.launched)
        calls = [p for _, p in ahead.rows if isinstance(p, Forward)]
        by_call = dict(zip(map(id, calls), logits, strict=True))
        done = set()
        for seq, p in ahead.rows:
            if id(seq) not in live or (isinstance(p, FedPass) and p.dropped):
                continue
            if isinstance(p, FedPass):
                p.forward.best, out = p.best, p.logits
                going = self.advance(seq, out)
            elif p.reads_logits:  # (its rows were kept aside: read where the round in flight does not hold them up)
                with self.passes.reading(ahead.launched):
                    going = self.advance(seq, by_call[id(p)])
            else:
                going = self.advance(seq, by_call[id(p)])
            if not going:
                done.add(id(seq))
        return done

    def _keep(self, ended: set[int]) -> None:
        if ended:
            self.active = [s for s in self.active if id(s) not in ended]

    def _drain(self) -> None:
        """Read and drop a round still in flight (the engine closes, or nothing is left to run)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            for _, p in ahead.rows:
                if isinstance(p, FedPass):
                    p.dropped = True
            self.passes.collect(ahead.launched)


def rounds_for(passes, counts, overlap: bool, error_detail: bool) -> Rounds:
    """A scheduler's rounds: fed where its passes can be fed (fimble serve's slotted rounds), else plain."""
    if passes.can_feed:
        return FedRounds(passes, counts, overlap, error_detail, env_settings.read("FIMBLE_SERVE_FEED"))
    return Rounds(passes, counts, overlap, error_detail)
