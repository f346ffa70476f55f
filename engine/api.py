"""The engine's one narrow interface: submit a request, read a stream of text deltas, cancel.

Everything that crosses it is plain data (strings, numbers, lists, dicts), so a
later engine daemon can carry it as msgpack over a websocket without callers
changing. ``Engine`` is the protocol every engine answers, ``Supervised`` how a host watches one.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Protocol

from engine.errors import error_from_name
from engine.options import DecodeOptions

__all__ = [
    "CompletionRequest",
    "Delta",
    "CompletionResult",
    "CompletionStream",
    "DecodeOptions",
    "Engine",
    "Supervised",
    "Unwatched",
]


@dataclass
class CompletionRequest:
    prefix: str
    suffix: str = ""
    options: DecodeOptions = field(default_factory=DecodeOptions)
    # Which document this is for: the key of its KV cache (engine/caching/kv_store.py). Requests
    # without one share an anonymous cache.
    document_id: str | None = None
    # Lines of prefix + suffix (0 = the prefix's first line) where a logical block starts,
    # e.g. tree-sitter top-level definitions. None: the engine uses fixed blocks of lines.
    segment_lines: list[int] | None = None
    # KV reuse: "exact" (token-identical to recomputing), "shift" (also reuse blocks that
    # moved, re-rotating their keys: approximate, opt-in), "none" (recompute everything).
    reuse: str = "exact"
    # Trim the prefix (from the left) and suffix (from the right) to fit the context
    # instead of failing with PromptError.
    truncate: bool = False
    # Token healing (engine/decoding/healing.py): re-type the prompt's ragged last token.
    heal: bool = True
    # An editor's keystroke: where the document's cache would prefill too much, answer from a small prompt
    # while the full one fills in the background (engine/caching/cold_window.py). Off: always the full prompt.
    cold_window: bool = False
    # A decode nobody asked for yet (Tab-Tab's follow-up): it does not count as the user's activity, so it
    # does not keep the engine's background work going (engine/local.py BACKGROUND_S).
    background: bool = False
    # Other files' chunks to put before this file's prompt (engine/caching/context_prompt.py has the wire
    # form: {"repo", "path", "comment", "budget", "chunks": [{"path", "text"}]}). None: the file alone.
    context: dict | None = None
    # Seconds since the user's last activity (a key, an edit, a cursor move) when the host sent this: a
    # pre-warm's background work counts its window from that moment, not from the message (engine/background.py
    # BACKGROUND_S), so a pre-warm sent late (after a decode, a ring change) keeps no engine busy past it.
    idle_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Delta:
    """New text since the previous delta. The last delta has ``finished`` set."""

    text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | eos | cancelled | context | error
    error: str | None = None
    error_type: str | None = None  # the FimbleError subclass, e.g. "PromptError"


@dataclass
class CompletionResult:
    text: str
    finish_reason: str
    tokens: int
    stats: dict


class CompletionStream:
    """Deltas of one request, readable from asyncio (``async for``) or a thread (``for``)."""

    def __init__(
        self,
        request_id: int,
        loop: asyncio.AbstractEventLoop | None,
        on_delta: Callable[[Delta], None] | None = None,
        on_cancel: Callable[[], None] | None = None,
    ):
        self.id = request_id
        self._cancel = threading.Event()
        self._on_delta, self._on_cancel = on_delta, on_cancel
        self._loop = loop
        self._async_q: asyncio.Queue[Delta] | None = asyncio.Queue() if loop else None
        self._sync_q: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self.result: CompletionResult | None = None
        self.text = ""

    # -- producer side (engine worker thread) --------------------------------------
    def push(self, delta: Delta) -> None:
        self.text += delta.text
        if self._on_delta is not None:  # forwarded elsewhere (the engine process writes it to a pipe)
            self._on_delta(delta)
        elif self._loop is not None and self._async_q is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_q.put_nowait, delta)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        else:
            self._sync_q.put(delta)

    # -- consumer side ------------------------------------------------------------
    def cancel(self) -> None:
        """Stop decoding at the engine's next step; the stream ends with finish_reason 'cancelled'."""
        self._cancel.set()
        if self._on_cancel is not None:
            self._on_cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self) -> Iterator[Delta]:
        if self._async_q is not None:
            raise RuntimeError("this stream was submitted from an event loop: use 'async for'")
        while True:
            delta = self._sync_q.get()
            _raise_if_error(delta)
            yield delta
            if delta.finished:
                return

    async def __aiter__(self) -> AsyncIterator[Delta]:
        if self._async_q is None:
            raise RuntimeError("this stream was submitted outside an event loop: use 'for'")
        while True:
            delta = await self._async_q.get()
            _raise_if_error(delta)
            yield delta
            if delta.finished:
                return

    def collect(self) -> str:
        """Block until the end; return the whole text."""
        return "".join(d.text for d in self)


def _raise_if_error(delta: Delta) -> None:
    if delta.finish_reason == "error":
        raise error_from_name(delta.error_type, delta.error or "completion failed")


class Engine(Protocol):
    """What every engine answers, whoever runs the model: ``LocalEngine`` and ``ServeEngine`` (engine/scheduler.py, in
    this process), ``EngineProcess`` (engine/process.py, a child process), ``ServeEngineProcess``
    (engine/serve/engine_process.py), ``WSEngine`` (engine/serve/client.py, a fimble serve daemon), ``RemoteEngine``
    (engine/remote.py, an OpenAI-compatible or llama.cpp server) and ``RayEngine`` (engine/ray_serve.py)."""

    def submit(self, request: CompletionRequest, on_delta: Callable[[Delta], None] | None = None) -> CompletionStream:
        """Start a completion; its deltas arrive on the stream (or, with ``on_delta``, are handed to it)."""
        ...

    def prewarm(self, request: CompletionRequest) -> None:
        """Fill ``request.document_id``'s cache for this prompt when idle (no reply; engines without a cache ignore
        it)."""
        ...

    def forget(self, document_id: str) -> None:
        """The document was closed: drop what is kept for it."""
        ...

    def counters(self) -> dict:
        """Plain numbers about the engine's work so far."""
        ...

    def info(self) -> dict:
        """Plain facts about the engine: model, backend, context..."""
        ...

    def close(self) -> None: ...


class Supervised(Protocol):
    """How a host watches an engine and replaces it (the LSP server's engine host and its watchdog). Every
    engine class above answers these; engines with nothing that can go silent on its own (no process or connection:
    in-process and per-request HTTP engines) answer as ``Unwatched`` does."""

    pid: int | None  # its own process (the watchdog reads its CPU time), or None
    error: str | None  # why it stopped working; None while it works
    abandoned: bool  # given up on (``abandon``): its requests were answered with what they had, not to be retried
    started_at: float  # time.monotonic() when it started
    last_heard: float | None  # time.monotonic() when it last sent anything; None: nothing to watch
    notify: Callable[[str, str], None] | None  # set by the host: the engine tells the user (level, text) on its own
    work: dict  # its last progress report ({"phase": "prefill", "done", "total"}: a long prompt), or {}

    def alive(self) -> bool:
        """Not known to have died."""
        ...

    def ping(self) -> None:
        """Ask for a sign of life (it moves ``last_heard``)."""
        ...

    def stalled_for(self) -> float:
        """Seconds without progress while requests are open (0 with none)."""
        ...

    def abandon(self, error: str) -> None:
        """Give up on the engine: end every open request now, with ``error``, and refuse new ones."""
        ...

    def kill(self) -> None:
        """End it now, without waiting for it to agree."""
        ...


class Unwatched:
    """``Supervised`` for an engine with nothing to watch: no process or connection of its own that could go silent.
    A class that uses it sets ``started_at`` and has ``close``."""

    pid: int | None = None
    error: str | None = None
    abandoned = False
    started_at = 0.0
    last_heard: float | None = None
    notify: Callable[[str, str], None] | None = None
    work: dict = {}  # (never changed: nothing reports progress)

    def alive(self) -> bool:
        return self.error is None

    def ping(self) -> None:
        pass

    def stalled_for(self) -> float:
        return 0.0

    def abandon(self, error: str) -> None:
        self.error = self.error or error
        self.abandoned = True

    def kill(self) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError
