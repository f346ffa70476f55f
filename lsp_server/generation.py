"""One engine decode, anchored at one cursor context, and the text it has produced so far.

Requests don't own generations: a request either starts one or attaches to one whose
anchor plus the text typed since matches (type-through). The generation keeps running
after the first request is answered, so later keystrokes are answered from its text.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

from lsp_server.prompt import Context

FINISHED_OK = ("stop", "eos", "length")
SETTLED = ("stop", "eos")  # ended by the model or the guard, not by a token limit: nothing more to come
_ids = itertools.count(1)


def first_line_end(text: str) -> int:
    """Index of the newline that ends the first line with content, or -1."""
    i = text.find("\n")
    while i != -1 and not text[:i].strip():
        i = text.find("\n", i + 1)
    return i


class Generation:
    def __init__(self, ctx: Context, stream: Any, t_request: float, build_ms: float):
        self.id = next(_ids)
        self.ctx = ctx
        self.stream = stream
        self.text = ""
        self.done = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.shown = 0  # characters of ``text`` sent to the client (answers and deltas)
        self.waiting = 0  # requests waiting for an answer from it
        self.invoked_waiting = 0  # of those, requests the user invoked (not typed)
        # A request the user invoked asked for it: it runs to its end, after its answer too (a block's later lines
        # stream on; the quiet stop of lsp_server/decodes.py cut 47 of 80 multi-line answers of bench/quality.py).
        self.invoked = False
        self.waiter_tasks: set[asyncio.Task] = set()  # their tasks (see TypeThrough.doomed)
        self.tokens = 0  # from the engine's result
        self.accounted = False  # its tokens are counted as shown / never shown
        self.prefetched = False  # started by a keystroke, before any request asked
        self.follow_up = False  # started after a shown completion ended, at the cursor its accept leaves
        self.followed = False  # a follow-up of this one was considered (lsp_server/completer.py)
        self.plan: Any = None  # the Plan (lsp_server/plan.py) and Settings it was submitted with
        self.settings: Any = None
        self.t_request = t_request  # when the request that started it arrived
        self.t_user = t_request  # the user's action the quiet clock counts from (lsp_server/decodes.py)
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_first_line: float | None = None
        self.t_done: float | None = None
        self.build_ms = build_ms
        # Syntax shaping (a CompletionShaper from the plan; lsp_server/shaping/stage.py applies it): its guard
        # stops the text at a closer beyond the completion's scope while streaming (``cut``);
        # at the end its ``finish`` may shorten ``text`` further. ``replace_cols``: then set
        # to the code points after the anchor cursor the final text replaces (auto-paired
        # closers it re-types), for answers taken from the finished text.
        self.shaper: Any = None
        self.cut = False
        # Stopped for quiet (lsp_server/decodes.py QUIET_AFTER_S): its text so far is whole, as at a token limit.
        self.quiet = False
        self.replace_cols: int | None = None
        # lsp_server.indent.IndentFit when the cursor sits in a line's auto-indentation (set by the
        # completer): streamed text passes through it first.
        self.indent_fit: Any = None
        self.listeners: list[Callable[[Generation], None]] = []
        self._waiters: list[asyncio.Future] = []

    @property
    def usable(self) -> bool:
        """Whether its text may serve later requests (a cancelled or failed decode may stop mid-thought).

        Cancelled counts from the moment of the cancel, not from when the engine stops: a request
        that attached to a decode cancelled but not yet finished got its cut-off text (often none).
        A guard stop cancels too, but its text is complete up to the stop (``cut``).
        """
        if self.done:
            return self.finish_reason in FINISHED_OK
        return self.cut or self.quiet or not self.stream.cancelled

    def cancel(self) -> None:
        if not self.done and not self.stream.cancelled:
            self.stream.cancel()

    def mark_shown(self, end: int) -> None:
        """``text[:end]`` has been sent to the client (an answer or a delta)."""
        self.shown = max(self.shown, end)

    def add_text(self, text: str) -> None:
        now = time.perf_counter()
        self.text += text
        if self.t_first is None and text:
            self.t_first = now
        if self.t_first_line is None and first_line_end(self.text) != -1:
            self.t_first_line = now

    def cut_to(self, n: int) -> None:
        """Keep only the first ``n`` characters (a guard stop or the final shaping)."""
        if n < len(self.text):
            self.text = self.text[:n]

    def finish(self, reason: str | None, error: str | None = None) -> None:
        self.done = True
        self.finish_reason = reason or "error"
        self.error = error
        self.t_done = time.perf_counter()

    def changed(self) -> None:
        """Wake everyone waiting for more text (or the end)."""
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)
        for listener in list(self.listeners):
            listener(self)

    async def wait_change(self, timeout: float | None) -> None:
        if self.done:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)


def record_decode(stats: Any, gen: Generation) -> bool:
    """Count a decode that ended: its finish reason and latencies, its tokens. Whether the engine's result
    (its figures) was there: only then is ``gen.tokens`` known."""
    stats.count(f"finish_{gen.finish_reason}")
    if gen.t_first is not None:
        stats.observe("first_token", (gen.t_first - gen.t_request) * 1e3)
    if gen.t_first_line is not None:
        stats.observe("first_line", (gen.t_first_line - gen.t_request) * 1e3)
    result = getattr(gen.stream, "result", None)
    if result is None or gen.t_done is None:
        return False
    st = result.stats
    stats.observe("complete", (gen.t_done - gen.t_request) * 1e3)
    stats.observe("prompt_build", gen.build_ms + st.get("prompt_ms", 0.0))
    stats.observe("submit", (gen.t_submit - gen.t_request) * 1e3)
    if "first_token_ms" in st:
        stats.observe("prefill", max(0.0, st["first_token_ms"] - st.get("prompt_ms", 0.0)))
        stats.observe("engine_first_token", st["first_token_ms"])
    if "total_ms" in st:
        stats.observe("queue", max(0.0, (gen.t_done - gen.t_submit) * 1e3 - st["total_ms"]))
    stats.count("tokens_generated", result.tokens)
    gen.tokens = result.tokens
    return True
