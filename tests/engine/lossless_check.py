"""Greedy decoding with a trace of the logits each choice was made from, and the near-tie check.

See tests/engine/test_lossless_greedy.py for why a divergence may be a tie, and when it is one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.api import CompletionRequest
from engine.decoding import spec_policy
from engine.decoding.drafters import ModelDrafter, NgramDrafter
from engine.decoding.speculative import DecodeOptions, SpeculativeDecoder
from engine.local import LocalEngine

MAX_TOKENS = 12
TIE_TOLERANCE = 1e-4  # relative to the logit's size; fp32 shape-dependent rounding is ~1e-7


def decode(target, cache, prompt, heal, drafter_name, model_drafter, ngram) -> SpeculativeDecoder:
    opts = DecodeOptions(max_tokens=MAX_TOKENS, drafter=drafter_name)
    dec = SpeculativeDecoder(
        target.runtime, cache, target.stop_ids, opts, model_drafter, ngram, heal, target.token_index
    )
    dec.trace = []
    # Plain greedy is the reference: the healed text re-typed one constrained step at a time. The drafters
    # also check a heal draft with the prompt's pass (SpeculativeDecoder.prefill_draft).
    dec.heal_drafts = drafter_name != "none"
    # Draft every round (no cost-aware skipping, engine/decoding/spec_policy.py): the check needs verify
    # blocks, and whether drafting pays on this machine must not decide what is tested.
    dec.costs = None
    # The prompt's keys/values from the previous run over the same prompt stay valid.
    reuse = min(cache.length, len(prompt) - 1)
    cache.rollback(reuse)
    dec.prefill_committed = len(dec.prefill(prompt, reuse))
    while not dec.done:
        dec.step()
    return dec


def first_difference(a: SpeculativeDecoder, b: SpeculativeDecoder) -> int | None:
    """First position where the two decoders chose different tokens (stop tokens included)."""
    return next((i for i, (x, y) in enumerate(zip(a.trace, b.trace, strict=False)) if x[0] != y[0]), None)


def tie_margins(a: SpeculativeDecoder, b: SpeculativeDecoder, i: int) -> tuple[float, float]:
    """How far each decoder's own choice at position ``i`` led the other's choice, in its own logits."""
    (ta, row_a), (tb, row_b) = a.trace[i], b.trace[i]
    return float(row_a[ta] - row_a[tb]), float(row_b[tb] - row_b[ta])


def is_tie(a: SpeculativeDecoder, b: SpeculativeDecoder, i: int) -> bool:
    (ta, row_a), _ = a.trace[i], b.trace[i]
    tol = TIE_TOLERANCE * max(1.0, abs(float(row_a[ta])))
    return all(0 <= m < tol for m in tie_margins(a, b, i))  # an -inf (masked) choice is never a tie


@dataclass
class Comparison:
    mismatches: list = field(default_factory=list)
    ties: int = 0
    healed: int = 0
    heal_drafts_taken: int = 0  # runs whose prompt pass committed more than one token (a heal draft accepted)
    accepted: dict = field(default_factory=lambda: {"model": [], "ngram": [], "auto": []})

    def mean_accepted(self, name: str) -> float:
        return sum(self.accepted[name]) / max(1, len(self.accepted[name]))

    def summary(self) -> str:
        return (
            f"{self.healed} healed ({self.heal_drafts_taken} heal drafts taken), x 3 drafters: "
            f"{len(self.mismatches)} divergences, {self.ties} near ties; "
            "mean tokens per verify step: " + ", ".join(f"{k} {self.mean_accepted(k):.2f}" for k in self.accepted)
        )


def compare_drafters(target, draft, prompts: list[tuple[str, str]]) -> Comparison:
    """Plain greedy against the model, n-gram and auto drafters on each (prefix, suffix), healing on.

    The policy drafts by the verify passes' measured costs (spec_policy.verify_costs), which move with the
    machine's load and are measured once per library: a probe taken on a busy machine drafted less, and the
    model drafter's tokens per verify step fell below what the callers assert. So the costs are pinned flat
    here (every pass one step: the longest drafts) and the counts depend on outputs alone. Losslessness does
    not depend on the policy either way."""
    pinned = spec_policy._COSTS.get(target.runtime)
    spec_policy._COSTS[target.runtime] = spec_policy.FLAT
    try:
        return _compare_drafters(target, draft, prompts)
    finally:
        if pinned is None:
            spec_policy._COSTS.pop(target.runtime, None)
        else:
            spec_policy._COSTS[target.runtime] = pinned


def _compare_drafters(target, draft, prompts: list[tuple[str, str]]) -> Comparison:
    engine = LocalEngine(target, None, start_thread=False)  # only for its prompt builder
    cache = target.runtime.new_cache(target.max_len)
    model_drafter = ModelDrafter(draft.runtime, draft.max_len)
    ngram = NgramDrafter()
    out = Comparison()
    for prefix, suffix in prompts:
        prompt, heal, constrained = engine.build_prompt(CompletionRequest(prefix, suffix))
        heal = heal if constrained else ""
        out.healed += bool(heal)
        # Every run starts from the same prompt state: all but the last prompt token cached, that one
        # re-run as a 1-token pass (what the engine does for a cached document).
        cache.rollback(0)
        target.runtime(torch.tensor(prompt[:-1]), cache, 0, 1)
        plain = decode(target, cache, prompt, heal, "none", None, None)
        for name in ("model", "ngram", "auto"):
            dec = decode(target, cache, prompt, heal, name, model_drafter, ngram)
            out.accepted[name].append(dec.stats.mean_accepted)
            out.heal_drafts_taken += dec.prefill_committed > 1
            if dec.output == plain.output:
                continue
            i = first_difference(plain, dec)
            if i is not None and is_tie(plain, dec, i):
                out.ties += 1
            else:
                margins = tie_margins(plain, dec, i) if i is not None else None
                out.mismatches.append((name, prefix[-40:], plain.output, dec.output, i, margins))
    return out
