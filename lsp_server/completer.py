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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lsp_server.documents import Document, DocumentStore
from lsp_server.engine_host import EngineHost
from lsp_server.generation import Generation, first_line_end
from lsp_server.positions import advance
from lsp_server.prompt import Context, build_context, clean, typed_since
from lsp_server.settings import Settings
from lsp_server.stats import Stats
from lsp_server.streaming import DeltaStreamer, Subscription
from lsp_server.telemetry import Telemetry

log = logging.getLogger(__name__)
RECENT_PER_DOC = 3
RECENT_DOCS = 32
# Keystrokes closer together than this are a burst (paste, key repeat, a script): no prefetch,
# or every one of them would queue a decode that the next one cancels.
PREFETCH_MIN_GAP_S = 0.02


@dataclass
class Answer:
    text: str
    cursor: tuple[int, int]  # (line, code point column) in the current document
    completion_id: str
    cached: bool


@dataclass
class RequestInfo:
    request_id: Any
    token: Any
    position: dict  # client units, echoed in deltas
    t0: float
    invoked: bool = False  # explicitly asked for: skip the debounce


def _early_text(rem: str, done: bool, past_deadline: bool) -> str | None:
    """What to answer now with ``rem`` so far, or None to keep waiting."""
    if done:
        return rem.rstrip()
    if first_line_end(rem) != -1:
        return rem[:rem.rfind("\n")].rstrip()  # complete lines only
    if past_deadline and rem.strip():
        return rem
    return None


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

    # -- tables (for the bounded-growth check in fimble/stats) -------------------------------
    def tables(self) -> dict:
        return {"recent_docs": len(self.recent), "recent_generations": sum(len(d) for d in self.recent.values()),
                "subscriptions": len(self.streamer), "pumps": len(self._pumps), "request_seq": len(self._seq),
                "last_edit": len(self._last_edit),
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
        self._submit(engine, ctx, settings, t0, (time.perf_counter() - t0) * 1e3).prefetched = True

    def document_closed(self, uri: str) -> None:
        self.streamer.end_document(uri, "closed")
        if self.active is not None and self.active.ctx.uri == uri:
            self.active.cancel()
        for gen in self.recent.pop(uri, ()):
            self._account(gen)
        self._seq.pop(uri, None)
        self._last_edit.pop(uri, None)

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
                self.stats.count("prefetch_hits")  # the decode this keystroke started: model-served
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
            gen = await self._start(ctx, settings, req.t0, build_ms)
            if gen is None:
                return None
            offset = 0
        completion_id = self.telemetry.new_id()
        sub = None
        if stream:
            sub = Subscription(gen, offset, req.request_id, req.token, completion_id, doc.uri, ctx.version,
                               req.position, cached=cached)
            self.streamer.subscribe(sub)
        gen.waiting += 1
        try:
            text = await self._wait_answer(gen, offset, req.t0 + settings.early_answer_ms / 1e3,
                                           settings.answer_at == "end")
        except asyncio.CancelledError:  # $/cancelRequest: stop the decode unless another request uses it
            self.stats.count("cancel_requests")
            if sub is not None:
                self.streamer.end(sub, "cancelled")
            if gen.waiting == 1 and self.streamer.live(gen) == 0:
                gen.cancel()
            raise
        finally:
            gen.waiting -= 1
        answer = self._finish_answer(doc, ctx, gen, offset, text, completion_id, cached, req)
        if instant:
            self.stats.observe("cache_answer", (time.perf_counter() - req.t0) * 1e3)
        return answer

    def _lookup(self, ctx: Context) -> tuple[Generation, int] | None:
        """A generation whose anchor + the text typed since matches ``ctx``, with the typed length."""
        candidates = list(reversed(self.recent.get(ctx.uri, ())))
        if self.active is not None and self.active.ctx.uri == ctx.uri:
            candidates.insert(0, self.active)
        for gen in candidates:
            a = gen.ctx
            if not gen.usable or a.window != ctx.window or a.suffix != ctx.suffix:
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

    async def _start(self, ctx: Context, settings: Settings, t0: float, build_ms: float) -> Generation | None:
        engine = await self.host.get(settings)
        if engine is None:
            self.stats.count("engine_unavailable")
            return None
        return self._submit(engine, ctx, settings, t0, build_ms)

    def _submit(self, engine: Any, ctx: Context, settings: Settings, t0: float, build_ms: float) -> Generation:
        from engine.api import CompletionRequest, DecodeOptions  # loaded by the engine host already

        if self.active is not None:
            self.active.cancel()  # one decode at a time: the newest request wins
        opts = DecodeOptions(max_tokens=max(1, settings.max_tokens), drafter=settings.drafter,
                             max_lines=settings.max_lines)
        stream = engine.submit(CompletionRequest(clean(ctx.prefix), clean(ctx.suffix), options=opts,
                                                 document_id=ctx.uri, truncate=True, heal=settings.token_healing))
        gen = Generation(ctx, stream, t0, build_ms)
        self.active = gen
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
                if delta.text:
                    gen.add_text(delta.text)
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
            gen.finish(reason, error)
            if self.active is gen:
                self.active = None
            self._record(gen)
            if gen.usable and gen.text.strip() and gen.ctx.uri in self._seq:
                self._remember(gen)
            gen.changed()

    def _remember(self, gen: Generation) -> None:
        dq = self.recent.pop(gen.ctx.uri, None) or deque()
        if len(dq) == RECENT_PER_DOC:
            self._account(dq.popleft())
        dq.append(gen)
        self.recent[gen.ctx.uri] = dq  # most recent document last
        while len(self.recent) > RECENT_DOCS:
            for old in self.recent.popitem(last=False)[1]:
                self._account(old)

    async def _wait_answer(self, gen: Generation, offset: int, deadline: float, at_end: bool) -> str:
        while True:
            if at_end:
                await gen.wait_change(None)
                if gen.done:
                    return gen.text[offset:].rstrip()
                continue
            now = time.perf_counter()
            text = _early_text(gen.text[offset:], gen.done, now >= deadline)
            if text is not None:
                return text
            await gen.wait_change(deadline - now if now < deadline else None)

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
        now = time.perf_counter()
        self.stats.observe("answer", (now - req.t0) * 1e3)
        if not text.strip():
            return None
        gen.shown = max(gen.shown, offset + consumed + len(text))
        self.telemetry.remember(completion_id, text, cached)
        return Answer(text, cursor, completion_id, cached)

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
