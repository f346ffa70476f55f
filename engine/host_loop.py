"""The one host loop: an engine answering a client's messages (engine/wire.py), whichever the transport.

``fimble lsp``'s engine child (engine/process.py ``ChildHost``: the messages on its stdin) and each websocket
session of ``fimble serve`` (engine/serve/daemon.py ``SessionHost``) dispatch the op set here. What differs is
said by the few methods a host overrides: how a request is read and a bad one refused, whose documents these
are, how counters are answered, what an unknown op means.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.api import CompletionRequest, CompletionStream, Delta, Engine
from engine.wire import delta_message, error_delta, request_from_dict, result_message


class MessageHost:
    def __init__(self, engine: Engine, send: Callable[[dict], None]):
        self.engine, self.send = engine, send
        self.streams: dict[int, CompletionStream] = {}  # open requests by the client's id

    # -- what a host decides -----------------------------------------------------------------------
    def request_id(self, msg: dict):
        return msg.get("id")

    def parse(self, msg: dict) -> CompletionRequest:
        """The message's request (raises on a bad one)."""
        return request_from_dict(msg["request"])

    def refuse(self, rid, exc: Exception) -> None:
        """A submit's request could not be read: end it with the reason (or raise: not a bad request)."""
        if not isinstance(exc, (TypeError, KeyError, ValueError)):
            raise exc
        self.send(error_delta(rid, f"bad request: {exc}"))

    def refuse_prewarm(self, exc: Exception) -> None:
        """A pre-warm's request could not be read: by default it is dropped (a pre-warm is only an optimisation)."""
        if not isinstance(exc, (TypeError, KeyError, ValueError)):
            raise exc

    def document(self, document) -> str:
        """The engine's key of a document the client names."""
        return str(document if document is not None else "")

    def uses(self, document_id: str | None) -> None:
        """A request or pre-warm for this document was accepted."""

    def forgets(self, document_id: str) -> None:
        """The client closed this document."""

    def answer_counters(self, rid) -> None:
        self.send({"op": "counters", "id": rid, "counters": self.engine.counters()})

    def unknown(self, op: str) -> None:
        """An op this host does not know: ignored."""

    # -- the loop's one step ---------------------------------------------------------------------------
    def handle(self, msg: dict) -> bool:
        """Answer one message; False once the client said close."""
        op = msg.get("op")
        if op == "submit":
            self._submit(msg)
        elif op == "cancel":
            stream = self.streams.get(self.request_id(msg))
            if stream is not None:
                stream.cancel()
        elif op == "prewarm":  # no reply
            try:
                request = self.parse(msg)
            except Exception as exc:
                self.refuse_prewarm(exc)
                return True
            self.uses(request.document_id)
            self.engine.prewarm(request)
        elif op == "forget":
            key = self.document(msg.get("document"))
            self.forgets(key)
            self.engine.forget(key)
        elif op == "counters":
            self.answer_counters(self.request_id(msg))
        elif op == "ping":
            self.send({"op": "pong", "id": self.request_id(msg)})
        elif op == "close":
            return False
        else:
            self.unknown(op)
        return True

    def _submit(self, msg: dict) -> None:
        rid = self.request_id(msg)
        try:
            request = self.parse(msg)
        except Exception as exc:
            self.refuse(rid, exc)
            return
        self.uses(request.document_id)
        box: list[CompletionStream] = []  # the stream, once submit returned (the first deltas may come before)
        done: list[bool] = []

        def forward(delta: Delta) -> None:  # from the engine's thread
            stream = box[0] if box else self.streams.get(rid)
            if delta.finished:
                done.append(True)
                self.streams.pop(rid, None)
                if stream is not None and stream.result is not None:
                    self.send(result_message(rid, stream.result))
            self.send(delta_message(rid, delta))

        stream = self.engine.submit(request, on_delta=forward)
        box.append(stream)
        self.streams[rid] = stream
        if done:  # it ended before it was recorded
            self.streams.pop(rid, None)
