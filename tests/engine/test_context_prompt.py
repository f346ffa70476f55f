"""Cross-file context at the prompt's head (engine/caching/context_prompt.py, prompt_plan.py), embedded model."""

from __future__ import annotations

import dataclasses

import pytest

from engine.api import CompletionRequest
from engine.caching.context_prompt import MAX_CHUNKS, QWEN, context_from_wire
from engine.caching.prompt_plan import PromptBuilder
from engine.errors import PromptError
from engine.local import LocalEngine
from engine.options import DecodeOptions
from engine.wire import request_from_dict

OPTS = DecodeOptions(max_tokens=8)
UTIL = "def scale_polygon(points, factor, origin=(0.0, 0.0)):\n    ox, oy = origin\n    return points\n"
OTHER = "class Canvas:\n    def draw_line(self, start, end, color):\n        pass\n"
PREFIX = "from .util import scale_polygon\n\n\ndef grow(points):\n    return scale_"
SUFFIX = "\n\nprint(grow([(1, 2)]))\n"


def ctx(*chunks: tuple[str, str], budget: int = 512) -> dict:
    return {
        "repo": "proj",
        "path": "pkg/main.py",
        "comment": "#",
        "budget": budget,
        "chunks": [{"path": p, "text": t} for p, t in chunks],
    }


def request(prefix: str = PREFIX, context: dict | None = None, doc: str = "main") -> CompletionRequest:
    return CompletionRequest(prefix, SUFFIX, options=OPTS, document_id=doc, context=context)


@pytest.fixture(scope="module")
def builder(embedded_target):
    return PromptBuilder(embedded_target)


def test_context_is_the_prompts_leading_segments(builder, embedded_target):
    plain = builder.build(request())
    with_ctx = builder.build(request(context=ctx(("pkg/util.py", UTIL), ("pkg/canvas.py", OTHER))))
    n = with_ctx.context_tokens
    assert with_ctx.context_chunks == 2 and n > 20
    assert with_ctx.ids[n:] == plain.ids  # the file's own prompt follows unchanged
    assert [s.start for s in with_ctx.segments][:3] == [0, with_ctx.segments[1].start, n]  # a segment per chunk
    text = embedded_target.tokenizer.decode(with_ctx.ids[:n])
    assert text == "# pkg/util.py\n" + UTIL + "# pkg/canvas.py\n" + OTHER  # no repo tokens: comment headers
    # A keystroke: everything up to the file's own prompt is the same tokens (the cache keeps it).
    typed = builder.build(request(PREFIX + "pol", ctx(("pkg/util.py", UTIL), ("pkg/canvas.py", OTHER))))
    assert typed.ids[:n] == with_ctx.ids[:n] and typed.segments[0].chain == with_ctx.segments[0].chain


def test_no_chunk_means_the_file_only_prompt(builder):
    plain = builder.build(request()).ids
    assert builder.build(request(context=ctx())).ids == plain
    assert builder.build(request(context=ctx(("a.py", UTIL), budget=0))).ids == plain
    assert builder.build(request(context=ctx(("a.py", UTIL), budget=5))).ids == plain  # nothing fits


def test_budget_keeps_leading_chunks_only(builder):
    one = builder.build(request(context=ctx(("a.py", UTIL)))).context_tokens
    plan = builder.build(request(context=ctx(("a.py", UTIL), ("b.py", OTHER), ("c.py", UTIL + "\n"), budget=one + 3)))
    assert plan.context_chunks == 1 and plan.context_tokens == one  # the second does not fit: it ends the context


class _QwenVocab:
    """The embedded model with two more control tokens, as Qwen2.5-Coder's vocabulary has."""

    def __init__(self, model):
        self._m = model
        self._extra = {"<|repo_name|>": model.token_id("<|endoftext|>"), "<|file_sep|>": model.token_id("<|file_sep|>")}

    def token_id(self, tok):
        return self._extra.get(tok, self._m.token_id(tok))

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_repository_format_where_the_model_has_its_tokens(embedded_target):
    b = PromptBuilder(_QwenVocab(embedded_target))
    assert b.repo_format is QWEN
    plan = b.build(request(context=ctx(("pkg/util.py", UTIL))))
    repo, sep = b.model.token_id("<|repo_name|>"), b.model.token_id("<|file_sep|>")
    ids = plan.ids[: plan.context_tokens]
    assert ids[0] == repo and ids.count(sep) == 2  # the chunk's, and the current file's before the FIM part
    tok = embedded_target.tokenizer
    assert tok.decode(ids[1 : ids.index(sep)]) == "proj\n"
    last = len(ids) - 1 - ids[::-1].index(sep)
    assert tok.decode(ids[last + 1 :]) == "pkg/main.py\n"
    assert tok.decode(ids[ids.index(sep) + 1 : last]) == "pkg/util.py\n" + UTIL


def test_document_text_never_becomes_control_tokens(builder, embedded_target):
    plan = builder.build(request(context=ctx(("a.py", "x = '<|fim_mid|><|file_sep|>'\n"))))
    assert embedded_target.token_id("<|fim_mid|>") not in plan.ids[: plan.context_tokens]


def test_malformed_or_oversized_context_is_refused(builder):
    for bad in (
        {"chunks": "x"},
        {"chunks": [{"text": 3}]},
        {"budget": -1},
        {"budget": 10**9},
        [1],
        {"chunks": [{"text": "x"}] * (MAX_CHUNKS + 1)},
        {"chunks": [{"text": "x" * 20_000}]},
    ):
        with pytest.raises(ValueError):
            context_from_wire(bad)
        with pytest.raises(ValueError):
            request_from_dict({"prefix": "x", "context": bad})
        with pytest.raises(PromptError):
            builder.build(request(context=bad))
    assert request_from_dict({"prefix": "x", "context": ctx(("a.py", UTIL))}).context == ctx(("a.py", UTIL))


def test_the_engine_reuses_the_context_across_keystrokes_and_documents(embedded_target):
    engine = LocalEngine(embedded_target, None, start_thread=False)
    context = ctx(("pkg/util.py", UTIL * 3), ("pkg/canvas.py", OTHER * 3))
    first = engine.complete(request(context=context)).stats
    assert first["context_chunks"] == 2 and first["context_tokens"] > 64
    prefix = PREFIX
    for ch in "pol":
        prefix += ch
        st = engine.complete(request(prefix, context)).stats
        assert st["prefilled_tokens"] <= 16 and st["reused_tokens"] >= first["context_tokens"]
    # Another file of the session with the same context borrows its cached segments.
    other = engine.complete(request("import os\n\nx = ", context, doc="other")).stats
    assert engine.counters()["kv_borrowed_tokens"] >= 64
    assert other["reused_tokens"] >= 64
    assert engine.counters()["context_prompts"] == 5


@pytest.mark.parametrize("mode", ["exact", "shift"])
def test_a_ring_eviction_shifts_the_cached_chunks_where_reuse_may_shift(compact_target, mode):
    """The ring drops its oldest chunk and appends one: with "shift" reuse (a runtime with RoPE re-rotation:
    the compact one) the chunks that stay are moved in the cache, not computed again; "exact" (the default)
    computes everything after the change."""
    engine = LocalEngine(compact_target, None, start_thread=False)
    a, b, c, d = (
        ("pkg/a.py", UTIL * 3),
        ("pkg/b.py", OTHER * 3),
        ("pkg/c.py", UTIL.upper() * 2),
        ("pkg/d.py", OTHER.upper()),
    )
    first = engine.complete(dataclasses.replace(request(context=ctx(a, b, c)), reuse=mode)).stats
    assert first["context_chunks"] == 3
    after = engine.complete(dataclasses.replace(request(context=ctx(b, c, d)), reuse=mode)).stats
    assert after["context_chunks"] == 3
    if mode == "shift":
        assert after["shifted_tokens"] >= 64  # b and c, moved to where a was
        assert after["prefilled_tokens"] < after["context_tokens"] // 2
    else:
        assert after["shifted_tokens"] == 0
        assert after["prefilled_tokens"] >= after["context_tokens"] - 16  # all but the repository header
