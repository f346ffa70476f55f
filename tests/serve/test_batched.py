"""Continuous batching in-process: a batched pass equals each sequence alone, bit for bit; the
scheduler's output equals unbatched decoding token for token; fairness and cancellation by counters.
"""

from __future__ import annotations

import threading

import pytest
import torch
from serve_helpers import wait_for

from bench.harness.prompts import fim_prompts
from engine.api import CompletionRequest, DecodeOptions
from engine.local import LocalEngine
from engine.serve.batched import Forward, batched_forward
from engine.serve.scheduler import ServeEngine

N_PROMPTS = 5
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def models(compact_target, compact_draft):
    return compact_target, compact_draft  # batching is the compact runtime's (engine/serve/batched.py)


def _requests(n: int = N_PROMPTS) -> list[CompletionRequest]:
    return [
        CompletionRequest(p, s, options=DecodeOptions(max_tokens=MAX_TOKENS), document_id=f"doc{i}")
        for i, (p, s) in enumerate(fim_prompts(n, seed=3))
    ]


class Running:
    """A ServeEngine whose decode loop runs in a thread for the test."""

    def __init__(self, target, draft, **kw):
        self.engine = ServeEngine(target, draft, **kw)
        self.thread = threading.Thread(target=self.engine.serve_forever, daemon=True)
        self.thread.start()

    def __enter__(self) -> ServeEngine:
        return self.engine

    def __exit__(self, *exc) -> None:
        self.engine.close()
        self.thread.join(10)


def test_batched_pass_equals_each_sequence_alone(models, one_thread):
    """Prefill, 1-token steps and verify blocks at different cache lengths in one pass: every
    sequence's logits and cache are bit-identical to running it by itself."""
    rt = models[0].runtime
    torch.manual_seed(0)
    prompts = [torch.randint(0, rt.cfg.vocab_size, (n,)) for n in (37, 5, 120, 64)]
    blocks = [torch.randint(0, rt.cfg.vocab_size, (t,)) for t in (1, 9, 1, 4)]

    def prepared() -> list:
        caches = []
        for p in prompts:
            cache = rt.new_cache(256)
            batched_forward(rt, [Forward(p, cache, 0, 1)])
            caches.append(cache)
        return caches

    alone_caches, together_caches = prepared(), prepared()
    alone = [
        batched_forward(rt, [Forward(b, c, len(p), len(b))])[0]
        for p, b, c in zip(prompts, blocks, alone_caches, strict=True)
    ]
    fresh = torch.randint(0, rt.cfg.vocab_size, (50,))  # a new request's prefill in the same pass
    calls = [Forward(b, c, len(p), len(b)) for p, b, c in zip(prompts, blocks, together_caches, strict=True)]
    together = batched_forward(rt, [*calls, Forward(fresh, rt.new_cache(256), 0, 1)])
    for a, b in zip(alone, together, strict=False):
        assert torch.equal(a, b)
    for a, b in zip(alone_caches, together_caches, strict=True):
        assert a.length == b.length and torch.equal(a.keys[:, :, : a.length], b.keys[:, :, : b.length])


def test_batched_drafts_equal_each_drafter_alone(models, one_thread):
    """Greedy drafts of several sequences drafted together equal each drafted alone, and equal
    ModelDrafter.propose's (the same choices; caches left holding the same tokens)."""
    from engine.decoding.drafters import ModelDrafter
    from engine.serve.batched import DraftNeed, batched_greedy_drafts

    rt = models[1].runtime
    torch.manual_seed(1)
    contexts = [torch.randint(0, rt.cfg.vocab_size, (n,)).tolist() for n in (30, 7, 90)]

    def needs() -> list[DraftNeed]:
        out = []
        for i, ctx in enumerate(contexts):
            d = ModelDrafter(rt, 0)
            d.bind(rt.new_cache(256), [])
            out.append(DraftNeed(d, ctx, 3 + 2 * i, 0.0))  # gate 0: every draft runs its full length
        return out

    together = batched_greedy_drafts(rt, needs())
    alone = [batched_greedy_drafts(rt, [n])[0] for n in needs()]
    plain = [n.drafter.propose(n.context, n.k, 0.0, 1.0, n.gate, None).tokens for n in needs()]
    assert together == alone == plain
    assert [len(t) for t in together] == [3, 5, 7]


def test_batched_output_equals_unbatched(models, one_thread, compact_unbatched):
    target, draft = models
    expected = compact_unbatched(_requests())  # LocalEngine(target, draft): `fimble lsp`'s engine
    with Running(target, draft, batch=True) as engine:  # all at once: one pass per round
        together = [s.collect() for s in [engine.submit(r) for r in _requests()]]
        counters = engine.counters()
    assert counters["sched_max_batch"] == N_PROMPTS and counters["sched_passes"] == counters["sched_rounds"]
    with Running(target, draft, batch=True) as engine:  # one at a time through the same batched path
        alone = [engine.submit(r).collect() for r in _requests()]
    with Running(target, draft, batch=False) as engine:  # round-robin: the runtime's own forward
        interleaved = [s.collect() for s in [engine.submit(r) for r in _requests()]]
    assert together == alone  # bit-identical by construction (previous test)
    assert together == expected  # the same tokens as the unbatched engine of `fimble lsp`
    assert interleaved == expected


def test_long_completion_does_not_hold_back_a_new_one(models):
    """A short request submitted while a long one runs is admitted at the next round and ends first."""
    target, draft = models
    with Running(target, draft) as engine:
        long = engine.submit(
            CompletionRequest(
                "# " + "a long comment line\n# " * 20,
                "",
                document_id="long",
                options=DecodeOptions(max_tokens=400, drafter="none"),
            )
        )
        first = next(iter(long))  # the long one is decoding
        assert first.text
        short = engine.submit(
            CompletionRequest("def add(a, b):\n    ", "\n", document_id="short", options=DecodeOptions(max_tokens=4))
        )
        short.collect()
        assert long.result is None  # still running when the short one had its whole answer
        assert engine.counters()["sched_max_batch"] >= 2
        long.cancel()
        rest = list(long)
        assert rest[-1].finish_reason == "cancelled"
        assert long.result is not None and long.result.tokens < 400


def test_cancel_stops_within_one_step(models):
    target, draft = models
    with Running(target, draft) as engine:
        stream = engine.submit(
            CompletionRequest(
                "# " + "a long comment line\n# " * 20,
                "",
                document_id="c",
                options=DecodeOptions(max_tokens=400, drafter="none"),
            )
        )
        it = iter(stream)
        next(it)
        stream.cancel()
        steps_at_cancel = engine.counters()["decode_steps"]
        deltas = list(it)
        assert deltas[-1].finish_reason == "cancelled"
        # The pass in flight when the flag was set may finish; no step starts after it.
        assert engine.counters()["decode_steps"] - steps_at_cancel <= 1
        assert engine.counters()["cancelled"] == 1
        wait_for(lambda: engine.counters()["sched_active"] == 0)  # the gauge is set after the round


def test_same_document_requests_take_turns(models):
    """Two requests for one document share its cache, so they never run in the same round."""
    target, draft = models
    with Running(target, draft) as engine:
        reqs = [
            CompletionRequest("def add(a, b):\n    ", "\n", document_id="same", options=DecodeOptions(max_tokens=8))
            for _ in range(3)
        ]
        texts = [s.collect() for s in [engine.submit(r) for r in reqs]]
        assert texts[0] == texts[1] == texts[2]
        assert engine.counters()["sched_max_batch"] == 1


def test_sampled_output_equals_unbatched_with_a_seed(models, one_thread):
    """Temperature sampling (drafts carry distributions, drafted per sequence) through the scheduler."""
    target, draft = models

    def reqs() -> list[CompletionRequest]:
        return [
            CompletionRequest(
                p, s, document_id=f"s{i}", options=DecodeOptions(max_tokens=16, temperature=0.8, seed=11 + i)
            )
            for i, (p, s) in enumerate(fim_prompts(3, seed=9))
        ]

    plain = LocalEngine(target, draft, start_thread=False)
    expected = [plain.complete(r).text for r in reqs()]
    with Running(target, draft) as engine:
        got = [s.collect() for s in [engine.submit(r) for r in reqs()]]
    assert got == expected


def test_prewarm_runs_when_idle_and_is_reused(models):
    target, draft = models
    prefix, suffix = fim_prompts(1, seed=4)[0]
    with Running(target, draft) as engine:
        engine.prewarm(CompletionRequest(prefix, suffix, document_id="warm"))
        wait_for(lambda: engine.counters()["prewarms_done"] == 1)
        stream = engine.submit(
            CompletionRequest(prefix, suffix, document_id="warm", options=DecodeOptions(max_tokens=4))
        )
        stream.collect()
        assert stream.result.stats["prefilled_tokens"] <= 1 < stream.result.stats["reused_tokens"]


def test_streamed_deltas_are_paced_but_nothing_is_lost(compact_target):
    """fimble serve sends a completion's first text at once, later text at most every STREAM_INTERVAL_S, and
    the rest at the end: joined, the deltas are the whole text."""
    from types import SimpleNamespace

    from engine.serve.scheduler import STREAM_INTERVAL_S
    from engine.steps import TextOut

    pushed = []
    engine = SimpleNamespace(
        documents=SimpleNamespace(target=compact_target),
        stream_interval=STREAM_INTERVAL_S,
        counts=SimpleNamespace(add=lambda *a: None),
    )
    decoder = SimpleNamespace(opt=SimpleNamespace(stop=(), max_lines=0), done=False, finish_reason="length")
    stream = SimpleNamespace(push=lambda d: pushed.append(d.text))
    out = TextOut(engine, decoder, stream, "", False)
    now = [100.0]
    out.clock = lambda: now[0]  # a clock of the test's own: no dependence on how fast this machine runs
    tok = compact_target.tokenizer
    ids = tok.encode("def total(values):\n    return sum(v for v in values if v)\n", add_special_tokens=False)
    for i in ids[:-1]:  # far faster than the interval: one delta for the first text, then held
        out.emit([i])
    assert len(pushed) == 1 and pushed[0]
    now[0] += STREAM_INTERVAL_S
    out.emit([])  # the interval has passed: what was held goes out
    assert len(pushed) == 2
    decoder.done = True
    out.emit(ids[-1:])  # the last tokens always go
    out.finish()
    assert "".join(pushed) == tok.decode(ids) == out.text


def test_a_keystrokes_request_joins_the_round_that_frees_its_document(models, one_thread):
    """An editor types on: the new request for a document whose completion still runs has its prompt built while
    it waits, is admitted in the round where the cancelled one ends (not a round later), and answers exactly what
    it answers alone."""
    target, draft = models
    prefix, suffix = "# " + "a long comment line\n# " * 20, ""
    typed = CompletionRequest(prefix + "an", suffix, document_id="typing", options=DecodeOptions(max_tokens=12))
    alone_engine = LocalEngine(target, draft, start_thread=False)
    alone = alone_engine.complete(
        CompletionRequest(prefix + "an", suffix, document_id="typing", options=DecodeOptions(max_tokens=12))
    ).text
    with Running(target, draft) as engine:
        long = DecodeOptions(max_tokens=400, drafter="none")
        old = engine.submit(CompletionRequest(prefix, suffix, document_id="typing", options=long))
        assert next(iter(old)).text  # decoding
        new = engine.submit(typed)
        wait_for(lambda: engine.counters()["sched_prebuilt"] == 1)  # built while the document is busy
        old.cancel()
        text = new.collect()
        counters = engine.counters()
    assert counters["sched_admitted_early"] == 1
    assert text == alone
