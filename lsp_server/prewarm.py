"""Pre-warm and prefetch: work for a completion before the editor asks for it.

- Pre-warm: after didOpen, and once edits settle (prewarmDelayMs), the prompt a completion at the
  presumed cursor would send goes to ``engine.prewarm``, which prefills it in the background, so the
  next completion there prefills only what changed. Where the editor reports the resting cursor
  (``fimble/cursor``), the prompt at that cursor instead, unless the engine already got (or is about
  to get) exactly that prompt. Nothing is decoded.
- Prefetch: a keystroke (a single insertion) in a document the editor asks completions for starts
  the decode at the new cursor at once: the request its debounce sends a moment later finds it
  running (type-through's lookup, offset 0). The completer decides when (lsp_server/completer.py).

Both send what a completion at that cursor would send: the plan recipe (lsp_server/plan.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from lsp_server.documents import Document, DocumentStore
from lsp_server.engine_host import EngineHost
from lsp_server.generation import Generation
from lsp_server.line_start import line_start
from lsp_server.plan import Plan, Planner
from lsp_server.prompt import Context, build_context
from lsp_server.settings import Settings
from lsp_server.stats import Stats
from lsp_server.typethrough import TypeThrough

log = logging.getLogger(__name__)
MAX_IDLE_S = 3600.0  # engine/wire.py's bound on CompletionRequest.idle_s
CONTEXT_WAIT_S = 0.05  # a pre-warm due while the cross-file context is refreshed looks again this much later
# The completer's submit: (engine, ctx, settings, t0, build_ms, plan) -> the running Generation.
Submit = Callable[[Any, Context, Settings, float, float, Plan], Generation]


def clamp(doc: Document, cursor: tuple[int, int] | None) -> tuple[int, int]:
    """``cursor`` inside ``doc`` (None: the document's end)."""
    last = len(doc.lines) - 1
    if cursor is None:
        return last, len(doc.line_text(last))
    line = min(cursor[0], last)
    return line, min(cursor[1], len(doc.line_text(line)))


class Prewarmer:
    def __init__(self, docs: DocumentStore, host: EngineHost, stats: Stats, planner: Planner, typethrough: TypeThrough):
        self.docs, self.host, self.stats, self.planner, self.typethrough = docs, host, stats, planner, typethrough
        # Pending pre-warms by URI: a timer (debounce), or a task waiting for the engine to start.
        self._pending: dict[str, asyncio.TimerHandle | asyncio.Task] = {}
        # By URI: (version, cursor) of the prompt the document's KV cache holds or is about to hold:
        # the latest decode submitted or pre-warm scheduled there. fimble/cursor skips a pre-warm for it.
        self._warm_at: dict[str, tuple[int, tuple[int, int]]] = {}
        # By URI: time.monotonic() of the user's latest event there (an edit, didOpen, a cursor rest). A pre-warm
        # says how long ago that was (CompletionRequest.idle_s): the engine's background window counts from it.
        self._activity: dict[str, float] = {}

    def tables(self) -> dict:
        return {"prewarms_pending": len(self._pending), "warm_at": len(self._warm_at)}

    def decoding_at(self, ctx: Context) -> None:
        """A decode at ``ctx`` was submitted: the document's cache is about to hold its prompt."""
        if self.docs.get(ctx.uri) is not None:  # (not closed while the engine started)
            self._warm_at[ctx.uri] = (ctx.version, ctx.cursor)

    def cancel(self, uri: str) -> None:
        """Drop ``uri``'s pending pre-warm (its document is changing or closing)."""
        pending = self._pending.pop(uri, None)
        if pending is not None:
            pending.cancel()

    def forget(self, uri: str) -> None:
        self.cancel(uri)
        self._warm_at.pop(uri, None)
        self._activity.pop(uri, None)

    # -- prefetch ----------------------------------------------------------------------------
    def prefetch(self, doc: Document, cursor: tuple[int, int], settings: Settings, submit: Submit) -> None:
        """Start the decode a request at ``cursor`` would start, unless a kept generation answers it already."""
        engine = self.host.ready_engine()
        if engine is None:
            return
        t0 = time.perf_counter()
        ctx = build_context(doc, cursor[0], cursor[1], settings.prefix_chars, settings.suffix_chars)
        if self.typethrough.lookup(ctx) is not None or (not ctx.prefix.strip() and not ctx.suffix.strip()):
            return
        at_start = line_start(doc, ctx) if settings.line_start else None  # as the request will decode
        if at_start is not None and self.typethrough.lookup(at_start.ctx) is not None:
            return
        self.stats.count("prefetches")
        try:
            if at_start is not None:
                ctx, plan = at_start.ctx, self.planner.plan(at_start.doc, at_start.ctx, settings, prefetch=True)
            else:
                plan = self.planner.plan(doc, ctx, settings, prefetch=True)
        except ValueError:  # the document is being changed (Document.with_edit)
            return
        submit(engine, ctx, settings, t0, (time.perf_counter() - t0) * 1e3, plan).prefetched = True

    # -- pre-warm ----------------------------------------------------------------------------
    def needs_prewarm(self, doc: Document, cursor: tuple[int, int]) -> bool:
        """The editor's cursor rests at ``cursor`` (fimble/cursor): whether to pre-warm the prompt there.

        Not when the engine already got, or is about to get, that very prompt (a decode or a
        pre-warm at this version and cursor: the editor reports the cursor after typing too).
        """
        if self._warm_at.get(doc.uri) == (doc.version, cursor):
            self.stats.count("cursor_skipped")
            return False
        return True

    def schedule(
        self,
        doc: Document,
        cursor: tuple[int, int] | None,
        settings: Settings,
        *,
        delay_ms: int | None = None,
        exact: bool = False,
        activity: bool = True,
    ) -> None:
        """Pre-warm ``doc``'s KV cache for a completion at ``cursor`` (None: the document's end).

        Runs ``delay_ms`` (default: prewarmDelayMs) from now, debounced per document: the next
        call for it (the next edit) replaces a pending one. It never starts the engine, but
        waits for one that is starting. The request is what a completion at that cursor would
        send (same windows, options, segment lines, healing, reuse), so the engine's cache ends
        up holding exactly the next completion's prompt. A completion arriving meanwhile needs
        nothing from here: the engine drops a document's pending pre-warm when one is submitted.

        ``exact``: ``cursor`` is where the editor says the cursor is (fimble/cursor), so pre-warm
        even if a decode at this version (at another cursor) already filled the cache. Otherwise
        the cursor is a guess, and such a decode's prompt is the better one to keep.

        ``activity``: the user's own event (not a cross-file ring that changed).
        """
        if activity or doc.uri not in self._activity:
            self._activity[doc.uri] = time.monotonic()
        self.cancel(doc.uri)
        if not settings.prewarm or not settings.enabled_for(doc.language_id):
            return
        if self.host.state not in ("ready", "starting"):
            return
        delay = settings.prewarm_delay_ms if delay_ms is None else delay_ms
        cursor = clamp(doc, cursor)
        self._pending[doc.uri] = asyncio.get_running_loop().call_later(
            delay / 1e3, self._due, doc.uri, cursor, settings, exact
        )
        self._warm_at[doc.uri] = (doc.version, cursor)

    def _due(self, uri: str, cursor: tuple[int, int], settings: Settings, exact: bool) -> None:
        self._pending.pop(uri, None)
        if self.planner.context.pending:  # its ring may change the prompt's head: pre-warm the prompt it leads to
            self._pending[uri] = asyncio.get_running_loop().call_later(
                CONTEXT_WAIT_S, self._due, uri, cursor, settings, exact
            )
            return
        engine = self.host.ready_engine()
        if engine is not None:
            self._send(engine, uri, cursor, settings, exact)
        elif self.host.state == "starting":
            task = asyncio.create_task(self._when_ready(uri, cursor, settings, exact))
            self._pending[uri] = task

            def done(t: asyncio.Task, uri: str = uri) -> None:
                if self._pending.get(uri) is t:
                    del self._pending[uri]

            task.add_done_callback(done)

    async def _when_ready(self, uri: str, cursor: tuple[int, int], settings: Settings, exact: bool) -> None:
        engine = await self.host.wait_ready()
        if engine is not None:
            self._send(engine, uri, cursor, settings, exact)

    def _send(self, engine: Any, uri: str, cursor: tuple[int, int], settings: Settings, exact: bool) -> None:
        doc = self.docs.get(uri)
        if doc is None or doc.changing:
            return
        if exact:
            skip = self._warm_at.get(uri) != (doc.version, cursor)  # a decode elsewhere since: the user is there
        else:  # a decode at this version already filled the cache
            skip = any(
                g.ctx.version == doc.version and g.t_first is not None for g in self.typethrough.generations(uri)
            )
        if skip:
            self.stats.count("prewarms_skipped")
            return
        line, col = clamp(doc, cursor)  # (the document has not changed since: an edit reschedules)
        try:
            ctx = build_context(doc, line, col, settings.prefix_chars, settings.suffix_chars)
            if not ctx.prefix.strip() and not ctx.suffix.strip():
                return
            request = self.planner.request(ctx, self.planner.plan(doc, ctx, settings, prewarm=True), settings)
            since = time.monotonic() - self._activity.get(uri, time.monotonic())
            request.idle_s = min(max(0.0, since), MAX_IDLE_S)
            engine.prewarm(request)
        except Exception:  # only an optimisation: never let it cost the session
            log.exception("pre-warm failed")
            self.stats.count("prewarm_errors")
            return
        self.stats.count("prewarms_sent")
