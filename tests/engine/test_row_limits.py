"""Row limits for the cuBLAS kernel set (engine/runtimes/row_limits.py), on a CPU: the probe finds the row count
where a stage's reduction order changes, and products run in pieces below it reproduce the 16-row passes' bits.

A stand-in stage switches its summation order above 48 rows, as cuBLAS switches kernels above some row count on
the GPU (bench/reports/gpu-invariant-h200-2026-12-03.txt); tests/engine/test_invariant_rows.py runs the same
mechanism through the batched forward, and tests/gpu/test_row_limits_gpu.py on the real kernels.
"""

from __future__ import annotations

import torch

from engine.runtimes import row_limits as rl


def _switching(threshold: int):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=gen)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= threshold:
            return x @ w
        return x[:, :48] @ w[:48] + x[:, 48:] @ w[48:]  # another order over K: other bits

    return fn


def test_find_limit_stops_where_the_order_changes():
    x = torch.randn(200, 96, generator=torch.Generator().manual_seed(1))
    assert rl.find_limit(_switching(48), [x], 16) == 48
    assert rl.find_limit(_switching(10_000), [x], 16) == 192  # every multiple of 16 in the rows given
    assert rl.find_limit(_switching(16), [x], 16) == 16  # nothing above one piece agrees


def test_pieces_reproduce_the_small_passes():
    fn = _switching(48)
    x = torch.randn(200, 96, generator=torch.Generator().manual_seed(2))
    small = rl.pieces(fn, 16, x)
    assert not torch.equal(fn(x), small)  # unpieced, the switch shows in the bits
    assert torch.equal(rl.pieces(fn, 48, x), small)
    assert torch.equal(rl.pieces(fn, 48, x[:32]), fn(x[:32]))  # within the limit: one call


def test_limits_are_probed_once_per_model_and_can_be_turned_off(monkeypatch):
    calls = []

    def fake_probe(model, step, max_rows=rl.PROBE_ROWS):
        calls.append(step)
        return dict.fromkeys(rl.STAGES, 32)

    class Model:
        pass

    monkeypatch.setattr(rl, "probe", fake_probe)
    model = Model()
    assert rl.limits(model, 16) == dict.fromkeys(rl.STAGES, 32)
    assert rl.limits(model, 16) is model.row_limits and calls == [16]
    monkeypatch.setenv("FIMBLE_CUDA_ROW_LIMITS", "0")
    assert rl.limits(Model(), 16) == dict.fromkeys(rl.STAGES, rl.UNBOUNDED)
    assert calls == [16]
