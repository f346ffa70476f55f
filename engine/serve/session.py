"""One websocket session of ``fimble serve``: the host loop of engine/host_loop.py with a session's rules.

A session's document ids are its own (namespaced by the session: engine/serve/protocol.py ``document_key``);
requests are range-checked, a bad one ends with its reason and a bad message is answered ``{op: error}``;
counters are read off the listeners' loop (an engine in another process answers over a pipe, and a busy one must
not freeze every session while it does). When the client leaves, its running requests are cancelled and its
documents' caches freed.
"""

from __future__ import annotations

import asyncio
import logging

from engine.api import CompletionRequest
from engine.host_loop import MessageHost
from engine.serve import protocol
from engine.serve.protocol import ProtocolError
from engine.wire import error_delta

log = logging.getLogger("fimble.serve")


class SessionHost(MessageHost):
    def __init__(self, daemon, session_id: str, send):
        super().__init__(daemon.engine, send)
        self.daemon, self.id = daemon, session_id
        self.documents: set[str] = set()  # its documents' engine keys (freed when it ends)

    def request_id(self, msg: dict) -> int:
        return protocol.request_id(msg)

    def parse(self, msg: dict) -> CompletionRequest:
        return protocol.parse_request(msg.get("request"), self.id)

    def refuse(self, rid, exc: Exception) -> None:
        self.daemon.counts["bad_messages"] += 1
        if isinstance(exc, ProtocolError):
            reason = str(exc)
        else:  # not foreseen: its text could hold the request's, so only its kind is told
            log.debug("a submit could not be read", exc_info=True)
            reason = f"bad request: {type(exc).__name__}"
        self.send(error_delta(rid, reason, "PromptError"))

    def refuse_prewarm(self, exc: Exception) -> None:
        raise exc  # answered {op: error} by the session's loop

    def document(self, document) -> str:
        return protocol.document_key(self.id, document)

    def uses(self, document_id: str | None) -> None:
        self.documents.add(document_id or "")

    def forgets(self, document_id: str) -> None:
        self.documents.discard(document_id)

    def answer_counters(self, rid) -> None:
        asyncio.get_running_loop().run_in_executor(None, self._send_counters, rid)

    def _send_counters(self, rid: int) -> None:
        try:
            self.send({"op": "counters", "id": rid, "counters": self.daemon.counters()})
        except Exception:  # the engine is gone or failed: the client hears that, not silence
            log.debug("counters failed", exc_info=True)
            self.send({"op": "error", "id": rid, "error": "the engine's counters could not be read"})

    def unknown(self, op: str) -> None:
        raise ProtocolError(f"unknown op {op[:40]!r}")

    def end(self) -> None:
        """The client left: cancel its running requests and free its documents' caches."""
        counts = self.daemon.counts
        for stream in list(self.streams.values()):
            stream.cancel()
            counts["disconnect_cancels"] += 1
        self.streams.clear()
        for doc in self.documents:
            self.engine.forget(doc)  # done by the engine once the cancelled sequence has stopped
            counts["documents_freed"] += 1
        self.documents.clear()
