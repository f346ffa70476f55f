"""On a CUDA GPU: greedy decoding through CUDA graphs (engine/runtimes/cuda_graphs.py) equals eager greedy decoding.

The embedded pair in bf16 on >= 200 FIM prompts from the frozen corpus: eager plain greedy is the
reference; graph plain and graph speculative (draft model + n-gram, the draft model's steps graphed
too) must produce the same tokens, and graph plain must equal the same static passes run uncaptured
exactly (capture and replay change nothing). Skipped without CUDA (CI has none); run on the GPU machine with
``python3 -m pytest -s tests/gpu``.

With the batch-invariant kernels (the CUDA default, engine/runtimes/gpu_kernels.py) every output must be
identical: eager and graph passes run the same kernels, whose reduction orders do not depend on a pass's
shape. With the old kernels (FIMBLE_CUDA_INVARIANT=0) bf16 logits depend on a pass's kernels: the graph
path attends over a masked, bucketed key length and pads blocks, the eager path slices. So there, as in
tests/engine/test_lossless_greedy.py, a divergence is allowed only where it is a near tie: at the first
differing position each path's own logits put the two tokens within ``TIE_TOLERANCE`` (a few bf16
rounding steps) of each other. Every tie is printed.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The done-when count; FIMBLE_GPU_PROMPTS=24 for a quick look.
N_PROMPTS = int(os.environ.get("FIMBLE_GPU_PROMPTS", "200"))
MAX_TOKENS = 48
TIE_TOLERANCE = 2**-6  # relative to the logit's size: bf16 keeps 8 significant bits, so 4 rounding steps


def _decode(runtime, cache, prompt, drafter, model_drafter, ngram):
    from engine.decoding.speculative import DecodeOptions, SpeculativeDecoder

    dec = SpeculativeDecoder(
        runtime, cache, set(), DecodeOptions(max_tokens=MAX_TOKENS, drafter=drafter), model_drafter, ngram
    )
    dec.trace = []
    cache.rollback(0)
    dec.prefill(prompt)
    while not dec.done:
        dec.step()
    return dec


def _margins(a, b, i):
    (ta, row_a), (tb, row_b) = a.trace[i], b.trace[i]
    return float(row_a[ta] - row_a[tb]), float(row_b[tb] - row_b[ta]), float(row_a[ta])


def test_graph_greedy_equals_eager_greedy():
    from bench.harness.prompts import fim_prompts
    from engine.api import CompletionRequest
    from engine.decoding.drafters import ModelDrafter, NgramDrafter
    from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
    from engine.local import LocalEngine
    from engine.runtimes.cuda_graphs import GraphRuntime, eager_runtime

    target = load_model(DEFAULT_TARGET, device="cuda", dtype=torch.bfloat16)
    draft = load_model(DEFAULT_DRAFT, device="cuda", dtype=torch.bfloat16)
    builder = LocalEngine(target, None, start_thread=False)
    # load_model wraps compact models on CUDA in a GraphRuntime: the reference is the model under it.
    target.runtime, draft.runtime = eager_runtime(target.runtime), eager_runtime(draft.runtime)
    g_target, g_draft = GraphRuntime(target.runtime), GraphRuntime(draft.runtime)
    prompts = []
    for prefix, suffix in fim_prompts(N_PROMPTS, seed=0, window=600):
        prompts.append(builder.build_prompt(CompletionRequest(prefix, suffix, heal=False))[0])
    max_len = max(len(p) for p in prompts) + MAX_TOKENS + 32
    eager_cache, graph_cache = target.runtime.new_cache(max_len), target.runtime.new_cache(max_len)
    md = ModelDrafter(g_draft, max_len)
    ngram = NgramDrafter(history=0)
    # The same static passes run without capture: replaying a graph must reproduce them bit for bit.
    s_target = GraphRuntime(target.runtime)
    s_target.use_graphs = False
    static_cache = target.runtime.new_cache(max_len)
    same_as_static = 0
    identical = {"graph plain": 0, "graph spec: auto": 0, "graph spec: draft model": 0}
    ties, mismatches, accepted = [], [], []
    for n, prompt in enumerate(prompts):
        ref = _decode(target.runtime, eager_cache, prompt, "none", None, None)
        runs = {
            "graph plain": _decode(g_target, graph_cache, prompt, "none", None, None),
            "graph spec: auto": _decode(g_target, graph_cache, prompt, "auto", md, ngram),
            "graph spec: draft model": _decode(g_target, graph_cache, prompt, "model", md, None),
        }
        accepted.append(runs["graph spec: draft model"].stats.mean_accepted)
        same_as_static += (
            _decode(s_target, static_cache, prompt, "none", None, None).output == runs["graph plain"].output
        )
        for name, dec in runs.items():
            if dec.output == ref.output:
                identical[name] += 1
                continue
            i = next(j for j, (x, y) in enumerate(zip(ref.trace, dec.trace, strict=False)) if x[0] != y[0])
            m_ref, m_dec, size = _margins(ref, dec, i)
            tol = TIE_TOLERANCE * max(1.0, abs(size))
            case = (n, name, i, round(m_ref, 5), round(m_dec, 5), round(tol, 5))
            (ties if 0 <= m_ref < tol and 0 <= m_dec < tol else mismatches).append(case)
    print(
        f"\n{N_PROMPTS} prompts x {MAX_TOKENS} tokens, embedded pair, bf16, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}"
    )
    for name, count in identical.items():
        print(f"  {name:24s} identical to eager plain greedy: {count}/{N_PROMPTS}")
    print(f"  graph plain identical to the same passes run uncaptured: {same_as_static}/{N_PROMPTS}")
    print(f"  near ties (prompt, path, position, margin eager, margin graph, tolerance): {len(ties)}")
    for case in ties:
        print(f"    {case}")
    print(f"  divergences not explained by a near tie: {len(mismatches)} {mismatches[:5]}")
    print(
        f"  mean tokens per verify (draft model): {sum(accepted) / len(accepted):.2f}; graph captures: "
        f"target {g_target.captures}, draft {g_draft.captures}; replays: target {g_target.replays}, "
        f"draft {g_draft.replays}"
    )
    assert not mismatches
    if g_target.attention in ("invariant", "invariant-cublas"):  # the default: no ties, every output identical
        assert all(count == N_PROMPTS for count in identical.values()), identical
    assert same_as_static == N_PROMPTS
    assert g_target.replays > 0 and g_draft.replays > 0  # the graphs really ran
    assert sum(accepted) / len(accepted) > 1.3  # speculation really happened
