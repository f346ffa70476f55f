"""From a request at a cursor to an answer: the keystroke path on the LSP side, as a pipeline of stages.

``Completer.complete`` reads top to bottom: context -> type-through lookup -> plan -> submit -> stream
-> finish. Each stage's rules live in a module of its own:

- context: the prefix and suffix windows around the cursor (lsp_server/prompt.py);
- type-through lookup: a kept generation whose anchor plus the text typed since matches answers
  without the model (lsp_server/typethrough.py);
- plan: the decode's options from the syntax policy, its shaper, its segment lines, and the engine
  request (lsp_server/plan.py: one recipe for requests, prefetches, follow-ups, pre-warms and
  ``fimble complete``);
- submit: one decode at a time, so starting one cancels the one before it (within one engine step);
- stream: the engine's deltas, fitted to the editor's indentation (lsp_server/indent.py) and guarded
  by the shaper (lsp_server/shaping/stage.py), grow the generation; streaming clients get them as
  ``fimble/completionDelta`` (lsp_server/streaming.py);
- finish: the answer once it is due, re-based onto what was typed since, shaped at the answer's
  cursor (lsp_server/answer.py, lsp_server/shaping/stage.py).

Around the request: an edit that disagrees with the running decode stops it, typing along it keeps
it going, and a keystroke may start the next decode before the request asks (prefetch); documents
are pre-warmed once edits settle (lsp_server/prewarm.py); after a shown completion ends, Tab-Tab's
follow-up decodes the completion after its accept (lsp_server/follow_up.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from lsp_server.answer import Answer, RequestInfo, rebase, wait_answer
from lsp_server.context import CrossFileContext
from lsp_server.decodes import Decodes
from lsp_server.documents import Document, DocumentStore
from lsp_server.engine_host import EngineHost
from lsp_server.generation import Generation
from lsp_server.line_start import LineStart, at_cursor, line_start
from lsp_server.plan import Planner
from lsp_server.prewarm import Prewarmer
from lsp_server.prompt import Context, build_context, typed_since
from lsp_server.settings import Settings
from lsp_server.shaping import stage
from lsp_server.stats import Stats
from lsp_server.streaming import DeltaStreamer, Subscription
from lsp_server.telemetry import Telemetry
from lsp_server.typethrough import TypeThrough

log = logging.getLogger(__name__)
# Keystrokes closer together than this are a burst (paste, key repeat, a script): no prefetch,
# or every one of them would queue a decode that the next one cancels.
PREFETCH_MIN_GAP_S = 0.02


async def debounce(
    doc: Document, ctx: Context, settings: Settings, req: RequestInfo, seq: int, seqs: dict[str, int], stats: Stats
) -> bool:
    """Wait ``debounceMs`` before an automatic request's decode; whether it goes on then. ``seq``: the request's
    number in its document, ``seqs``: each document's latest. One that a newer request or an edit overtook
    meanwhile is dropped, and ``req.no_decode`` says which (PROTOCOL.md, completionDelta)."""
    if not settings.debounce_ms or req.invoked:
        return True
    await asyncio.sleep(settings.debounce_ms / 1e3)
    latest = seqs.get(doc.uri)  # (None: the document was closed meanwhile)
    if latest == seq and doc.version == ctx.version:
        return True
    stats.count("debounced")
    req.no_decode = "closed" if latest is None else "superseded" if latest != seq else "stale"
    return False


class Completer:
    def __init__(
        self,
        docs: DocumentStore,
        host: EngineHost,
        stats: Stats,
        telemetry: Telemetry,
        notify: Callable[[str, dict], None],
    ):
        self.docs, self.host, self.stats, self.telemetry = docs, host, stats, telemetry
        self.streamer = DeltaStreamer(notify)
        self.typethrough = TypeThrough(stats, self.streamer)
        self._seq: dict[str, int] = {}  # requests per document (only documents the editor asks completions for)
        self._last_edit: dict[str, float] = {}
        # Other files' chunks before the prompt (lsp_server/context/): a ring per document, refreshed off the
        # keystroke path; a ring that changed is pre-warmed.
        self.context = CrossFileContext(
            docs,
            stats,
            on_change=lambda doc, cursor, settings: self.warm.schedule(
                doc, cursor, settings, delay_ms=0, exact=cursor is not None, activity=False
            ),
        )
        self.planner = Planner(docs, stats, self.context)
        self.warm = Prewarmer(docs, host, stats, self.planner, self.typethrough)
        # Submit and stream (lsp_server/decodes.py): the decodes requests, prefetches and follow-ups start.
        self.decodes = Decodes(docs, host, stats, self.typethrough, self.planner, self.warm, self._seq, self._last_edit)

    @property
    def active(self) -> Generation | None:
        """The running decode: the engine decodes one request at a time."""
        return self.typethrough.active

    @property
    def last_policy(self) -> dict | None:
        """The latest decode's syntax-policy decision, for fimble/stats."""
        return self.planner.last_policy

    @property
    def engine_ns(self) -> str:
        """The session's id where sessions share the engine (FimbleServer)."""
        return self.planner.engine_ns

    @engine_ns.setter
    def engine_ns(self, value: str) -> None:
        self.planner.engine_ns = value

    def engine_doc_id(self, uri: str) -> str:
        return self.planner.engine_doc_id(uri)

    # -- tables (for the bounded-growth check in fimble/stats) -------------------------------
    def tables(self) -> dict:
        return {
            **self.typethrough.tables(),
            "subscriptions": len(self.streamer),
            "pumps": len(self.decodes.pumps),
            "request_seq": len(self._seq),
            "last_edit": len(self._last_edit),
            **self.warm.tables(),
            **self.context.tables(),
        }

    def pending_accounting(self) -> dict:
        return self.typethrough.pending_accounting()

    # -- the request: context -> type-through lookup -> plan -> submit -> stream -> finish ----
    async def complete(
        self, doc: Document, cursor: tuple[int, int], settings: Settings, req: RequestInfo, *, stream: bool
    ) -> Answer | None:
        t_build = time.perf_counter()
        ctx = build_context(doc, cursor[0], cursor[1], settings.prefix_chars, settings.suffix_chars)  # context
        build_ms = (time.perf_counter() - t_build) * 1e3
        seq = self._seq[doc.uri] = self._seq.get(doc.uri, 0) + 1
        # An indentation-only line: decodes start at the line's start (lsp_server/line_start.py). ``ls`` is set
        # while the answer may still be a dedent (its text has not shown that it keeps the indentation).
        at_start = line_start(doc, ctx) if settings.line_start else None
        hit = self.typethrough.attach(ctx, count_miss=at_start is None)  # type-through lookup
        ls = None
        if hit is None and at_start is not None:
            hit = self.typethrough.attach(at_start.ctx)  # a dedent decoded for this line earlier
            ls = at_start if hit is not None else None
        if hit is not None:
            gen, offset, cached, instant = hit
        else:
            # (A return before ``subscribe`` sets ``req.no_decode``, its done delta's finishReason, unless "empty".)
            if not ctx.prefix.strip() and not ctx.suffix.strip():
                return None  # nothing to complete from
            if not await debounce(doc, ctx, settings, req, seq, self._seq, self.stats):
                return None
            t_plan = time.perf_counter()
            ls = at_start
            try:
                # plan: now, while the document is at ctx.version
                plan = self.planner.plan(ls.doc, ls.ctx, settings) if ls else self.planner.plan(doc, ctx, settings)
            except ValueError:  # the document is being changed (Document.with_edit): at the cursor then
                ls = None
                plan = self.planner.plan(doc, ctx, settings)
            build_ms += (time.perf_counter() - t_plan) * 1e3
            gen = await self.decodes.start(ls.ctx if ls else ctx, settings, req.t0, build_ms, plan)  # submit
            if gen is None:
                req.no_decode = "unavailable"  # no engine (the model did not load)
                return None
            offset, cached, instant = 0, False, False
        completion_id = self.telemetry.new_id()
        sub = None
        if stream:  # stream: deltas of the text so far, then of each change
            sub = Subscription(
                gen,
                offset,
                req.request_id,
                req.token,
                completion_id,
                doc.uri,
                ctx.version,
                req.position,
                cached=cached,
                replace_end=stage.delta_replace_end(doc, ctx, gen, offset, req.position, req.encoding),
                indent=ls.indent if ls else "",
            )
            req.streamed = True  # the subscription sends the request's one done delta (not FimbleServer.answer)
            self.streamer.subscribe(sub)
        text = await self._wait(doc, ctx, gen, offset, settings, req, sub, ls)
        answer = self._finish(doc, ctx, gen, offset, text, completion_id, cached, req, ls)  # finish
        if answer is not None:
            self.decodes.follow_up(gen)
        if instant:
            self.stats.observe("cache_answer", (time.perf_counter() - req.t0) * 1e3)
        return answer

    async def _wait(
        self,
        doc: Document,
        ctx: Context,
        gen: Generation,
        offset: int,
        settings: Settings,
        req: RequestInfo,
        sub: Subscription | None,
        ls: LineStart | None = None,
    ) -> str:
        """The text to answer with, once due (lsp_server/answer.py). A cancelled request stops the decode
        unless another request or a stream uses it. With ``ls``, the text is the line's from its start."""

        def shows(text: str) -> bool:
            """Whether an early answer shapes to something (else: wait for more text).

            Validation cuts a block header alone (``if x:``, its body not decoded yet), and part of
            a first line that would add a parse error (``return self.headers["`` before the rest
            of the line): a client without streaming shows exactly the answer."""
            if doc.version != ctx.version or self.docs.get(doc.uri) is not doc:
                return True  # _finish decides
            if ls is not None:
                rest = at_cursor(text, ls.indent)
                if rest is None:  # a dedent, shaped where it goes
                    return bool(stage.shape_answer(ls.doc, ls.ctx.cursor, gen, offset, text, self.stats)[0])
                return bool(rest.strip()) and bool(
                    stage.shape_answer(doc, ctx.cursor, gen, offset + len(ls.indent), rest, self.stats)[0]
                )
            return bool(stage.shape_answer(doc, ctx.cursor, gen, offset, text, self.stats)[0])

        gen.waiting += 1
        gen.invoked_waiting += req.invoked
        gen.invoked = gen.invoked or req.invoked  # the user asked: the decode runs to its end (no quiet stop)
        task = asyncio.current_task()
        if task is not None:
            gen.waiter_tasks.add(task)
        try:
            # An invoked request (the user asked) waits for whole lines or the decode's end: never a fragment.
            return await wait_answer(
                gen,
                offset,
                req.t0 + settings.early_answer_ms / 1e3,
                settings.answer_at == "end",
                shows,
                partial_ok=not req.invoked,
                host=self.host,
                stats=self.stats,
            )
        except asyncio.CancelledError:  # $/cancelRequest: stop the decode unless another request uses it
            self.stats.count("cancel_requests")
            if sub is not None:
                self.streamer.end(sub, "cancelled")
            if gen.waiting == 1 and self.streamer.live(gen) == 0:
                gen.cancel()
            raise
        finally:
            gen.waiting -= 1
            gen.invoked_waiting -= req.invoked
            gen.waiter_tasks.discard(task)

    def _finish(
        self,
        doc: Document,
        ctx: Context,
        gen: Generation,
        offset: int,
        text: str,
        completion_id: str,
        cached: bool,
        req: RequestInfo,
        ls: LineStart | None = None,
    ) -> Answer | None:
        """The answer at the document as it is now: re-based onto what was typed since, then shaped there.
        With ``ls``, ``text`` is the line's from its start: a dedent is answered over the indentation."""
        if self.docs.get(doc.uri) is not doc:
            return None  # closed meanwhile
        if ls is not None and at_cursor(text, ls.indent) is None:
            if doc.version != ctx.version:  # the editor's line changed: the range over it is gone
                self.stats.count("stale_dropped")
                return None
            text, replace_cols = stage.shape_answer(ls.doc, ls.ctx.cursor, gen, offset, text, self.stats)
            self.stats.observe("answer", (time.perf_counter() - req.t0) * 1e3)
            if not text.strip():
                return None
            self.stats.count("line_start_answers")
            gen.mark_shown(offset + len(text))
            self.telemetry.remember(completion_id, text, cached)
            return Answer(text, ls.ctx.cursor, completion_id, cached, replace_cols + len(ls.indent))
        if ls is not None:  # the text keeps the indentation: answered at the cursor, past it
            offset, text = offset + len(ls.indent), text[len(ls.indent) :]
        rebased = rebase(doc, ctx, text, self.stats)
        if rebased is None:
            return None
        text, consumed, cursor = rebased
        text, replace_cols = stage.shape_answer(doc, cursor, gen, offset + consumed, text, self.stats)
        self.stats.observe("answer", (time.perf_counter() - req.t0) * 1e3)
        if not text.strip():
            return None
        gen.mark_shown(offset + consumed + len(text))
        self.telemetry.remember(completion_id, text, cached)
        return Answer(text, cursor, completion_id, cached, replace_cols)

    # -- document events ---------------------------------------------------------------------
    def document_changed(self, doc: Document, cursor: tuple[int, int] | None, settings: Settings) -> None:
        """Deltas are tied to a version: end them. Stop the decode unless the edit types along it.

        ``cursor`` is where a single insertion left the cursor (typing). If the editor has
        been asking for completions in this document, start decoding there now (prefetch): the
        request its debounce sends a moment later then finds the decode already running.
        """
        self.streamer.end_document(doc.uri, "stale")
        gen = self.active
        if gen is not None and not gen.done and gen.ctx.uri == doc.uri:
            typed = typed_since(doc, gen.ctx)
            if typed is not None and gen.text.startswith(typed):
                return  # typing along the completion: keep decoding for type-through
            gen.cancel()
            self.stats.count("cancelled_by_edit")
        now = time.perf_counter()
        gap = now - self._last_edit.get(doc.uri, 0.0)
        if doc.uri in self._seq:  # only documents the editor asks completions for
            self._last_edit[doc.uri] = now
            if (
                cursor is not None
                and settings.prefetch
                and gap >= PREFETCH_MIN_GAP_S
                and settings.enabled_for(doc.language_id)
            ):
                self.warm.prefetch(doc, cursor, settings, self.decodes.submit)

    def hold(self, uri: str) -> None:
        """A change to ``uri`` is being applied in slices (lsp_server/pacing.py): stop what reads it."""
        self.warm.cancel(uri)
        self.streamer.end_document(uri, "stale")
        gen = self.active
        if gen is not None and not gen.done and gen.ctx.uri == uri:
            gen.cancel()
            self.stats.count("cancelled_by_edit")

    def document_closed(self, uri: str) -> None:
        self.streamer.end_document(uri, "closed")
        self.context.closed(uri)
        self.warm.cancel(uri)
        engine = self.host.ready_engine()
        if engine is not None:
            engine.forget(self.engine_doc_id(uri))  # its KV caches: memory for the documents still open
        self.typethrough.forget(uri)
        self._seq.pop(uri, None)
        self._last_edit.pop(uri, None)
        self.warm.forget(uri)

    def cursor_moved(self, doc: Document, cursor: tuple[int, int], settings: Settings) -> None:
        """The editor's cursor rests at ``cursor`` (fimble/cursor): pre-warm the prompt a completion there would
        send, unless the engine already got (or is about to get) that very prompt (lsp_server/prewarm.py)."""
        if self.warm.needs_prewarm(doc, cursor):
            self.schedule_prewarm(doc, cursor, settings, exact=True)

    def schedule_prewarm(
        self,
        doc: Document,
        cursor: tuple[int, int] | None,
        settings: Settings,
        *,
        delay_ms: int | None = None,
        exact: bool = False,
    ) -> None:
        """A document event: the cross-file context's (off this path), then a pre-warm at ``cursor``
        (None: the document's end), debounced per document (lsp_server/prewarm.py, Prewarmer.schedule)."""
        self.context.touch(doc, cursor, settings)
        self.warm.schedule(doc, cursor, settings, delay_ms=delay_ms, exact=exact)
