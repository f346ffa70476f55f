"""The client half of engine/wire.py, shared by the engine child's pipe (engine/process.py ``EngineProcess``)
and a fimble serve daemon's websocket (engine/serve/client.py ``WSEngine``).

Threads: a reader thread (the transport's) hands each message to ``_dispatch``; a writer thread sends the outbox,
so an engine that stops reading never blocks the caller (the LSP server's event loop). A transport says how bytes
go out (``_transmit``), how it is shut (``_shut``) and what its other messages mean (``_other``).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time

from engine.api import CompletionRequest, CompletionStream, Delta
from engine.wire import delta_from, pack, request_to_dict, result_from


class MessageClient:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._streams: dict[int, CompletionStream] = {}
        self._submitted: dict[int, float] = {}  # open request id -> when it was submitted
        self._progress: dict[int, float] = {}  # open request id -> its last delta (or its submit)
        self._last_progress = 0.0  # when the engine last sent a delta or a progress report
        self._pending_counters: dict[int, tuple[threading.Event, list]] = {}
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.error: str | None = None
        self.abandoned = False
        self.notify = None  # (a silent engine is the host's watchdog's to see: nothing to report on its own)
        self.work: dict = {}  # the engine's last progress report: phase, done, total
        self.last_heard = self.started_at = time.monotonic()  # when the engine last sent anything

    # -- the transport's ---------------------------------------------------------------------------
    def _transmit(self, data: bytes) -> None:
        """Send one message's bytes (raise OSError, ValueError or RuntimeError when the transport is gone)."""
        raise NotImplementedError

    def _shut(self) -> None:
        """Close the sending side once the outbox is done."""

    def _write_failed(self) -> str:
        return "the connection to the engine closed"

    # A transport whose sending failed is shut too (a pipe: its end closed), unless shutting would wait on the
    # other side (a websocket's closing handshake).
    _shut_after_failure = True

    def _other(self, op: str, msg: dict) -> None:
        """A message that is not a request's (an engine child's ready, fatal, progress)."""

    # -- threads -----------------------------------------------------------------------------------
    def _send(self, msg: dict) -> None:
        """Queue ``msg`` for the writer thread: never blocks, even when the engine has stopped reading."""
        self._outbox.put(pack(msg))

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._transmit(data)
            except (OSError, ValueError, RuntimeError):
                self._lost(self._write_failed())
                if not self._shut_after_failure:
                    return
                break
        self._shut()

    def _dispatch(self, msg: dict) -> None:
        op, rid = msg.get("op"), msg.get("id")
        if op == "result" and rid in self._streams:
            self._streams[rid].result = result_from(msg)
        elif op == "delta":
            stream = self._streams.get(rid)
            if stream is not None:
                delta = delta_from(msg)
                self._last_progress = self._progress[rid] = time.monotonic()
                if delta.finished:
                    if self._streams.pop(rid, None) is None:
                        return  # abandoned meanwhile: already ended
                    self._submitted.pop(rid, None)
                    self._progress.pop(rid, None)
                stream.push(delta)
        elif op == "counters" and rid in self._pending_counters:
            event, box = self._pending_counters.pop(rid)
            box.append(msg["counters"])
            event.set()
        else:
            self._other(op, msg)

    def _lost(self, error: str) -> None:
        """The engine is gone: end every open request with ``error`` (each keeps the text it had)."""
        self.error = self.error or error
        self._end_streams(self.error)
        for event, _ in list(self._pending_counters.values()):
            event.set()

    def _end_streams(self, error: str) -> None:
        for rid, stream in list(self._streams.items()):
            if self._streams.pop(rid, None) is not None:
                self._submitted.pop(rid, None)
                self._progress.pop(rid, None)
                stream.push(Delta("", True, "error", error))

    # -- Engine API --------------------------------------------------------------------------------
    def submit(self, request: CompletionRequest, on_delta=None) -> CompletionStream:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        rid = next(self._ids)
        stream = CompletionStream(rid, loop, on_delta, on_cancel=lambda: self._send({"op": "cancel", "id": rid}))
        if self.error:
            stream.push(Delta("", True, "error", self.error))
            return stream
        self._submitted[rid] = self._progress[rid] = time.monotonic()
        self._streams[rid] = stream
        self._send({"op": "submit", "id": rid, "request": request_to_dict(request)})
        return stream

    def prewarm(self, request: CompletionRequest) -> None:
        """Ask the engine to fill ``request.document_id``'s KV cache for this prompt when idle (no reply)."""
        if not self.error:
            self._send({"op": "prewarm", "request": request_to_dict(request)})

    def forget(self, document_id: str) -> None:
        """Drop a document's KV caches in the engine (the document was closed)."""
        if not self.error:
            self._send({"op": "forget", "document": document_id})

    def counters(self, timeout: float = 5.0) -> dict:
        if self.error:
            return {}
        rid = next(self._ids)
        event, box = threading.Event(), []
        self._pending_counters[rid] = (event, box)
        self._send({"op": "counters", "id": rid})
        event.wait(timeout)
        return box[0] if box else {}

    # -- supervision (engine/api.py Supervised) -----------------------------------------------------
    def ping(self) -> None:
        """Ask for a sign of life: the engine's reader answers at once (it moves ``last_heard``)."""
        if not self.error:
            self._send({"op": "ping", "id": next(self._ids)})

    def stalled_for(self) -> float:
        """Seconds without progress while requests are open (0 with none): since the engine's last delta or
        progress report, or since the oldest open request was submitted if that came later. An engine that runs
        requests in turn makes progress for those queued behind the one it runs."""
        oldest = min(self._submitted.values(), default=None)
        return 0.0 if oldest is None else time.monotonic() - max(oldest, self._last_progress)

    def abandon(self, error: str) -> None:
        """Give up on the engine: end every open request now, with ``error``, and refuse new ones."""
        self.error = self.error or error
        self.abandoned = True  # its requests were answered with what they had: not to be retried
        self._lost(error)
