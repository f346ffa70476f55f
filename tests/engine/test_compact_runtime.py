"""fimble's compact transformer must compute the same logits as transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import TARGET_DIR, build_tiny_model

from engine.runtimes.compact import load_compact


def hf_logits(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, scale), "logits differ from transformers"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),
        ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
        ("qwen2", {}),  # q/k/v biases
        ("mistral", {"num_key_value_heads": 1}),
    ],
)
def test_tiny_random_models_match_transformers(tmp_path, model_type, overrides):
    folder = build_tiny_model(tmp_path / model_type, model_type, vocab_size=300, with_tokenizer=False, **overrides)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(folder, ids)
    model = load_compact(folder)
    cache = model.new_cache(64)
    # All at once, then as prefill + one token at a time + a verify block, as decoding does.
    assert_close(model(torch.tensor(ids), cache, 0, len(ids)), ref)
    cache.rollback(0)
    parts = [model(torch.tensor(ids[:20]), cache, 0, 20)]
    parts += [model(torch.tensor([t]), cache, None, 1) for t in ids[20:30]]
    parts.append(model(torch.tensor(ids[30:]), cache, None, 10))
    assert_close(torch.cat(parts), ref)


def test_embedded_model_matches_transformers():
    ids = list(range(5, 200, 3))
    ref = hf_logits(TARGET_DIR, ids)
    model = load_compact(TARGET_DIR)
    assert_close(model(torch.tensor(ids), model.new_cache(128), 0, len(ids)), ref)


def test_rollback_is_a_pointer_move():
    model = load_compact(TARGET_DIR)
    cache = model.new_cache(64)
    keys_ptr = cache.keys.data_ptr()
    first = model(torch.tensor([10, 11, 12, 13]), cache, 0, 1)
    model(torch.tensor([99, 98]), cache)  # a rejected block
    cache.rollback(3)
    again = model(torch.tensor([13]), cache)
    assert cache.keys.data_ptr() == keys_ptr and cache.length == 4
    assert torch.allclose(first, again, atol=1e-5)
