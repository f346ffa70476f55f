"""A small prompt for the first completion at a spot whose full prompt is not in the cache yet.

The full windows (about 4,000 characters before the cursor and 1,000 after) are ~1,250 tokens of
Qwen's: 6 s of prefill at ~220 prompt tokens a second on a 2-core CPU, far past the wait before the
next keystroke. When the document's cache would leave more than a budget to prefill (engine/local.py:
the measured prefill rate times COLD_BUDGET_S), the completion runs on this smaller prompt instead, in
a cache of its own (the document's key plus COLD_KEY), while the full prompt fills the document's own
cache in the background, in pre-warm chunks that yield to completions. Later completions take the full
prompt once it costs no more than the budget.

Stable while the user types: the cold prefix starts at a line on a grid of COLD_STRIDE lines counted
from the prefix window's own start, so it moves only in jumps, and the cold suffix is the suffix's
first lines (the text after the cursor does not change while typing).

The cold prompt keeps the request's cross-file context (engine/caching/context_prompt.py) at its head.
Without it, a typist who never leaves the engine the seconds the full prompt needs was served by the cold
prompt alone, and so never saw the context at all (bench/lsp_typing.py --root on pygls: 0 of 110 requests
that carried context used it). The context is the same leading tokens in the full prompt, the cold one and
every document of the session whose ring holds the same chunks, so it is prefilled once and then borrowed
(engine/caching/kv_store.py); a ring changes rarely. Until it is cached, a keystroke runs the same prompts
without it where those cost less (engine/documents.py ``choose``), each in a cache of its own.
"""

from __future__ import annotations

import dataclasses

from engine import env_settings
from engine.api import CompletionRequest

# Prefill the first completion at a new spot may cost, at the measured rate (the environment setting: for tests
# that need the cold window with a fast model).
COLD_BUDGET_S = env_settings.read("FIMBLE_COLD_BUDGET_S")
COLD_KEY = "\x00cold"  # appended to a document's key: the cold prompt's cache
CONTEXT_KEY = "\x00ctx"  # appended next: the cache of a prompt that leads with cross-file context (cache_key)
STAGE_KEY = "\x00stage"  # appended last: where background work fills a cache's next prompt (KVStore.staging)
# The window's size is what its prefill costs. It was 12-20 lines before the cursor and 4 after (caps 1,500 and 400
# characters) when a prompt token cost ~8.5 ms at 1 thread; the q8_0 lane-order kernel made that ~4.9 ms (1.75x,
# bench/reports/verify-rows-lanes-2026-12-05.txt), so the same wait now buys twice the lines, and the character caps
# (which bound the wait on long lines) grow by the same 1.75x. What the small window cost in answers: through the
# LSP the held-out cursors scored a third below the raw harness's 4,000 + 1,500 characters.
COLD_PREFIX_LINES = 24  # at least this many lines before the cursor's line ...
COLD_STRIDE = 16  # ... and fewer than this many more: the start moves in jumps of this many lines
COLD_PREFIX_CHARS = 2600  # long lines: fewer lines
COLD_SUFFIX_LINES = 8
COLD_SUFFIX_CHARS = 700


def cold_request(request: CompletionRequest, held: str | None = None) -> CompletionRequest | None:
    """``request`` with short windows and the cold cache's key, or None where its windows are short already.

    ``held``: the text the cold cache's prompt starts with (before its anchor). Where the prefix still holds it
    at a line start, within twice the usual length and with enough lines after it, the window starts there
    rather than on the grid: new lines then go after the anchor at a few tokens each, where a jump on the grid
    re-evaluated the whole small prompt (~250 tokens, ~1.2 s at 1 thread on a 2-core CPU), and Tab-Tab's follow-up a few
    lines further down shares the keystrokes' prompt instead of paying for its own."""
    prefix, suffix = request.prefix, request.suffix
    lines = prefix.count("\n")  # the cursor's line, counted from the window's first
    first = max(0, (lines - COLD_PREFIX_LINES) // COLD_STRIDE * COLD_STRIDE)
    start = _line_start(prefix, first)
    kept = _held_start(prefix, held)
    if kept is not None:
        first, start = prefix.count("\n", 0, kept), kept
    if len(prefix) - start > COLD_PREFIX_CHARS:  # long lines: the first line start within the cap
        cut = prefix.find("\n", len(prefix) - COLD_PREFIX_CHARS)
        if cut < 0 or cut + 1 >= len(prefix):
            return None
        first, start = first + prefix.count("\n", start, cut + 1), cut + 1
    end = _line_start(suffix, COLD_SUFFIX_LINES)
    end = min(len(suffix) if end < 0 else end, COLD_SUFFIX_CHARS)
    if start == 0 and end >= len(suffix):
        return None
    segment_lines = None
    if request.segment_lines is not None:
        segment_lines = [n - first for n in request.segment_lines if n >= first]
    return dataclasses.replace(  # (the context stays: see the module doc)
        request,
        prefix=prefix[start:],
        suffix=suffix[:end],
        document_id=(request.document_id or "") + COLD_KEY,
        segment_lines=segment_lines,
    )


def cache_key(document_id: str, with_context: bool) -> str:
    """The cache a prompt runs in: a prompt that leads with cross-file context has its own beside the
    document's prompt without it, so either stays warm while the other is used (engine/documents.py ``choose``)."""
    return document_id + CONTEXT_KEY if with_context else document_id


def document_of(doc_id: str) -> str:
    """The document a cache's key belongs to: its cold window's, its context's and their stages are part of it."""
    return doc_id.removesuffix(STAGE_KEY).removesuffix(CONTEXT_KEY).removesuffix(COLD_KEY)


def cache_keys(document_id: str) -> list[str]:
    """Every cache a document may have: its own, its cold window's, each with and without the context, and the
    stage of each."""
    return [
        document_id + cold + ctx + stage
        for cold in ("", COLD_KEY)
        for ctx in ("", CONTEXT_KEY)
        for stage in ("", STAGE_KEY)
    ]


def _held_start(prefix: str, held: str | None) -> int | None:
    """Where ``held`` starts in ``prefix`` as a window start may (see ``cold_request``), or None."""
    if not held:
        return None
    at = prefix.rfind(held, max(0, len(prefix) - 2 * COLD_PREFIX_CHARS))
    if at < 0 or (at > 0 and prefix[at - 1] != "\n"):
        return None
    if prefix.count("\n", at) < COLD_PREFIX_LINES:  # the cursor moved up to it: too little before the cursor
        return None
    return at


def _line_start(text: str, line: int) -> int:
    """Offset where line ``line`` (0-based) of ``text`` starts; -1 where it has fewer lines."""
    at = 0
    for _ in range(line):
        at = text.find("\n", at) + 1
        if at == 0:
            return -1
    return at
