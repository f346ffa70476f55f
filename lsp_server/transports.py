"""stdio, TCP and WebSocket transports. TCP and WS listen on loopback unless told otherwise.

One session per connection: every TCP or WS connection gets its own ``FimbleServer``
(documents, settings, requests, streams, type-through cache), its responses go only to its
own connection, and when the connection ends, however it ends (``exit``, a clean close, a
reset), the session's documents are dropped here and in the engine. The listener keeps
listening. Why a server object per connection rather than one server multiplexing: a pygls
``LanguageServer`` owns exactly one protocol (one writer, one set of request futures), so a
second connection on one server took over the first one's output. Sessions share one
``EngineHost`` (one engine process, one model in memory); the engine keys each session's
documents by "<session id>\\x00<uri>" (Completer.engine_doc_id), so no session reaches
another's KV caches.

SIGTERM and SIGINT end the server at once, on every transport: the engine child is killed and
reaped first (``EngineHost.kill_now``: one still loading a model too, which used to outlive the
server by the rest of its load), then the listener and sessions close; no traceback, exit status
0 (SIGTERM) or 130 (SIGINT). An address that cannot be bound is one line (``FimbleError``).

Frames are read by lsp_server/framing.py (stdio, TCP) and checked by
``FimbleProtocol.receive``: a malformed frame is answered and reading goes on.
WebSocket messages go out as text frames (pygls sends binary frames, which browser clients
such as Monaco and vscode-ws-jsonrpc drop). Who may connect: engine/auth.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from pygls.io_ import StdoutWriter

from engine import auth
from engine.errors import FimbleError
from lsp_server.engine_host import EngineHost
from lsp_server.framing import FrameError, Limits, read_frames, read_opening
from lsp_server.protocol import PARSE_ERROR
from lsp_server.server import FimbleServer, create_server
from lsp_server.settings import Settings

log = logging.getLogger(__name__)
DEFAULT_HOST = "127.0.0.1"
UNAUTHORIZED = -32001  # JSON-RPC server error range: a TCP client without the right token
SERVER_BUSY = -32000  # ... and one over --max-sessions


def parse_address(text: str) -> tuple[str, int]:
    """ "HOST:PORT", ":PORT" or "PORT" -> (host, port); the host defaults to loopback."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or DEFAULT_HOST
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"bad address {text!r}: expected HOST:PORT") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"bad port {number}: expected 0-65535")
    return host, number


@dataclass(frozen=True)
class ListenOptions:
    limits: Limits = Limits()
    token: str | None = None  # every connection must present it (the CLI sets one unless --no-token)
    show_token: bool = False  # print the token once listening (a generated one; never one read from a file)
    allow_origins: tuple[str, ...] = ()  # browser origins a WS handshake may come from
    loopback: bool = True  # bound to loopback: WS handshakes must also name a loopback Host
    debug: bool = False
    max_sessions: int = 64
    init_timeout: float = 60.0  # seconds a connection may stay open without sending `initialize`


@dataclass
class Sessions:
    """Makes one server session per connection, all sharing one engine host."""

    defaults: Settings
    debug: bool = False
    max_sessions: int = 64  # each holds documents and a protocol: a bound, so idle connections can't pile up
    host: EngineHost = field(default_factory=EngineHost)
    live: set[FimbleServer] = field(default_factory=set)
    opened: int = 0

    @property
    def full(self) -> bool:
        return len(self.live) >= self.max_sessions

    def new(self) -> FimbleServer:
        ls = create_server(self.defaults, host=self.host, session_id=secrets.token_hex(8), debug=self.debug)
        self.host.on_change = self._engine_changed  # (each session sets itself there)
        ls.peers = self.tables
        self.live.add(ls)
        self.opened += 1
        return ls

    def end(self, ls: FimbleServer) -> None:
        if ls in self.live:
            self.live.discard(ls)
            ls.close_session()
            ls.peers = None
            log.info("session ended (%d live)", len(self.live))

    def tables(self) -> dict:
        """For fimble/stats: how many sessions are live, and their documents together."""
        return {
            "sessions": len(self.live),
            "sessionsOpened": self.opened,
            "documents": sum(len(ls.docs) for ls in self.live),
        }

    def _engine_changed(self) -> None:
        for ls in list(self.live):
            publish = getattr(ls, "publish_status", None)
            if publish is not None:
                publish()

    async def close(self) -> None:
        for ls in list(self.live):
            self.end(ls)
        await self.host.close()


def bad_frame(ls: FimbleServer, error: FrameError) -> None:
    """Answer a frame that could not be read; log the first few per session (a flood must not fill the log)."""
    ls.stats.count("bad_frames")
    n = ls.stats.counters["bad_frames"]
    if n <= 10 or n % 1000 == 0:
        log.warning("bad frame (%d in this session): %s", n, error)
    ls.protocol.send_error(None, PARSE_ERROR, f"Parse error: {error}")


# -- stdio ---------------------------------------------------------------------------------
def _pump_file(src: Any, stream: asyncio.StreamReader, loop: asyncio.AbstractEventLoop) -> None:
    """Feed a regular file (stdin redirected from one, which asyncio cannot watch) to ``stream``."""
    while chunk := src.read1(65536):
        loop.call_soon_threadsafe(stream.feed_data, chunk)
    loop.call_soon_threadsafe(stream.feed_eof)


async def _read_loop(ls: FimbleServer, reader: asyncio.StreamReader, limits: Limits, ended: asyncio.Event) -> None:
    async for frame in read_frames(reader, limits):
        if isinstance(frame, FrameError):
            bad_frame(ls, frame)
        else:
            ls.protocol.receive(frame)
        await ls.pacer.settle()  # lsp_server/pacing.py
        if ended.is_set():
            return


def start_stdio(ls: FimbleServer, limits: Limits) -> int:
    ls.protocol.set_writer(StdoutWriter(sys.stdout.buffer))
    code = 0

    async def main() -> None:
        nonlocal code
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()

        def closer(exit_code: int) -> None:
            nonlocal code
            code = exit_code
            ended.set()

        ls.closer = closer
        stopped = _on_stop_signals(ls.host, ended.set)
        stream = asyncio.StreamReader(limit=limits.max_header_line)
        try:
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stream), sys.stdin.buffer)
        except (ValueError, OSError):  # stdin is a regular file
            threading.Thread(target=_pump_file, args=(sys.stdin.buffer, stream, loop), daemon=True).start()
        reading = asyncio.create_task(_read_loop(ls, stream, limits, ended))
        waiting = asyncio.create_task(ended.wait())
        await asyncio.wait({reading, waiting}, return_when=asyncio.FIRST_COMPLETED)
        reading.cancel()
        waiting.cancel()
        ls.close_session()
        await ls.host.close()
        if stopped:
            code = _signal_status(stopped[0])

    try:
        asyncio.run(main())
    except BrokenPipeError:
        log.error("the client went away")
    except (KeyboardInterrupt, SystemExit):
        pass
    return code


# -- TCP -----------------------------------------------------------------------------------
class _TcpWriter:
    """pygls' writer interface over one connection; a client that stops reading is dropped."""

    def __init__(self, writer: asyncio.StreamWriter, max_buffer: int):
        self._writer, self._max = writer, max_buffer

    def close(self) -> None:
        self._writer.close()

    def write(self, data: bytes) -> None:
        if self._writer.is_closing():
            return
        self._writer.write(data)
        if self._writer.transport.get_write_buffer_size() > self._max:
            log.warning("closing a connection whose client does not read its responses")
            self._writer.transport.abort()


def _tcp_token_ok(payload: bytes, token: str) -> tuple[bool, Any]:
    """Token mode: is this first message an ``initialize`` carrying the token? Also its id."""
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):
        return False, None
    if not isinstance(data, dict):
        return False, None
    msg_id = data.get("id") if isinstance(data.get("id"), int | str) else None
    params = data.get("params")
    opts = params.get("initializationOptions") if isinstance(params, dict) else None
    given = opts.get("token") if isinstance(opts, dict) else None
    if given is None and isinstance(opts, dict) and isinstance(opts.get("fimble"), dict):
        given = opts["fimble"].get("token")
    return data.get("method") == "initialize" and auth.token_matches(token, given), msg_id


async def _tcp_admit(
    frames: AsyncIterator[bytes | FrameError], opts: ListenOptions, writer: asyncio.StreamWriter
) -> bytes | None:
    """Token mode: the connection's first message if it is an ``initialize`` carrying the token. Anything else is
    answered UNAUTHORIZED (nothing at all if no message came in time) and the connection closed: None."""
    try:
        first = await asyncio.wait_for(anext(frames), opts.init_timeout)
    except (TimeoutError, StopAsyncIteration, OSError):
        writer.transport.abort()
        return None
    ok, msg_id = (False, None) if isinstance(first, FrameError) else _tcp_token_ok(first, opts.token or "")
    if ok and isinstance(first, bytes):
        return first
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": msg_id,
            "error": {
                "code": UNAUTHORIZED,
                "message": "Unauthorized: initialize with initializationOptions.token set to the server's token",
            },
        }
    ).encode()
    writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    writer.close()  # after the error is written
    return None


async def _tcp_session(
    sessions: Sessions, opts: ListenOptions, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    if sessions.full:
        body = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": None,
                "error": {"code": SERVER_BUSY, "message": f"Server busy: {sessions.max_sessions} sessions are open"},
            }
        ).encode()
        writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        writer.close()
        return
    try:  # the first bytes decide, before a session exists (lsp_server/framing.py LSP_OPENINGS)
        opening = await asyncio.wait_for(read_opening(reader), opts.init_timeout)
    except TimeoutError:
        opening = None
    if opening is None:
        log.debug("closing a TCP connection that did not open with an LSP header")
        writer.transport.abort()
        return
    frames = read_frames(reader, opts.limits, opening)
    first: bytes | None = None
    if opts.token is not None:  # checked before a session exists: a client without the token never holds one
        first = await _tcp_admit(frames, opts, writer)
        if first is None:
            return
    ls = sessions.new()
    ended = asyncio.Event()
    ls.protocol.set_writer(_TcpWriter(writer, 2 * opts.limits.max_message))
    ls.closer = lambda _code: ended.set()
    deadline = _init_deadline(ls, opts, writer.transport.abort)
    try:
        if first is not None:  # the initialize that carried the token
            ls.protocol.receive(first)
            await ls.pacer.settle()
        async for frame in frames:
            if isinstance(frame, FrameError):
                bad_frame(ls, frame)
            else:
                ls.protocol.receive(frame)
            await ls.pacer.settle()  # the other sessions' frames between this one's (lsp_server/pacing.py)
            if ended.is_set():
                break
    except OSError:  # a reset: the session ends the same way
        pass
    finally:
        deadline.cancel()
        sessions.end(ls)
        if not writer.is_closing():
            try:
                await writer.drain()
            except OSError:
                pass
            writer.close()


async def _serve_tcp(sessions: Sessions, host: str, port: int, opts: ListenOptions) -> None:
    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _tcp_session(sessions, opts, reader, writer)
        except asyncio.CancelledError:  # the server stops: end quietly (on 3.11 asyncio logs a cancelled
            writer.transport.abort()  # handler task's "exception" with a traceback)

    try:
        server = await asyncio.start_server(on_connect, host, port, limit=opts.limits.max_header_line)
    except OSError as exc:
        raise _bind_error(host, port, exc) from None
    published = _announce("tcp", server.sockets, opts)
    try:
        async with server:
            await server.serve_forever()
    finally:
        _withdraw(published, opts)
        await sessions.close()


def _init_deadline(ls: FimbleServer, opts: ListenOptions, close: Any) -> asyncio.TimerHandle:
    """Close a connection that has not sent `initialize` in time: idle ones must not hold session slots."""

    def check() -> None:
        if ls.protocol.phase == "new":
            log.warning("closing a connection that sent no initialize within %.0f s", opts.init_timeout)
            close()

    return asyncio.get_running_loop().call_later(opts.init_timeout, check)


# -- WebSocket -----------------------------------------------------------------------------
class TextFrameWriter:
    """pygls writer interface over a websocket connection, one text frame per message."""

    def __init__(self, ws: Any):
        self._ws = ws

    def close(self) -> Any:
        return self._ws.close()

    def write(self, data: bytes) -> Any:
        return self._send(data.decode("utf-8"))

    async def _send(self, text: str) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            await self._ws.send(text)
        except ConnectionClosed:  # the client left: its session is ending
            pass


async def _ws_session(sessions: Sessions, ws: Any, opts: ListenOptions) -> None:
    from websockets.exceptions import ConnectionClosed

    ls = sessions.new()
    ls.protocol.set_writer(TextFrameWriter(ws), include_headers=False)
    ls.closer = lambda _code: asyncio.ensure_future(ws.close())
    deadline = _init_deadline(ls, opts, lambda: asyncio.ensure_future(ws.close(1008, "no initialize")))
    try:
        while True:
            try:
                data = await ws.recv(decode=False)  # bytes: invalid UTF-8 is answered, not fatal
            except ConnectionClosed:
                break
            ls.protocol.receive(data)
            await ls.pacer.settle()  # the other sessions' frames between this one's (lsp_server/pacing.py)
    finally:
        deadline.cancel()
        sessions.end(ls)


def _ws_gate(opts: ListenOptions, sessions: Sessions) -> Any:
    """websockets' process_request hook: refuse a handshake without a loopback Host or the token."""

    def check(connection: Any, request: Any) -> Any:
        hosts = request.headers.get_all("Host")
        if opts.loopback and (len(hosts) > 1 or not auth.loopback_host_header(hosts[0] if hosts else None)):
            return connection.respond(HTTPStatus.FORBIDDEN, "Host header is not a loopback name\n")
        if opts.token is not None and not (
            auth.token_matches(opts.token, auth.bearer(request.headers))
            or auth.token_matches(opts.token, auth.query_token(request.path))
        ):
            return connection.respond(HTTPStatus.UNAUTHORIZED, "a token is required\n")
        if sessions.full:
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "too many sessions\n")
        return None

    return check


async def _serve_ws(sessions: Sessions, host: str, port: int, opts: ListenOptions) -> None:
    from websockets.asyncio.server import serve

    async def handler(ws: Any) -> None:
        await _ws_session(sessions, ws, opts)

    # origins: None stands for "no Origin header" (editors, scripts); browsers always send one.
    try:
        listening = serve(
            handler,
            host,
            port,
            max_size=opts.limits.max_message,
            origins=[None, *opts.allow_origins],
            process_request=_ws_gate(opts, sessions),
            server_header=None,
        )
        server = await listening.__aenter__()
    except OSError as exc:
        raise _bind_error(host, port, exc) from None
    published: list[Path] = []
    try:
        published = _announce("ws", server.sockets, opts)
        await server.serve_forever()
    finally:
        _withdraw(published, opts)
        try:
            await sessions.close()
        finally:
            await listening.__aexit__(None, None, None)


def _announce(scheme: str, sockets: Any, opts: ListenOptions) -> list[Path]:
    """Say where the server listens; with a token, leave it in this user's token file for each port (the files
    written: ``_withdraw`` removes them at exit)."""
    # The token lines come first: a caller that waits for "listening on" finds the token and its file there already.
    if opts.token is not None and opts.show_token:
        print(f"fimble: token: {opts.token}", file=sys.stderr, flush=True)  # as Jupyter does: copied from here
    published: list[Path] = []
    for port in dict.fromkeys(sock.getsockname()[1] for sock in sockets):
        if opts.token is None:
            break
        try:
            published.append(auth.publish_token(port, opts.token))
        except OSError as exc:  # the listener still works: clients pass the token themselves
            print(
                f"fimble: could not write the token file ({exc.strerror or exc}): clients need the token",
                file=sys.stderr,
                flush=True,
            )
            continue
        print(
            f"fimble: token file: {published[-1]} (only you can read it; removed at exit)", file=sys.stderr, flush=True
        )
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(
            f"fimble: listening on {scheme}://{shown}:{port}" + (" (token required)" if opts.token else ""),
            file=sys.stderr,
            flush=True,
        )
    return published


def _withdraw(published: list[Path], opts: ListenOptions) -> None:
    for path in published:
        auth.withdraw_token(path, opts.token or "")


def _bind_error(host: str, port: int, exc: OSError) -> FimbleError:
    """One line for an address that cannot be listened on (taken, not this machine's, not allowed)."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    shown = f"[{host}]" if ":" in host else host
    return FimbleError(f"cannot listen on {shown}:{port}: {reason}")


def _signal_status(signum: int) -> int:
    """The exit status after a stop signal: SIGTERM is a normal end (0); SIGINT the shell's 130."""
    return 130 if signum == signal.SIGINT else 0


def _on_stop_signals(host: EngineHost, stop: Callable[[], object]) -> list[int]:
    """On SIGTERM/SIGINT: end the engine child now (killed and reaped, even mid-load), then ``stop()``.

    Returns the list the signal's number is put in. Handlers run on the event loop (not inside whatever
    it was doing), so no KeyboardInterrupt unwinds through the server's tasks with a traceback."""
    loop = asyncio.get_running_loop()
    got: list[int] = []

    def handle(signum: int) -> None:
        if got:
            return  # a second signal while stopping: already on it
        got.append(signum)
        log.info("%s: stopping", signal.Signals(signum).name)
        try:
            host.kill_now()
        finally:
            stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, handle, sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    return got


async def _until_stopped(run: Coroutine[Any, Any, None], host: EngineHost) -> int:
    """Run a listener until it ends or a stop signal comes; the exit status."""
    task = asyncio.ensure_future(run)
    stopped = _on_stop_signals(host, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        if not stopped:
            raise
    return _signal_status(stopped[0]) if stopped else 0


def serve(
    defaults: Settings, tcp: str | None = None, ws: str | None = None, *, options: ListenOptions = ListenOptions()
) -> int:
    """Run the server on the chosen transport until it ends; the process's exit status."""
    if not tcp and not ws:
        return start_stdio(create_server(defaults, debug=options.debug), options.limits)
    sessions = Sessions(defaults, debug=options.debug, max_sessions=options.max_sessions)
    host, port = parse_address(tcp or ws or "")
    run = _serve_tcp if tcp else _serve_ws
    try:
        return asyncio.run(_until_stopped(run(sessions, host, port, options), sessions.host))
    except (KeyboardInterrupt, SystemExit):  # a signal before the handlers were in place
        return 130
