"""Small statistics the benchmarks share."""

from __future__ import annotations

import math


def sign_test_p(a: int, b: int) -> float:
    """Two-sided exact sign test (McNemar's on paired outcomes): the chance, under binomial(a + b, 1/2), of a split
    of the discordant pairs at least as uneven as ``a`` against ``b``."""
    n = a + b
    if n == 0:
        return 1.0
    k = min(a, b)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)
