"""From a request at a cursor to an answer: type-through cache, cancel-previous, early answers, version safety.

- Type-through: a request whose text before the cursor is a generation's anchor plus
  characters that match that generation's text is answered from it, without the model.
- Cancel-previous: the engine decodes one request at a time, so starting a generation
  stops the one before it (within one engine step), and an edit that disagrees with
  the running generation stops it too. Typing *along* it keeps it going.
- Early answer: a request is answered once its text has a full line, the generation
  ends, or ``earlyAnswerMs`` passes; the generation keeps running for later keystrokes.
- Version safety: an answer computed for an older document version is re-based onto
  what was typed since (when that agrees with it) or dropped. Never shown wrong.
- Syntax policy: each decode's options come from lsp_server.shaping.policy.decide at its cursor
  (settings maxTokens / maxLines cap them, settings ``policy`` overrides the table), and
  its text streams through an lsp_server.shaping.shaper.CompletionShaper: the bracket guard ends
  the decode at a closer beyond the completion's scope, and every answer is the shaper's
  ``finish`` at the answer's cursor (text, plus the auto-paired closers it replaces).
  A finished decode's text is cut to its shaped text, so type-through serves only that.
- KV cache: every request names its document (its KV cache in the engine) and the lines
  where the document's top-level definitions start (lsp_server/segments.py), the engine's
  segment boundaries. Pre-warm: after didOpen, and once edits settle (prewarmDelayMs), the
  prompt a completion at the presumed cursor would send goes to ``engine.prewarm``, which
  prefills it in the background, so the next completion there prefills only what changed.
  Where the editor reports the resting cursor (``fimble/cursor``), the prompt at that cursor
  instead, unless the engine already got (or is about to get) exactly that prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from engine.options import DecodeOptions  # plain data: no torch here
from lsp_server import indent
from lsp_server.context import CrossFileContext
from lsp_server.documents import Document, DocumentStore
from lsp_server.engine_host import EngineHost
from lsp_server.follow_up import follow_up_context, follow_up_options
from lsp_server.generation import Generation, first_line_end
from lsp_server.positions import advance, from_codepoints
from lsp_server.prompt import Context, build_context, clean, typed_since
from lsp_server.segments import segment_lines
from lsp_server.settings import Settings
from lsp_server.shaping.policy import cap_line_limit, decide
from lsp_server.shaping.shaper import CompletionShaper
from lsp_server.shaping.syntax.brackets import fit_to_line_rest
from lsp_server.shaping.syntax.context import classify
from lsp_server.stats import Stats
from lsp_server.streaming import DeltaStreamer, Subscription
from lsp_server.telemetry import Telemetry

log = logging.getLogger(__name__)
RECENT_PER_DOC = 3
RECENT_DOCS = 32
# Keystrokes closer together than this are a burst (paste, key repeat, a script): no prefetch,
# or every one of them would queue a decode that the next one cancels.
PREFETCH_MIN_GAP_S = 0.02
# Cursor lines longer than this (minified code, data) skip the syntax policy and shaping:
# classifying such a line costs milliseconds per thousand characters and grows faster.
POLICY_MAX_LINE = 4000
# A request waits at most this long on a running engine, then answers with the text it has (the
# decode goes on for type-through). Time while the engine (re)starts does not count: a request
# after an engine crash is served once the new engine is up (lsp_server/engine_host.py).
REQUEST_BUDGET_S = float(os.environ.get("FIMBLE_REQUEST_BUDGET_S", 20.0))
# Tab-Tab's follow-up decode (lsp_server/follow_up.py) starts only this soon after the document's last edit.
FOLLOW_UP_WITHIN_S = float(os.environ.get("FIMBLE_FOLLOW_UP_WITHIN_S", 1.5))
CONTEXT_WAIT_S = 0.05  # a pre-warm due while the cross-file context is refreshed looks again this much later


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


def _early_text(rem: str, done: bool, past_deadline: bool) -> str | None:
    """What to answer now with ``rem`` so far, or None to keep waiting."""
    if done:
        return rem.rstrip()
    if first_line_end(rem) != -1:
        return rem[:rem.rfind("\n")].rstrip()  # complete lines only
    if past_deadline and rem.strip():
        return rem
    return None


class Plan(NamedTuple):
    """What a decode at a cursor needs besides its windows."""

    options: DecodeOptions
    shaper: CompletionShaper | None
    segment_lines: list[int] | None  # CompletionRequest.segment_lines (None: the engine's fixed blocks)


class _Skip(Exception):
    """The syntax policy does not apply here (see POLICY_MAX_LINE)."""


def _clamp(doc: Document, cursor: tuple[int, int] | None) -> tuple[int, int]:
    """``cursor`` inside ``doc`` (None: the document's end)."""
    last = len(doc.lines) - 1
    if cursor is None:
        return last, len(doc.line_text(last))
    line = min(cursor[0], last)
    return line, min(cursor[1], len(doc.line_text(line)))


class Completer:
    def __init__(self, docs: DocumentStore, host: EngineHost, stats: Stats, telemetry: Telemetry,
                 notify: Callable[[str, dict], None]):
        self.docs, self.host, self.stats, self.telemetry = docs, host, stats, telemetry
        self.streamer = DeltaStreamer(notify)
        self.active: Generation | None = None
        self.recent: OrderedDict[str, deque[Generation]] = OrderedDict()
        self._seq: dict[str, int] = {}
        self._last_edit: dict[str, float] = {}
        self._pumps: set[asyncio.Task] = set()
        # Pending pre-warms by URI: a timer (debounce), or a task waiting for the engine to start.
        self._prewarms: dict[str, asyncio.TimerHandle | asyncio.Task] = {}
        # By URI: (version, cursor) of the prompt the document's KV cache holds or is about to hold:
        # the latest decode submitted or pre-warm scheduled there. fimble/cursor skips a pre-warm for it.
        self._warm_at: dict[str, tuple[int, tuple[int, int]]] = {}
        self.last_policy: dict | None = None  # the latest decode's decision, for fimble/stats
        self.engine_ns = ""  # the session's id where sessions share the engine (FimbleServer)
        # Other files' chunks before the prompt (lsp_server/context/): a ring per document, refreshed off the
        # keystroke path; a ring that changed is pre-warmed.
        self.context = CrossFileContext(docs, stats, on_change=lambda doc, cursor, settings: self.schedule_prewarm(
            doc, cursor, settings, delay_ms=0, exact=cursor is not None))

    def engine_doc_id(self, uri: str) -> str:
        """The document's key in the engine: its URI, under the session's namespace when shared."""
        return f"{self.engine_ns}\x00{uri}" if self.engine_ns else uri

    # -- tables (for the bounded-growth check in fimble/stats) -------------------------------
    def tables(self) -> dict:
        return {"recent_docs": len(self.recent), "recent_generations": sum(len(d) for d in self.recent.values()),
                "subscriptions": len(self.streamer), "pumps": len(self._pumps), "request_seq": len(self._seq),
                "last_edit": len(self._last_edit), "prewarms_pending": len(self._prewarms),
                "warm_at": len(self._warm_at), **self.context.tables(),
                "active": 0 if self.active is None else 1}

    # -- document events ---------------------------------------------------------------------
    def document_changed(self, doc: Document, cursor: tuple[int, int] | None, settings: Settings) -> None:
        """Deltas are tied to a version: end them. Stop the decode unless the edit types along it.

        ``cursor`` is where a single insertion left the cursor (typing). If the editor has
        been asking for completions in this document, start decoding there now: the
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
            if cursor is not None and settings.prefetch and gap >= PREFETCH_MIN_GAP_S \
                    and settings.enabled_for(doc.language_id):
                self._prefetch(doc, cursor, settings)

    def _prefetch(self, doc: Document, cursor: tuple[int, int], settings: Settings) -> None:
        engine = self.host.ready_engine()
        if engine is None:
            return
        t0 = time.perf_counter()
        ctx = build_context(doc, cursor[0], cursor[1], settings.prefix_chars, settings.suffix_chars)
        if self._lookup(ctx) is not None or (not ctx.prefix.strip() and not ctx.suffix.strip()):
            return
        self.stats.count("prefetches")
        plan = self._plan(doc, ctx, settings, prefetch=True)
        self._submit(engine, ctx, settings, t0, (time.perf_counter() - t0) * 1e3, plan).prefetched = True

    def document_closed(self, uri: str) -> None:
        self.streamer.end_document(uri, "closed")
        self.context.closed(uri)
        pending = self._prewarms.pop(uri, None)
        if pending is not None:
            pending.cancel()
        engine = self.host.ready_engine()
        if engine is not None:
            engine.forget(self.engine_doc_id(uri))  # its KV caches: memory for the documents still open
        if self.active is not None and self.active.ctx.uri == uri:
            self.active.cancel()
        for gen in self.recent.pop(uri, ()):
            self._account(gen)
        self._seq.pop(uri, None)
        self._last_edit.pop(uri, None)
        self._warm_at.pop(uri, None)

    # -- pre-warm ----------------------------------------------------------------------------
    def cursor_moved(self, doc: Document, cursor: tuple[int, int], settings: Settings) -> None:
        """The editor's cursor rests at ``cursor`` (fimble/cursor): pre-warm the prompt a completion there would send.

        Skipped when the engine already got, or is about to get, that very prompt (a decode or a
        pre-warm at this version and cursor: the editor reports the cursor after typing too).
        """
        if self._warm_at.get(doc.uri) == (doc.version, cursor):
            self.stats.count("cursor_skipped")
            return
        self.schedule_prewarm(doc, cursor, settings, exact=True)

    def hold(self, uri: str) -> None:
        """A change to ``uri`` is being applied in slices (lsp_server/pacing.py): stop what reads it."""
        pending = self._prewarms.pop(uri, None)
        if pending is not None:
            pending.cancel()
        self.streamer.end_document(uri, "stale")
        gen = self.active
        if gen is not None and not gen.done and gen.ctx.uri == uri:
            gen.cancel()
            self.stats.count("cancelled_by_edit")

    def schedule_prewarm(self, doc: Document, cursor: tuple[int, int] | None, settings: Settings, *,
                         delay_ms: int | None = None, exact: bool = False) -> None:
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
        """
        self.context.touch(doc, cursor, settings)  # (a document event: cross-file context, off this path)
        pending = self._prewarms.pop(doc.uri, None)
        if pending is not None:
            pending.cancel()
        if not settings.prewarm or not settings.enabled_for(doc.language_id):
            return
        if self.host.state not in ("ready", "starting"):
            return
        delay = settings.prewarm_delay_ms if delay_ms is None else delay_ms
        cursor = _clamp(doc, cursor)
        self._prewarms[doc.uri] = asyncio.get_running_loop().call_later(
            delay / 1e3, self._prewarm_due, doc.uri, cursor, settings, exact)
        self._warm_at[doc.uri] = (doc.version, cursor)

    def _prewarm_due(self, uri: str, cursor: tuple[int, int], settings: Settings, exact: bool) -> None:
        self._prewarms.pop(uri, None)
        if self.context.pending:  # its ring may change the prompt's head: pre-warm the prompt it leads to
            self._prewarms[uri] = asyncio.get_running_loop().call_later(
                CONTEXT_WAIT_S, self._prewarm_due, uri, cursor, settings, exact)
            return
        engine = self.host.ready_engine()
        if engine is not None:
            self._prewarm(engine, uri, cursor, settings, exact)
        elif self.host.state == "starting":
            task = asyncio.create_task(self._prewarm_when_ready(uri, cursor, settings, exact))
            self._prewarms[uri] = task

            def done(t: asyncio.Task, uri: str = uri) -> None:
                if self._prewarms.get(uri) is t:
                    del self._prewarms[uri]
            task.add_done_callback(done)

    async def _prewarm_when_ready(self, uri: str, cursor: tuple[int, int], settings: Settings,
                                  exact: bool) -> None:
        engine = await self.host.wait_ready()
        if engine is not None:
            self._prewarm(engine, uri, cursor, settings, exact)

    def _prewarm(self, engine: Any, uri: str, cursor: tuple[int, int], settings: Settings,
                 exact: bool = False) -> None:
        doc = self.docs.get(uri)
        if doc is None or doc.changing:
            return
        if exact:
            skip = self._warm_at.get(uri) != (doc.version, cursor)  # a decode elsewhere since: the user is there
        else:  # a decode at this version already filled the cache
            skip = any(g.ctx.version == doc.version and g.t_first is not None for g in self._generations(uri))
        if skip:
            self.stats.count("prewarms_skipped")
            return
        line, col = _clamp(doc, cursor)  # (the document has not changed since: an edit reschedules)
        try:
            ctx = build_context(doc, line, col, settings.prefix_chars, settings.suffix_chars)
            if not ctx.prefix.strip() and not ctx.suffix.strip():
                return
            engine.prewarm(self._request(ctx, self._plan(doc, ctx, settings, prewarm=True), settings))
        except Exception:  # only an optimisation: never let it cost the session
            log.exception("pre-warm failed")
            self.stats.count("prewarm_errors")
            return
        self.stats.count("prewarms_sent")

    def _generations(self, uri: str) -> list[Generation]:
        gens = list(self.recent.get(uri, ()))
        if self.active is not None and self.active.ctx.uri == uri:
            gens.append(self.active)
        return gens

    # -- requests ----------------------------------------------------------------------------
    async def complete(self, doc: Document, cursor: tuple[int, int], settings: Settings,
                       req: RequestInfo, *, stream: bool) -> Answer | None:
        t_build = time.perf_counter()
        ctx = build_context(doc, cursor[0], cursor[1], settings.prefix_chars, settings.suffix_chars)
        build_ms = (time.perf_counter() - t_build) * 1e3
        seq = self._seq[doc.uri] = self._seq.get(doc.uri, 0) + 1
        hit = self._lookup(ctx)
        instant = False  # answered from a finished generation's text: no model, no waiting
        cached = False  # served by text generated for an earlier cursor (type-through)
        if hit is not None:
            gen, offset = hit
            if gen.prefetched and offset == 0:
                self.stats.count("follow_up_hits" if gen.follow_up else "prefetch_hits")  # model-served
            else:
                cached, instant = True, gen.done
                self.stats.count("typethrough_hits" if instant else "inflight_hits")
        else:
            self.stats.count("misses")
            if not ctx.prefix.strip() and not ctx.suffix.strip():
                return None  # nothing to complete from
            if settings.debounce_ms and not req.invoked:
                await asyncio.sleep(settings.debounce_ms / 1e3)
                if self._seq.get(doc.uri) != seq or doc.version != ctx.version:
                    self.stats.count("debounced")
                    return None
            t_plan = time.perf_counter()
            plan = self._plan(doc, ctx, settings)  # now: the document is at ctx.version
            build_ms += (time.perf_counter() - t_plan) * 1e3
            gen = await self._start(ctx, settings, req.t0, build_ms, plan)
            if gen is None:
                return None
            offset = 0
        completion_id = self.telemetry.new_id()
        sub = None
        if stream:
            sub = Subscription(gen, offset, req.request_id, req.token, completion_id, doc.uri, ctx.version,
                               req.position, cached=cached,
                               replace_end=self._delta_replace_end(doc, ctx, gen, offset, req))
            self.streamer.subscribe(sub)
        def shows(text: str) -> bool:
            """Whether an early answer shapes to something (else: wait for more text).

            Validation cuts a block header alone (``if x:``, its body not decoded yet), and part of
            a first line that would add a parse error (``return self.headers["`` before the rest
            of the line): a client without streaming shows exactly the answer."""
            if doc.version != ctx.version or self.docs.get(doc.uri) is not doc:
                return True  # _finish_answer decides
            return bool(self._shape_answer(doc, ctx.cursor, gen, offset, text)[0])

        gen.waiting += 1
        task = asyncio.current_task()
        if task is not None:
            gen.waiter_tasks.add(task)
        try:
            # An invoked request (the user asked) waits for whole lines or the decode's end: never a fragment.
            text = await self._wait_answer(gen, offset, req.t0 + settings.early_answer_ms / 1e3,
                                           settings.answer_at == "end", shows, partial_ok=not req.invoked)
        except asyncio.CancelledError:  # $/cancelRequest: stop the decode unless another request uses it
            self.stats.count("cancel_requests")
            if sub is not None:
                self.streamer.end(sub, "cancelled")
            if gen.waiting == 1 and self.streamer.live(gen) == 0:
                gen.cancel()
            raise
        finally:
            gen.waiting -= 1
            gen.waiter_tasks.discard(task)
        answer = self._finish_answer(doc, ctx, gen, offset, text, completion_id, cached, req)
        if answer is not None:
            self._follow_up(gen)
        if instant:
            self.stats.observe("cache_answer", (time.perf_counter() - req.t0) * 1e3)
        return answer

    def _doomed(self, gen: Generation) -> bool:
        """Whether every request waiting on ``gen`` has a cancel pending, so the decode is about to stop.

        `$/cancelRequest` cancels the request's task, but its CancelledError (which cancels the
        decode) arrives only at that task's next step; messages read in the same chunk are handled
        first. A request arriving in between must not attach to a decode that is being cancelled."""
        tasks = gen.waiter_tasks
        return (not gen.done and bool(tasks) and all(t.cancelling() for t in tasks)
                and self.streamer.live(gen) <= len(tasks))

    def _lookup(self, ctx: Context) -> tuple[Generation, int] | None:
        """A generation whose anchor + the text typed since matches ``ctx``, with the typed length."""
        candidates = list(reversed(self.recent.get(ctx.uri, ())))
        if self.active is not None and self.active.ctx.uri == ctx.uri:
            candidates.insert(0, self.active)
        for gen in candidates:
            a = gen.ctx
            if not gen.usable or self._doomed(gen) or a.window != ctx.window or a.suffix != ctx.suffix:
                continue
            if len(ctx.prefix) < len(a.prefix) or not ctx.prefix.startswith(a.prefix):
                continue
            typed = ctx.prefix[len(a.prefix):]
            if not gen.text.startswith(typed):
                continue
            if gen.done and not gen.text[len(typed):].strip():
                continue  # typed through all of it: ask the model for more
            return gen, len(typed)
        return None

    async def _start(self, ctx: Context, settings: Settings, t0: float, build_ms: float,
                     plan: Plan) -> Generation | None:
        engine = await self.host.get(settings)
        if engine is None:
            self.stats.count("engine_unavailable")
            return None
        return self._submit(engine, ctx, settings, t0, build_ms, plan)

    def _plan(self, doc: Document, ctx: Context, settings: Settings, *,
              prefetch: bool = False, prewarm: bool = False) -> Plan:
        """The decode options the syntax policy gives ``ctx``'s cursor, the shaper for its text, segment lines.

        Call it while ``doc`` is at ``ctx.version`` (the shaper snapshots the document).
        Settings cap the decision: maxTokens, maxLines (0 = no cap). A ``prewarm`` plan has
        no shaper and is not recorded (lastPolicy, policy counters): nothing is decoded.
        """
        lines = self._segment_lines(doc, ctx)
        try:
            if len(doc.lines[ctx.cursor[0]]) > POLICY_MAX_LINE:
                raise _Skip
            byte = doc.byte_offset(*ctx.cursor)
            cursor_ctx = classify(doc.syntax, byte)
            decision = decide(doc.syntax, byte, doc.language_id, settings.policy, context=cursor_ctx)
            opts = decision.to_options(drafter=settings.drafter,
                                       max_tokens=min(decision.max_tokens, max(1, settings.max_tokens)),
                                       max_lines=cap_line_limit(decision.line_limit, settings.max_lines))
            shaper = None if prewarm else CompletionShaper(doc.syntax, byte, context=cursor_ctx)
        except Exception as exc:  # a syntax-layer bug must not cost the user the completion
            if prewarm:
                pass  # the completion that follows counts (and logs) it
            elif isinstance(exc, _Skip):
                self.stats.count("policy_skipped_long_line")
            else:
                log.exception("syntax policy failed: decoding with the fixed settings")
                self.stats.count("policy_errors")
            if not prewarm:
                self.last_policy = None
            return Plan(DecodeOptions(max_tokens=max(1, settings.max_tokens), drafter=settings.drafter,
                                      max_lines=settings.max_lines), None, lines)
        if prewarm:
            return Plan(opts, None, lines)
        self.last_policy = {"uri": ctx.uri, "version": ctx.version, "cursor": list(ctx.cursor),
                            "language": doc.syntax.language_id, "context": decision.context,
                            "midLine": decision.mid_line, "plainText": decision.plain_text, "prefetch": prefetch,
                            "options": dataclasses.asdict(opts)}
        self.stats.count(f"policy_{decision.context}")
        return Plan(opts, shaper, lines)

    def _segment_lines(self, doc: Document, ctx: Context) -> list[int] | None:
        try:
            return segment_lines(doc, ctx.window, ctx.cursor[0], ctx.suffix)
        except Exception:  # only an optimisation: the engine cuts fixed blocks instead
            log.exception("segment lines failed")
            self.stats.count("segment_lines_errors")
            return None

    def _request(self, ctx: Context, plan: Plan, settings: Settings, background: bool = False) -> Any:
        """The engine request for ``ctx``: one code path for completions, prefetches, follow-ups and pre-warms."""
        from engine.api import CompletionRequest  # loaded by the engine host already

        return CompletionRequest(clean(ctx.prefix), clean(ctx.suffix), options=plan.options,
                                 document_id=self.engine_doc_id(ctx.uri),
                                 segment_lines=plan.segment_lines, reuse=settings.reuse, truncate=True,
                                 heal=settings.token_healing, cold_window=True, background=background,
                                 context=self.context.for_request(ctx.uri, self.docs.get(ctx.uri), settings))

    def _submit(self, engine: Any, ctx: Context, settings: Settings, t0: float, build_ms: float,
                plan: Plan, background: bool = False) -> Generation:
        if self.active is not None:
            self.active.cancel()  # one decode at a time: the newest request wins
        stream = engine.submit(self._request(ctx, plan, settings, background))
        gen = Generation(ctx, stream, t0, build_ms)
        gen.shaper, gen.plan, gen.settings = plan.shaper, plan, settings
        line_before = ctx.prefix[ctx.prefix.rfind("\n") + 1:]
        if indent.applies(line_before, ctx.suffix.split("\n", 1)[0]):
            gen.indent_fit = indent.IndentFit()  # no indentation added to the editor's (lsp_server/indent.py)
        self.active = gen
        if self.docs.get(ctx.uri) is not None:  # (not closed while the engine started)
            self._warm_at[ctx.uri] = (ctx.version, ctx.cursor)
        self.stats.count("generations")
        task = asyncio.create_task(self._pump(gen))
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)
        return gen

    async def _pump(self, gen: Generation) -> None:
        from engine.errors import FimbleError

        reason, error = None, None
        try:
            async for delta in gen.stream:
                if delta.text and not gen.cut:
                    text = gen.indent_fit.feed(delta.text) if gen.indent_fit is not None else delta.text
                    if text:
                        self._add_guarded(gen, text)
                if delta.finished:
                    reason = delta.finish_reason
                gen.changed()
        except FimbleError as exc:
            reason, error = "error", str(exc)
        except Exception as exc:  # a broken stream must end its requests, not hang them
            log.exception("completion stream failed")
            gen.cancel()
            reason, error = "error", f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            gen.cancel()
            reason = "cancelled"
            raise
        finally:
            if gen.cut and reason in (None, "cancelled"):
                reason = "stop"  # the guard ended it: the text is complete up to the stop
            gen.finish(reason, error)
            if gen.usable:
                self._shape_final(gen)
            if self.active is gen:
                self.active = None
            self._record(gen)
            if gen.usable and gen.text.strip() and gen.ctx.uri in self._seq:
                self._remember(gen)
            gen.changed()
            self._follow_up(gen)

    def _follow_up(self, gen: Generation) -> None:
        """Tab-Tab: once ``gen`` has ended and shown text, decode in the background the completion that follows
        accepting it (lsp_server/follow_up.py). Once per generation, only while nothing else decodes; the next
        keystroke's request cancels it. Called when the decode ends and when an answer is shown."""
        if gen.followed or not (gen.done and gen.usable and gen.shown) or self.active is not None:
            return
        gen.followed = True
        settings, doc, engine = gen.settings, self.docs.get(gen.ctx.uri), self.host.ready_engine()
        # Local engines only: a remote server's or a shared daemon's decodes cost others (and maybe money).
        if doc is None or engine is None or settings is None or not settings.prefetch or settings.engine_spec:
            return
        try:
            ctx = follow_up_context(doc, gen, settings.prefix_chars, settings.suffix_chars)
        except Exception:  # only an optimisation: never let it cost the session
            log.exception("follow-up context failed")
            return
        # Only soon after the user's last key: a user who stopped typing stops the engine (it has shown them
        # what they asked for; Tab after a long read decodes afresh).
        last = max(self._last_edit.get(gen.ctx.uri, 0.0), gen.t_request)  # the user's last key or request
        if ctx is None or time.perf_counter() - last > FOLLOW_UP_WITHIN_S:
            return
        plan = Plan(follow_up_options(gen.plan.options), None, gen.plan.segment_lines)
        nxt = self._submit(engine, ctx, settings, time.perf_counter(), 0.0, plan, background=True)
        nxt.prefetched = nxt.follow_up = True
        self.stats.count("follow_ups")

    def _add_guarded(self, gen: Generation, text: str) -> None:
        """Add streamed text up to the guard's stop; at a stop, cancel the decode."""
        if gen.shaper is not None:
            try:
                stop = gen.shaper.feed(text)
            except Exception:
                log.exception("completion guard failed: streaming unguarded")
                gen.shaper, stop = None, None
            if stop is not None:
                gen.cut = True
                self.stats.count("guard_stops")
                if gen.shaper.stop_reason == "suffix_overlap":  # it began re-typing the text after the cursor
                    self.stats.count("suffix_overlap_stops")
                gen.cancel()  # generation goes no further than a closer beyond its scope
                full = gen.text + text
                gen.cut_to(stop)  # (a stop inside text already added: only after a lookahead)
                text = full[len(gen.text):stop]
        if text:
            gen.add_text(text)

    def _shape_final(self, gen: Generation) -> None:
        """Shape a finished decode's text at its anchor; keep only the shaped text (type-through)."""
        shaper, gen.shaper = gen.shaper, None
        if shaper is None:
            return
        try:
            shaped = shaper.finish()
        except Exception:
            log.exception("completion shaping failed: keeping the text as generated")
            return
        if shaped.cut_reason:
            self.stats.count(f"shaped_{shaped.cut_reason}")
        if not gen.text.startswith(shaped.text):
            log.warning("shaped text is not a prefix of the generated text; keeping the generated text")
            return
        gen.cut_to(len(shaped.text))
        gen.replace_cols = len(shaper.doc.bytes[shaped.replace_start:shaped.replace_end].decode("utf-8", "replace"))

    def _shape_answer(self, doc: Document, cursor: tuple[int, int], gen: Generation, start: int,
                      text: str) -> tuple[str, int]:
        """(text to show, code points after the cursor it replaces) for ``text`` at ``cursor`` now.

        ``text`` is ``gen.text[start:]`` or a prefix of it. The finished decode's own shaping
        holds when the answer runs to its end: typing along a completion leaves the document
        prefix + typed + rest + suffix the same, and the rest of the line the same. Any other
        text, part of a first line (at earlyAnswerMs) included, is validated here like a whole
        completion: an answer never adds a parse error.
        """
        if not text.strip():
            return "", 0
        if len(doc.lines[cursor[0]]) > POLICY_MAX_LINE:
            return text, 0  # see POLICY_MAX_LINE
        to_end = gen.done and gen.text[start:].rstrip() == text
        if to_end and gen.replace_cols is not None:
            return text, gen.replace_cols
        try:
            byte = doc.byte_offset(*cursor)
            shaped = CompletionShaper(doc.syntax, byte, snapshot=False).finish(text)  # no await: doc can't change
        except Exception:
            log.exception("completion shaping failed: answering unshaped")
            return text, 0
        cols = len(doc.syntax.bytes[shaped.replace_start:shaped.replace_end].decode("utf-8", "replace"))
        if shaped.text != text:
            self.stats.count(f"answer_shaped_{shaped.cut_reason}")
            if to_end and text.startswith(shaped.text):  # the cache must not serve what was cut
                gen.cut_to(start + len(shaped.text))
                gen.replace_cols = cols
        return shaped.text, cols

    @staticmethod
    def _delta_replace_end(doc: Document, ctx: Context, gen: Generation, offset: int,
                           req: RequestInfo) -> Callable[[str, bool], dict]:
        """For deltas: text -> the end of what it replaces at the request's cursor (its ``replaceEnd``).

        A subscription lives for one document version, so the rest of the cursor's line is read
        once, now. The finished decode's own shaped range holds for its whole text (see
        _shape_answer); a text still streaming is fitted to the closers after the cursor, as a
        partial answer is.
        """
        line, col = ctx.cursor
        line_text = doc.line_text(line)
        rest = line_text[col:]
        language = doc.syntax.language_id if doc.syntax is not None else None

        def replace_end(text: str, done: bool) -> dict:
            cols = 0
            if text.strip() and rest.strip() and len(line_text) <= POLICY_MAX_LINE:
                if done and gen.done and gen.replace_cols is not None and gen.text[offset:] == text:
                    cols = gen.replace_cols
                else:
                    try:
                        cols = fit_to_line_rest(text, rest, language)[1]
                    except Exception:  # a syntax-layer bug costs the range, not the stream
                        log.exception("fitting a delta to the line's closers failed")
            return {"line": req.position["line"],
                    "character": req.position["character"]
                    + from_codepoints(rest, min(cols, len(rest)), req.encoding)}
        return replace_end

    def _remember(self, gen: Generation) -> None:
        dq = self.recent.pop(gen.ctx.uri, None) or deque()
        if len(dq) == RECENT_PER_DOC:
            self._account(dq.popleft())
        dq.append(gen)
        self.recent[gen.ctx.uri] = dq  # most recent document last
        while len(self.recent) > RECENT_DOCS:
            for old in self.recent.popitem(last=False)[1]:
                self._account(old)

    async def _wait_answer(self, gen: Generation, offset: int, deadline: float, at_end: bool,
                           shows: Callable[[str], bool] | None = None, *, partial_ok: bool = True) -> str:
        budget_end = time.perf_counter() + REQUEST_BUDGET_S
        while True:
            now = time.perf_counter()
            if self.host.state == "starting":
                budget_end = now + REQUEST_BUDGET_S  # (re)starting engine: the budget waits with us
            elif now >= budget_end and not gen.done:
                # What it has (whole lines where fragments are not wanted and there are some); the decode goes
                # on. With nothing to show yet it waits on for the first text, up to two more budgets.
                rem = gen.text[offset:]
                lines = "" if partial_ok else rem[:max(0, rem.rfind("\n"))]
                if rem.strip() or now >= budget_end + 2 * REQUEST_BUDGET_S:
                    self.stats.count("request_budget_expired")
                    return (lines if lines.strip() else rem).rstrip()
            left = max(0.05, budget_end - now) if now < budget_end else REQUEST_BUDGET_S
            if at_end:
                await gen.wait_change(left)
                if gen.done:
                    return gen.text[offset:].rstrip()
                continue
            text = _early_text(gen.text[offset:], gen.done, partial_ok and now >= deadline)
            if text is not None and (gen.done or shows is None or shows(text)):
                return text
            await gen.wait_change(min(deadline - now, left) if now < deadline else left)

    def _finish_answer(self, doc: Document, ctx: Context, gen: Generation, offset: int, text: str,
                       completion_id: str, cached: bool, req: RequestInfo) -> Answer | None:
        cursor = ctx.cursor
        consumed = 0
        if self.docs.get(doc.uri) is not doc:
            return None  # closed meanwhile
        if doc.version != ctx.version:
            typed = typed_since(doc, ctx)
            if typed is None or not text.startswith(typed):
                self.stats.count("stale_dropped")
                return None
            self.stats.count("stale_rebased")
            text, consumed = text[len(typed):], len(typed)
            cursor = advance(*cursor, typed)
        text, replace_cols = self._shape_answer(doc, cursor, gen, offset + consumed, text)
        now = time.perf_counter()
        self.stats.observe("answer", (now - req.t0) * 1e3)
        if not text.strip():
            return None
        gen.shown = max(gen.shown, offset + consumed + len(text))
        self.telemetry.remember(completion_id, text, cached)
        return Answer(text, cursor, completion_id, cached, replace_cols)

    # -- accounting --------------------------------------------------------------------------
    def _record(self, gen: Generation) -> None:
        s = self.stats
        s.count(f"finish_{gen.finish_reason}")
        if gen.t_first is not None:
            s.observe("first_token", (gen.t_first - gen.t_request) * 1e3)
        if gen.t_first_line is not None:
            s.observe("first_line", (gen.t_first_line - gen.t_request) * 1e3)
        result = getattr(gen.stream, "result", None)
        if result is None or gen.t_done is None:
            return
        st = result.stats
        s.observe("complete", (gen.t_done - gen.t_request) * 1e3)
        s.observe("prompt_build", gen.build_ms + st.get("prompt_ms", 0.0))
        s.observe("submit", (gen.t_submit - gen.t_request) * 1e3)
        if "first_token_ms" in st:
            s.observe("prefill", max(0.0, st["first_token_ms"] - st.get("prompt_ms", 0.0)))
            s.observe("engine_first_token", st["first_token_ms"])
        if "total_ms" in st:
            s.observe("queue", max(0.0, (gen.t_done - gen.t_submit) * 1e3 - st["total_ms"]))
        s.count("tokens_generated", result.tokens)
        gen.tokens = result.tokens
        if not (gen.usable and gen.text.strip()):
            self._account(gen)  # not kept for type-through: its shown share is final now

    def _account(self, gen: Generation) -> None:
        """Split a generation's tokens into shown and never shown, once, when it can be shown no more."""
        tokens = gen.tokens
        if gen.accounted or not tokens:
            return
        gen.accounted = True
        shown = round(tokens * min(1.0, gen.shown / len(gen.text))) if gen.text else 0
        self.stats.count("tokens_shown", shown)
        self.stats.count("tokens_never_shown", tokens - shown)

    def pending_accounting(self) -> dict:
        """Tokens of generations still kept for type-through (may yet be shown)."""
        kept = [g for d in self.recent.values() for g in d if not g.accounted]
        return {"tokens_pending": sum(g.tokens for g in kept)}
