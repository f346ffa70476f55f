"""HTTP/1.1 connections on ``fimble serve``'s port, framed by h11.

Why a library: the hand parser this replaces read one head and one Content-Length body, then closed. So
pipelined requests, a request followed by garbage and one CRLF too many after a body all ended in a closed
connection and no status. h11 (a small, pure-Python, sans-IO HTTP/1.1 state machine, the parser under
httpcore/httpx) frames requests correctly (Content-Length and chunked bodies, keep-alive, pipelining,
HTTP/1.0) and says which 4xx a malformed request deserves, while the reading and writing stay on the
daemon's own asyncio streams: the same port still relays websocket upgrades (daemon.py) and a full server
framework (aiohttp, uvicorn) would want the socket to itself.

Rules of a connection (tests/serve/test_serve_http.py):
- Requests are answered one at a time, in order; pipelined ones wait in h11's buffer. Empty lines before a
  request line are skipped (RFC 9112 2.2 asks servers to ignore at least one).
- A malformed request (a bad request line or header, a head over HEAD_LIMIT) is answered with h11's status
  (400, 431, ...) and a JSON error, then the connection closes: after a framing error nothing that follows
  can be trusted to be a request.
- A body over the limit is answered 413 with ``Connection: close`` before it is read; its bytes are then
  drained (bounded) so the client reads the answer instead of a reset, and the connection closes. Requests
  pipelined behind it are not answered: HTTP has clients retry those on a new connection.
- Other errors (bad JSON, a bad field, 404, 405) leave the connection open for the next request.
- The first request may be a websocket upgrade: its bytes go to the websockets server unparsed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from websockets.datastructures import Headers

HEAD_LIMIT = 16 << 10  # bytes of a request head
HEAD_TIMEOUT_S = 10.0  # for a connection's first request head
IDLE_TIMEOUT_S = 60.0  # for the next request on a kept-alive connection
BODY_TIMEOUT_S = 60.0
READ_CHUNK = 1 << 16
REASONS = {
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large",
    431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
}  # fmt: skip
# What a framing error is called in the reply: h11's own messages can quote the client's bytes.
PROTOCOL_ERRORS = {431: "the request head is too large", 501: "only chunked or Content-Length bodies are supported"}


class HTTPError(Exception):
    """A request answered with an OpenAI-shaped JSON error; ``close``: the connection ends after it."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        close: bool = False,
        headers: tuple[tuple[str, str], ...] = (),
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.close = status, message, kind, param, close
        self.headers = headers


def is_upgrade(request: h11.Request) -> bool:
    """A websocket handshake (which the websockets server answers, not this module)."""
    return request.method == b"GET" and any(
        name == b"upgrade" and b"websocket" in value.lower() for name, value in request.headers
    )


def headers_of(request: h11.Request) -> Headers:
    """The request's headers as websockets' case-insensitive multi-dict (what daemon.authorized reads)."""
    headers = Headers()
    for name, value in request.headers:
        headers[name.decode("latin-1")] = value.decode("latin-1")
    return headers


class HTTPConnection:
    """One client connection: its requests in order, each one's body and answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body_limit: int):
        self.reader, self.writer, self.body_limit = reader, writer, body_limit
        self.h11 = self._new_cycle(b"")
        self.raw: bytearray | None = bytearray()  # bytes before the first request: a websocket upgrade's
        self._request_headers: list[tuple[bytes, bytes]] = []

    def _new_cycle(self, pending: bytes, closed: bool = False) -> h11.Connection:
        # A fresh h11 state machine per request, fed what the client has sent beyond the last one: h11 itself
        # refuses the empty lines that some clients send after a body, and this is where they are skipped.
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
        pending = pending.lstrip(b"\r\n")
        self._at_start = not pending  # nothing of the next request yet: its leading empty lines are skipped
        if pending:
            conn.receive_data(pending)
        if closed:
            conn.receive_data(b"")  # (an empty receive_data is h11's EOF)
        return conn

    def _feed(self, data: bytes) -> None:
        if self._at_start and data:
            data = data.lstrip(b"\r\n")
            if not data:
                return  # only empty lines so far (an empty read, EOF, does not get here)
            self._at_start = False
        if self.raw is not None:
            self.raw += data
        self.h11.receive_data(data)

    async def _event(self, deadline: float) -> Any:
        """h11's next event, reading as needed until ``deadline`` (TimeoutError)."""
        loop = asyncio.get_running_loop()
        while (event := self.h11.next_event()) is h11.NEED_DATA:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            self._feed(await asyncio.wait_for(self.reader.read(READ_CHUNK), left))
        return event

    async def next_request(self, timeout: float) -> h11.Request | None:
        """The next request's head; None when the client has closed the connection between requests.
        A malformed head raises h11.RemoteProtocolError."""
        event = await self._event(asyncio.get_running_loop().time() + timeout)
        if not isinstance(event, h11.Request):
            return None
        # h11 bounds only a head still arriving: one that came whole in a single read is measured here.
        size = len(event.target) + sum(len(name) + len(value) + 4 for name, value in event.headers)
        if size > HEAD_LIMIT:
            raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        return event

    async def read_body(self) -> bytes:
        """The request's body, at most ``body_limit`` bytes (HTTPError 413, and the connection closes)."""
        too_big = HTTPError(413, f"the body must be at most {self.body_limit} bytes", close=True)
        for name, value in self._request_headers:
            if name == b"content-length" and int(value) > self.body_limit:  # h11 checked it is a number
                raise too_big
        if self.h11.they_are_waiting_for_100_continue:
            self._send(h11.InformationalResponse(status_code=100, headers=[]))
        deadline = asyncio.get_running_loop().time() + BODY_TIMEOUT_S
        chunks, size = [], 0
        while True:
            try:
                event = await self._event(deadline)
            except TimeoutError:
                raise HTTPError(408, "the body did not arrive in time", close=True) from None
            except h11.RemoteProtocolError as exc:  # a malformed chunked body
                raise protocol_error(exc) from None
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.body_limit:  # a chunked body has no length up front
                    raise too_big
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:  # the client closed mid-body (h11 raises RemoteProtocolError for most of these itself)
                raise ConnectionResetError

    def begin(self, request: h11.Request) -> None:
        """A request's head has arrived: what read_body needs of it, and no more websocket bytes to keep."""
        self._request_headers = list(request.headers)
        self.raw = None

    # -- answers ------------------------------------------------------------------------------------------
    def _send(self, event: Any) -> None:
        data = self.h11.send(event)
        if data:
            self.writer.write(data)

    def can_reply(self) -> bool:
        """Whether no answer to the current request has begun (an error can still be sent)."""
        return self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    async def reply(
        self, status: int, payload: dict, close: bool = False, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        body = json.dumps(payload).encode()
        fields = [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *headers]
        if close:
            fields.append(("Connection", "close"))
        self._send(h11.Response(status_code=status, headers=fields, reason=REASONS.get(status, "Error")))
        self._send(h11.Data(data=body))
        self._send(h11.EndOfMessage())
        await self.writer.drain()

    async def reply_error(self, exc: HTTPError) -> None:
        error = {"message": exc.message, "type": exc.kind, "param": exc.param, "code": None}
        await self.reply(exc.status, {"error": error}, close=exc.close, headers=exc.headers)

    async def start_stream(self, content_type: str) -> None:
        """A 200 whose body follows in pieces (chunked; HTTP/1.0 clients get it until the connection closes)."""
        headers = [("Content-Type", content_type), ("Cache-Control", "no-cache")]
        self._send(h11.Response(status_code=200, headers=headers, reason="OK"))
        await self.writer.drain()

    async def send_data(self, data: bytes) -> None:
        self._send(h11.Data(data=data))
        await self.writer.drain()

    async def end_stream(self) -> None:
        self._send(h11.EndOfMessage())
        await self.writer.drain()

    # -- between requests ---------------------------------------------------------------------------------
    async def watch_close(self) -> None:
        """Return once the client has closed its side. Meant to run while an answer is computed: what the
        client sends meanwhile (pipelined requests) is kept for later, up to a bound, then reading stops."""
        kept = 0
        while kept <= self.body_limit + HEAD_LIMIT:
            try:
                data = await self.reader.read(READ_CHUNK)
            except ConnectionError:
                return
            if not data:
                self.h11.receive_data(b"")
                return
            self._feed(data)
            kept += len(data)
        await asyncio.Event().wait()  # reading has stopped: a client that leaves shows as a failed write

    def next_cycle(self) -> bool:
        """Ready for the next request; False when the connection must close (an answer was cut short, the
        request's body was not read, or either side asked for ``Connection: close``)."""
        if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
            return False
        pending, closed = self.h11.trailing_data
        self.h11 = self._new_cycle(pending, closed)
        return True

    async def linger(self, most: int = 16 << 20, seconds: float = 2.0) -> None:
        """Before closing: read and drop what the client is still sending (bounded in bytes and time).

        A refused request is answered before its body is read; closing at once would reset the connection
        while the client still writes, and the client would see a broken pipe instead of the answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while most > 0 and (left := deadline - loop.time()) > 0:
            try:
                chunk = await asyncio.wait_for(self.reader.read(min(most, READ_CHUNK)), left)
            except (TimeoutError, ConnectionError):
                return
            if not chunk:
                return
            most -= len(chunk)


def protocol_error(exc: h11.RemoteProtocolError) -> HTTPError:
    """The answer to a malformed request (h11's status hint; a fixed message, never the client's bytes)."""
    status = exc.error_status_hint if 400 <= exc.error_status_hint < 600 else 400
    return HTTPError(status, PROTOCOL_ERRORS.get(status, "malformed HTTP request"), close=True)
