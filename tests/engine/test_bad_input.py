"""Bad input gets a clear one-line error and no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import TARGET_DIR, build_tiny_model

from engine.api import CompletionRequest, DecodeOptions
from engine.errors import FimbleError, ModelLoadError, PromptError
from engine.loader import load_model
from engine.local import LocalEngine


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lsp_server.cli", *args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fimble:")]
    assert len(lines) == 1 and expected in lines[0], proc.stderr


@pytest.fixture
def source(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("def f(x):\n    return x\n")
    return f


def test_missing_model_folder(tmp_path, source):
    assert_one_line_error(run_cli("complete", f"{source}:2:5", "--model", str(tmp_path / "nope")), "does not exist")


def test_corrupt_model_folder(tmp_path, source):
    bad = tmp_path / "corrupt"
    shutil.copytree(TARGET_DIR, bad)
    (bad / "config.json").write_text("{not json")
    assert_one_line_error(run_cli("complete", f"{source}:2:5", "--model", str(bad)), "corrupt")


def test_truncated_weights(tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(TARGET_DIR, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot read weights"):
        load_model(bad)


def test_unknown_architecture(tmp_path, source):
    odd = tmp_path / "odd"
    shutil.copytree(TARGET_DIR, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    cfg["architectures"] = ["FrobnicatorForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_cli("complete", f"{source}:2:5", "--model", str(odd)), "unknown architecture")


def test_empty_prompt(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("")
    assert_one_line_error(run_cli("complete", f"{empty}:1:1"), "empty prompt")


def test_prompt_longer_than_context(embedded_target):
    engine = LocalEngine(embedded_target, None, start_thread=False)
    long_prefix = "x = 1\n" * 5000
    with pytest.raises(PromptError, match="does not fit the model's context of 4096"):
        engine.complete(CompletionRequest(long_prefix, "", DecodeOptions(max_tokens=8)))
    # With truncate the same request is served from the text nearest the cursor.
    result = engine.complete(CompletionRequest(long_prefix, "", DecodeOptions(max_tokens=8), truncate=True))
    assert result.finish_reason in ("length", "eos", "stop")
    assert result.stats["prompt_tokens"] <= 4096 - 8


def test_bad_options_are_rejected(embedded_target):
    engine = LocalEngine(embedded_target, None, start_thread=False)
    with pytest.raises(FimbleError, match="unknown drafter"):
        engine.complete(CompletionRequest("x = ", "", DecodeOptions(drafter="psychic")))


def test_model_without_fim_tokens_completes_from_the_prefix_and_a_forced_template_must_fit(tmp_path):
    # A pretrained model without FIM tokens: prefix-only with a notice (tests/engine/test_real_model_fixes.py has
    # the details).
    folder = build_tiny_model(tmp_path / "nofim", vocab_size=300, with_tokenizer=False)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(folder)
    model = load_model(folder)
    assert model.template.name == "prefix-only" and "no fill-in-the-middle tokens" in model.notice
    LocalEngine(model, None, start_thread=False)
    with pytest.raises(FimbleError, match="does not fit"):
        load_model(folder, template="starcoder2")
