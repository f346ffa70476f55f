"""On a CUDA GPU: with the default kernels ("invariant-cublas"), a batched round's rows equal each sequence's own
pass bit for bit at any batch size (engine/runtimes/row_limits.py), where cuBLAS changes its kernel with the row
count: 32 streams x 1 and x 16 tokens (32 and 512 rows) on random-weight Qwen2.5 0.5B, 1.5B and 7B shapes, in a
slotted graph round and the eager batched pass. The same rounds with the limits off are printed, not asserted (they
differ where cuBLAS switches; bench/gpu_row_limits.py measures both and the cost).

Skipped without CUDA and Triton (CI has neither); run on the GPU machine with ``python3 -m pytest -s tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch


def _triton() -> bool:
    from engine.runtimes import gpu_kernels

    return gpu_kernels.available()


pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not _triton(), reason="needs CUDA and Triton")


@pytest.mark.parametrize("shape", ["0.5B", "1.5B", "7B"])
def test_batched_rounds_equal_alone_at_any_batch(shape):
    from bench.harness.random_models import random_model
    from bench.harness.slot_rounds import rows_differing
    from engine.runtimes import gpu_kernels as gk
    from engine.runtimes import row_limits as rl

    model = random_model(shape)
    model.invariant = "invariant-cublas"
    limits = rl.limits(model, gk.CUBLAS_ROWS)
    assert set(limits) == set(rl.STAGES)
    assert all(base in rl.BASES and most >= base and most % gk.CUBLAS_ROWS == 0 for base, most in limits.values())
    report = [f"{shape}: limits {limits}"]
    for block in (1, 16):
        on = rows_differing(model, 32, block)
        model.row_limits = dict.fromkeys(rl.STAGES, rl.OFF)
        off = rows_differing(model, 32, block)
        model.row_limits = limits
        report.append(f"32 x {block}: rows differing from alone, limits on {on}, off {off}")
        assert on["slot_round"] == 0 and on["batched_pass"] == 0, report
    print("\n" + "; ".join(report))
    del model
    torch.cuda.empty_cache()
