"""The anchored PSM layout: lines typed since the cache's anchor go after the middle sentinel, so a new
line costs what a key costs (engine/caching/prompt_plan.py, engine/local.py).

The embedded target's ``fimble-psm`` template stands in for PSM models such as Qwen2.5-Coder: real
tokenizer, real runtime, real KV cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from engine.api import CompletionRequest
from engine.caching.prompt_plan import MAX_ANCHOR_HEAD_LINES, anchor_at, split_line_head
from engine.local import LocalEngine
from engine.options import DecodeOptions
from tests.conftest import TARGET_DIR
from tests.engine.kv_sources import stdlib_source

OPTS = DecodeOptions(max_tokens=8)
# A cross-file context of one chunk (engine/caching/context_prompt.py's wire form), about 200 tokens.
HELPER_CONTEXT = {
    "repo": "r",
    "path": "a.py",
    "comment": "#",
    "budget": 512,
    "chunks": [{"path": "b.py", "text": "def helper(a, b):\n    return a + b\n" * 20}],
}
TYPED = "    total = compute(a, b)\n    if total > limit:\n        return None\n    "


@pytest.fixture(scope="module")
def target():
    from engine.loader import load_model

    return load_model(TARGET_DIR, template="fimble-psm")


def engine(target) -> LocalEngine:
    return LocalEngine(target, None, start_thread=False)


@contextmanager
def serving(target, quiet_for: float = 0.0) -> Iterator[LocalEngine]:
    """An engine whose request loop runs in a thread, as the engine process runs it; ``quiet_for``: seconds since
    the host's last message, as if it had been quiet that long."""
    eng = LocalEngine(target, None, start_thread=False)
    eng.background.last_message -= quiet_for
    threading.Thread(target=eng.serve_forever, daemon=True).start()
    try:
        yield eng
    finally:
        eng.close()


def prewarms_done(eng: LocalEngine, timeout_s: float = 60.0) -> int:
    """The engine's finished pre-warms once there is one, or after ``timeout_s``."""
    for _ in range(int(timeout_s * 10)):
        if eng.counters()["prewarms_done"]:
            break
        time.sleep(0.1)
    return eng.counters()["prewarms_done"]


def request(prefix: str, suffix: str, doc: str = "doc") -> CompletionRequest:
    return CompletionRequest(prefix, suffix, options=OPTS, document_id=doc, truncate=True, cold_window=True)


def test_anchor_at_cases():
    held = ("a = 1", "\nrest\n")
    assert anchor_at("a = 1\nb = 2\nc", "\nrest\n", held) == 5  # two lines typed below the anchor
    assert anchor_at("a = 1\nb", "\nrest\n", held) is None  # the cursor line's own break: canonical
    assert anchor_at("a = 1\nb = 2\nc", "\nother\n", held) is None  # the text after the cursor changed
    assert anchor_at("a = 2\nb = 2\nc", "\nrest\n", held) is None  # an edit above the anchor
    assert anchor_at("a = 1\nb = 2\nc", "\nrest\n", None) is None
    many = "a = 1" + "\nx" * (MAX_ANCHOR_HEAD_LINES + 1)
    assert anchor_at(many, "\nrest\n", held) is None  # too long a head: canonical
    assert split_line_head("a = 1\nb = 2\nc = fo", "a = 1\nb = 2\nc = ", 5) == ("a = 1", "\nb = 2\nc = ")
    assert split_line_head("a = 1\nb = 2\n    ", "a = 1\nb = 2", 5) == ("a = 1", "\nb = 2")


def test_new_lines_prefill_a_few_tokens_and_equal_one_computation(target):
    text = stdlib_source(target.encode, 900)
    cursor = text.index("\n", len(text) * 3 // 4) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    typing = engine(target)
    typing.complete(request(prefix + "    x", suffix))  # the anchor: the cursor's line
    prefilled, last = [], None
    for i in range(6, len(TYPED) + 1):
        last = typing.complete(request(prefix + "    x" + TYPED[5:i], suffix))
        prefilled.append(last.stats["prefilled_tokens"])
    assert typing.counters()["anchored_prompts"] > 0
    # without the anchor every new line re-evaluates the suffix (hundreds of tokens)
    assert max(prefilled) <= 12, prefilled

    # the same prompt computed at once (anchor first, then the final text): the same completion
    fresh = engine(target)
    fresh.complete(request(prefix + "    x", suffix))
    assert fresh.complete(request(prefix + "    x" + TYPED[5:], suffix)).text == last.text


def test_idle_moves_the_anchor_to_the_cursor_line(target):
    text = stdlib_source(target.encode, 600)
    cursor = text.index("\n", len(text) // 2) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    eng = engine(target)
    eng.complete(request(prefix + "    x", suffix))
    eng.complete(request(prefix + "    x = 1\n    y", suffix))  # anchored: two lines after the sentinel
    anchored = eng.counters()["anchored_prompts"]
    assert anchored == 1
    assert eng.counters()["prewarms_done"] == 0
    eng.run_pending(idle=True)  # no worker thread: pending re-anchors run here, as when the user is idle
    assert eng.counters()["prewarms_done"] == 1
    # the cache now holds the canonical prompt: the next key needs no anchor and reuses it
    r = eng.complete(request(prefix + "    x = 1\n    y = ", suffix))
    assert eng.counters()["anchored_prompts"] == anchored
    assert r.stats["prefilled_tokens"] <= 6


def test_a_reanchor_cut_short_leaves_the_anchored_prompt_for_the_next_key(target):
    """A re-anchor works on a copy of the cache (KVStore.staging) that takes over only once done: cut short by a
    keystroke, it leaves the anchored prompt the keystroke reuses, and its work is kept for the next idle moment."""
    text = stdlib_source(target.encode, 600)
    cursor = text.index("\n", len(text) // 2) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    eng = engine(target)
    eng.complete(request(prefix + "    x", suffix))
    eng.complete(request(prefix + "    x = 1\n    y", suffix))  # anchored; a re-anchor is due when idle
    checks = iter([False] + [True] * 10)  # a completion arrives after the re-anchor's first chunk
    eng.background._completion_waiting = lambda: next(checks)
    assert eng.background.take_due_reanchors(idle=True)  # the user went idle ...
    eng.background.run_next()  # ... the re-anchor starts, and a keystroke cuts it short
    assert eng.counters()["prewarms_preempted"] == 1
    assert eng.store.stats["kv_staged_tokens"] > 0

    r = eng.complete(request(prefix + "    x = 1\n    y =", suffix))
    assert r.stats["prefilled_tokens"] <= 6  # the anchored prompt is intact: no re-evaluated suffix
    same = engine(target)  # the same anchor, no re-anchor: the same prompt, so the same answer
    same.complete(request(prefix + "    x", suffix))
    assert same.complete(request(prefix + "    x = 1\n    y =", suffix)).text == r.text

    anchored = eng.counters()["anchored_prompts"]
    eng.background._completion_waiting = lambda: False
    eng.run_pending(idle=True)  # the re-anchor runs to its end and takes over the document's cache
    assert eng.store.stats["kv_promoted"] == 1
    r = eng.complete(request(prefix + "    x = 1\n    y = 2", suffix))
    assert r.stats["prefilled_tokens"] <= 6
    assert eng.counters()["anchored_prompts"] == anchored  # the canonical prompt, as one computation runs it
    assert engine(target).complete(request(prefix + "    x = 1\n    y = 2", suffix)).text == r.text


def test_a_follow_up_leaves_the_keystrokes_cache_and_their_re_anchor(target):
    """Tab-Tab's follow-up (a background request) runs on a copy of the keystrokes' cache: it reuses their anchored
    prompt, the next keystroke still reuses it and answers as it would have without the follow-up, and the
    re-anchor due for it still runs."""
    import dataclasses

    text = stdlib_source(target.encode, 600)
    cursor = text.index("\n", len(text) // 2) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    keys = [prefix + "    x", prefix + "    x = 1\n    y", prefix + "    x = 1\n    y ="]
    eng, same = engine(target), engine(target)
    for key in keys[:2]:
        eng.complete(request(key, suffix))
        same.complete(request(key, suffix))  # (no follow-up)
    follow_up = request(prefix + "    x = 1\n    y = 2\n    z = 3\n    ", suffix)
    r = eng.complete(dataclasses.replace(follow_up, background=True))
    assert eng.store.docs["doc\x00stage"].ids  # it ran in the stage, a copy of the keystrokes' cache ...
    assert eng.counters()["anchored_prompts"] == 2  # ... at their anchor: its lines cost what typed ones do
    assert r.stats["prefilled_tokens"] <= 12

    r = eng.complete(request(keys[2], suffix))
    assert r.stats["prefilled_tokens"] <= 6
    assert r.text == same.complete(request(keys[2], suffix)).text
    assert eng.background.take_due_reanchors(idle=True)  # the keystroke's re-anchor, not dropped


def test_a_prewarm_where_the_anchored_prompt_is_warm_fills_only_the_new_lines(target):
    """The host's pre-warm at a new line fills the prompt a keystroke there would run: the anchored one, a few
    tokens, not the canonical one, which re-evaluates the suffix (that is the idle re-anchor's work)."""
    text = stdlib_source(target.encode, 600)
    cursor = text.index("\n", len(text) // 2) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    eng = engine(target)
    eng.complete(request(prefix + "    x", suffix))
    eng.complete(request(prefix + "    x = 1\n    y", suffix))  # anchored
    eng.prewarm(request(prefix + "    x = 1\n    y = 2\n    ", suffix))
    eng.run_pending()
    assert eng.counters()["prewarms_done"] == 1
    assert eng.counters()["tokens_prewarmed"] <= 12
    r = eng.complete(request(prefix + "    x = 1\n    y = 2\n    z", suffix))
    assert r.stats["prefilled_tokens"] <= 6


def test_an_edit_above_the_anchor_takes_the_canonical_layout(target):
    text = stdlib_source(target.encode, 600)
    cursor = text.index("\n", len(text) // 2) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    eng = engine(target)
    eng.complete(request(prefix + "    x", suffix))
    eng.complete(request("# edited\n" + prefix + "    x = 1\n    y", suffix))
    assert eng.counters()["anchored_prompts"] == 0


def test_a_cold_spot_answers_from_a_small_prompt_while_the_full_one_fills(target):
    from engine.caching.cold_window import COLD_KEY

    text = stdlib_source(target.encode, 1500)
    cursor = text.index("\n", len(text) * 3 // 4) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    eng = engine(target)
    eng.documents.cold_window = True  # (off in the test suite: tests/conftest.py)
    eng.documents.prefill_rate = 20.0  # as slow as a big model on a small CPU: a budget of 10 prompt tokens
    first = eng.complete(request(prefix + "    x", suffix))
    assert eng.counters()["cold_prompts"] == 1
    assert first.stats["prompt_tokens"] * 2 < len(target.encode(prefix + suffix))  # under half: the rule
    assert eng.store.docs.get("doc" + COLD_KEY) is not None
    eng.run_pending()  # the full prompt fills the document's own cache (a pre-warm)
    assert eng.counters()["prewarms_done"] >= 1
    full = eng.complete(request(prefix + "    x =", suffix))
    assert eng.counters()["cold_prompts"] == 1  # the full prompt is cached now
    assert full.stats["prompt_tokens"] > 600 and full.stats["prefilled_tokens"] <= 6
    eng.forget("doc")
    eng.run_pending()
    assert eng.store.docs.get("doc") is None and eng.store.docs.get("doc" + COLD_KEY) is None


def test_new_lines_at_a_cold_spot_keep_the_small_prompts_start(target):
    """The cold window starts where its cache's prompt starts while that still fits: new lines across the grid's
    step go after the anchor at a few tokens each, instead of re-evaluating the whole small prompt."""
    from engine.caching.cold_window import COLD_STRIDE

    text = stdlib_source(target.encode, 1500)
    cursor = text.index("\n", len(text) * 3 // 4) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    eng = engine(target)
    eng.documents.cold_window = True  # (off in the test suite: tests/conftest.py)
    eng.documents.prefill_rate = 20.0  # a budget of 10 prompt tokens: every key here is a cold one ...
    eng.background.window_left = lambda: 0.0  # ... as the user types on, the full prompt never fills
    typed = "    x"
    eng.complete(request(prefix + typed, suffix))
    costs = []
    for n in range(COLD_STRIDE + 2):  # past the grid's next step, whichever line it falls on
        typed += f" = {n}\n    x"
        costs.append(eng.complete(request(prefix + typed, suffix)).stats["prefilled_tokens"])
    assert eng.counters()["cold_prompts"] == COLD_STRIDE + 3
    assert max(costs) <= 12, costs


def test_cold_request_keeps_a_held_start_only_where_it_fits():
    from engine.caching.cold_window import COLD_PREFIX_LINES, COLD_STRIDE, cold_request

    prefix = "".join(f"line{i}\n" for i in range(80)) + "    x"
    at = CompletionRequest(prefix, "\nrest\n" * 10, document_id="d")
    on_grid = f"line{(80 - COLD_PREFIX_LINES) // COLD_STRIDE * COLD_STRIDE}\n"
    assert on_grid == "line48\n"  # (the numbers below assume the windows of cold_window.py)
    assert cold_request(at).prefix.startswith(on_grid)
    held = "line36\nline37\n"
    assert cold_request(at, held).prefix.startswith("line36\n")
    assert cold_request(at, "ine36\n").prefix.startswith(on_grid)  # not at a line start
    assert cold_request(at, "missing\n").prefix.startswith(on_grid)
    late = "".join(f"line{i}\n" for i in range(80 - COLD_PREFIX_LINES + 1, 80))
    assert cold_request(at, late).prefix.startswith(on_grid)  # too few lines before the cursor


def test_background_work_waits_once_the_host_goes_quiet(target, monkeypatch):
    from engine import background

    text = stdlib_source(target.encode, 900)
    with serving(target) as eng:
        monkeypatch.setattr(background, "BACKGROUND_S", 1e-6)  # the window closes right after each message
        eng.prewarm(request(text, "", doc="quiet"))
        time.sleep(0.5)
        assert eng.counters()["tokens_prewarmed"] == 0  # nothing ran, nothing was dropped
        monkeypatch.setattr(background, "BACKGROUND_S", 600.0)
        eng.prewarm(request(text, "", doc="quiet"))  # the host speaks again: the work goes on
        assert prewarms_done(eng) == 1


def test_a_prewarm_at_a_cold_spot_fills_the_small_prompt_first(target):
    from engine.caching.cold_window import COLD_KEY

    text = stdlib_source(target.encode, 1500)
    cursor = text.index("\n", len(text) * 3 // 4) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    eng = engine(target)
    eng.documents.cold_window, eng.documents.prefill_rate = True, 20.0  # (see the test above)
    eng.prewarm(request(prefix + "    x", suffix))  # the editor's cursor rests there (fimble/cursor)
    eng.run_pending()
    assert eng.counters()["prewarms_done"] == 2  # the small prompt, then the full one
    assert eng.store.docs.get("doc" + COLD_KEY) is not None and eng.store.docs.get("doc") is not None
    r = eng.complete(request(prefix + "    x =", suffix))
    assert eng.counters()["cold_prompts"] == 0 and r.stats["prefilled_tokens"] <= 6


def test_a_prewarm_counts_its_window_from_the_users_activity(target, monkeypatch):
    """A pre-warm the host sends late (after a decode, or for a ring that changed) says how long ago the user
    acted (``idle_s``): past the background window it starts no work, so the engine stays quiet."""
    import dataclasses

    from engine import background
    from engine.wire import request_from_dict

    for bad in (-1, 1e9, "1", True, None):
        with pytest.raises(ValueError):
            request_from_dict({"prefix": "x", "idle_s": bad})
    assert request_from_dict({"prefix": "x", "idle_s": 2}).idle_s == 2.0

    text = stdlib_source(target.encode, 900)
    monkeypatch.setattr(background, "BACKGROUND_S", 5.0)
    with serving(target, quiet_for=100.0) as eng:  # the host has been quiet a while
        eng.prewarm(dataclasses.replace(request(text, "", doc="late"), idle_s=6.0))  # the user left 6 s ago
        time.sleep(0.5)
        assert eng.counters()["tokens_prewarmed"] == 0 and eng.background.window_left() < 0
        monkeypatch.setattr(background, "BACKGROUND_S", 600.0)  # (a window a loaded machine cannot outlast)
        eng.prewarm(dataclasses.replace(request(text, "", doc="late"), idle_s=0.5))  # they just acted
        assert prewarms_done(eng) == 1


def test_a_background_request_is_not_the_users_activity(target):
    import dataclasses

    eng = engine(target)
    before = eng.background.last_message
    eng.complete(dataclasses.replace(request("def f(x):\n    return ", "\n"), background=True))
    assert eng.background.last_message == before  # a follow-up keeps no background work going
    eng.complete(request("def f(x):\n    return ", "\n"))
    assert eng.background.last_message > before


def test_the_cold_prompt_keeps_the_cross_file_context_and_borrows_its_cache(target):
    """The context leads the cold prompt too: a typist who never leaves the engine time for the full prompt
    still gets it. Its tokens are the same in every prompt of the session, so a cold prompt of another
    document copies them from the cache that holds them and prefills only its own small window."""
    from engine.caching.cold_window import cold_request

    text = stdlib_source(target.encode, 2000)
    cursor = text.index("\n", len(text) * 3 // 4) + 1
    context = HELPER_CONTEXT

    def at(doc: str, prefix: str, suffix: str) -> CompletionRequest:
        return CompletionRequest(
            prefix, suffix, options=OPTS, document_id=doc, truncate=True, cold_window=True, context=context
        )

    full = at("doc", text[:cursor], text[cursor:])
    cold = cold_request(full)
    assert cold is not None and cold.context == context
    eng = engine(target)
    eng.documents.cold_window, eng.documents.prefill_rate = True, 20.0  # a budget of 10 prompt tokens
    eng.documents.context_wait = False  # the mode where the context always leads
    first = eng.complete(full)  # cold: it prefills the context and its small window
    assert eng.counters()["cold_prompts"] == 1
    n = first.stats["context_tokens"]
    assert first.stats["context_chunks"] == 1 and n > 100
    assert first.stats["prefilled_tokens"] >= n
    # Another document of the session, the same ring: its prompt borrows the context from the first's cache.
    # (Here the full one: it shares the file's first lines too, so with what it borrows it costs under twice
    # the cold one.)
    other = text[: len(text) // 2] + "\n\n\ndef fresh(a, b):\n    return "
    second = eng.complete(at("other", other, "\n"))
    counters = eng.counters()
    assert counters["context_prompts"] == 2
    assert second.stats["context_tokens"] == n
    assert second.stats["prefilled_tokens"] <= second.stats["prompt_tokens"] - n
    assert counters["kv_borrowed_tokens"] >= n


def test_context_wait_answers_without_the_context_until_the_background_fills_it(target):
    """FIMBLE_CONTEXT_WAIT (on by default): a keystroke never pays for the context's prefill."""
    text = stdlib_source(target.encode, 2000)
    cursor = text.index("\n", len(text) * 3 // 4) + 1
    context = HELPER_CONTEXT

    def at(doc: str, prefix: str, suffix: str) -> CompletionRequest:
        return CompletionRequest(
            prefix, suffix, options=OPTS, document_id=doc, truncate=True, cold_window=True, context=context
        )

    eng = engine(target)
    eng.documents.cold_window, eng.documents.prefill_rate = True, 20.0  # a budget of 10 prompt tokens
    eng.documents.context_wait = True
    first = eng.complete(at("doc", text[:cursor] + "    x", text[cursor:]))
    assert eng.counters()["cold_prompts"] == 1 and first.stats["context_chunks"] == 0
    assert eng.counters()["context_deferred"] == 1
    assert first.stats["prompt_tokens"] * 2 < len(target.encode(text))  # the small window, no context
    # Idle: first the prompts without the context (what the keystrokes run until it is cached: the cold one is
    # warm already, the full one fills), then the cold prompt with the context, then the full one.
    eng.run_pending()
    assert eng.counters()["prewarms_done"] == 4
    # Another document with the same ring: the context is cached now, so its prompt carries it, borrowed.
    other = text[: len(text) // 2] + "\n\n\ndef fresh(a, b):\n    return "
    second = eng.complete(at("other", other, "\n"))
    assert eng.counters()["context_deferred"] == 1
    n = second.stats["context_tokens"]
    assert second.stats["context_chunks"] == 1 and n > 100
    assert second.stats["prefilled_tokens"] <= second.stats["prompt_tokens"] - n


def test_a_ring_change_leaves_the_keystroke_on_the_warm_prompt_until_the_context_is_cached(target, monkeypatch):
    """The full prompt is warm; a context arrives (a ring change). The keystrokes after it cost what they cost
    without context, on the warm prompt, until the background has the prompt with the context; from then on
    they carry it, at a keystroke's cost. The cold window is on but never needed: the rule is the context's."""
    text = stdlib_source(target.encode, 900)
    cursor = text.index("\n", len(text) * 3 // 4) + 1
    prefix, suffix = text[:cursor] + "    x", text[cursor:]
    context = HELPER_CONTEXT

    def at(typed: str, ctx: dict | None) -> CompletionRequest:
        return CompletionRequest(
            prefix + typed, suffix, options=OPTS, document_id="doc", truncate=True, cold_window=True, context=ctx
        )

    from engine import background

    eng = engine(target)
    eng.documents.cold_window, eng.documents.prefill_rate = True, 1e6  # every prompt fits the budget
    eng.complete(at("", None))  # the file's prompt, warm
    # A typist: no background window between the keystrokes (the pre-warm waits for the user to pause).
    eng.background.windowed = True
    monkeypatch.setattr(background, "BACKGROUND_S", 0.0)
    first = eng.complete(at(" ", context))
    assert first.stats["context_chunks"] == 0 and first.stats["prefilled_tokens"] <= 4
    assert eng.counters()["context_deferred"] == 1
    second = eng.complete(at(" =", context))  # typing on: still the warm prompt, the context still pending
    assert second.stats["context_chunks"] == 0 and second.stats["prefilled_tokens"] <= 4
    assert eng.counters()["prewarms_done"] == 0
    monkeypatch.setattr(background, "BACKGROUND_S", 60.0)
    eng.run_pending()  # idle: the prompt with the context fills
    assert eng.counters()["prewarms_done"] >= 1
    third = eng.complete(at(" = ", context))
    assert third.stats["context_chunks"] == 1 and third.stats["context_tokens"] > 100
    assert third.stats["prefilled_tokens"] <= 4
    assert eng.counters()["context_deferred"] == 2
    # Off: the context leads at once, and that keystroke prefills the whole prompt with it.
    eng.documents.context_wait = False
    eng.complete(at(" = ", None))
    other = dict(context, chunks=[{"path": "c.py", "text": "def other(a):\n    return a * 2\n" * 20}])
    paid = eng.complete(at(" = 1", other))
    assert paid.stats["context_chunks"] == 1 and paid.stats["prefilled_tokens"] > 300
