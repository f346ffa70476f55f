"""The install step's pieces: FIM sentinels by renaming special tokens, and merging a LoRA adapter.

Tiny random models only (no download): the merged plain model must compute what the
adapter-wrapped model computed in training, and the renamed tokenizer must select fimble's
FIM template with the token ids unchanged.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_model

from training import adapter as lora
from training.fim_tokens import RENAMES, rename_tokenizer_json, write_fim_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *RENAMES]


def _smol_shaped_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["def f(x):\n    return x + 1\n" * 50],
        trainer=trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=SPECIALS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>", eos_token="<|im_end|>").save_pretrained(
        folder
    )
    return tok


def test_renamed_special_tokens_select_the_fimble_template_with_ids_kept(tmp_path):
    from transformers import AutoTokenizer

    from engine.fim import detect_template

    base = tmp_path / "base"
    tok = _smol_shaped_tokenizer(base)
    ids = write_fim_tokenizer(base, tmp_path / "fim")
    for old, new in RENAMES.items():
        assert ids[new] == tok.token_to_id(old)
    fim = AutoTokenizer.from_pretrained(tmp_path / "fim")
    assert detect_template(set(fim.get_vocab())).name == "fimble"
    assert fim.eos_token == "<|endoftext|>"
    # Text that spells a sentinel is not turned into it when encoded as document text.
    assert ids["<|fim_pre|>"] not in fim.encode("<|fim_pre|>", add_special_tokens=False, split_special_tokens=True)
    with pytest.raises(ValueError, match="not SmolLM2"):
        rename_tokenizer_json({"added_tokens": [], "model": {"vocab": {}}})


def test_merged_adapter_computes_what_the_wrapped_model_computed(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(
        tmp_path / "base", vocab_size=300, with_tokenizer=False, initializer_range=0.2, tie_word_embeddings=True
    )
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    base_state = {k: v.clone() for k, v in load_file(str(folder / "model.safetensors")).items()}
    wrapped = lora.attach(model, rank=4, alpha=8)
    torch.manual_seed(1)
    with torch.no_grad():
        for m in wrapped.values():  # B starts at zero; give it values, rounded as the export stores them
            m.lora_b.copy_(torch.randn_like(m.lora_b) * 0.5)
            m.lora_a.copy_(m.lora_a.bfloat16().float())
            m.lora_b.copy_(m.lora_b.bfloat16().float())
        rows = {3: torch.randn(model.config.hidden_size), 5: torch.randn(model.config.hidden_size)}
        emb = model.get_input_embeddings().weight
        for i, r in rows.items():
            emb[i] = r
    ids = torch.tensor([[1, 3, 7, 5, 9, 11]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    lora.export(wrapped, rows, 4, 8, tmp_path / "adapter", {"seed": 0})
    assert json.loads((tmp_path / "adapter" / lora.ADAPTER_META).read_text())["embed_row_ids"] == [3, 5]
    merged = lora.merge_state_dict(base_state, tmp_path / "adapter")
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    plain.load_state_dict(merged, strict=False)
    plain.tie_weights()
    with torch.no_grad():
        got = plain(input_ids=ids).logits
    assert not torch.allclose(got, AutoModelForCausalLM.from_pretrained(folder)(input_ids=ids).logits, atol=1e-3)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
