"""engine.decoding.sampling.greedy_ids: numpy's argmax where it can, the index torch.argmax gives."""

from __future__ import annotations

import torch

from engine.decoding.sampling import greedy_ids


def test_greedy_ids_is_torch_argmax_ties_and_nan_included():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 300, generator=gen)
    rows[1, 7] = rows[1, 9] = 1e9  # a tie: the first maximum
    rows[2, 4] = float("nan")  # a NaN counts as the maximum
    rows[3, :] = -float("inf")
    rows[4, 299] = float("inf")
    want = rows.argmax(-1).tolist()
    assert want[1] == 7 and want[2] == 4
    assert greedy_ids(rows) == want
    assert greedy_ids(rows.numpy()) == want
    half = rows.to(torch.bfloat16)  # not float32: torch's own argmax
    assert greedy_ids(half) == half.argmax(-1).tolist()
