"""bench/harness/stats.py: the sign test every paired benchmark report quotes."""

from bench.harness.stats import sign_test_p


def test_sign_test_matches_the_binomial_tail():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(4, 0) == sign_test_p(0, 4) == 0.125  # 2 * (1/2)^4
    assert sign_test_p(7, 3) == 0.34375  # 2 * (1 + 10 + 45 + 120) / 1024
    assert sign_test_p(5, 5) == 1.0  # capped
    assert sign_test_p(55, 5) < 1e-10
