"""Row limits for the cuBLAS kernel set (engine/runtimes/row_limits.py), on a CPU: the probe finds the row count
where a stage's reduction order changes, and products run in pieces below it reproduce the 16-row passes' bits.

A stand-in stage switches its summation order by row count, as cuBLAS switches kernels on the GPU (on the H200 the
7B shape's down projection at 16 rows and again from 32; bench/reports/gpu-row-limits-h200-*.txt);
tests/engine/test_invariant_rows.py runs the same mechanism through the batched forward, and
tests/gpu/test_row_limits_gpu.py on the real kernels.
"""

from __future__ import annotations

import torch

from engine.runtimes import row_limits as rl


def _switching(threshold: int, low: int = 0):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=gen)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if low < x.shape[0] <= threshold:
            return x @ w
        return x[:, :48] @ w[:48] + x[:, 48:] @ w[48:]  # another order over K: other bits

    return fn


def test_find_limit_stops_where_the_order_changes():
    x = torch.randn(400, 96, generator=torch.Generator().manual_seed(1))
    assert rl.find_limit(_switching(48), [x], 16, 16) == 48
    assert rl.find_limit(_switching(10_000), [x], 16, 16) == 400  # every multiple of 16 in the rows given
    assert rl.find_limit(_switching(16), [x], 16, 16) == 16  # nothing above one piece agrees
    # another order at 16 rows only (the 7B down projection's case): from a base of 32 rows, every count agrees
    assert rl.find_limit(_switching(10_000, low=16), [x], 16, 16) == 16
    assert rl.find_limit(_switching(10_000, low=16), [x], 16, 32) == 400
    assert rl.best_limit(_switching(10_000, low=16), [x], 16) == (32, 400)
    assert rl.best_limit(_switching(160), [x], 16) == (16, 160)  # enough rows at the smallest base
    assert rl.best_limit(_switching(48), [x], 16) == (64, 400)  # 48 rows is not enough: every count from 64 agrees


def test_pieces_reproduce_the_base_passes():
    x = torch.randn(200, 96, generator=torch.Generator().manual_seed(2))
    fn = _switching(48)
    small = rl.pieces(fn, (16, 16), x)
    assert not torch.equal(fn(x), small)  # unpieced, the switch shows in the bits
    assert torch.equal(rl.pieces(fn, (16, 48), x), small)
    assert torch.equal(rl.pieces(fn, (16, 48), x[:32]), fn(x[:32]))  # within the limit: one call
    fn = _switching(10_000, low=16)
    base = rl.pieces(fn, (32, 32), x[:16])  # 16 rows padded to 32
    assert not torch.equal(fn(x[:16]), base)
    assert torch.equal(rl.pieces(fn, (32, 192), x)[:16], base)
    assert torch.equal(rl.pieces(fn, (32, 192), x[:16]), base)


def test_limits_are_probed_once_per_model_and_can_be_turned_off(monkeypatch):
    calls = []

    def fake_probe(model, step, max_rows=rl.PROBE_ROWS):
        calls.append(step)
        return dict.fromkeys(rl.STAGES, (16, 32))

    class Model:
        pass

    monkeypatch.setattr(rl, "probe", fake_probe)
    model = Model()
    assert rl.limits(model, 16) == dict.fromkeys(rl.STAGES, (16, 32))
    assert rl.limits(model, 16) is model.row_limits and calls == [16]
    monkeypatch.setenv("FIMBLE_CUDA_ROW_LIMITS", "0")
    assert rl.limits(Model(), 16) == dict.fromkeys(rl.STAGES, rl.OFF)
    assert calls == [16]
