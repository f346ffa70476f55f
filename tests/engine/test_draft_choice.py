"""Which drafter drafts (engine/decoding/draft_plan.py): prompt lookup's drafts are scored by how long a match found
them, and where verify costs are known, a weak lookup match yields to the draft model."""

from __future__ import annotations

from engine.decoding.draft_plan import DraftPlan, fresh_acceptance, ngram_kind
from engine.decoding.drafters import NgramDrafter
from engine.decoding.spec_policy import VerifyCosts
from engine.options import DecodeOptions

# A verify row costs 0.15 of a step (the default model's 2-row pass, 2026-12-07).
COSTS = VerifyCosts((1, 2, 3, 4), (1.0, 1.15, 1.5, 1.85), 0.03)


class Runtime:
    cost_aware_drafting = False  # the tests set the plan's costs themselves


class ReadyDrafter:
    """A draft model whose cache holds the context: never deferred (the plan's prefill rate is unknown)."""

    def missing(self, context: list[int]) -> int:
        return 0


def plan_for(model: bool, costs: VerifyCosts | None = COSTS, record: dict | None = None) -> DraftPlan:
    opts = DecodeOptions(max_tokens=64, drafter="auto")
    plan = DraftPlan(Runtime(), opts, ReadyDrafter() if model else None, NgramDrafter(), record or fresh_acceptance())
    plan.costs = costs
    plan.opening = False
    plan.new_round()
    return plan


WEAK = [5, 6, 7, 8, 9, 3, 10, 11, 12, 9]  # only the last token (9) was seen before: a 1-token match drafts "3 10 11"
STRONG = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]  # "1 2 3 4" seen before: a 4-token match drafts "5 6 7"


def test_lookup_drafts_are_recorded_by_match_length():
    assert [ngram_kind(n) for n in (1, 2, 3, 4)] == ["ngram1", "ngram2", "ngram", "ngram"]
    assert NgramDrafter().propose(WEAK, 3).match == 1 and NgramDrafter().propose(STRONG, 3).match == 4
    fresh = fresh_acceptance()
    assert fresh["ngram1"].rate(0) < fresh["ngram2"].rate(0) < fresh["ngram"].rate(0)  # the measured order
    plan = plan_for(model=False)
    draft = plan.choose(WEAK, 1, 100)
    assert plan.record is plan.acceptance["ngram1"]
    plan.account(len(draft.tokens), 0, 4)
    plan.new_round()
    draft = plan.choose(STRONG, 2, 100)
    assert plan.record is plan.acceptance["ngram"] and len(draft.tokens) >= 2
    trials = plan.acceptance["ngram"].trials[0]
    plan.account(len(draft.tokens), len(draft.tokens), 5)
    assert plan.acceptance["ngram"].trials[0] > trials


def test_a_weak_match_yields_to_the_draft_model_and_is_still_scored():
    plan = plan_for(model=True)
    weak_record = plan.acceptance["ngram1"]
    before = weak_record.trials[0]
    choice = plan.choose(WEAK, 1, 100)
    assert isinstance(choice, int) and choice > 0  # the draft model drafts
    assert plan.record is plan.acceptance["model"] and plan.shadow[0] == 3
    plan.account(choice, 0, 3)  # the target's next token was the lookup's: a hit for its record
    assert weak_record.trials[0] > before and weak_record.rate(0) > 0.3


def test_a_strong_match_drafts_ahead_of_the_draft_model():
    plan = plan_for(model=True)
    draft = plan.choose(STRONG, 1, 100)
    assert not isinstance(draft, int) and draft.tokens[:1] == [5] and plan.record is plan.acceptance["ngram"]


def test_a_lookup_record_that_keeps_failing_gives_way_even_on_strong_matches():
    record = fresh_acceptance()
    for _ in range(12):
        record["ngram"].update(3, 0)
    plan = plan_for(model=True, record=record)
    assert isinstance(plan.choose(STRONG, 1, 100), int)


def test_without_known_costs_the_old_rule_holds():
    """Unknown costs (the GPU path, the compact runtime): lookup drafts when it found two tokens or more, or when no
    draft model can; a single token goes to the draft model."""
    single = [5, 6, 9, 9]  # "9" seen just before the last token: one token follows it
    plan = plan_for(model=True, costs=None)
    choice = plan.choose(single, 1, 100)
    assert isinstance(choice, int) and choice > 0 and plan.shadow == [9]  # the draft model's turn
    plan.new_round()
    assert len(plan.choose(WEAK, 2, 100).tokens) >= 2  # two or more: lookup's
    assert plan_for(model=False, costs=None).choose(single, 1, 100).tokens == [9]  # no draft model: lookup's
