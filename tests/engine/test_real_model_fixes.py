"""Loader and prompt fixes that real pretrained models needed (found adapting SmolLM2).

A tiny random Llama with a SmolLM2-shaped tokenizer stands in for the real base: its
``<|endoftext|>`` is the unk token, EOS is ``<|im_end|>``, and it has no FIM tokens.
"""

from __future__ import annotations

import json
import logging

import pytest
from conftest import TARGET_DIR, build_tiny_model

from engine.api import CompletionRequest, DecodeOptions
from engine.decoding.healing import split_heal, unheal
from engine.errors import ModelLoadError
from engine.fim import PREFIX_ONLY
from engine.loader import load_model
from engine.local import LocalEngine

SMOL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>"]
CODE = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x):\n        self.x = x\n" * 20


@pytest.fixture(scope="module")
def smol_like(tmp_path_factory):
    """A model folder whose tokenizer marks <|endoftext|> unk and has no FIM sentinels."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("smol_like")
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SMOL_SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CODE], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<|endoftext|>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|im_end|>",
    )
    wrapped.save_pretrained(folder)
    ids = {t: tok.token_to_id(t) for t in SMOL_SPECIALS}
    build_tiny_model(
        folder,
        vocab_size=tok.get_vocab_size(),
        with_tokenizer=False,
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=ids["<|im_start|>"],
    )
    # The generation config names one more end token than config.json does.
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|im_end|>"], ids["<file_sep>"]]}))
    return folder, ids


def test_stop_ids_include_unk_marked_end_token_and_generation_config(smol_like):
    folder, ids = smol_like
    model = load_model(folder)
    assert model.tokenizer.unk_token_id == ids["<|endoftext|>"]  # the trap: it is also the unk token
    assert {ids["<|endoftext|>"], ids["<|im_end|>"], ids["<file_sep>"]} <= model.stop_ids
    assert ids["<|im_start|>"] not in model.stop_ids and ids["<repo_name>"] not in model.stop_ids


def test_no_fim_tokens_means_prefix_only_with_a_one_line_notice(smol_like, caplog):
    folder, _ = smol_like
    with caplog.at_level(logging.WARNING, logger="fimble.loader"):
        model = load_model(folder)
    assert model.template is PREFIX_ONLY
    assert model.notice and "\n" not in model.notice and "before the cursor only" in model.notice
    assert [r.getMessage() for r in caplog.records] == [f"fimble: {model.notice}"]
    engine = LocalEngine(model, None, start_thread=False)
    prefix, suffix = "def add(a, b):\n    return a", "\n\nSUFFIX_NEVER_SEEN = 1\n"
    ids, heal, constrained = engine.build_prompt(CompletionRequest(prefix, suffix))
    # The prompt is the prefix alone, minus the ragged last word that healing re-types.
    assert constrained and heal.strip() == "a"
    assert ids == model.encode(prefix[: -len(heal)])
    result = engine.complete(CompletionRequest(prefix, suffix, DecodeOptions(max_tokens=8)))
    assert result.finish_reason in {"length", "eos", "stop"} and result.tokens >= 1
    with pytest.raises(Exception, match="before the cursor only"):
        engine.build_prompt(CompletionRequest("", suffix))


def test_forced_template_that_does_not_fit_is_a_clear_error(smol_like):
    folder, _ = smol_like
    for name in ("starcoder2", "fimble"):
        with pytest.raises(ModelLoadError, match=rf"template '{name}' does not fit .*templates that fit: prefix-only"):
            load_model(folder, template=name)
    assert load_model(folder, template="prefix-only").notice is None  # asked for: no notice


def test_cli_forced_template_prints_one_line_not_a_traceback(smol_like, tmp_path, capsys):
    from lsp_server.cli import main

    folder, _ = smol_like
    src = tmp_path / "a.py"
    src.write_text("def f(x):\n    return x\n")
    assert main(["complete", f"{src}:2:5", "--model", str(folder), "--no-draft", "--template", "starcoder2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fimble: template 'starcoder2' does not fit"), err


def test_newline_healing_unit_cases():
    # Cursor at a line start or on indentation: the prompt ends before the break, which is re-typed.
    assert split_heal("if x:\n        ", "\n        ") == ("if x:", "\n        ", True)
    assert split_heal("x = 1\n", "\n") == ("x = 1", "\n", True)
    assert split_heal("x = 1\n\n    ", "\n    ") == ("x = 1", "\n\n    ", True)
    assert split_heal("x = 1  \r\n", "\n") == ("x = 1", "  \r\n", True)
    assert split_heal("\n   ", "\n   ") == ("\n", "   ", False)  # nothing before the break: older rule
    long_blank = "x = 1" + "\n" * 80
    assert split_heal(long_blank, "\n") == ("x = 1" + "\n" * 79, "\n", True)  # only the last break
    # What is shown drops exactly the re-typed text, deeper indentation included.
    assert unheal("\n        return x", "\n    ", True) == "    return x"
    assert unheal("\n    return x", "\n", True) == "    return x"


@pytest.mark.parametrize("template", ["fimble", "fimble-psm", "prefix-only"])
def test_newline_healing_in_every_prompt_layout(template):
    """FIM or not, a prefix ending in a line break is healed, and the output re-types the break."""
    model = load_model(TARGET_DIR, template=template)
    engine = LocalEngine(model, None, start_thread=False)
    prefix, suffix = "def area(r):\n    ", "\n\nprint(area(2))\n"
    ids, heal, constrained = engine.build_prompt(CompletionRequest(prefix, suffix))
    assert (heal, constrained) == ("\n    ", True)
    newline_ids = {i for t, i in model.tokenizer.get_vocab().items() if "Ċ" in t}  # byte-level "\n"
    body = model.encode("def area(r):")
    assert ids[ids.index(body[0]) :][: len(body)] == body
    prefix_end = ids.index(body[0]) + len(body)
    assert prefix_end == len(ids) or ids[prefix_end] not in newline_ids  # no bare break ends the prefix
    result = engine.complete(CompletionRequest(prefix, suffix, DecodeOptions(max_tokens=12, max_lines=1)))
    assert result.tokens >= 1 and not result.text.startswith("\n")
    # The older rule left the bare break at the prefix's end.
    engine.prompts.newline_healing = False
    old_ids, _, _ = engine.build_prompt(CompletionRequest(prefix, suffix))
    assert old_ids[prefix_end] in newline_ids


def test_default_model_is_the_built_smollm2_unless_pinned_or_unbuilt(tmp_path, monkeypatch):
    from engine import model_info
    from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, default_models

    built = tmp_path / "fimble-smollm2"
    built.mkdir()
    monkeypatch.setattr(model_info, "BUILT_TARGET", built)
    monkeypatch.setattr(model_info, "QWEN_TARGET", tmp_path / "not-fetched.gguf")
    monkeypatch.delenv("FIMBLE_DEFAULT_MODEL", raising=False)
    assert default_models() == (DEFAULT_TARGET, DEFAULT_DRAFT)  # not built: the embedded pair
    (built / "model.safetensors").write_bytes(b"x")
    (built / "built_from.json").write_text("{}")
    assert default_models() == (built, None)  # no draft shares its tokenizer
    assert model_info.model_folder(None) == built  # the server's languages follow the same folder
    monkeypatch.setenv("FIMBLE_DEFAULT_MODEL", "embedded")
    assert default_models() == (DEFAULT_TARGET, DEFAULT_DRAFT)


def test_default_model_is_qwen_once_fetched(tmp_path, monkeypatch):
    from engine import model_info
    from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, default_models

    built, qwen = tmp_path / "fimble-smollm2", tmp_path / "qwen" / "q8_0.gguf"
    built.mkdir()
    qwen.parent.mkdir()
    monkeypatch.setattr(model_info, "BUILT_TARGET", built)
    monkeypatch.setattr(model_info, "QWEN_TARGET", qwen)
    monkeypatch.delenv("FIMBLE_DEFAULT_MODEL", raising=False)
    (built / "model.safetensors").write_bytes(b"x")
    (built / "built_from.json").write_text("{}")
    qwen.write_bytes(b"GGUF")
    assert default_models() == (built, None)  # no SOURCE.txt yet: the fetch did not finish
    (qwen.parent / "SOURCE.txt").write_text("sha256 ...")
    assert default_models() == (qwen, None)
    assert model_info.read_model_info(None).languages is None  # no fimble.json beside the file: every language
    shipped = model_info.EMBEDDED_TARGET.parent / "qwen2.5-coder-0.5b" / "fimble.json"
    (qwen.parent / "fimble.json").write_text(shipped.read_text())  # the committed list, beside the GGUF
    langs = model_info.read_model_info(None).languages
    assert langs is not None and {"python", "javascript", "typescript", "go", "rust", "java", "c", "cpp"} <= set(langs)
    assert "plaintext" not in langs
    monkeypatch.setenv("FIMBLE_DEFAULT_MODEL", "smollm2")
    assert default_models() == (built, None)
    monkeypatch.setenv("FIMBLE_DEFAULT_MODEL", "qwen")
    assert default_models() == (qwen, None)
    qwen.unlink()
    assert default_models() == (built, None)  # pinned but gone: the next one, with a log line
    monkeypatch.setenv("FIMBLE_DEFAULT_MODEL", "embedded")
    assert default_models() == (DEFAULT_TARGET, DEFAULT_DRAFT)


def test_unbuilt_adapter_folder_names_the_install_step():
    from conftest import REPO

    folder = REPO / "models" / "fimble-smollm2"
    if (folder / "config.json").is_file():
        pytest.skip("fimble-smollm2 is built here")
    with pytest.raises(ModelLoadError, match="python -m training.assemble"):
        load_model(folder)
