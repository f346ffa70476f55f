"""What an engine start on a GGUF pays for (bench/start.py measures it): the ggml path imports no torch, llama.cpp
loads on a thread, its weight checks are remembered per file, and healing's token index answers by scanning
until it is sorted. Real models (the embedded target exported to a GGUF), real llama.cpp, real processes."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
from conftest import TARGET_DIR

from engine.api import CompletionRequest
from engine.decoding.healing import TokenIndex
from engine.loader import cached_token_texts, load_model
from engine.options import DecodeOptions
from engine.process import EngineProcess
from engine.runtimes import probe_cache
from engine.runtimes.ggml_lib import unavailable_reason
from engine.runtimes.gguf_export import export_gguf

REASON = unavailable_reason()
needs_ggml = pytest.mark.skipif(REASON is not None, reason=f"no llama.cpp library: {REASON}")
CODE = (TARGET_DIR.parent.parent / "engine" / "loader.py").read_text()

# The engine child (engine/process.py, as fimble lsp starts it), then a report of what it imported.
CHILD = """
import json, sys
from engine.process import main
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}, f)
"""


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return export_gguf(TARGET_DIR, tmp_path_factory.mktemp("gguf") / "target-q8_0.gguf", "q8_0")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FIMBLE_PROBE_CACHE", raising=False)
    return tmp_path / "cache"


@needs_ggml
@pytest.mark.parametrize("start", ["cold", "cached"])
def test_the_engine_child_on_a_gguf_never_imports_torch(gguf, cache_dir, tmp_path, monkeypatch, start):
    """Load (probes run on a cold cache), a healed completion (the cursor on indentation: constrained first
    tokens), a plain one and a pre-warm, through the real engine process: torch is never imported."""
    monkeypatch.setenv("FIMBLE_RUNTIME", "ggml")
    if start == "cached":
        load_model(gguf)  # fills the probe cache: the child reads every answer back
    report = tmp_path / "report.json"
    eng = EngineProcess(command=[sys.executable, "-c", CHILD, str(report), "--model", str(gguf), "--no-draft"])
    texts = []
    try:
        for prefix in ("def read_config(path):\n    with open(path) as f:\n        ", "import os\n\n\ndef ma"):
            request = CompletionRequest(prefix, "\n", options=DecodeOptions(max_tokens=12), document_id="file:///a.py")
            stream = eng.submit(request)
            stream.collect()
            assert stream.result is not None and stream.result.tokens > 0
            texts.append(stream.result.text)
        eng.prewarm(CompletionRequest("import sys\n", "", document_id="file:///b.py"))
        assert eng.counters().get("completed", 0) == 2
    finally:
        eng.close()
    got = json.loads(report.read_text())
    assert got == {"code": 0, "torch": False, "transformers": False}
    # The same answers from an engine in this process (torch loaded here, the probe cache warm).
    from engine.local import LocalEngine

    local = LocalEngine(load_model(gguf), start_thread=False)
    again = [
        local.complete(CompletionRequest(p, "\n", options=DecodeOptions(max_tokens=12), document_id="file:///a.py"))
        for p in ("def read_config(path):\n    with open(path) as f:\n        ", "import os\n\n\ndef ma")
    ]
    assert [r.text for r in again] == texts


@needs_ggml
def test_healed_decoding_on_numpy_rows_equals_the_torch_rows(gguf):
    """Healing's constrained first tokens (newline and mid-word) on the numpy rows the ggml path now takes, against
    the torch rows a trace keeps: the same tokens, plain and with n-gram drafts."""
    from engine.decoding.drafters import NgramDrafter
    from engine.decoding.healing import split_heal
    from engine.decoding.speculative import SpeculativeDecoder

    model = load_model(gguf, runtime="ggml")
    rt = model.runtime
    healed = 0
    for prefix in ("def read_config(path):\n    with open(path) as f:\n        ", "import os\n\n\ndef ma", CODE[:700]):
        last = model.tokenizer.decode(model.encode(prefix)[-1:])
        body, heal, constrained = split_heal(prefix, last)
        healed += bool(heal and constrained)
        for drafter in ("none", "ngram"):
            outs = []
            for traced in (False, True):
                opts = DecodeOptions(max_tokens=16, drafter=drafter)
                forced = heal if constrained else ""
                dec = SpeculativeDecoder(
                    rt, rt.new_cache(512), model.stop_ids, opts, None, NgramDrafter(), forced, model.token_index
                )
                if traced:
                    dec.trace = []
                assert dec.numpy_ok is not traced
                dec.prefill(model.encode(body))
                while not dec.done:
                    dec.step()
                outs.append(dec.output)
            assert outs[0] == outs[1] and len(outs[0]) > 0, (prefix[-20:], drafter)
    assert healed >= 2


@needs_ggml
def test_weight_checks_run_once_per_file_and_a_bad_entry_is_not_trusted(gguf, cache_dir, tmp_path):
    first = load_model(gguf, runtime="ggml").runtime
    assert first.weights_checked is False  # a cold cache: llama.cpp's tensor scan and the probe pass ran
    assert load_model(gguf, runtime="ggml").runtime.weights_checked is True
    (entry,) = probe_cache.probe_dir().glob("ggml-weights-checked-*.json")
    for damage in ('{"kind": "ggml-weights-checked", "key": "0", "value": {"finite": true}}', "{not json", ""):
        entry.write_text(damage)
        assert load_model(gguf, runtime="ggml").runtime.weights_checked is False  # checked again, rewritten
    assert load_model(gguf, runtime="ggml").runtime.weights_checked is True
    st = os.stat(gguf)
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a replaced file: checked again
    assert load_model(gguf, runtime="ggml").runtime.weights_checked is False


@needs_ggml
def test_a_gguf_that_is_not_one_fails_with_one_line_while_llama_cpp_loads_beside(tmp_path):
    from engine.errors import ModelLoadError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="bad.gguf") as info:
        load_model(bad, runtime="ggml")
    assert "\n" not in str(info.value)


def test_the_token_index_answers_the_same_before_and_after_it_is_sorted():
    model = load_model(TARGET_DIR, runtime="compact")
    texts = cached_token_texts(model)
    scanning, built = TokenIndex(model.tokenizer, texts), TokenIndex(model.tokenizer, texts)
    built.build()
    assert built.built and not scanning.built
    rng = random.Random(7)
    probes = ["\n        ", "\n    ", "os.pa", "def ", "ret", " ", "\n", "self.", "é", "\n\n    # x", "x" * 30]
    probes += [CODE[i : i + rng.randint(1, 14)] for i in (rng.randrange(len(CODE) - 20) for _ in range(60))]
    for text in probes:
        allowed = scanning.allowed(text)
        assert allowed == built.allowed(text), text
        for index in (scanning, built):  # the array constrained_argmax takes: the same ids, once each
            ids = index.allowed_ids(text).tolist()
            assert sorted(ids) == sorted(allowed) and len(set(ids)) == len(ids), text
        assert scanning.spell(text, 8) == built.spell(text, 8), text
    assert any(len(scanning.allowed(t)) > 1 for t in probes)  # the probes reach tokens of both kinds
    assert any(scanning.spell(t, 8) for t in probes)
    assert all(scanning.text.get(i) == built.text.get(i) for i in range(len(texts) + 2))
    thread = scanning.build_soon()
    thread.join(60)
    assert scanning.built and scanning.allowed("\n    ") == built.allowed("\n    ")
