"""Decodes on the LSP side: submit one to the engine (the newest cancels the one before it), pump its deltas
into its Generation, and start Tab-Tab's follow-up once a shown completion ends.

The Completer (lsp_server/completer.py) owns the requests; this owns the decodes they, prefetches and
follow-ups start. One decode runs at a time: ``TypeThrough.active`` is it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from engine import env_settings
from lsp_server import indent
from lsp_server.documents import DocumentStore
from lsp_server.engine_host import EngineHost
from lsp_server.follow_up import after_lead, follow_up_context, follow_up_options, next_line_follows
from lsp_server.generation import SETTLED, Generation, record_decode
from lsp_server.plan import Plan, Planner
from lsp_server.prewarm import Prewarmer
from lsp_server.prompt import Context
from lsp_server.settings import Settings
from lsp_server.shaping import stage
from lsp_server.stats import Stats
from lsp_server.typethrough import TypeThrough

log = logging.getLogger(__name__)


# Tab-Tab's follow-up decode (lsp_server/follow_up.py) starts only this soon after the document's last edit.
FOLLOW_UP_WITHIN_S = env_settings.read("FIMBLE_FOLLOW_UP_WITHIN_S")  # (engine/env_settings.py: 0..600 s)
# ... and with at least this long left before the quiet stop (QUIET_AFTER_S): one pass on a 2-core CPU (a prefill
# chunk, a few steps) takes 0.1-0.4 s, so a follow-up started later is cut before it shows anything, and the pass
# it is in runs on past the quiet. One started 1.42 s after the key (a cold answer came late) ran its prefill to
# 2.6 s: the CPU still busy 2-3 s after the key (bench/reports/typing-default-follow-up-quiet-2026-12-05.txt).
FOLLOW_UP_MIN_LEFT_S = 0.5


# A laptop's fan and battery: the server's CPU falls quiet within 2 s of the last key. A decode still
# running then (a block's later lines streaming after the answer, a first line the shaper keeps rejecting, a
# Tab-Tab follow-up) stops this long after the user's last key or request (the engine stops within a pass,
# up to ~0.1 s here); one an automatic request still waits on, once it has had QUIET_MIN_SHOWN_S since its first
# text. What it decoded stays shown and cached (a prefix of the plain decode, as a token limit leaves), and a
# request waiting on it is answered with that. A decode a request the user invoked asked for is never cut, not
# after its answer either (Generation.invoked).
# FIMBLE_QUIET_AFTER_S (engine/env_settings.py: 0 = never, else 0.5..600 s; default 1.5).
QUIET_AFTER_S = env_settings.read("FIMBLE_QUIET_AFTER_S")
QUIET_MIN_SHOWN_S = 0.6
QUIET_POLL_S = 0.1  # how often a decode past its quiet time without a delta is looked at again


def follow_up_in_time(since: float) -> bool:
    """Whether a follow-up may start ``since`` seconds after the user's last key or request."""
    if since > FOLLOW_UP_WITHIN_S:
        return False
    return not QUIET_AFTER_S or since <= QUIET_AFTER_S - FOLLOW_UP_MIN_LEFT_S


def _settled_follow_up(gen: Generation) -> bool:
    """A follow-up that ended by itself with nothing: kept, so that the request after the accept (the one it
    was decoded for) is answered at once instead of decoding the same nothing again. Only follow-ups: another
    decode's nothing may have come from a prompt without the cross-file context yet, and a user waiting at
    that cursor must get a fresh decode (a Neovim test waited on a cached nothing)."""
    return gen.follow_up and gen.finish_reason in SETTLED


class Decodes:
    def __init__(
        self,
        docs: DocumentStore,
        host: EngineHost,
        stats: Stats,
        typethrough: TypeThrough,
        planner: Planner,
        warm: Prewarmer,
        asked: dict[str, int],
        last_edit: dict[str, float],
    ):
        self.docs, self.host, self.stats = docs, host, stats
        self.typethrough, self.planner, self.warm = typethrough, planner, warm
        # Shared with the Completer: the documents the editor asks completions for, and each one's last edit.
        self.asked, self.last_edit = asked, last_edit
        self.pumps: set[asyncio.Task] = set()

    async def start(
        self, ctx: Context, settings: Settings, t0: float, build_ms: float, plan: Plan
    ) -> Generation | None:
        engine = await self.host.get(settings)
        if engine is None:
            self.stats.count("engine_unavailable")
            return None
        return self.submit(engine, ctx, settings, t0, build_ms, plan)

    def submit(
        self,
        engine: Any,
        ctx: Context,
        settings: Settings,
        t0: float,
        build_ms: float,
        plan: Plan,
        background: bool = False,
        lead: str = "",
    ) -> Generation:
        """Start a decode at ``ctx``. ``lead``: text the completion starts with that the model is not asked
        for (a follow-up's line break): the engine's prompt has it after ``ctx.prefix``, the generation is
        anchored at ``ctx`` and its text starts with it, so the editor is shown ``lead`` + the model's text."""
        if self.typethrough.active is not None:
            self.typethrough.active.cancel()  # one decode at a time: the newest request wins
        sent = ctx if not lead else after_lead(ctx, lead)
        stream = engine.submit(self.planner.request(sent, plan, settings, background))
        gen = Generation(ctx, stream, t0, build_ms)
        gen.shaper, gen.plan, gen.settings = plan.shaper, plan, settings
        line_before = ctx.prefix[ctx.prefix.rfind("\n") + 1 :]
        if not lead and indent.applies(line_before, ctx.suffix.split("\n", 1)[0]):
            gen.indent_fit = indent.IndentFit()  # no indentation added to the editor's (lsp_server/indent.py)
        if lead:
            stage.stream_text(gen, lead, self.stats)  # the shaper sees the whole text the editor will
        self.typethrough.active = gen
        self.warm.decoding_at(ctx)
        self.stats.count("generations")
        task = asyncio.create_task(self._pump(gen))
        self.pumps.add(task)
        task.add_done_callback(self.pumps.discard)
        if QUIET_AFTER_S:
            asyncio.get_running_loop().call_later(QUIET_AFTER_S, self._quiet_check, gen)
        return gen

    def _quiet_check(self, gen: Generation) -> None:
        """The quiet stop for a decode nobody waits on that sends no delta (a prefill of seconds: a follow-up's, a
        prefetch's), which the check in ``_pump`` never sees; again every QUIET_POLL_S until it ends. One a request
        waits on is left to ``_pump``: cut between deltas, a block header streamed but its body not yet (held back
        until it comes) would leave the answer empty (real VS Code showed 5 empty spots of 25 against 3)."""
        if gen.done or gen.quiet or gen.cut:
            return
        if not gen.waiting and self._quiet_now(gen):
            self._stop_for_quiet(gen)
            return
        asyncio.get_running_loop().call_later(QUIET_POLL_S, self._quiet_check, gen)

    def _stop_for_quiet(self, gen: Generation) -> None:
        gen.quiet = True
        gen.cancel()  # the engine stops at its next step (a prefill between two chunks)
        self.stats.count("quiet_stops")

    async def _pump(self, gen: Generation) -> None:
        """The engine's deltas into ``gen`` (indent fit, then the shaper's guard) until the decode ends."""
        from engine.errors import FimbleError

        reason, error = None, None
        try:
            async for delta in gen.stream:
                if delta.text and not gen.cut:
                    text = gen.indent_fit.feed(delta.text) if gen.indent_fit is not None else delta.text
                    if text:
                        stage.stream_text(gen, text, self.stats)
                if delta.finished:
                    reason = delta.finish_reason
                elif self._quiet_now(gen):
                    self._stop_for_quiet(gen)
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
            elif gen.quiet and reason in (None, "cancelled"):
                reason = "length"  # stopped for quiet: whole up to here, more would follow
            gen.finish(reason, error)
            if gen.usable:
                stage.finish_decode(gen, self.stats)
            if self.typethrough.active is gen:
                self.typethrough.active = None
            kept = gen.usable and (gen.text.strip() or _settled_follow_up(gen))
            if record_decode(self.stats, gen) and not kept:
                self.typethrough.account(gen)  # not kept for type-through: its shown share is final now
            if kept and gen.ctx.uri in self.asked:
                self.typethrough.remember(gen)
            gen.changed()
            self.follow_up(gen)

    def _quiet_now(self, gen: Generation) -> bool:
        """Whether ``gen`` should stop for quiet now (see QUIET_AFTER_S)."""
        if not QUIET_AFTER_S or gen.invoked or gen.cut or gen.quiet:
            return False
        now = time.perf_counter()
        if now - max(self.last_edit.get(gen.ctx.uri, 0.0), gen.t_user) <= QUIET_AFTER_S:
            return False
        # A request still waiting gets QUIET_MIN_SHOWN_S of text first (a cold prompt's answer comes late).
        return not gen.waiting or (gen.t_first is not None and now - gen.t_first > QUIET_MIN_SHOWN_S)

    def follow_up(self, gen: Generation) -> None:
        """Tab-Tab: once ``gen`` has ended and shown text, decode in the background the completion that follows
        accepting it (lsp_server/follow_up.py). Once per generation, only while nothing else decodes; the next
        keystroke's request cancels it. Called when the decode ends and when an answer is shown."""
        if gen.followed or not (gen.done and gen.usable and gen.shown) or self.typethrough.active is not None:
            return
        gen.followed = True
        settings, doc, engine = gen.settings, self.docs.get(gen.ctx.uri), self.host.ready_engine()
        # Local engines only: a remote server's or a shared daemon's decodes cost others (and maybe money).
        if doc is None or engine is None or settings is None or not settings.prefetch or settings.engine_spec:
            return
        # Only soon after the user's last key or request: a user who stopped typing stops the engine (it has
        # shown them what they asked for; Tab after a long read, or after a cold answer that came late,
        # decodes afresh from the warm cache). Quiet wins over Tab-Tab (see QUIET_AFTER_S).
        last = max(self.last_edit.get(gen.ctx.uri, 0.0), gen.t_request)
        since = time.perf_counter() - last
        if not follow_up_in_time(since) or doc.changing or doc.parsing:
            return
        try:
            accept = follow_up_context(doc, gen, settings.prefix_chars, settings.suffix_chars)
            if accept is None:
                return
            # Planned where the accept leaves the cursor, as the request there will be: a shown call's
            # arguments (one line, mid-statement) are followed by the next lines (a block's policy).
            accepted = accept.document(doc)
            plan = self.planner.plan(accepted, accept.ctx, settings, follow_up=True)
            options = follow_up_options(plan.options, accepted, accept.ctx.cursor, settings.max_lines)
        except Exception:  # only an optimisation: never let it cost the session
            log.exception("follow-up context failed")
            return
        lead = "\n" if next_line_follows(gen, accepted, accept.ctx.cursor) else ""
        if lead:  # decoded on a fresh blank line: say something there (DecodeOptions.no_empty, lsp_server/plan.py)
            options = replace(options, no_empty=True)
        plan = plan._replace(options=options)
        nxt = self.submit(engine, accept.ctx, settings, time.perf_counter(), 0.0, plan, background=True, lead=lead)
        nxt.prefetched = nxt.follow_up = True
        if lead:
            self.stats.count("follow_ups_next_line")
        nxt.t_user = last  # quiet counts from the user's key or request, not from the follow-up's own start
        self.stats.count("follow_ups")
