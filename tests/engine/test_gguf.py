"""GGUF files load into the compact runtime with the file's own tokenizer and FIM template.

The GGUF is written here from the embedded draft model with the ``gguf`` package (no download).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DRAFT_DIR

from engine.api import CompletionRequest
from engine.errors import ModelLoadError
from engine.loader import load_model
from engine.local import LocalEngine
from engine.options import DecodeOptions
from engine.runtimes.gguf_export import export_gguf

CODE = (DRAFT_DIR.parent.parent / "engine" / "fim.py").read_text()


@pytest.fixture(scope="module")
def folder_model():
    return load_model(DRAFT_DIR)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    return {q: export_gguf(DRAFT_DIR, tmp / f"draft-{q}.gguf", q) for q in ("f32", "q8_0")}


def test_gguf_matches_the_folder_model(gguf_files, folder_model):
    model = load_model(gguf_files["f32"])
    assert model.template.name == "fimble" and model.template.order == "spm"  # from the fim ids
    assert model.stop_ids == folder_model.stop_ids
    ids = model.encode(CODE)
    assert ids == folder_model.encode(CODE) and len(ids) > 500
    assert model.tokenizer.decode(ids) == CODE
    tokens = torch.tensor(ids[:300])
    ours = model.runtime(tokens, model.runtime.new_cache(320), 0, 300)
    ref = folder_model.runtime(tokens, folder_model.runtime.new_cache(320), 0, 300)
    assert torch.equal(ours, ref)  # f32 GGUF of bf16-trained weights: the same numbers


def test_q8_gguf_completes_with_the_right_template(gguf_files, folder_model):
    model = load_model(gguf_files["q8_0"])
    assert model.template.name == "fimble"
    tokens = torch.tensor(model.encode(CODE)[:200])
    ours = model.runtime(tokens, model.runtime.new_cache(256), 0, 200)
    ref = folder_model.runtime(tokens, folder_model.runtime.new_cache(256), 0, 200)
    agree = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    assert agree > 0.9 and not torch.equal(ours, ref)  # really dequantised q8_0, and close
    assert complete(model).strip()


def test_f32_gguf_completes_like_the_folder(gguf_files, folder_model):
    assert complete(load_model(gguf_files["f32"])) == complete(folder_model) != ""


def complete(model) -> str:
    engine = LocalEngine(model, None)
    try:
        request = CompletionRequest("def add(a, b):\n    return ", "\n", DecodeOptions(max_tokens=12))
        return engine.submit(request).collect()
    finally:
        engine.close()


def test_bad_gguf_is_a_one_line_error(tmp_path, gguf_files):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_files["f32"].read_bytes()[:100_000])
    for path in (garbage, truncated):
        with pytest.raises(ModelLoadError) as info:
            load_model(path)
        message = str(info.value)
        assert path.name in message and "\n" not in message and "Traceback" not in message


# Texts where GPT-2's split rule and Qwen2's differ: digit runs (Qwen2 splits every digit), CR/LF runs,
# whitespace before a line break, upper-case contractions, punctuation runs before line breaks.
SPLIT_TEXTS = [
    "x = 12345 + 0x7f3\r\n\r\n    y = 'DON'T' ; z = x[1:-2]);\n\n\n",
    'def f(a, b):  \n\treturn a//b  # 3.14159e-10\r\r\nnaïve = "héllo wörld"  \n  ',
    "日本語 テキスト 123abc def  \n  \u00a0 \u2028 end",
    CODE[:3000],
]


def test_qwen2_pre_tokenizer_splits_as_llama_cpp(tmp_path):
    """A GGUF naming the qwen2 pre-tokenizer (Qwen2.5-Coder's) tokenises exactly as llama.cpp does."""
    from llama_cpp import Llama

    from engine.runtimes.gguf_loader import _tokenizer, open_reader

    ids = {}
    for pre in ("qwen2", "gpt-2"):
        path = export_gguf(DRAFT_DIR, tmp_path / f"{pre}.gguf", "q8_0", pre=pre)
        tok, _ = _tokenizer(open_reader(path), path)
        ids[pre] = [tok.encode(t, add_special_tokens=False, split_special_tokens=True) for t in SPLIT_TEXTS]
        ref = Llama(model_path=str(path), vocab_only=True, verbose=False)
        assert ids[pre] == [ref.tokenize(t.encode(), add_bos=False, special=False) for t in SPLIT_TEXTS], pre
    assert ids["qwen2"] != ids["gpt-2"]  # the rule is applied: same vocabulary, other splits


def test_fim_template_by_token_names_when_the_file_has_no_fim_ids():
    """Qwen2.5-Coder GGUFs often lack tokenizer.ggml.fim_* ids: the template comes from the token names."""
    from engine.runtimes.gguf_loader import _template

    class Field:
        def __init__(self, value):
            self.value = value

        def contents(self):
            return self.value

    class Reader:
        fields = {"tokenizer.ggml.eos_token_id": Field(3)}

    tokens = [
        "a",
        "b",
        "<|endoftext|>",
        "<|im_end|>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    ]
    template, stops = _template(Reader(), tokens)
    assert template is not None and template.name == "qwen2.5-coder" and template.order == "psm"
    assert stops == {2, 3, 7, 8, 9}  # eos, <|endoftext|> and the template's own stop tokens
    template, stops = _template(Reader(), ["a", "b", "c", "d"])
    assert template is None and stops == {3}


def test_fast_metadata_reader_equals_gguf_py(gguf_files, tmp_path):
    """engine/runtimes/gguf_meta.py (the ggml runtime's loader) reads what gguf-py's GGUFReader reads."""
    from gguf import GGUFReader

    from engine.runtimes.gguf_meta import GGUFFormatError, GGUFMeta

    for path in gguf_files.values():
        meta, ref = GGUFMeta(path), GGUFReader(str(path))
        keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # gguf-py's own header pseudo-fields
        assert list(meta.fields) == keys
        for k in keys:
            assert meta.fields[k].contents() == ref.fields[k].contents(), k
        assert [(t.name, t.shape) for t in meta.tensors] == [
            (t.name, tuple(int(x) for x in t.shape)) for t in ref.tensors
        ]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_files["f32"].read_bytes()[:5000])  # inside the vocabulary
    with pytest.raises(GGUFFormatError, match="ends early"):
        GGUFMeta(cut)


def _hf_twin(tok):
    """transformers' fast tokenizer over the same Rust tokenizer, as the loader built it before."""
    from transformers import PreTrainedTokenizerFast

    eos = tok.eos_token_id
    vocab = {i: t for t, i in tok.get_vocab().items()}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer,
        clean_up_tokenization_spaces=False,
        eos_token=vocab[eos] if eos is not None else None,
    )


def _gguf_paths(gguf_files) -> list:
    from pathlib import Path

    qwen = sorted(Path(DRAFT_DIR.parent / "qwen2.5-coder-0.5b").glob("*.gguf"))
    return [gguf_files["q8_0"], *qwen[:1]]  # the default model too, where the install step fetched it


def test_the_gguf_tokenizer_answers_as_transformers_does(gguf_files):
    """engine/runtimes/bpe_tokenizer.py stands in for PreTrainedTokenizerFast: the same ids and texts."""
    from engine.runtimes.gguf_loader import _tokenizer, open_meta

    for path in _gguf_paths(gguf_files):
        tok, tokens = _tokenizer(open_meta(path), path)
        hf = _hf_twin(tok)
        specials = sorted(tok.get_added_vocab())
        texts = [*SPLIT_TEXTS, "".join(specials[:4]) + " typed <|fim_middle|> in a file", "", "\n\n   \t"]
        assert len(tok) == len(hf) == len(tokens)
        assert tok.get_vocab() == hf.get_vocab() and tok.get_added_vocab() == hf.get_added_vocab()
        assert tok.eos_token_id == hf.eos_token_id
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
            assert ids == hf.encode(text, add_special_tokens=False, split_special_tokens=True)
            for skip in (False, True):
                assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
                )
        added = tok.get_added_vocab()
        some = [[i] for i in range(0, len(tok), max(1, len(tok) // 3000))] + [[added[s]] for s in specials]
        assert tok.batch_decode(some, skip_special_tokens=True) == hf.batch_decode(
            some, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        assert set(tok.all_special_ids) >= set(hf.all_special_ids)
