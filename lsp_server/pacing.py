"""One session's heavy messages must not stall the others: work in slices, one frame at a time.

Every session of a ``--tcp``/``--ws`` listener runs on one event loop, and a handler runs on it
from start to end. Before, one ``didChange`` of 20,000 edits held the loop 36 s, a 50 MB
``didOpen`` 8 s, 5,000 requests in one write 17 s: every other session waited that long. Three
rules keep any one message's hold on the loop to about ``SLICE_S``:

1. After each frame a session's reader calls ``settle``: it yields to the loop (the other
   sessions' frames are read and answered in between), waits for the frame's deferred work,
   and waits while the session has ``MAX_IN_FLIGHT`` requests unanswered (back-pressure: the
   session's socket is not read meanwhile, so its own bytes wait, not anyone else's).
2. Heavy work (a change with many edits or much text, a large open) is a generator of steps
   (lsp_server/documents.py ``*_steps``) run by ``run_in_slices``, which yields to the loop
   whenever a slice's time is spent. The session's next frame waits for it (rule 1), so its
   own messages still see its edits in order.
3. A document over ``MAX_DOCUMENT_CHARS`` is not kept (no completions in it): its lines alone
   would take gigabytes, and no completion needs more than a window of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

T = TypeVar("T")
SLICE_S = 0.02  # longest hold on the loop between yields, for work done in steps
MAX_IN_FLIGHT = 64  # unanswered requests per session before its reader pauses
HEAVY_EDITS = 16  # a change with more edits is applied in steps, lines first, syntax once at the end
HEAVY_CHARS = 256_000  # ... and one carrying more text (an open too)
MAX_DOCUMENT_CHARS = 16_000_000  # larger documents are not kept (the default largest message is 16 MiB)


async def run_in_slices(steps: Generator[None, None, T], slice_s: float = SLICE_S) -> T:
    """Run ``steps`` to its end, yielding to the event loop each time ``slice_s`` is spent."""
    deadline = time.perf_counter() + slice_s
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        if time.perf_counter() > deadline:
            await asyncio.sleep(0)
            deadline = time.perf_counter() + slice_s


class Pacer:
    """A session's deferred work and its unanswered requests (rule 1)."""

    def __init__(self, request_futures: Callable[[], dict]) -> None:
        self._request_futures = request_futures  # () -> pygls' table of the session's running handlers
        self.pending: asyncio.Future | None = None
        self.deferred = 0  # heavy messages run in slices (fimble/stats "pacing")
        self.paused = 0  # times the reader waited for answers to drain

    def defer(self, work: Awaitable[Any]) -> None:
        """Run ``work`` before this session's next frame is handled."""
        self.deferred += 1
        self.pending = asyncio.ensure_future(work)

    async def settle(self) -> None:
        """Called by the transport after each frame it hands to the session."""
        await asyncio.sleep(0)
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                await pending
            except asyncio.CancelledError:
                if not pending.cancelled():
                    raise  # the reader itself is being cancelled
        futures = self._in_flight()
        while len(futures) >= MAX_IN_FLIGHT:
            self.paused += 1
            await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
            futures = self._in_flight()

    def _in_flight(self) -> list[asyncio.Future]:
        return [f for f in list(self._request_futures().values()) if asyncio.isfuture(f) and not f.done()]

    def close(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
