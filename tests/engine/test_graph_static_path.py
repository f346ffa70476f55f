"""The CUDA-graph path's static-shape pass (engine/runtimes/cuda_graphs.py), run without graphs on the CPU.

Padding to a block bucket, the device-held start position, masked attention over a key bucket and
the one-sync greedy draft must give the eager path's tokens; the GPU test (tests/gpu) checks the
captured graphs themselves.
"""

from __future__ import annotations

import torch

from bench.harness.prompts import fim_prompts
from engine.api import CompletionRequest
from engine.decoding.drafters import ModelDrafter, NgramDrafter
from engine.decoding.speculative import DecodeOptions, SpeculativeDecoder
from engine.local import LocalEngine
from engine.runtimes.cuda_graphs import (
    BatchedCache,
    GraphRuntime,
    batched_forward,
    block_bucket,
    key_bucket,
    maybe_wrap,
)


def _decode(runtime, draft_runtime, prompt, drafter, tokens=16):
    cache = runtime.new_cache(len(prompt) + tokens + 16)
    md = ModelDrafter(draft_runtime, cache.max_len) if draft_runtime is not None else None
    dec = SpeculativeDecoder(
        runtime, cache, set(), DecodeOptions(max_tokens=tokens, drafter=drafter), md, NgramDrafter(history=0)
    )
    dec.prefill(prompt)
    while not dec.done:
        dec.step()
    return dec


def test_buckets():
    assert [block_bucket(t) for t in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, None]
    assert key_bucket(10, 4096) == 256 and key_bucket(257, 4096) == 512 and key_bucket(3000, 2100) == 2100


def test_cpu_models_are_not_wrapped(compact_target):
    assert maybe_wrap(compact_target.runtime) is compact_target.runtime


def test_static_block_logits_match_eager(compact_target):
    model = compact_target.runtime
    static = GraphRuntime(model)
    prompt = compact_target.encode("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self")
    eager_cache, static_cache = model.new_cache(300), model.new_cache(300)
    for cache in (eager_cache, static_cache):
        model(torch.tensor(prompt), cache, 0, 1)
    for t in (1, 3, 7, 13):  # padded to 1, 4, 8, 16
        block = torch.tensor(prompt[:t])
        a = model(block, eager_cache, len(prompt), t)
        b = static(block, static_cache, len(prompt), t)
        assert static_cache.length == eager_cache.length == len(prompt) + t
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()


def test_static_decode_equals_eager_greedy(compact_target, compact_draft):
    engine = LocalEngine(compact_target, None, start_thread=False)
    target, draft = GraphRuntime(compact_target.runtime), GraphRuntime(compact_draft.runtime)
    drafted = 0
    for prefix, suffix in fim_prompts(3, seed=3, window=300):
        prompt, _, _ = engine.build_prompt(CompletionRequest(prefix, suffix, heal=False))
        ref = _decode(compact_target.runtime, compact_draft.runtime, prompt, "model")
        for drafter in ("none", "model", "auto"):
            dec = _decode(target, draft, prompt, drafter)
            assert dec.output == ref.output, drafter
            if drafter == "model":  # the one-sync draft proposes what the eager loop proposes
                assert (dec.stats.drafted, dec.stats.accepted) == (ref.stats.drafted, ref.stats.accepted)
                drafted += dec.stats.drafted
    assert drafted > 0


def test_batched_forward_matches_one_sequence_at_a_time(compact_target):
    """Streams of a batched cache, each at its own position, with several new tokens each."""
    model = compact_target.runtime
    texts = ["def foo(x):\n    return", "import os\nimport sys\n", "class A:\n    pass\n\n\nclass B(A):"]
    prompts = [compact_target.encode(t) for t in texts]
    new = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    cache = BatchedCache(model, len(prompts), 300)
    expected = []
    for i, p in enumerate(prompts):
        model(torch.tensor(p), cache.slot(i), 0, 1)
        own = model.new_cache(300)
        model(torch.tensor(p), own, 0, 1)
        expected.append(model(new[i], own, len(p), 4))
    starts = torch.tensor([len(p) for p in prompts])
    for attention in ("sdpa", "matmul"):
        logits = batched_forward(model, cache, new, starts, 256, attention=attention).view(3, 4, -1)
        for i in range(3):
            torch.testing.assert_close(logits[i], expected[i], atol=1e-4, rtol=1e-4)
        last = torch.tensor([3, 1, 2])
        rows = batched_forward(model, cache, new, starts, 256, last, attention)
        for i in range(3):
            torch.testing.assert_close(rows[i], expected[i][last[i]], atol=1e-4, rtol=1e-4)
