"""Fed rounds (engine/fed_rounds.py): fimble serve's next round launched before the one in flight is read, its plain
steps' tokens fed from the previous round's argmax on the device. On CUDA that hides the host's work between rounds;
the CPU runs the same slotted forward synchronously, so the bookkeeping is checked here: the fed tokens, rows kept
aside, guesses matched and dropped, and output equal to plain decoding."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from serve_helpers import wait_for

from bench.harness.prompts import fim_prompts
from engine.api import CompletionRequest, DecodeOptions
from engine.decoding.draft_plan import FED_DRAFT_TOKENS, DraftPlan
from engine.decoding.drafters import Draft
from engine.decoding.passes import Forward
from engine.fed_rounds import FedRounds
from engine.local import LocalEngine
from engine.runtimes.cuda_graphs import SlotGraphs
from engine.serve.scheduler import ServeEngine
from engine.steps import AWAIT


@pytest.fixture(autouse=True)
def feed_on(monkeypatch):
    """Fed rounds are opt-in (engine/env_settings.py says why): on for these tests unless a test turns them off."""
    monkeypatch.setenv("FIMBLE_SERVE_FEED", "1")


def _requests(n: int, max_tokens: int) -> list[CompletionRequest]:
    return [
        CompletionRequest(p, s, options=DecodeOptions(max_tokens=max_tokens), document_id=f"fed{i}")
        for i, (p, s) in enumerate(fim_prompts(n, seed=5))
    ]


def _plain(target, requests: list[CompletionRequest]) -> list[str]:
    """Each request's text from `fimble lsp`'s engine, one at a time: what plain decoding gives."""
    plain = LocalEngine(target, None, start_thread=False)
    return [plain.complete(r).text for r in requests]


def _serve(engine: ServeEngine, requests: list[CompletionRequest]) -> tuple[list[str], dict]:
    thread = threading.Thread(target=engine.serve_forever, daemon=True)
    thread.start()
    try:
        texts = [s.collect() for s in [engine.submit(r) for r in requests]]
        wait_for(lambda: engine.slots.in_use() == 0 and not engine.active_documents())
        counters = engine.counters()
    finally:
        engine.close()
        thread.join(10)
    return texts, counters


def test_fed_rounds_give_plain_output(compact_target, one_thread):
    requests = _requests(5, 24)
    engine = ServeEngine(compact_target, None, batch=True, slots=True, overlap=True)
    texts, c = _serve(engine, requests)
    assert texts == _plain(compact_target, requests)
    assert not c.get("failed")
    assert c["sched_fed_rounds"] > 0 and c["sched_fed_matched"] > 0
    # Every guess is either some sequence's pass or dropped, once the last round is read.
    assert c["sched_fed_matched"] + c["sched_fed_dropped"] == c["sched_fed_rows"]
    assert engine.rounds.ahead is None


def test_feed_off_runs_plain_rounds(compact_target, one_thread, monkeypatch):
    monkeypatch.setenv("FIMBLE_SERVE_FEED", "0")
    requests = _requests(3, 16)
    engine = ServeEngine(compact_target, None, batch=True, slots=True, overlap=True)
    texts, c = _serve(engine, requests)
    assert texts == _plain(compact_target, requests)
    assert c["sched_fed_rows"] == 0 and c["sched_fed_rounds"] == 0 and c["sched_graph_rounds"] > 0


def test_cancels_under_fed_rounds_free_slots_and_keep_caches_exact(compact_target, one_thread):
    """Sequences cancelled while fed rows of theirs are in flight: no slot leaks, and the caches they leave behind
    serve the next requests exactly (a dropped row's key/value write lies past the cache's length)."""
    expected = _plain(compact_target, _requests(4, 20))
    engine = ServeEngine(compact_target, None, batch=True, slots=True, overlap=True)
    thread = threading.Thread(target=engine.serve_forever, daemon=True)
    thread.start()
    try:
        long = [engine.submit(r) for r in _requests(4, 400)]
        wait_for(lambda: engine.counters()["sched_fed_matched"] > 8)
        for s in long:
            s.cancel()
        for s in long:
            s.collect()
        wait_for(lambda: engine.slots.in_use() == 0 and not engine.active_documents())
        again = [engine.submit(r).collect() for r in _requests(4, 20)]
        c = engine.counters()
    finally:
        engine.close()
        thread.join(10)
    assert not c.get("failed") and c["tokens_reused"] > 0
    assert again == expected


def test_a_fed_row_reads_its_token_from_the_round_before(compact_target, one_thread):
    """SlotGraphs.launch's feeds: a 1-token pass whose token is the previous round's argmax, copied on the device,
    gives the logits of that token passed explicitly; rows kept aside read as the graph's own rows."""
    rt = compact_target.runtime
    torch.manual_seed(1)
    prompts = [torch.randint(0, rt.cfg.vocab_size, (n,)) for n in (21, 9)]
    blocks = [[int(x) for x in torch.randint(0, rt.cfg.vocab_size, (t,))] for t in (1, 3)]
    own, ref_own = [], []
    slots = SlotGraphs(rt, 4, 128)
    for p in prompts:
        for caches in (own, ref_own):
            cache = rt.new_cache(128)
            rt(p, cache, 0, 1)
            caches.append(cache)
    views = [slots.take(c) for c in own]
    first = slots.launch([(b, v, len(p), len(b)) for p, b, v in zip(prompts, blocks, views, strict=True)], keep=[1])
    # Sequence 0 steps on with its argmax, fed on the device, before the first round is read.
    row = first.slots[0] * first.key[1]
    second = slots.launch([([0], views[0], len(prompts[0]) + 1, 1)], feeds=[(0, row)], after=first)
    best: list = []
    got = slots.collect(first, best, lazy=True)
    fed = slots.collect(second, [], lazy=False)[0]
    ref = [rt(torch.tensor(b), c, len(p), len(b)) for p, b, c in zip(prompts, blocks, ref_own, strict=True)]
    token = int(ref[0][-1].argmax())
    assert best[0] == [token]
    assert torch.allclose(got[1].tensor(), ref[1], atol=1e-4, rtol=1e-4)  # the kept rows, from the side copy
    assert got[1].logits is first.side
    want = rt(torch.tensor([token]), ref_own[0], len(prompts[0]) + 1, 1)
    assert torch.allclose(fed, want, atol=1e-4, rtol=1e-4) and int(fed[-1].argmax()) == int(want[-1].argmax())
    assert views[0].length == len(prompts[0]) + 2


def test_skipped_fed_rows_leave_the_cache_length_alone(compact_target, one_thread):
    rt = compact_target.runtime
    slots = SlotGraphs(rt, 2, 64)
    cache = rt.new_cache(64)
    rt(torch.tensor([1, 2, 3, 4]), cache, 0, 1)
    view = slots.take(cache)
    first = slots.launch([([5], view, 4, 1)])
    second = slots.launch([([0], view, 5, 1)], feeds=[(0, first.slots[0] * first.key[1])], after=first)
    slots.collect(first, [])
    assert view.length == 5
    assert slots.collect(second, [], skip={0}) == [None]
    assert view.length == 5  # the guess was wrong: its row is nobody's


class _Runtime:
    cost_aware_drafting = False


class _Ngram:
    name = "ngram"

    def propose(self, ids: list[int], k: int) -> Draft:
        return Draft([7, 8, 9][:k])


@pytest.mark.parametrize("rate, fed, drafted", [(0.1, True, False), (0.1, False, True), (0.95, True, True)])
def test_under_fed_rounds_a_draft_must_be_worth_a_round(rate, fed, drafted):
    plan = DraftPlan(_Runtime(), DecodeOptions(gamma=3), None, _Ngram())
    for record in plan.acceptance.values():
        record.hits = [rate * t for t in record.trials]
    plan.fed = fed
    plan.opening = False
    draft = plan.choose([1, 2, 3], 0, 100)
    assert bool(draft.tokens) == drafted
    if not drafted:  # still scored against the next token, so a drafter that improves is used again
        assert plan.shadow == [7, 8, 9]
    expected = plan.acceptance["ngram"].expected_tokens(3)
    assert (expected >= FED_DRAFT_TOKENS) == drafted or not fed


class _Stream:
    cancelled = False

    def __init__(self):
        self.deltas = []

    def push(self, delta):
        self.deltas.append(delta)


class _Passes:
    """The passes FedRounds drives, with no model: every call's logits are a string, every guess holds token 5."""

    can_feed, ahead_ok = True, True

    def shorten(self, calls):
        pass

    def launch(self, calls, fed=(), keep_rows=False):
        return list(calls), list(fed)

    def collect(self, launched):
        calls, fed = launched
        for f in fed:
            f.best, f.logits = [5], "row"
        return ["logits"] * len(calls)

    def round_done(self, round_ms):
        pass

    def reading(self, launched):
        return contextlib.nullcontext()


def _steps(passes: int):
    """A request that runs ``passes`` prefill-like passes (nothing to feed: no decoder), then ends."""
    for i in range(passes):
        yield Forward([1], object(), i)
        yield AWAIT


def test_a_request_admitted_in_a_round_that_ended_another_stays_active(monkeypatch):
    """A round that reads the round in flight first (few to feed) and ends a sequence there, then admits a new one
    that CPython places at the ended one's freed address: the new one runs. (A set of ended sequences' ids outlived
    the sequences, and such a newcomer was dropped without an answer: 32 editors through fimble serve hung on an
    H100, 2026-12-07.) The allocator's reuse is made certain here: a sequence's id is its request's "address"."""
    import builtins

    from engine.counters import Counters
    from engine.rounds import _Seq
    from engine.scheduler import COUNTER_NAMES, SCHED_COUNTERS

    monkeypatch.setattr(
        "engine.fed_rounds.id", lambda o: hash(o.request) if isinstance(o, _Seq) else builtins.id(o), raising=False
    )
    rounds = FedRounds(_Passes(), Counters(COUNTER_NAMES + SCHED_COUNTERS), overlap=True, error_detail=False, feed=True)
    newcomer = _Stream()
    rounds.start("address 1", _Stream(), _steps(1), "short")
    rounds.start("address 2", _Stream(), _steps(3), "long")
    rounds.run(lambda: None)  # launches both
    # Reads them first (nothing to feed: no decoder), "short" ends, then a request lands where it was.
    rounds.run(lambda: rounds.start("address 1", newcomer, _steps(2), "new"))
    assert sorted(rounds.keys()) == ["long", "new"]
    for _ in range(6):
        rounds.run(lambda: None)
    assert not rounds.active and rounds.ahead is None


@pytest.mark.parametrize("feed", ["0", "1"])
def test_a_keystrokes_last_prefill_pass_is_capped_in_slotted_rounds(compact_target, one_thread, monkeypatch, feed):
    """FIMBLE_SERVE_TAIL_ROWS=2: a keystroke's new tokens and heal draft run in passes of at most two rows (a longer
    pass pads every slot of a slotted round's graph), and the text is still plain decoding's."""
    from engine.serve.slot_passes import SlottedPasses

    monkeypatch.setenv("FIMBLE_SERVE_TAIL_ROWS", "2")
    monkeypatch.setenv("FIMBLE_SERVE_FEED", feed)
    ((prefix, suffix),) = fim_prompts(1, seed=9)
    typed = [prefix, prefix + "total = ", prefix + "total = a + b"]
    requests = [CompletionRequest(p, suffix, options=DecodeOptions(max_tokens=12), document_id="tail") for p in typed]
    rows: list[int] = []
    launch = SlottedPasses.launch

    def spy(self, calls, fed=(), keep_rows=False):
        rows.extend(
            len(c.tokens) for c in calls if c.decoder is None and self.slots.fits(len(c.tokens), c.cache, c.start)
        )
        return launch(self, calls, fed, keep_rows)

    monkeypatch.setattr(SlottedPasses, "launch", spy)
    engine = ServeEngine(compact_target, None, batch=True, slots=True, overlap=True)
    thread = threading.Thread(target=engine.serve_forever, daemon=True)
    thread.start()
    try:
        texts = [engine.submit(r).collect() for r in requests]
        c = engine.counters()
    finally:
        engine.close()
        thread.join(10)
    assert not c.get("failed")
    assert rows and max(rows) <= 2
    assert len(rows) >= 4  # the two keystrokes' tails were split (each is three tokens or more)
    monkeypatch.setenv("FIMBLE_SERVE_TAIL_ROWS", "0")
    plain = LocalEngine(compact_target, None, start_thread=False)
    assert texts == [plain.complete(r).text for r in requests]
