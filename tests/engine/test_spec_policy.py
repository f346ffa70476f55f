"""The cost-aware speculation policy (engine/decoding/spec_policy.py): decisions, not timings."""

from engine.decoding.spec_policy import FLAT, Acceptance, VerifyCosts, choose_gamma, expected_tokens

# Measured shapes: q8_0 in llama.cpp on a 2-core CPU (1 row 3.5 ms, 4 rows 10.7, 13 rows 27: compute
# bound) and fp32 (memory bound: a block of 16 rows costs little more than one).
LINEAR = VerifyCosts((1, 4, 13), (1.0, 10.7 / 3.5, 27 / 3.5), 3.5e-3)
FLATISH = VerifyCosts((1, 2, 4, 8, 16), (1.0, 1.05, 1.1, 1.2, 1.5), 15e-3)


def test_expected_tokens_geometric():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == 1.75
    assert expected_tokens(1.0, 3) == 4.0


def test_drafting_off_when_verify_rows_cost_linearly():
    assert choose_gamma(LINEAR, 0.6, 12) == 0
    assert choose_gamma(LINEAR, 0.75, 12, draft_cost=0.3) == 0


def test_drafting_on_when_verify_rows_are_nearly_free():
    assert choose_gamma(FLATISH, 0.75, 12) >= 4
    assert choose_gamma(FLATISH, 0.75, 12, draft_cost=0.25) > 0
    assert choose_gamma(FLAT, 0.3, 6) == 6  # unmeasured: draft as much as allowed, as before


def test_near_certain_drafts_pay_even_on_linear_costs():
    assert choose_gamma(LINEAR, 0.98, 12) > 0


def test_expensive_draft_model_is_skipped():
    assert choose_gamma(FLATISH, 0.75, 12, draft_cost=1.5) == 0


def test_acceptance_follows_outcomes():
    a = Acceptance()
    for _ in range(10):
        a.update(4, 0)
    low = a.rate(0)
    assert choose_gamma(LINEAR, a, 12) == 0
    for _ in range(10):
        a.update(4, 4)
    assert low < 0.2 < 0.9 < a.rate(3)
    assert choose_gamma(LINEAR, a, 12) > 0


def test_bursty_acceptance_drafts_long():
    a = Acceptance()
    for _ in range(20):  # half the drafts fail at once, the rest match 8 tokens
        a.update(8, 0)
        a.update(8, 8)
    assert a.rate(0) < 0.6 < 0.9 < a.rate(5)
    assert choose_gamma(FLATISH, a, 8) == 8
