"""engine.decoding.sampling.greedy_ids: numpy's argmax where it can, the index torch.argmax gives."""

from __future__ import annotations

import numpy as np
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


def test_constrained_argmax_is_the_masked_rows_argmax():
    """Healing's constrained choice (SpeculativeDecoder._choose) without masking the row: the same token as the
    argmax of the row with everything but the allowed ids at -inf, ties to the lowest id, in any order given."""
    from engine.decoding.sampling import constrained_argmax

    gen = torch.Generator().manual_seed(1)
    checked = 0
    for trial in range(200):
        row = torch.randn(500, generator=gen)
        allowed = torch.randperm(500, generator=gen)[: 1 + trial % 40].tolist()
        if trial % 5 == 0:  # a tie between two allowed ids: the lower one wins, as with the mask
            row[allowed[0]] = row[allowed[-1]] = 50.0
        mask = torch.full_like(row, float("-inf"))
        mask[allowed] = 0.0
        want = greedy_ids((row + mask).reshape(1, -1))[0]
        assert constrained_argmax(row, allowed) == want
        assert constrained_argmax(row.numpy(), allowed) == want
        assert constrained_argmax(row.numpy(), np.asarray(allowed[::-1])) == want  # an array, in any order
        checked += want != greedy_ids(row.reshape(1, -1))[0]  # the constraint changed the choice
    assert checked > 100


def test_constrained_argmax_takes_a_nan_as_the_maximum_and_the_lowest_nan_id():
    from engine.decoding.sampling import constrained_argmax

    row = torch.zeros(50)
    row[[30, 12]] = float("nan")
    row[5] = 1e9
    want = greedy_ids(
        (row + torch.where(torch.isin(torch.arange(50), torch.tensor([5, 12, 30])), 0.0, -float("inf"))).reshape(1, -1)
    )[0]
    assert want == 12
    for allowed in ([30, 5, 12], np.array([12, 30, 5])):
        assert constrained_argmax(row, allowed) == 12
        assert constrained_argmax(row.numpy(), allowed) == 12
    assert constrained_argmax(torch.full((8,), -float("inf")), np.array([6, 3, 7])) == 3  # all -inf: the lowest id
