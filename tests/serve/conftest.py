from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread, as `fimble serve` runs by default (engine/serve/batched.py says why)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
