"""The ggml runtime (engine/runtimes/ggml_runtime.py): llama.cpp's kernels under fimble's engine, real models.

Skipped where no llama.cpp library loads (the optional 'ggml' extra needs glibc >= 2.38; the
'bench' extra builds one from source). The lossless check runs on 24 prompts per weight type; on 200, the
issue's bar, in the heavy suite (tests/heavy.sh).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DRAFT_DIR, TARGET_DIR
from lossless_check import compare_drafters

from bench.harness.prompts import fim_prompts
from engine.api import CompletionRequest
from engine.errors import ModelLoadError
from engine.loader import load_model
from engine.local import LocalEngine
from engine.options import DecodeOptions
from engine.runtimes.ggml_lib import unavailable_reason
from engine.runtimes.gguf_export import export_gguf

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no llama.cpp library: {REASON}")
CODE = (TARGET_DIR.parent.parent / "engine" / "local.py").read_text()
N_LOSSLESS = 200  # the bar, per weight type: tests/heavy.sh (about 3 minutes for both on 2 cores)
DEFAULT_LOSSLESS = 24  # the default suite: the first 24 of the same prompts (about 22 s for both)


@pytest.fixture(scope="module", params=["none", "int8"], ids=["f32", "q8_0"])
def pair(request):
    q = request.param
    return (load_model(TARGET_DIR, runtime="ggml", quant=q), load_model(DRAFT_DIR, runtime="ggml", quant=q))


def test_loads_as_ggml_and_probes_batch_invariance(pair):
    target, draft = pair
    assert target.backend == draft.backend == "ggml"
    assert target.runtime.batch_invariant  # else speculative output could differ from plain at near-ties
    assert target.template.name == "fimble" and target.encode(CODE) == load_model(TARGET_DIR).encode(CODE)


def test_blocks_equal_steps_bit_for_bit(pair):
    """A verify block's logits (any size, chunked past 32 rows) equal 1-token steps' exactly."""
    rt = pair[0].runtime
    ids = pair[0].encode(CODE)[:400]
    cache = rt.new_cache(512)
    rt(torch.tensor(ids[:300]), cache, 0, 1)
    steps = torch.cat([rt(torch.tensor([ids[300 + i]]), cache, 300 + i, 1) for i in range(40)])
    for k in (2, 3, 4, 5, 13, 40):  # 3 and 4: the build's two- and three-row passes (ggml_patch.py)
        block = rt(torch.tensor(ids[300 : 300 + k]), cache, 300, k)
        assert block.shape == (k, rt.vocab) and torch.equal(block, steps[:k]), k
    # A long prefill's last row runs the prefill's kernels (llama.cpp's own split, below); a warm request's
    # re-run of the last token alone runs the 1-row path, as llama-server's cache_prompt does: the two
    # differ in the last bits, as they do in llama.cpp.
    other = rt.new_cache(512)
    fresh = rt(torch.tensor(ids[:340]), other, 0, 1)
    warm = rt(torch.tensor(ids[339:340]), other, 339, 1)
    assert torch.allclose(fresh, warm, rtol=0, atol=1e-2)


@pytest.mark.parametrize("flash", [False, True], ids=["flash-off", "flash-on"])
def test_prefill_passes_follow_llamacpp_ubatches(flash):
    """llama.cpp's ubatches of 512 (the last token inside the last), each in passes of at most 256 rows, so
    every prompt row runs the kernel class it runs in llama.cpp: flash attention off, 33+ row passes
    wherever llama.cpp's ubatch has 2+ rows (tinyBLAS; a short last ubatch is run as the last 33 tokens);
    on, 64+ row passes exactly where llama.cpp's ubatch has 64+ (its tiled kernel)."""
    from engine.runtimes.ggml_runtime import _blocks

    assert _blocks(20, 1, flash) == [(0, 20)] and _blocks(40, 40, flash) == [(0, 32), (32, 40)]
    assert _blocks(300, 1, flash) == [(0, 150), (150, 300)]
    assert _blocks(580, 1, flash) == [(0, 256), (256, 512), (512, 580)]
    assert _blocks(513, 1, flash) == [(0, 256), (256, 512), (512, 513)]  # 1 row: the 1-row path in both
    assert _blocks(540, 1, flash) == [(0, 256), (256, 512), (507, 540) if not flash else (512, 540)]
    for t in range(33, 1600, 7):
        passes = _blocks(t, 1, flash)
        assert passes[0][0] == 0 and passes[-1][1] == t and all(b - a <= 256 for a, b in passes)
        assert all(a2 <= b1 for (_, b1), (a2, _) in zip(passes, passes[1:], strict=False))  # no gap
        for a, b in passes:
            u = (b - 1) // 512 * 512  # the llama.cpp ubatch this pass's last row is in, and its size
            size = min(t, u + 512) - u
            if flash:  # inside that ubatch, tiled exactly where llama.cpp's is
                assert a >= u and (b - a >= 64) == (size >= 64), (t, a, b)
            else:  # the 1-row path for a 1-row ubatch; else tinyBLAS, as llama.cpp from 2 rows
                assert (b - a == 1) if size == 1 else (b - a >= 33), (t, a, b)


# Weight type x flash attention, 3-4 s a case on 2 cores: the default suite runs f32 without flash attention and q8_0
# with it (each weight type and each setting once), the heavy suite (tests/heavy.sh) the other two.
@pytest.mark.parametrize(
    ("quant", "flash"),
    [
        ("none", "off"),
        ("int8", "on"),
        pytest.param("none", "on", marks=pytest.mark.heavy),
        pytest.param("int8", "off", marks=pytest.mark.heavy),
    ],
    ids=["f32-off", "q8_0-on", "f32-on", "q8_0-off"],
)
def test_greedy_output_equals_llamacpp_on_the_same_gguf(quant, flash, monkeypatch):
    """fimble's plain greedy output equals llama.cpp's own (llama-cpp-python's Llama, 512-token batches,
    the same flash attention setting) token for token on the same GGUF, on prompts past one ubatch.
    In this process both run fimble's build; against a stock build, bench/vs_llamacpp.py checks it."""
    target = load_model(TARGET_DIR, runtime="ggml", quant=quant)  # (its GGUF, config and tokenizer: a second load)
    monkeypatch.setenv("FIMBLE_GGML_FLASH", flash)
    from llama_cpp import Llama

    from engine.decoding.speculative import SpeculativeDecoder
    from engine.runtimes.ggml_runtime import GGMLRuntime

    rt = GGMLRuntime(target.runtime.path, target.runtime.cfg, threads=1)
    assert rt.flash_attn == (flash == "on") and rt.batch_invariant
    llm = Llama(
        model_path=str(rt.path),
        n_ctx=2048,
        n_batch=512,
        n_ubatch=512,
        n_threads=1,
        n_threads_batch=1,
        flash_attn=rt.flash_attn,
        verbose=False,
    )
    ids = target.encode(CODE)
    for n in (300, 580, 700):  # the last ubatch of 68 and 188 rows (tinyBLAS; tiled with flash attention)
        prompt = ids[:n]
        theirs = []
        llm.reset()
        for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            theirs.append(int(tok))
            if len(theirs) == 24:
                break
        cache = rt.new_cache(n + 32)
        dec = SpeculativeDecoder(rt, cache, set(), DecodeOptions(max_tokens=24, drafter="none"))
        dec.prefill(prompt)
        while not dec.done:
            dec.step()
        assert dec.output == theirs, n


def test_rollback_then_redecode_equals_fresh_decode(pair):
    rt = pair[0].runtime
    ids = pair[0].encode(CODE)[:200]
    a = rt.new_cache(256)
    rt(torch.tensor(ids[:150]), a, 0, 1)
    rt(torch.tensor([5, 6, 7, 8, 9]), a, 150, 5)  # a rejected draft
    a.rollback(150)
    again = rt(torch.tensor(ids[150:160]), a, 150, 10)
    b = rt.new_cache(256)
    rt(torch.tensor(ids[:150]), b, 0, 1)
    assert torch.equal(again, rt(torch.tensor(ids[150:160]), b, 150, 10)) and a.length == 160
    with pytest.raises(ValueError):
        rt(torch.tensor([1]), a, 170, 1)  # a gap after the cache's length


@pytest.mark.parametrize("n", [pytest.param(N_LOSSLESS, marks=pytest.mark.heavy), DEFAULT_LOSSLESS])
def test_lossless_speculative_equals_plain(pair, n):
    """Greedy speculative decoding (model, n-gram, auto drafters, healing on) equals plain greedy
    token for token: with bit-identical blocks there is not even a near tie to excuse."""
    target, draft = pair
    result = compare_drafters(target, draft, fim_prompts(n, window=600))
    print(f"\nggml {n} prompts: {result.summary()}")
    assert not result.mismatches and result.ties == 0, result.mismatches[:2]
    assert result.mean_accepted("model") > 1.3 and result.healed >= 5


def test_engine_completion_equals_plain_and_reuses_caches(pair):
    target, draft = pair
    engine = LocalEngine(target, draft, start_thread=False)
    try:
        first = ""
        for i, (prefix, suffix) in enumerate(fim_prompts(6, seed=3, window=800)):
            texts = {}
            for drafter in ("none", "auto", "model", "ngram"):
                req = CompletionRequest(
                    prefix, suffix, DecodeOptions(max_tokens=24, drafter=drafter), document_id=f"doc{i}"
                )
                texts[drafter] = engine.complete(req)
            assert {r.text for r in texts.values()} == {texts["none"].text}, i
            assert texts["auto"].stats["reused_tokens"] > 0  # the document's cache was kept
            first = first or texts["none"].text
        # Another document with the same text borrows the leading segments (a context-to-context copy).
        prefix, suffix = fim_prompts(1, seed=3, window=800)[0]
        req = CompletionRequest(prefix, suffix, DecodeOptions(max_tokens=24, drafter="auto"), document_id="copy")
        assert engine.complete(req).text == first
        assert engine.counters()["kv_borrowed_tokens"] > 0
    finally:
        engine.close()


def test_cancel_stops_a_ggml_decode(pair):
    target, draft = pair
    engine = LocalEngine(target, draft)
    try:
        opts = DecodeOptions(max_tokens=400, drafter="none")
        stream = engine.submit(CompletionRequest(CODE[:3000], "", opts))
        for delta in stream:  # cancel at the first text; the stream still ends, marked cancelled
            if delta.text:
                stream.cancel()
        assert stream.result.finish_reason == "cancelled" and stream.result.tokens < 400
        after = engine.submit(CompletionRequest("def add(a, b):\n    return ", "\n", DecodeOptions(max_tokens=8)))
        after.collect()
        assert after.result.finish_reason in ("eos", "stop", "length")
    finally:
        engine.close()


def test_gguf_file_runs_on_ggml_and_a_bad_one_is_a_one_line_error(tmp_path):
    path = export_gguf(DRAFT_DIR, tmp_path / "draft-q8_0.gguf", "q8_0")
    model = load_model(path, runtime="ggml")
    assert model.backend == "ggml" and model.template.name == "fimble" and model.template.order == "spm"
    engine = LocalEngine(model, None, start_thread=False)
    try:
        assert engine.complete(
            CompletionRequest("def add(a, b):\n    return ", "\n", DecodeOptions(max_tokens=8))
        ).text.strip()
    finally:
        engine.close()
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:100_000])
    for bad in (garbage, truncated):
        with pytest.raises(ModelLoadError) as info:
            load_model(bad, runtime="ggml")
        assert bad.name in str(info.value) and "\n" not in str(info.value)


def test_settings_are_range_checked(monkeypatch):
    from engine.runtimes.ggml_runtime import resolve_threads

    assert resolve_threads(2) == 2
    monkeypatch.setenv("FIMBLE_GGML_THREADS", "0")
    with pytest.raises(ModelLoadError, match="out of range"):
        resolve_threads()
    monkeypatch.setenv("FIMBLE_GGML_THREADS", "many")
    with pytest.raises(ModelLoadError, match="whole number"):
        resolve_threads()
    with pytest.raises(ModelLoadError, match="unknown runtime"):
        load_model(TARGET_DIR, runtime="onnx")
    monkeypatch.setenv("FIMBLE_RUNTIME", "ggml")
    with pytest.raises(ModelLoadError, match="CPU"):
        load_model(TARGET_DIR, device="cuda")


def test_greedy_rounds_on_numpy_rows_decode_as_the_torch_path(pair):
    """Greedy rounds take the runtime's numpy rows, no torch call (speculative.py, _numpy_rows); a trace
    forces the torch path. Both commit the same tokens, plain and speculative."""
    from engine.decoding.drafters import ModelDrafter
    from engine.decoding.speculative import SpeculativeDecoder

    target, draft = pair
    prompt = target.encode(CODE)[:300]
    for drafter in ("none", "model"):
        outs = []
        for traced in (False, True):
            md = ModelDrafter(draft.runtime, 512) if drafter == "model" else None
            opts = DecodeOptions(max_tokens=48, drafter=drafter)
            dec = SpeculativeDecoder(target.runtime, target.runtime.new_cache(400), set(), opts, md, None)
            if traced:
                dec.trace = []
            assert dec._numpy_rows is not traced
            dec.prefill(prompt)
            while not dec.done:
                dec.step()
            outs.append(dec.output)
        assert len(outs[0]) == 48 and outs[0] == outs[1], drafter


def test_the_model_outlives_its_last_context():
    """A runtime finalised before its caches (a reference cycle collected in any order) frees its model only once
    the last context is gone: a context freed after its model touched freed memory (a test run's exit crashed)."""
    import gc

    runtime = load_model(TARGET_DIR).runtime
    caches = [runtime.new_cache(64) for _ in range(2)]
    assert runtime._contexts == 2
    runtime.__del__()  # as a collected cycle may call it first
    assert runtime.model is not None
    del caches[0]
    gc.collect()
    assert runtime._contexts == 1 and runtime.model is not None
    caches.clear()
    gc.collect()
    assert runtime._contexts == 0 and runtime.model is None
