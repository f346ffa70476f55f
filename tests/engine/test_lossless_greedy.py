"""Greedy speculative decoding must reproduce plain greedy decoding token for token."""

from __future__ import annotations

import torch
from prompts import fim_prompts

from engine.drafters import ModelDrafter, NgramDrafter
from engine.local import LocalEngine
from engine.speculative import DecodeOptions, SpeculativeDecoder

N_PROMPTS = 200
MAX_TOKENS = 12


def decode(target, cache, prompt, heal, drafter_name, model_drafter, ngram) -> tuple[list[int], SpeculativeDecoder]:
    opts = DecodeOptions(max_tokens=MAX_TOKENS, drafter=drafter_name)
    dec = SpeculativeDecoder(target.runtime, cache, target.stop_ids, opts, model_drafter, ngram, heal,
                             target.token_index)
    # The prompt's keys/values from the previous run over the same prompt stay valid.
    reuse = min(cache.length, len(prompt) - 1)
    cache.rollback(reuse)
    dec.prefill(prompt, reuse)
    while not dec.done:
        dec.step()
    return dec.output, dec


def near_tie(target, prompt: list[int], plain: list[int], other: list[int]) -> bool:
    """At the first differing position, are the target's top two logits within 1e-4?"""
    i = next((j for j, (a, b) in enumerate(zip(plain, other, strict=False)) if a != b), None)
    if i is None:
        return False  # one output is a strict prefix of the other: a real bug
    cache = target.runtime.new_cache(len(prompt) + i + 1)
    logits = target.runtime(torch.tensor(prompt + plain[:i]), cache, 0, 1)[-1]
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1]) < 1e-4


def test_speculative_greedy_equals_plain_greedy(embedded_target, embedded_draft):
    target = embedded_target
    engine = LocalEngine(target, None, start_thread=False)  # only for its prompt builder
    cache = target.runtime.new_cache(target.max_len)
    model_drafter = ModelDrafter(embedded_draft.runtime, embedded_draft.max_len)
    ngram = NgramDrafter()
    from engine.api import CompletionRequest

    mismatches, ties, accepted = [], 0, {"model": [], "ngram": [], "auto": []}
    for prefix, suffix in fim_prompts(N_PROMPTS, window=600):
        prompt, heal, constrained = engine.build_prompt(CompletionRequest(prefix, suffix))
        heal = heal if constrained else ""
        cache.rollback(0)
        plain, _ = decode(target, cache, prompt, heal, "none", None, None)
        for name in ("model", "ngram", "auto"):
            out, dec = decode(target, cache, prompt, heal, name, model_drafter, ngram)
            accepted[name].append(dec.stats.mean_accepted)
            if out != plain:
                if near_tie(target, prompt, plain, out):
                    ties += 1
                else:
                    mismatches.append((name, prefix[-40:], plain, out))
    print(f"\n{N_PROMPTS} prompts x 3 drafters: {ties} near-tie divergences; mean tokens per verify step: "
          + ", ".join(f"{k} {sum(v) / len(v):.2f}" for k, v in accepted.items()))
    assert not mismatches, f"{len(mismatches)} divergences not explained by a near tie: {mismatches[:2]}"
    # Speculation must actually be exercised, or equality proves nothing.
    assert sum(accepted["model"]) / N_PROMPTS > 1.3
