"""Type-through: a request answered from text already decoded, without the model.

A request whose text before the cursor is a generation's anchor plus characters that match that
generation's text is answered from the rest of it. The generations kept for this are the running
decode (``active``: the engine decodes one request at a time) and the last few finished ones per
document. A decode that was cancelled serves nobody from the moment of the cancel, even before the
engine stops it; a decode whose every waiting request has a cancel pending is about to be cancelled
(``doomed``), and serves nobody either.

Also here: a kept generation's tokens are split into shown and never shown once it can be shown no
more (``account``): when it leaves the cache, or its document closes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import NamedTuple

from lsp_server.generation import SETTLED, Generation
from lsp_server.prompt import Context
from lsp_server.stats import Stats
from lsp_server.streaming import DeltaStreamer

RECENT_PER_DOC = 3
RECENT_DOCS = 32


class Hit(NamedTuple):
    gen: Generation
    offset: int  # characters of ``gen.text`` typed through since its anchor
    cached: bool  # served by text generated for an earlier cursor (type-through)
    instant: bool  # answered from a finished generation's text: no model, no waiting


class TypeThrough:
    def __init__(self, stats: Stats, streamer: DeltaStreamer):
        self.stats, self.streamer = stats, streamer
        self.active: Generation | None = None  # the running decode (the newest request's)
        self.recent: OrderedDict[str, deque[Generation]] = OrderedDict()  # finished, most recent document last

    def tables(self) -> dict:
        return {
            "recent_docs": len(self.recent),
            "recent_generations": sum(len(d) for d in self.recent.values()),
            "active": 0 if self.active is None else 1,
        }

    def attach(self, ctx: Context, count_miss: bool = True) -> Hit | None:
        """A request at ``ctx``: the generation that answers it, counted by kind, or None (a miss; not counted
        without ``count_miss``, where the caller looks again elsewhere)."""
        found = self.lookup(ctx)
        if found is None:
            if count_miss:
                self.stats.count("misses")
            return None
        gen, offset = found
        if gen.prefetched and offset == 0:
            self.stats.count("follow_up_hits" if gen.follow_up else "prefetch_hits")  # model-served
            return Hit(gen, offset, False, False)
        self.stats.count("typethrough_hits" if gen.done else "inflight_hits")
        return Hit(gen, offset, True, gen.done)

    def lookup(self, ctx: Context) -> tuple[Generation, int] | None:
        """A generation whose anchor + the text typed since matches ``ctx``, with the typed length."""
        candidates = list(reversed(self.recent.get(ctx.uri, ())))
        if self.active is not None and self.active.ctx.uri == ctx.uri:
            candidates.insert(0, self.active)
        for gen in candidates:
            a = gen.ctx
            if not gen.usable or self.doomed(gen) or a.window != ctx.window or a.suffix != ctx.suffix:
                continue
            if len(ctx.prefix) < len(a.prefix) or not ctx.prefix.startswith(a.prefix):
                continue
            typed = ctx.prefix[len(a.prefix) :]
            if not gen.text.startswith(typed):
                continue
            settled_nothing = gen.follow_up and gen.finish_reason in SETTLED and not typed  # see decodes.py
            if gen.done and not gen.text[len(typed) :].strip() and not settled_nothing:
                continue  # typed through all of it (or nothing to show): ask the model for more
            return gen, len(typed)
        return None

    def doomed(self, gen: Generation) -> bool:
        """Whether every request waiting on ``gen`` has a cancel pending, so the decode is about to stop.

        `$/cancelRequest` cancels the request's task, but its CancelledError (which cancels the
        decode) arrives only at that task's next step; messages read in the same chunk are handled
        first. A request arriving in between must not attach to a decode that is being cancelled."""
        tasks = gen.waiter_tasks
        return (
            not gen.done
            and bool(tasks)
            and all(t.cancelling() for t in tasks)
            and self.streamer.live(gen) <= len(tasks)
        )

    def generations(self, uri: str) -> list[Generation]:
        """Every generation kept for ``uri``, the running one included."""
        gens = list(self.recent.get(uri, ()))
        if self.active is not None and self.active.ctx.uri == uri:
            gens.append(self.active)
        return gens

    def remember(self, gen: Generation) -> None:
        """Keep a finished generation with text for later keystrokes (the oldest ones go)."""
        dq = self.recent.pop(gen.ctx.uri, None) or deque()
        if len(dq) == RECENT_PER_DOC:
            self.account(dq.popleft())
        dq.append(gen)
        self.recent[gen.ctx.uri] = dq  # most recent document last
        while len(self.recent) > RECENT_DOCS:
            for old in self.recent.popitem(last=False)[1]:
                self.account(old)

    def forget(self, uri: str) -> None:
        """``uri`` closed: its generations can be shown no more."""
        if self.active is not None and self.active.ctx.uri == uri:
            self.active.cancel()
        for gen in self.recent.pop(uri, ()):
            self.account(gen)

    def account(self, gen: Generation) -> None:
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
