"""On a CUDA GPU: the batch-invariant kernels (engine/runtimes/gpu_kernels.py, the CUDA default) make a row's logits
the same bits whatever pass computes it.

1. Rows: a k-token verify pass against k 1-token steps, k = 1..16, at three cache depths, eagerly (the model's own
   forward) and through captured graphs (``GraphRuntime``), and eager against graph: the embedded target and draft
   and a random-weight Qwen2.5 0.5B shape, bf16. Every row bit-identical.
2. Batches: a slotted round of five sequences at other depths with blocks of 1-16 (``SlotGraphs``, one replayed
   graph) and the eager batched forward (engine/serve/batched.py) against each sequence's verify pass alone.
3. The embedded pair on FIM prompts, greedy bf16: speculative (auto, draft model, n-gram) output equals plain output
   token for token, eagerly and through graphs, and graph output equals eager output.

Skipped without CUDA and Triton (CI has neither); run on the GPU machine with
``python3 -m pytest -s tests/gpu/test_batch_invariance.py``. bench/gpu_invariant.py measures the same on more shapes
against the old kernels (FIMBLE_CUDA_INVARIANT=0), and what it costs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _triton() -> bool:
    from engine.runtimes import gpu_kernels

    return gpu_kernels.available()


pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not _triton(), reason="needs CUDA and Triton")

# The done-when count (every method, eager and graph); FIMBLE_GPU_PROMPTS=24 for a quick look.
N_PROMPTS = int(os.environ.get("FIMBLE_GPU_PROMPTS", "200"))
MAX_TOKENS = 64


def _copy(dst, src):
    dst.keys.copy_(src.keys)
    dst.values.copy_(src.values)
    dst.length = src.length


def _models():
    from bench.harness.random_models import random_model
    from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
    from engine.runtimes.cuda_graphs import eager_runtime

    yield "embedded target", eager_runtime(load_model(DEFAULT_TARGET, device="cuda", dtype=torch.bfloat16).runtime)
    yield "embedded draft", eager_runtime(load_model(DEFAULT_DRAFT, device="cuda", dtype=torch.bfloat16).runtime)
    yield "random 0.5B", random_model("0.5B")


def _kernels() -> str:
    from engine.runtimes.cuda_graphs import default_attention

    return default_attention()


def test_default_is_invariant():
    from engine.runtimes.cuda_graphs import GraphRuntime
    from engine.runtimes.gpu_kernels import INVARIANT_SETS

    assert _kernels() in INVARIANT_SETS
    name, model = next(_models())
    assert GraphRuntime(model).attention == _kernels()
    cache = model.new_cache(64)
    model(torch.tensor([1, 2, 3], device="cuda"), cache, 0, 1)
    assert model.invariant == _kernels()  # decided at the first CUDA pass


@torch.inference_mode()
def test_verify_rows_equal_steps_eager_and_graph():
    from engine.runtimes.cuda_graphs import GraphRuntime

    report = []
    for name, model in _models():
        model.invariant = _kernels()
        graph = GraphRuntime(model)
        vocab = model.cfg.vocab_size
        gen = torch.Generator().manual_seed(3)
        base, cv, cs = (model.new_cache(1100) for _ in range(3))
        rows = differ = cross = 0
        for depth in (37, 300, 1000):
            base.rollback(0)
            model(torch.randint(0, vocab, (depth,), generator=gen).cuda(), base, 0, 1)
            for k in range(1, 17):
                block = torch.randint(0, vocab, (k,), generator=gen).cuda()
                got = {}
                for kind, rt in (("eager", model), ("graph", graph)):
                    _copy(cv, base)
                    verify = rt(block, cv, depth, k).clone()
                    _copy(cs, base)
                    steps = torch.cat([rt(block[i : i + 1], cs, depth + i, 1).clone() for i in range(k)])
                    differ += int((verify != steps).any(-1).sum())
                    rows += k
                    got[kind] = verify
                cross += int((got["eager"] != got["graph"]).any(-1).sum())
        report.append(f"{name}: {differ} of {rows} rows differ, eager vs graph {cross}; replays {graph.replays}")
        assert graph.replays > 0
        assert differ == 0 and cross == 0, report[-1]
        del graph, model
    print("\n" + "\n".join(report))


@torch.inference_mode()
def test_long_pass_rows_equal_steps():
    """A prefill's rows are a step's bits: a 300-token pass (more than gpu_linear.WIDE_ROWS rows, so with Triton
    projections the swap products may take the wide tile, where this GPU gives the same bits) against the
    same prompt's first 260 tokens in one pass and its last 40 in 1-token steps: the 40 rows' logits bit-identical,
    for both kernel sets. With the Triton set on a Hopper GPU the wide tile must have been taken (the probe found
    it equal), or this test would not test it."""
    from engine.runtimes import gpu_linear

    report = []
    for name, model in _models():
        for kernels in dict.fromkeys(("invariant", _kernels())):
            model.invariant = kernels
            vocab = model.cfg.vocab_size
            gen = torch.Generator().manual_seed(6)
            prompt = torch.randint(0, vocab, (300,), generator=gen).cuda()
            taken = gpu_linear._wide_checks["taken"]
            whole = model(prompt, model.new_cache(320), 0, 40).clone()
            taken = gpu_linear._wide_checks["taken"] - taken
            cache = model.new_cache(320)
            model(prompt[:260], cache, 0, 1)
            steps = torch.cat([model(prompt[i : i + 1], cache, i, 1).clone() for i in range(260, 300)])
            differ = int((whole != steps).any(-1).sum())
            report.append(f"{name} {kernels}: {differ} of 40 rows differ; wide-tile products {taken}")
            assert differ == 0, report[-1]
            swap = any(gpu_linear.linear_config(*layer.shape).swap for layer in _weights(model))
            if kernels == "invariant" and swap and torch.cuda.get_device_capability() == (9, 0):
                assert taken > 0, report[-1]
        del model
    print("\n" + "\n".join(report))


def _weights(model):
    layer = model.layers[0]
    return [layer.qkv.weight, layer.o_proj.weight, layer.gate_up.weight, layer.down.weight]


@torch.inference_mode()
def test_batched_rows_equal_alone():
    """A batched round's rows are each sequence's bits alone: with Triton projections ("invariant") by construction;
    with the default set (cuBLAS on 16-row passes) because products of more rows than cuBLAS keeps its kernel for run
    in pieces (engine/runtimes/row_limits.py; tests/gpu/test_row_limits_gpu.py at 32 streams)."""
    from engine.runtimes.cuda_graphs import SlotGraphs
    from engine.serve.batched import Forward, batched_forward

    report = []
    for name, model in _models():
        for kernels in dict.fromkeys(("invariant", _kernels())):
            model.invariant = kernels
            vocab = model.cfg.vocab_size
            gen = torch.Generator().manual_seed(4)
            max_len = 1100
            depths, blocks = (37, 300, 1000, 500, 120), (1, 3, 16, 7, 2)
            bases = []
            for d in depths:
                c = model.new_cache(max_len)
                model(torch.randint(0, vocab, (d,), generator=gen).cuda(), c, 0, 1)
                bases.append(c)
            toks = [torch.randint(0, vocab, (k,), generator=gen).cuda() for k in blocks]

            def fresh(c, model=model, max_len=max_len):
                tmp = model.new_cache(max_len)
                _copy(tmp, c)
                return tmp

            alone = [model(t, fresh(c), d, len(t)).clone() for c, d, t in zip(bases, depths, toks, strict=True)]
            slots = SlotGraphs(model, 8, max_len, attention=kernels)
            views = [slots.take(fresh(c)) for c in bases]
            for _ in range(2):  # the first run captures, the second replays
                for v, d in zip(views, depths, strict=True):
                    v.length = d
                passes = [(t, v, d, len(t)) for t, v, d in zip(toks, views, depths, strict=True)]
                got = [g.clone() for g in slots.run(passes)]
            assert slots.captures == 1 and slots.replays == 2
            calls = [Forward(t, fresh(c), d, len(t)) for c, d, t in zip(bases, depths, toks, strict=True)]
            eager = batched_forward(model, calls)
            slot_differ = sum(int((a != g).any(-1).sum()) for a, g in zip(alone, got, strict=True))
            eager_differ = sum(int((a != e).any(-1).sum()) for a, e in zip(alone, eager, strict=True))
            report.append(f"{name} {kernels}: slot round {slot_differ}, batched pass {eager_differ} of {sum(blocks)}")
            assert slot_differ == 0 and eager_differ == 0, report[-1]
    print("\nrows differing from the sequence alone: " + "; ".join(report))


def test_embedded_pair_speculative_equals_plain():
    from bench.harness.prompts import fim_prompts
    from engine.api import CompletionRequest
    from engine.decoding.drafters import ModelDrafter, NgramDrafter
    from engine.decoding.speculative import DecodeOptions, SpeculativeDecoder
    from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
    from engine.local import LocalEngine
    from engine.runtimes.cuda_graphs import GraphRuntime, eager_runtime

    target = load_model(DEFAULT_TARGET, device="cuda", dtype=torch.bfloat16)
    draft = load_model(DEFAULT_DRAFT, device="cuda", dtype=torch.bfloat16)
    builder = LocalEngine(target, None, start_thread=False)
    tm, dm = eager_runtime(target.runtime), eager_runtime(draft.runtime)
    gt, gd = GraphRuntime(tm), GraphRuntime(dm)
    prompts = [builder.build_prompt(CompletionRequest(p, s, heal=False))[0] for p, s in fim_prompts(N_PROMPTS, seed=11)]
    max_len = max(len(p) for p in prompts) + MAX_TOKENS + 32
    caches = {"eager": tm.new_cache(max_len), "graph": tm.new_cache(max_len)}
    drafters = {"eager": ModelDrafter(dm, max_len), "graph": ModelDrafter(gd, max_len)}
    ngram = NgramDrafter(history=0)

    def decode(prompt, kind, drafter):
        runtime = tm if kind == "eager" else gt
        md = drafters[kind] if drafter in ("auto", "model") else None
        cache = caches[kind]
        cache.rollback(0)
        dec = SpeculativeDecoder(
            runtime, cache, set(), DecodeOptions(max_tokens=MAX_TOKENS, drafter=drafter), md, ngram
        )
        dec.prefill(prompt)
        while not dec.done:
            dec.step()
        return dec

    same = {}
    accepted = []
    for prompt in prompts:
        plain = {kind: decode(prompt, kind, "none").output for kind in ("eager", "graph")}
        key = "graph plain == eager plain"
        same[key] = same.get(key, 0) + (plain["graph"] == plain["eager"])
        for kind in ("eager", "graph"):
            for drafter in ("auto", "model", "ngram"):
                dec = decode(prompt, kind, drafter)
                key = f"{kind} spec {drafter} == {kind} plain"
                same[key] = same.get(key, 0) + (dec.output == plain[kind])
                if drafter == "model":
                    accepted.append(dec.stats.mean_accepted)
    print(
        "\n"
        + "; ".join(f"{k} {v}/{N_PROMPTS}" for k, v in same.items())
        + f"; mean tokens per verify (draft model) {sum(accepted) / len(accepted):.2f}"
    )
    assert all(v == N_PROMPTS for v in same.values()), same
    assert sum(accepted) / len(accepted) > 1.3  # speculation really happened
    assert gt.replays > 0 and gd.replays > 0
