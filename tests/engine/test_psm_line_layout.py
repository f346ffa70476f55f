"""Prefix-first (PSM) prompts put the cursor's line after the middle sentinel (engine/caching/prompt_plan.py).

The embedded target was trained on both orders, so its ``fimble-psm`` template stands in for
PSM models such as Qwen2.5-Coder: real tokenizer, real runtime, real KV cache.
"""

from __future__ import annotations

import pytest

from engine.api import CompletionRequest
from engine.caching.prompt_plan import MAX_LINE_HEAD_CHARS, split_line_head
from engine.local import LocalEngine
from engine.options import DecodeOptions
from tests.conftest import TARGET_DIR
from tests.engine.kv_sources import stdlib_source

OPTS = DecodeOptions(max_tokens=8)


@pytest.fixture(scope="module")
def psm_engine():
    from engine.loader import load_model

    return LocalEngine(load_model(TARGET_DIR, template="fimble-psm"), None, start_thread=False)


def plan(engine: LocalEngine, prefix: str, suffix: str):
    return engine.prompts.build(CompletionRequest(prefix, suffix, options=OPTS))


def after_middle(engine: LocalEngine, ids: list[int]) -> list[int]:
    mid = engine.target.token_id(engine.target.template.middle_token)
    return ids[ids.index(mid) + 1 :]


def test_split_line_head_cases():
    assert split_line_head("a = 1\nb = fo", "a = 1\nb = ") == ("a = 1", "\nb = ")
    assert split_line_head("first line", "first ") == ("first ", "")  # no line break: nothing to move
    assert split_line_head("a = 1\n    ", "a = 1") == ("a = 1", "")  # healed back to the break
    long = "a = 1\n" + "x" * MAX_LINE_HEAD_CHARS
    assert split_line_head(long, long) == (long, "")  # a minified line stays in the prefix


def test_the_cursor_line_follows_the_middle_sentinel(psm_engine):
    tok = psm_engine.target.tokenizer
    p = plan(psm_engine, "def f(x):\n    return x + 1\n\nvalue = compute(", ")\nprint(value)\n")
    head = tok.decode(after_middle(psm_engine, p.ids))
    assert head + p.heal == "\nvalue = compute("
    # a cursor at a line start or on indentation keeps the plain layout (newline healing)
    for prefix in ("def f(x):\n", "def f(x):\n    "):
        p = plan(psm_engine, prefix, "    return x\n")
        assert after_middle(psm_engine, p.ids) == [] and p.heal.startswith("\n")


def test_keys_within_a_line_keep_every_token_before_the_middle(psm_engine):
    text = stdlib_source(psm_engine.target.encode, 600)
    cursor = text.index("\n", len(text) // 2) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    typed = "    result = compute_value(x, y)"
    mid = psm_engine.target.token_id(psm_engine.target.template.middle_token)
    fronts = set()
    for i in range(5, len(typed) + 1):  # from the first word on (before it, indentation heals back)
        ids = plan(psm_engine, prefix + typed[:i], suffix).ids
        fronts.add(tuple(ids[: ids.index(mid) + 1]))
    assert len(fronts) == 1


def test_off_switch_and_spm_keep_the_middle_last(psm_engine, embedded_target):
    mid = psm_engine.target.token_id(psm_engine.target.template.middle_token)
    psm_engine.prompts.line_in_middle = False
    try:
        assert plan(psm_engine, "a = 1\nb = fo", "\n").ids[-1] == mid
    finally:
        psm_engine.prompts.line_in_middle = True
    spm = LocalEngine(embedded_target, None, start_thread=False)
    assert spm.target.template.order == "spm"
    assert plan(spm, "a = 1\nb = fo", "\n").ids[-1] == mid


def test_typing_a_line_prefills_a_few_tokens_and_matches_a_recompute(psm_engine):
    text = stdlib_source(psm_engine.target.encode, 1000)
    cursor = text.index("\n", len(text) * 3 // 4) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    typed = "    result = compute_value(x, y)"

    def run(i: int, doc: str, reuse: str = "exact"):
        req = CompletionRequest(prefix + typed[:i], suffix, options=OPTS, document_id=doc, reuse=reuse, truncate=True)
        return psm_engine.complete(req)

    run(5, "typing")  # the line's first word: the one recompute of the suffix a new line costs
    counts = []
    for i in range(6, len(typed) + 1):
        r = run(i, "typing")
        counts.append(r.stats["prefilled_tokens"])
        if i % 8 == 0:
            assert r.text == run(i, "scratch", reuse="none").text
    # the suffix (hundreds of tokens) sits behind the prefix: without the layout each key recomputes it
    assert max(counts) <= 8, counts
