"""A cancelled completion stops its prefill between passes, and the next request reuses what it filled
(engine/local.py COMPLETION_PREFILL_CHUNK): a user who types on does not wait for a stale prompt.

Real tokenizer, real runtime and KV cache (the embedded target). Cancellation is made deterministic:
the runtime's first prompt pass cancels the request, as a keystroke arriving during it would.
"""

from __future__ import annotations

import pytest

from engine.api import CompletionRequest
from engine.local import COMPLETION_PREFILL_CHUNK, LocalEngine
from engine.options import DecodeOptions
from tests.conftest import TARGET_DIR
from tests.engine.kv_sources import stdlib_source

OPTS = DecodeOptions(max_tokens=8)


@pytest.fixture(scope="module")
def target():
    from engine.loader import load_model

    return load_model(TARGET_DIR)


def request(text: str) -> CompletionRequest:
    return CompletionRequest(text, "", options=OPTS, document_id="doc", truncate=True)


def test_a_cancelled_prefill_stops_and_its_prefix_serves_the_next_request(target):
    text = stdlib_source(target.encode, 700)
    eng = LocalEngine(target, None, start_thread=False)
    stream = eng.submit(request(text))
    runtime = eng.target.runtime
    passes = []
    # A prompt pass enters the runtime through numpy_logits where it declares numpy rows (the ggml runtime: no
    # torch on that path, engine/decoding/passes.py), else through its forward.
    entry = "numpy_logits" if getattr(runtime, "numpy_rows", False) else "__call__"
    original = getattr(type(runtime), entry)

    def one_pass_then_cancel(self, tokens, cache, start=None, num_logits=1):
        passes.append(len(tokens))
        stream.cancel()  # the user typed on during this pass
        return original(self, tokens, cache, start, num_logits)

    setattr(type(runtime), entry, one_pass_then_cancel)
    try:
        eng.run_pending()
    finally:
        setattr(type(runtime), entry, original)
    stream.collect()
    assert stream.result is not None and stream.result.finish_reason == "cancelled"
    assert passes == [COMPLETION_PREFILL_CHUNK]  # one pass, not the whole prompt
    assert eng.counters()["tokens_prefilled"] == COMPLETION_PREFILL_CHUNK

    resumed = eng.complete(request(text))
    assert resumed.stats["reused_tokens"] == COMPLETION_PREFILL_CHUNK  # what the cancelled one filled
    fresh = LocalEngine(target, None, start_thread=False).complete(request(text))
    assert fresh.stats["reused_tokens"] == 0
    assert resumed.text == fresh.text and resumed.finish_reason == fresh.finish_reason


def test_a_background_request_prefills_in_short_passes_and_stops_between_them(target):
    """Tab-Tab's follow-up (``background``): nobody waits on it yet, and the host stops it when the user goes quiet.
    Its prompt goes in passes of BACKGROUND_PREFILL_CHUNK, so the stop lands within one; a completion's prompt
    takes its last PREFILL_TAIL tokens in one pass (over a second on a 2-core CPU)."""
    import dataclasses

    from engine.steps import BACKGROUND_PREFILL_CHUNK, PREFILL_TAIL

    text = stdlib_source(target.encode, 120)
    assert BACKGROUND_PREFILL_CHUNK < len(target.encode(text)) <= PREFILL_TAIL
    runtime = LocalEngine(target, None, start_thread=False).target.runtime
    entry = "numpy_logits" if getattr(runtime, "numpy_rows", False) else "__call__"
    original = getattr(type(runtime), entry)

    def first_pass(background: bool, cancel: bool) -> int:
        eng = LocalEngine(target, None, start_thread=False)
        stream = eng.submit(dataclasses.replace(request(text), background=background))
        passes = []

        def record(self, tokens, cache, start=None, num_logits=1):
            passes.append(len(tokens))
            if cancel:
                stream.cancel()  # the host's quiet stop, during this pass
            return original(self, tokens, cache, start, num_logits)

        setattr(type(runtime), entry, record)
        try:
            eng.run_pending()
        finally:
            setattr(type(runtime), entry, original)
        stream.collect()
        if cancel:
            assert stream.result is not None and stream.result.finish_reason == "cancelled"
            assert len(passes) == 1
        return passes[0]

    assert first_pass(background=True, cancel=True) == BACKGROUND_PREFILL_CHUNK
    assert first_pass(background=False, cancel=False) > BACKGROUND_PREFILL_CHUNK  # (one pass, with the heal draft)
