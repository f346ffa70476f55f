"""The probe cache (engine/runtimes/probe_cache.py): a start reads back what an earlier start probed, and
never trusts an entry it cannot check. Real files in a temporary cache folder; the ggml tests load the
embedded target on llama.cpp twice and count the probes."""

from __future__ import annotations

import json

import pytest
from conftest import TARGET_DIR

from engine.runtimes import probe_cache
from engine.runtimes.ggml_lib import unavailable_reason

PARTS = ("lib:1", "model:2", "threads=1")


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FIMBLE_PROBE_CACHE", raising=False)
    return tmp_path / "cache"


def _read_answer(value: dict) -> int:
    if type(value.get("answer")) is not int:
        raise TypeError("answer")
    return value["answer"]


def test_an_entry_is_read_back_only_under_its_own_key():
    assert probe_cache.load("demo", PARTS, _read_answer) is None
    probe_cache.store("demo", PARTS, {"answer": 42})
    assert probe_cache.load("demo", PARTS, _read_answer) == 42
    assert probe_cache.load("demo", (*PARTS[:2], "threads=2"), _read_answer) is None  # another thread count
    assert probe_cache.load("other", PARTS, _read_answer) is None


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign", "wrong type", "huge"])
def test_a_damaged_entry_is_ignored_and_replaced(damage):
    probe_cache.store("demo", PARTS, {"answer": 42})
    (path,) = probe_cache.probe_dir().glob("demo-*.json")
    text = path.read_text()
    path.write_text(
        {
            "garbage": "\x00\xff not json",
            "truncated": text[: len(text) // 2],
            "foreign": json.dumps({"kind": "demo", "key": "0" * 32, "value": {"answer": 7}}),
            "wrong type": text.replace("42", '"42"'),
            "huge": text + " " * (probe_cache.MAX_ENTRY_BYTES + 1),
        }[damage]
    )
    assert probe_cache.load("demo", PARTS, _read_answer) is None
    probe_cache.store("demo", PARTS, {"answer": 43})
    assert probe_cache.load("demo", PARTS, _read_answer) == 43


def test_off_probes_every_time(monkeypatch):
    probe_cache.store("demo", PARTS, {"answer": 42})
    monkeypatch.setenv("FIMBLE_PROBE_CACHE", "off")
    assert probe_cache.load("demo", PARTS, _read_answer) is None


def test_a_rewritten_file_has_another_identity(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"a" * 10)
    before = probe_cache.file_identity(f)
    f.write_bytes(b"a" * 11)
    assert probe_cache.file_identity(f) != before
    (tmp_path / "libllama.so").write_bytes(b"x")
    lib = probe_cache.library_identity(str(tmp_path))
    (tmp_path / "libggml.so").write_bytes(b"y")
    assert probe_cache.library_identity(str(tmp_path)) != lib  # a library added to the build's folder


def test_the_librarys_kernel_settings_are_part_of_the_key(monkeypatch):
    """FIMBLE_Q8_0_AVX2, _LANES and _PACK pick the q8_0 kernel the probes time: a probe under one value is not read
    back under another (an unpacked start timed with a packed start's verify costs drafts by the wrong costs)."""
    for name in probe_cache.LIBRARY_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    probe_cache.store("demo", (*PARTS, probe_cache.library_settings()), {"answer": 1})
    assert probe_cache.load("demo", (*PARTS, probe_cache.library_settings()), _read_answer) == 1
    for name, value in (("FIMBLE_Q8_0_PACK", "0"), ("FIMBLE_Q8_0_AVX2", "1"), ("FIMBLE_Q8_0_LANES", "avx2")):
        monkeypatch.setenv(name, value)
        assert probe_cache.load("demo", (*PARTS, probe_cache.library_settings()), _read_answer) is None, name
        monkeypatch.delenv(name)
    assert probe_cache.load("demo", (*PARTS, probe_cache.library_settings()), _read_answer) == 1


def test_an_unwritable_cache_costs_only_the_probe(cache_root):
    cache_root.parent.mkdir(parents=True, exist_ok=True)
    cache_root.write_text("a file where the folder should be")
    probe_cache.store("demo", PARTS, {"answer": 42})  # no exception
    assert probe_cache.load("demo", PARTS, _read_answer) is None


def test_token_texts_are_decoded_once_and_checked(monkeypatch):
    from engine import loader
    from engine.decoding import healing

    model = loader.load_model(TARGET_DIR)
    first = loader.cached_token_texts(model)
    assert first == healing.token_texts(model.tokenizer)
    calls = []
    monkeypatch.setattr(healing, "token_texts", lambda tok: calls.append(1) or ["x"] * len(tok))
    assert loader.cached_token_texts(model) == first and calls == []
    (path,) = probe_cache.probe_dir().glob("token-texts-*.json")
    entry = json.loads(path.read_text())
    entry["value"]["texts"] = entry["value"]["texts"][:-1]  # one text short: not this vocabulary's
    path.write_text(json.dumps(entry))
    assert loader.cached_token_texts(model) == ["x"] * len(model.tokenizer) and calls == [1]


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"no llama.cpp library: {unavailable_reason()}")
def test_a_second_ggml_start_reads_the_kernel_choice_and_verify_costs(monkeypatch):
    from engine.decoding import spec_policy
    from engine.loader import load_model
    from engine.runtimes.ggml_runtime import GGMLRuntime

    first = load_model(TARGET_DIR, runtime="ggml", quant="int8").runtime
    costs = spec_policy.verify_costs(first)
    assert costs.step_s > 0 and costs.rows == spec_policy.PROBE_ROWS

    def no_probe(*_a, **_k):
        raise AssertionError("probed again")

    monkeypatch.setattr(GGMLRuntime, "_probe_shapes", no_probe)
    monkeypatch.setattr(spec_policy, "measure", no_probe)
    second = load_model(TARGET_DIR, runtime="ggml", quant="int8").runtime
    chosen = ("flash_attn", "pad_single", "batch_invariant", "threads")
    assert [getattr(second, f) for f in chosen] == [getattr(first, f) for f in chosen]
    assert spec_policy.verify_costs(second) == costs

    # A damaged kernel entry is probed again, not trusted.
    (path,) = probe_cache.probe_dir().glob("ggml-kernels-*.json")
    path.write_text(path.read_text().replace("true", '"yes"').replace("false", '"no"'))
    with pytest.raises(AssertionError, match="probed again"):
        load_model(TARGET_DIR, runtime="ggml", quant="int8")
