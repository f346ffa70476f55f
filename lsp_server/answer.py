"""A request's answer: when it is due, and the text it shows at the document as it is now.

- Early answer: a request is answered once its text has a full line, the generation ends, or
  ``earlyAnswerMs`` passes (an invoked request, which the user asked for, never gets part of a line);
  the generation keeps running for later keystrokes. A request waits at most REQUEST_BUDGET_S on a
  running engine, then answers with the text it has.
- Version safety: an answer computed for an older document version is re-based onto what was typed
  since (when that agrees with it) or dropped. Never shown wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine import env_settings
from lsp_server.documents import Document
from lsp_server.engine_host import EngineHost
from lsp_server.generation import Generation, first_line_end
from lsp_server.positions import advance
from lsp_server.prompt import Context, typed_since
from lsp_server.stats import Stats

# A request waits at most this long on a running engine, then answers with the text it has (the
# decode goes on for type-through). Time while the engine (re)starts does not count: a request
# after an engine crash is served once the new engine is up (lsp_server/engine_host.py).
REQUEST_BUDGET_S = env_settings.read("FIMBLE_REQUEST_BUDGET_S")


@dataclass
class Answer:
    text: str
    cursor: tuple[int, int]  # (line, code point column) in the current document
    completion_id: str
    cached: bool
    replace_cols: int = 0  # code points after ``cursor`` (same line) the text replaces: re-typed closers


@dataclass
class RequestInfo:
    request_id: Any
    token: Any
    position: dict  # client units, echoed in deltas
    t0: float
    invoked: bool = False  # explicitly asked for: skip the debounce
    encoding: str = "utf-16"  # the session's position encoding (units of ``position`` and deltas' replaceEnd)
    # Streaming: every request gets exactly one ``done`` delta (PROTOCOL.md). ``streamed``: a subscription
    # (lsp_server/streaming.py) was made for it and sends that ``done``. Else FimbleServer.answer sends one
    # with empty text when the request ends, ``no_decode`` its finishReason (set where the request stops).
    streamed: bool = False
    no_decode: str = "empty"


def early_text(rem: str, done: bool, past_deadline: bool) -> str | None:
    """What to answer now with ``rem`` so far, or None to keep waiting."""
    if done:
        return rem.rstrip()
    if first_line_end(rem) != -1:
        return rem[: rem.rfind("\n")].rstrip()  # complete lines only
    if past_deadline and rem.strip():
        return rem
    return None


async def wait_answer(
    gen: Generation,
    offset: int,
    deadline: float,
    at_end: bool,
    shows: Callable[[str], bool] | None = None,
    *,
    partial_ok: bool = True,
    host: EngineHost,
    stats: Stats,
) -> str:
    """The text of ``gen`` past ``offset`` to answer with, once it is due (see the module's docstring).

    ``deadline``: earlyAnswerMs's end; ``at_end``: wait for the decode's end (answerAt "end");
    ``shows``: whether a text due early shapes to something (else wait for more)."""
    budget_end = time.perf_counter() + REQUEST_BUDGET_S
    while True:
        now = time.perf_counter()
        if host.state == "starting":
            budget_end = now + REQUEST_BUDGET_S  # (re)starting engine: the budget waits with us
        elif now >= budget_end and not gen.done:
            # What it has (whole lines where fragments are not wanted and there are some); the decode goes
            # on. With nothing to show yet it waits on for the first text, up to two more budgets.
            rem = gen.text[offset:]
            lines = "" if partial_ok else rem[: max(0, rem.rfind("\n"))]
            if rem.strip() or now >= budget_end + 2 * REQUEST_BUDGET_S:
                stats.count("request_budget_expired")
                return (lines if lines.strip() else rem).rstrip()
        left = max(0.05, budget_end - now) if now < budget_end else REQUEST_BUDGET_S
        if at_end:
            await gen.wait_change(left)
            if gen.done:
                return gen.text[offset:].rstrip()
            continue
        text = early_text(gen.text[offset:], gen.done, partial_ok and now >= deadline)
        if text is not None and (gen.done or shows is None or shows(text)):
            return text
        await gen.wait_change(min(deadline - now, left) if now < deadline else left)


def rebase(doc: Document, ctx: Context, text: str, stats: Stats) -> tuple[str, int, tuple[int, int]] | None:
    """(text, characters typed since ``ctx``, cursor now) for an answer computed at ``ctx``, or None to drop it."""
    if doc.version == ctx.version:
        return text, 0, ctx.cursor
    typed = typed_since(doc, ctx)
    if typed is None or not text.startswith(typed):
        stats.count("stale_dropped")
        return None
    stats.count("stale_rebased")
    return text[len(typed) :], len(typed), advance(*ctx.cursor, typed)
