"""Slotted rounds (engine/runtimes/cuda_graphs.py SlotGraphs, engine/serve/scheduler.py), on the CPU.

On CUDA `fimble serve` keeps each running sequence's target cache in a slot of one BatchedCache and replays
one captured batched graph per round. The CPU runs the same slotted forward without graphs, so the slot
bookkeeping (copy in, copy back, scratch rows of idle slots, rollback as a length change, slots freed on
finish and cancel) and the scheduler's use of it are checked here; tests/gpu/test_serve_graph_slots.py checks
the graphs on a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch
from serve_helpers import wait_for

from bench.harness.prompts import fim_prompts
from engine.api import CompletionRequest, DecodeOptions
from engine.local import LocalEngine
from engine.runtimes.cuda_graphs import SlotGraphs
from engine.serve.scheduler import ServeEngine

N_PROMPTS = 5
MAX_TOKENS = 20


def _requests(n: int = N_PROMPTS, max_tokens: int = MAX_TOKENS) -> list[CompletionRequest]:
    return [
        CompletionRequest(p, s, options=DecodeOptions(max_tokens=max_tokens), document_id=f"doc{i}")
        for i, (p, s) in enumerate(fim_prompts(n, seed=3))
    ]


def test_slot_passes_match_the_model_and_leave_other_slots_alone(compact_target, one_thread):
    rt = compact_target.runtime
    torch.manual_seed(0)
    slots = SlotGraphs(rt, 8, 256)
    prompts = [torch.randint(0, rt.cfg.vocab_size, (n,)) for n in (37, 5, 120)]
    blocks = [torch.randint(0, rt.cfg.vocab_size, (t,)) for t in (1, 9, 3)]
    own, views = [], []
    for p in prompts:
        cache = rt.new_cache(256)
        rt(p, cache, 0, 1)
        own.append(cache)
        views.append(slots.take(cache))
    assert all(v is not None for v in views) and slots.in_use() == 3
    for c, v in zip(own, views, strict=True):
        assert v.length == c.length and torch.equal(v.keys[:, :, : c.length], c.keys[:, :, : c.length])
    # A bystander slot holding a document that takes no part in the pass: its valid keys must survive.
    other = rt.new_cache(256)
    rt(torch.randint(0, rt.cfg.vocab_size, (200,)), other, 0, 1)
    bystander = slots.take(other)
    kept = bystander.keys[:, :, :200].clone()
    ref = [rt(b, c, len(p), len(b)) for p, b, c in zip(prompts, blocks, own, strict=True)]
    got = slots.run([(b, v, len(p), len(b)) for p, b, v in zip(prompts, blocks, views, strict=True)])
    for r, g in zip(ref, got, strict=True):
        assert g.shape == r.shape
        assert torch.allclose(g, r, atol=1e-4, rtol=1e-4)
        assert torch.equal(g.argmax(-1), r.argmax(-1))
    for c, v in zip(own, views, strict=True):
        assert v.length == c.length
        assert torch.allclose(v.keys[:, :, : c.length], c.keys[:, :, : c.length], atol=1e-5)
    assert torch.equal(bystander.keys[:, :, :200], kept) and bystander.length == 200
    # Longer chunks (prefill) of several slots in one eager slot pass, padded to the longest chunk.
    chunks = [torch.randint(0, rt.cfg.vocab_size, (t,)) for t in (100, 17, 64)]
    ref = [rt(ch, c, c.length, 1) for ch, c in zip(chunks, own, strict=True)]
    best: list = []
    got = slots.prefill([(ch, v, v.length, 1) for ch, v in zip(chunks, views, strict=True)], best)
    for r, g, b in zip(ref, got, best, strict=True):
        assert g.shape == r.shape and torch.allclose(g, r, atol=1e-4, rtol=1e-4)
        assert b == [int(g[-1].argmax())] == [int(r[-1].argmax())]
    for c, v in zip(own, views, strict=True):
        assert v.length == c.length
        assert torch.allclose(v.keys[:, :, : c.length], c.keys[:, :, : c.length], atol=1e-5)
    assert torch.equal(bystander.keys[:, :, :200], kept) and bystander.length == 200
    # Rollback is a length change; giving back copies the valid part home and frees the slot.
    views[0].rollback(len(prompts[0]))
    home = rt.new_cache(256)
    slots.give(views[0], home)
    assert home.length == len(prompts[0]) and slots.in_use() == 3
    assert torch.equal(home.keys[:, :, : home.length], views[0].keys[:, :, : home.length])
    again = slots.take(rt.new_cache(256))
    assert slots._slot[id(again)] == 0  # the lowest free slot is reused first
    assert slots.take(rt.new_cache(512)) is None  # longer than a slot: stays where it is


@pytest.mark.parametrize("overlap", [True, False])
def test_slotted_scheduler_output_equals_unbatched(
    compact_target, compact_draft, one_thread, overlap, compact_unbatched
):
    """Also without overlap (FIMBLE_SERVE_OVERLAP=0: text streamed before a round's launch, not during it)."""
    target, draft = compact_target, compact_draft
    expected = compact_unbatched(_requests())  # LocalEngine(target, draft): `fimble lsp`'s engine
    engine = ServeEngine(target, draft, batch=True, slots=True, overlap=overlap)
    thread = threading.Thread(target=engine.serve_forever, daemon=True)
    thread.start()
    try:
        together = [s.collect() for s in [engine.submit(r) for r in _requests()]]
        counters = engine.counters()
        alone = [engine.submit(r).collect() for r in _requests()]
        in_use = engine.slots.in_use()
    finally:
        engine.close()
        thread.join(10)
    assert engine.info()["scheduler"] == "batched-graphs"
    assert counters["sched_graph_rounds"] > 0 and counters["sched_max_batch"] == N_PROMPTS
    assert not counters.get("failed")
    assert in_use == 0  # every finished sequence gave its slot back
    assert together == expected
    assert alone == expected


def test_cancelled_sequences_free_their_slots(compact_target):
    engine = ServeEngine(compact_target, None, batch=True, slots=True)
    thread = threading.Thread(target=engine.serve_forever, daemon=True)
    thread.start()
    try:
        streams = [engine.submit(r) for r in _requests(4, max_tokens=200)]
        wait_for(lambda: engine.counters()["sched_graph_rounds"] > 2)
        for s in streams:
            s.cancel()
        for s in streams:
            s.collect()  # raises on an error
        wait_for(lambda: engine.slots.in_use() == 0 and not engine.active_documents())
        counters = engine.counters()
    finally:
        engine.close()
        thread.join(10)
    assert engine.slots.in_use() == 0 and not counters.get("failed")


def test_a_cancel_ends_while_the_pass_runs_and_leaves_the_cache_exact(compact_target, one_thread):
    """With overlap a cancelled sequence ends at the round's launch (its pass in flight dropped: engine/steps.py),
    not after the pass; what its document's cache keeps must still be exact for the next request."""
    plain = LocalEngine(compact_target, None, start_thread=False)
    expected = [plain.complete(r).text for r in _requests(4)]
    engine = ServeEngine(compact_target, None, batch=True, slots=True, overlap=True)
    thread = threading.Thread(target=engine.serve_forever, daemon=True)
    thread.start()
    try:
        long = [engine.submit(r) for r in _requests(4, max_tokens=400)]
        wait_for(lambda: engine.counters()["decode_steps"] > 12)
        for s in long:
            s.cancel()
        for s in long:
            s.collect()
        wait_for(lambda: engine.slots.in_use() == 0 and not engine.active_documents())
        cancelled = engine.counters()["sched_cancel_overlapped"]
        again = [engine.submit(r).collect() for r in _requests(4)]  # the same documents: their caches reused
        counters = engine.counters()
    finally:
        engine.close()
        thread.join(10)
    assert cancelled >= 1 and not counters.get("failed")
    assert counters["tokens_reused"] > 0
    assert again == expected


class _StubDecoder:
    """The two calls ``SlottedPasses.shorten`` makes of a SpeculativeDecoder, with a fixed acceptance rate."""

    def __init__(self, rate: float):
        self.rate, self.cut_to = rate, None

    def expected_tokens(self) -> list[float]:  # 1 + a + a^2 + ... with g of its 7 drafts
        return [sum(self.rate**j for j in range(g + 1)) for g in range(8)]

    def shorten(self, rows: int) -> None:
        self.cut_to = rows


def test_round_block_choice_cuts_drafts_that_do_not_pay(compact_target, one_thread):
    """A round's verify blocks are cut to the bucket with the most expected tokens per measured ms."""
    from engine.serve.batched import Forward

    rt = compact_target.runtime
    engine = ServeEngine(compact_target, None, slots=True, threads=1, slot_len=256)
    slots = engine.slots
    views = [slots.take(rt.new_cache(256)) for _ in range(2)]
    for v in views:
        v.length = 100
    batch = 2  # two slots: the lowest power of two covering both

    def round_with(rate: float, costs: dict[int, float]) -> list[_StubDecoder]:
        slots._cost = {(batch, rows, 256): ms for rows, ms in costs.items()}
        stubs = [_StubDecoder(rate) for _ in views]
        calls = [Forward([1] * 8, v, 100, 8, decoder=d) for v, d in zip(views, stubs, strict=True)]
        engine.passes.shorten(calls)
        return stubs

    flat = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.05}
    steep = {1: 1.0, 2: 1.9, 4: 3.8, 8: 7.6}  # a row costs as much as a step: drafting never pays
    assert [d.cut_to for d in round_with(0.9, flat)] == [None, None]  # cheap rows, good drafts: kept
    assert [d.cut_to for d in round_with(0.0, flat)] == [1, 1]  # drafts never accepted: plain steps
    assert [d.cut_to for d in round_with(0.9, steep)] == [1, 1]
    assert [d.cut_to for d in round_with(0.9, {1: 1.0})] == [2, 2]  # 2 rows unmeasured: tried once, then learnt
    assert engine.counters()["sched_shortened"] >= 6
    assert engine.warm_graphs() == 0  # nothing to capture without CUDA
    engine.close()


def test_row_span_reads_the_rows_a_slice_would():
    """SlotGraphs.collect(lazy=True) hands out RowSpans: the same rows as the slice, read only when asked."""
    import pytest

    from engine.runtimes.cuda_graphs import RowSpan, rows_tensor

    logits = torch.arange(40.0).view(10, 4)
    span = RowSpan(logits, 3, 6)
    assert len(span) == 3
    assert torch.equal(span[0], logits[3]) and torch.equal(span[-1], logits[5]) and torch.equal(span[2], logits[5])
    assert torch.equal(rows_tensor(span), logits[3:6]) and rows_tensor(logits) is logits
    with pytest.raises(IndexError):
        span[3]
    with pytest.raises(IndexError):
        span[-4]
