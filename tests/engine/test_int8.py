"""int8 weights (engine/runtimes/quant.py): rows never depend on the pass's shape, and speculation stays
lossless against the int8 model's own plain greedy output, bit for bit.

The default suite checks 16 prompts; the heavy suite (tests/heavy.sh) checks 200, the issue's bar.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DRAFT_DIR, TARGET_DIR
from lossless_check import compare_drafters

from bench.harness.prompts import fim_prompts
from engine.errors import ModelLoadError
from engine.loader import load_model
from engine.runtimes.quant import Int8Linear

N_PROMPTS = 200  # the bar: tests/heavy.sh
DEFAULT_PROMPTS = 16  # the default suite: the first 16 of the same prompts


@pytest.fixture(scope="module")
def int8_models():
    # fbgemm int8 rows are the compact runtime's (on the ggml runtime, int8 is q8_0: test_ggml_runtime.py)
    return (
        load_model(TARGET_DIR, quant="int8", runtime="compact"),
        load_model(DRAFT_DIR, quant="int8", runtime="compact"),
    )


def test_int8_rows_are_independent_of_the_batch():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96)
    lin = Int8Linear(weight, bias)
    x = torch.randn(7, 64)
    x[2] *= 100.0  # one loud row must not coarsen the others' quantisation
    batch = lin(x)
    one_by_one = torch.cat([lin(x[i : i + 1]) for i in range(7)])
    assert torch.equal(batch, one_by_one)
    exact = torch.nn.functional.linear(x, weight, bias)
    assert float((batch - exact).norm() / exact.norm()) < 0.05


def test_int8_model_loads_with_int8_layers(int8_models):
    target, _ = int8_models
    assert isinstance(target.runtime.layers[0].qkv, Int8Linear) and isinstance(target.runtime.lm_head, Int8Linear)
    cache = target.runtime.new_cache(64)
    logits = target.runtime(torch.arange(10, 40), cache, 0, 1)
    assert torch.isfinite(logits).all()


def test_int8_is_only_offered_where_it_runs():
    with pytest.raises(ModelLoadError, match="unknown quantisation"):
        load_model(TARGET_DIR, quant="int3")
    with pytest.raises(ModelLoadError, match="compact runtime"):
        load_model(TARGET_DIR, quant="int8", backend="hf")


@pytest.mark.parametrize("n", [pytest.param(N_PROMPTS, marks=pytest.mark.heavy), DEFAULT_PROMPTS])
def test_int8_speculative_equals_int8_plain_greedy(int8_models, n):
    target, draft = int8_models
    result = compare_drafters(target, draft, fim_prompts(n, seed=7, window=600))
    print(f"\nint8, {n} prompts: {result.summary()}")
    # int8 mode is batch-invariant end to end (Int8Linear, row-by-row verify attention): not even ties.
    assert not result.mismatches and result.ties == 0, result.mismatches[:2]
    assert result.mean_accepted("model") > 1.3


def test_int8_verify_block_is_bit_identical_to_steps(int8_models):
    runtime = int8_models[0].runtime
    ids = torch.arange(20, 300)
    cache = runtime.new_cache(320)
    runtime(ids[:250], cache, 0, 1)
    block = runtime(ids[250:258], cache, 250, 8)
    cache.rollback(250)
    steps = torch.cat([runtime(ids[250 + i : 251 + i], cache, None, 1) for i in range(8)])
    assert torch.equal(block, steps)
