"""On a CUDA GPU: slotted graph rounds of `fimble serve` (engine/runtimes/cuda_graphs.py SlotGraphs) against eager.

1. Pass level, embedded target (fp32): one replayed batched graph over several slots gives each sequence's
   logits as the eager model does (relative error, argmax) and leaves a bystander slot's keys alone.
2. The 1.5B shape (random bf16 weights, bench/harness/random_models.py): N_STREAMS sequences fed the same tokens,
   every step one replay of the slot graph, against each run alone by the eager model: argmax differences
   only at near ties, logits close; free-running greedy identity printed.
3. Scheduler, embedded pair: N_PROMPTS requests at once through ServeEngine (slotted graph rounds) against
   the plain LocalEngine, one at a time.

bf16/fp32 GEMMs pick kernels by row count, so a sequence's logits in a batch can differ in the last bit
from the same sequence alone, and greedy outputs can then part at a near tie (tests/gpu/test_graph_lossless.py
says the same of graph against eager). So 2 and 3 print how many outputs are identical and assert at least
MIN_IDENTICAL of them (and no failures), and all of them with the batch-invariant kernels (the CUDA default with
its row limits, or the Triton set); 1 asserts closeness. Skipped without CUDA; run on the GPU machine with
``python3 -m pytest -s tests/gpu/test_serve_graph_slots.py``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

N_PROMPTS = 32
MAX_TOKENS = 32
N_STREAMS = 16
STEPS = 48
MIN_IDENTICAL = 0.8


def test_slot_graph_pass_matches_eager():
    from engine.loader import DEFAULT_TARGET, load_model
    from engine.runtimes.cuda_graphs import SlotGraphs, eager_runtime

    rt = eager_runtime(load_model(DEFAULT_TARGET, device="cuda", runtime="compact").runtime)
    torch.manual_seed(0)
    slots = SlotGraphs(rt, 8, 512)
    lens, blocks = (37, 5, 300, 120, 64), (1, 9, 3, 16, 1)
    own, views = [], []
    for n in lens:
        cache = rt.new_cache(512)
        rt(torch.randint(0, rt.cfg.vocab_size, (n,), device="cuda"), cache, 0, 1)
        own.append(cache)
        views.append(slots.take(cache))
    other = rt.new_cache(512)
    rt(torch.randint(0, rt.cfg.vocab_size, (400,), device="cuda"), other, 0, 1)
    bystander = slots.take(other)
    kept = bystander.keys[:, :, :400].clone()
    toks = [torch.randint(0, rt.cfg.vocab_size, (t,), device="cuda") for t in blocks]
    ref = [rt(t, c, n, len(t)).clone() for t, c, n in zip(toks, own, lens, strict=True)]
    for _ in range(2):  # the first run captures, the second replays
        for v, n in zip(views, lens, strict=True):
            v.rollback(n)
        got = [g.clone() for g in slots.run([(t, v, n, len(t)) for t, v, n in zip(toks, views, lens, strict=True)])]
    assert slots.captures == 1 and slots.replays == 2
    for r, g in zip(ref, got, strict=True):
        err = float((g - r).norm() / r.norm())
        assert err < 1e-3, err
        assert torch.equal(g.argmax(-1), r.argmax(-1))
    assert torch.equal(bystander.keys[:, :, :400], kept)


def test_slot_graph_greedy_decode_1p5b_matches_eager():
    """Teacher-forced: every stream is fed the same tokens by both paths, so each step's logits compare
    directly. Every argmax difference must be a near tie the numeric difference explains (the reference's
    top-2 margin at most twice the row's largest logit difference); the free-running greedy outputs are
    printed too (random weights give near-flat logits, so they part early at such ties)."""
    from bench.harness.random_models import random_model
    from engine.runtimes.cuda_graphs import GraphRuntime, SlotGraphs

    model = random_model("1.5B")
    single = GraphRuntime(model, max_caches=N_STREAMS + 1)  # the per-sequence graphs: today's accepted path
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(5)
    lens = [int(n) for n in torch.randint(20, 600, (N_STREAMS,), generator=gen)]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).cuda() for n in lens]
    forced = torch.randint(0, vocab, (N_STREAMS, STEPS), generator=gen).cuda()
    max_len = 1024
    flips = unexplained = g_flips = g_unexplained = 0
    worst_rel = g_worst_rel = 0.0
    with torch.inference_mode():
        slots = SlotGraphs(model, N_STREAMS, max_len)
        own = [model.new_cache(max_len) for _ in prompts]
        alone = [model.new_cache(max_len) for _ in prompts]
        views = []
        for p, c, a in zip(prompts, own, alone, strict=True):
            model(p, c, 0, 1)
            model(p, a, 0, 1)
            view = slots.take(model.new_cache(max_len))
            model(p, view, 0, 1)  # the prefill runs eagerly into the slot
            views.append(view)
        for step in range(STEPS):
            best: list = []
            passes = [(forced[i, step : step + 1], v, v.length, 1) for i, v in enumerate(views)]
            got = [g[-1].clone() for g in slots.run(passes, best)]
            for i, (c, a) in enumerate(zip(own, alone, strict=True)):
                ref = model(forced[i, step : step + 1], c, c.length, 1)[-1]
                top2 = ref.topk(2).values
                margin = float(top2[0] - top2[1])
                diff = float((got[i] - ref).abs().max())
                worst_rel = max(worst_rel, float((got[i] - ref).norm() / ref.norm()))
                assert best[i][-1] == int(got[i].argmax())
                if best[i][-1] != int(ref.argmax()):
                    flips += 1
                    unexplained += int(margin > 2 * diff)
                g = single(forced[i, step : step + 1], a, a.length, 1)[-1]
                g_diff = float((g - ref).abs().max())
                g_worst_rel = max(g_worst_rel, float((g - ref).norm() / ref.norm()))
                if int(g.argmax()) != int(ref.argmax()):
                    g_flips += 1
                    g_unexplained += int(margin > 2 * g_diff)
        # Free running, for the record: greedy outputs of both paths from the same prompts.
        outs, expected = [], []
        for i, p in enumerate(prompts):
            cache = model.new_cache(max_len)
            tok, out = int(model(p, cache, 0, 1)[-1].argmax()), []
            for _ in range(STEPS):
                out.append(tok)
                tok = int(model(torch.tensor([tok], device="cuda"), cache, cache.length, 1)[-1].argmax())
            expected.append(out)
            views[i].rollback(0)
            outs.append([int(model(p, views[i], 0, 1)[-1].argmax())])
        for _ in range(STEPS - 1):
            best = []
            slots.run([(torch.tensor(o[-1:]), v, v.length, 1) for o, v in zip(outs, views, strict=True)], best)
            for o, b in zip(outs, best, strict=True):
                o.append(b[-1])
    same = sum(a == b for a, b in zip(outs, expected, strict=True))
    print(
        f"\n1.5B random bf16, {N_STREAMS} streams x {STEPS} steps, slot graph vs eager alone: teacher-forced "
        f"argmax differences {flips}/{N_STREAMS * STEPS} (unexplained by the numeric difference: {unexplained}), "
        f"worst relative logits error {worst_rel:.2e}; per-sequence graphs (GraphRuntime) vs eager: argmax "
        f"differences {g_flips} (unexplained {g_unexplained}), worst relative error {g_worst_rel:.2e}; "
        f"free-running greedy identical {same}/{N_STREAMS}; captures {slots.captures}, replays {slots.replays}"
    )
    if _invariant(slots.attention):  # a slotted round's rows are the eager rows' bits
        assert flips == g_flips == 0 and worst_rel == g_worst_rel == 0.0 and same == N_STREAMS
    # Random weights give near-flat logits (many near ties) and a deep random net amplifies bf16 rounding, so
    # the bar is the per-sequence graph path on the same inputs, not a fixed error; with the default kernels
    # (cuBLAS on 16-row passes) that path is exact, and the bar is what the old kernels gave (3.8e-2, 73 flips:
    # bench/reports/gpu-tests-h200-2026-12-01.txt), a round of 16 streams multiplying 256 rows.
    assert unexplained == 0
    assert worst_rel <= max(5e-2, 2 * g_worst_rel)
    assert flips <= max(0.12 * N_STREAMS * STEPS, 2 * g_flips)


def test_slotted_scheduler_on_cuda_matches_unbatched():
    from bench.harness.prompts import fim_prompts
    from engine import env_settings
    from engine.api import CompletionRequest, DecodeOptions
    from engine.local import open_engine
    from engine.serve.scheduler import ServeEngine

    plain = open_engine(REPO / "models" / "fimble-target", REPO / "models" / "fimble-draft", device="cuda")
    try:

        def requests() -> list[CompletionRequest]:
            return [
                CompletionRequest(p, s, options=DecodeOptions(max_tokens=MAX_TOKENS), document_id=f"doc{i}")
                for i, (p, s) in enumerate(fim_prompts(N_PROMPTS, seed=3))
            ]

        expected = [plain.complete(r) for r in requests()]
        engine = ServeEngine(plain.target, plain.draft, batch=True)
        assert engine.slots is not None
        thread = threading.Thread(target=engine.serve_forever, daemon=True)
        thread.start()
        try:
            together = [s.collect() for s in [engine.submit(r) for r in requests()]]
            counters = engine.counters()
            alone = [engine.submit(r).collect() for r in requests()]
            in_use = engine.slots.in_use()
        finally:
            engine.close()
            thread.join(10)
    finally:
        plain.close()
    assert all(e.finish_reason != "error" for e in expected)
    ref = [e.text for e in expected]
    same_together = sum(a == b for a, b in zip(together, ref, strict=True))
    same_alone = sum(a == b for a, b in zip(alone, ref, strict=True))
    print(
        f"\nserve slotted graphs on CUDA, {N_PROMPTS} prompts x {MAX_TOKENS} tokens: together == unbatched "
        f"{same_together}/{N_PROMPTS}, alone == unbatched {same_alone}/{N_PROMPTS}; graph rounds "
        f"{counters['sched_graph_rounds']} of {counters['sched_rounds']}, max batch {counters['sched_max_batch']}, "
        f"captures {engine.slots.captures}, replays {engine.slots.replays}, failed {counters.get('failed')}; fed "
        f"rounds {counters['sched_fed_rounds']}, guessed steps {counters['sched_fed_matched']} of "
        f"{counters['sched_fed_rows']} held"
    )
    assert counters["sched_graph_rounds"] > 0 and counters["sched_max_batch"] > 1 and not counters.get("failed")
    if env_settings.read("FIMBLE_SERVE_FEED"):  # fed rounds ran (engine/fed_rounds.py): their rows gave these outputs
        assert counters["sched_fed_rounds"] > 0 and counters["sched_fed_matched"] > 0
    assert in_use == 0
    if _invariant(engine.slots.attention):  # batched rounds give the unbatched bits
        assert same_together == same_alone == N_PROMPTS
    assert same_together >= MIN_IDENTICAL * N_PROMPTS


def _invariant(kernels: str | None) -> bool:
    """Whether a batched round's rows are each sequence's bits alone: the Triton set by construction, the default
    (cuBLAS on 16-row passes) with its row limits on (engine/runtimes/row_limits.py)."""
    from engine.runtimes import row_limits
    from engine.runtimes.gpu_kernels import INVARIANT_SETS

    return kernels == "invariant" or (kernels in INVARIANT_SETS and row_limits.enabled())
