"""``fimble serve``: one engine, many clients, over websockets and an OpenAI-compatible HTTP API.

One port answers two kinds of request:
- a websocket upgrade (``GET /`` with ``Upgrade: websocket``): an engine session speaking
  engine/serve/protocol.py (engine/process.py's msgpack messages after a version handshake);
- ``POST /v1/completions`` (and ``GET /v1/models``): engine/serve/openai_http.py.
websockets' own HTTP parser accepts no request body, so the port is a small asyncio front
(``_front``) that parses requests with h11 (engine/serve/http11.py) and either answers them
itself or, when a connection's first request is a websocket upgrade, relays its bytes to the
websockets server listening on a private unix socket.

Threads: the engine's decode loop runs in the main thread (``serve_forever``: on CPU torch is
about 2x slower elsewhere), the asyncio loop with every connection in a background thread.
Deltas cross from the engine thread to the loop with ``call_soon_threadsafe``.

Security: loopback by default (another address needs ``--allow-remote``); the CLI sets a token
unless ``--no-token`` (loopback only), and ``run_daemon`` leaves it in this user's token file for
the port (engine/auth.py); it is checked in constant time on the HTTP upgrade and on every
HTTP request; browser Origins are refused unless allowed; a loopback bind also refuses a
non-loopback Host header (DNS rebinding). Replies and logs carry no document text and no
tracebacks.

Entry points (for other modules, e.g. a Ray Serve replica)::

    engine = ServeEngine(target, draft)                     # engine/serve/scheduler.py
    daemon = EngineDaemon(engine, ServeOptions(port=0))     # port 0: any free port
    port = daemon.start()                                   # listeners up, in a background thread
    engine.serve_forever()                                  # the decode loop, in this (main) thread
    ...; daemon.stop(); engine.close()
or ``run_daemon(engine, options)`` for all of that with signal handling. A client connects with
``engine.serve.client.WSEngine("ws://127.0.0.1:PORT", token=...)`` (the EngineProcess API) or
any OpenAI client at ``http://127.0.0.1:PORT/v1``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import h11
from websockets.asyncio.server import ServerConnection, unix_serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Response

from engine.api import CompletionRequest, CompletionStream
from engine.serve import gc_pauses, http11, openai_http, protocol
from engine.serve.protocol import ProtocolError
from engine.serve.session import SessionHost

log = logging.getLogger("fimble.serve")
HELLO_TIMEOUT_S = 10.0
OUTBOX_LIMIT = 10_000  # messages queued for a client that does not read: then it is dropped
DAEMON_COUNTERS = (
    "sessions_open",
    "sessions_total",
    "refused_token",
    "refused_version",
    "refused_origin",
    "refused_busy",
    "bad_messages",
    "disconnect_cancels",
    "documents_freed",
    "http_requests",
    "http_errors",
)


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = protocol.DEFAULT_PORT
    token: str | None = None  # required from every client when set (the CLI sets one unless --no-token)
    show_token: bool = False  # run_daemon prints the token (a generated one; never one read from a file)
    loopback: bool = True  # the bind address is loopback: Host headers must be too
    allow_origins: tuple[str, ...] = ()
    max_message: int = protocol.DEFAULT_MAX_MESSAGE
    max_sessions: int = 256
    model_name: str = "fimble"  # the OpenAI "model" this server reports


class EngineDaemon:
    """Serves ``engine`` (a ServeEngine, or any LocalEngine) to websocket and HTTP clients."""

    def __init__(self, engine: Any, options: ServeOptions | None = None):
        self.engine = engine
        self.options = options or ServeOptions()
        self.counts = dict.fromkeys(DAEMON_COUNTERS, 0)
        self._gc = gc_pauses.pauses()
        self.port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._sockdir = tempfile.mkdtemp(prefix="fimble-serve-")  # 0700: only this user reaches the relay
        self._sock_path = os.path.join(self._sockdir, "ws.sock")
        self._stop: asyncio.Event | None = None
        # Messages from the engine thread wait here and reach the loop in one wake-up per batch: a round of
        # 32 sequences would otherwise wake the loop (a self-pipe write, a loop pass, the GIL) 32 times.
        self._outgoing: list[tuple[Any, dict]] = []
        self._outgoing_lock = threading.Lock()
        self._flush_pending = False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> int:
        """Bind and serve in a background thread; return the port (useful with port 0)."""
        self._thread = threading.Thread(target=self._thread_main, name="fimble-serve-io", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        assert self.port is not None
        return self.port

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            os.unlink(self._sock_path)
            os.rmdir(self._sockdir)
        except OSError:
            pass

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # a bind error: handed to start()
            self._error = exc
            self._started.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        ws_server = await unix_serve(
            self._ws_session,
            path=self._sock_path,
            max_size=self.options.max_message,
            process_request=self._check_upgrade,
            compression=None,
            server_header=None,
            logger=logging.getLogger("fimble.serve.ws"),
        )
        front = await asyncio.start_server(self._front, self.options.host, self.options.port)
        self.port = front.sockets[0].getsockname()[1]
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            front.close()
            ws_server.close()

    def counters(self) -> dict:
        """The engine's counters plus the daemon's (sessions, refusals, freed sequences, and this process's
        garbage-collector pauses, ``daemon_gc_*``: the engine's own are ``gc_*``, the same figures when the
        engine runs in this process)."""
        return {**self.engine.counters(), **self.counts, **self._gc.snapshot("daemon_gc_")}

    # -- the shared port -------------------------------------------------------------------------
    async def _front(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection to the shared port: HTTP requests in order (engine/serve/http11.py), unless the first one
        is a websocket upgrade, whose bytes then go to the websockets server."""
        conn = http11.HTTPConnection(reader, writer, self.options.max_message)
        first = True
        try:
            while True:
                try:
                    head = await conn.next_request(http11.HEAD_TIMEOUT_S if first else http11.IDLE_TIMEOUT_S)
                except h11.RemoteProtocolError as exc:  # not HTTP: its 4xx, then the connection closes
                    self.counts["http_requests"] += 1
                    self.counts["http_errors"] += 1
                    await conn.reply_error(http11.protocol_error(exc))
                    await conn.linger()
                    return
                except TimeoutError:  # idle (or a head that never ends): close quietly
                    return
                if head is None:
                    return
                if first and http11.is_upgrade(head):
                    await self._relay(bytes(conn.raw or b""), reader, writer)
                    return
                first = False
                conn.begin(head)
                await openai_http.handle(self, conn, head)
                if not conn.next_cycle():
                    await conn.linger()
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # shutting down: end quietly (asyncio would log a cancelled callback task)
            pass
        except Exception:  # the details stay in the log at DEBUG: no traceback reaches a client
            log.debug("connection failed", exc_info=True)
            log.warning("a connection failed (details at log level DEBUG)")
        finally:
            writer.close()

    async def _relay(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Pass a websocket connection's bytes to and from the websockets server on the unix socket."""
        inner_r, inner_w = await asyncio.open_unix_connection(self._sock_path)
        inner_w.write(head)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, inner_w), pipe(inner_r, writer))

    def authorized(self, headers: Any) -> str | None:
        """None if a request with these headers may proceed, else (status, reason) as 'CODE reason'."""
        from engine import auth

        for name in ("Origin", "Host", "Authorization"):  # one each at most: which one would count is ambiguous
            if len(headers.get_all(name)) > 1:
                self.counts["refused_origin"] += 1
                return f"400 more than one {name} header"
        origin = headers.get("Origin")
        if origin is not None and origin not in self.options.allow_origins:
            self.counts["refused_origin"] += 1
            return "403 Origin not allowed"
        if self.options.loopback and not auth.loopback_host_header(headers.get("Host")):
            self.counts["refused_origin"] += 1
            return "403 Host must be a loopback address"
        if self.options.token is not None and not auth.token_matches(self.options.token, auth.bearer(headers)):
            self.counts["refused_token"] += 1
            return "401 a valid bearer token is required"
        return None

    # -- websocket sessions ---------------------------------------------------------------------
    def _check_upgrade(self, connection: ServerConnection, request: Any) -> Response | None:
        refused = self.authorized(request.headers)
        if refused is None and self.counts["sessions_open"] >= self.options.max_sessions:
            self.counts["refused_busy"] += 1
            refused = "503 too many sessions"
        if refused is None:
            return None
        code, reason = refused.split(" ", 1)
        body = (reason + "\n").encode()
        return Response(
            int(code),
            reason,
            Headers({"Content-Type": "text/plain", "Content-Length": str(len(body)), "Connection": "close"}),
            body,
        )

    async def _ws_session(self, ws: ServerConnection) -> None:
        try:
            first = await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT_S)
            refusal = protocol.check_hello(protocol.unpack(first))
        except (TimeoutError, ConnectionClosed):
            return
        except ProtocolError as exc:
            refusal = str(exc)
        if refusal is not None:
            self.counts["refused_version"] += 1
            await ws.send(protocol.pack({"op": "refused", "error": refusal}))
            await ws.close(protocol.REFUSED_CLOSE_CODE, "refused")
            return
        self.counts["sessions_open"] += 1
        self.counts["sessions_total"] += 1
        outbox: asyncio.Queue[dict | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def enqueue(msg: dict) -> None:
            if outbox.qsize() >= OUTBOX_LIMIT:  # the client stopped reading: drop it, not our memory
                ws.transport.abort()
                return
            outbox.put_nowait(msg)

        def send(msg: dict) -> None:  # from any thread
            self._post(loop, enqueue, msg)

        async def writer() -> None:
            # Whatever queued up while the last frame went out is sent together, a request's consecutive deltas
            # as one: under load the writer falls behind the decode loop, and a frame per token would grow the
            # backlog (and every first delta's wait behind it).
            closing = False
            while not closing and (msg := await outbox.get()) is not None:
                batch = [msg]
                while not outbox.empty():
                    more = outbox.get_nowait()
                    if more is None:
                        closing = True
                        break
                    batch.append(more)
                for merged in coalesce_deltas(batch):
                    try:
                        data = protocol.pack(merged)
                    except Exception:  # packed here, on the loop: a bad message must not end the writer
                        log.debug("a message could not be packed", exc_info=True)
                        data = protocol.pack({"op": "error", "error": "a reply could not be encoded"})
                    await ws.send(data)

        write_task = asyncio.create_task(writer())
        session = SessionHost(self, secrets.token_hex(6), send)  # engine/serve/session.py
        send({"op": "ready", "version": protocol.PROTOCOL_VERSION, "session": session.id, "info": self.engine.info()})
        try:
            async for raw in ws:
                try:
                    if not session.handle(protocol.unpack(raw)):
                        break
                except ProtocolError as exc:
                    self.counts["bad_messages"] += 1
                    send({"op": "error", "error": str(exc)})
                except Exception:  # a message we did not foresee must not end the session (nor log its text)
                    self.counts["bad_messages"] += 1
                    log.debug("message failed", exc_info=True)
                    send({"op": "error", "error": "the message could not be handled"})
        except ConnectionClosed:
            pass
        finally:
            self.counts["sessions_open"] -= 1
            session.end()
            outbox.put_nowait(None)
            try:
                await asyncio.wait_for(write_task, 5)
            except (TimeoutError, ConnectionClosed):
                write_task.cancel()
            except Exception:  # the client vanished while we flushed: nothing left to tell it
                write_task.cancel()

    def _post(self, loop: asyncio.AbstractEventLoop, enqueue, msg: dict) -> None:
        """Queue ``msg`` for a session's writer from any thread; the first message of a batch wakes the loop."""
        with self._outgoing_lock:
            self._outgoing.append((enqueue, msg))
            if self._flush_pending:
                return
            self._flush_pending = True
        loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        """In the loop: hand every queued message to its session's outbox, in order."""
        with self._outgoing_lock:
            batch, self._outgoing = self._outgoing, []
            self._flush_pending = False
        for enqueue, msg in batch:
            enqueue(msg)

    def submit(self, request: CompletionRequest, on_delta) -> CompletionStream:
        """Submit to the engine; ``on_delta(delta, stream)`` is called from the engine thread."""
        box: list[CompletionStream] = []
        stream = self.engine.submit(request, on_delta=lambda d: on_delta(d, box[0] if box else None))
        box.append(stream)
        return stream


def coalesce_deltas(messages: list[dict]) -> list[dict]:
    """``messages`` in order, each run of consecutive deltas of one request merged into one (texts joined, the
    last one's end fields kept). A delta that ends its stream or carries an error ends a run."""
    out: list[dict] = []
    for msg in messages:
        prev = out[-1] if out else None
        if (
            prev is not None
            and msg.get("op") == "delta"
            and prev.get("op") == "delta"
            and prev.get("id") == msg.get("id")
            and not prev["delta"].get("finished")
            and not prev["delta"].get("error")
        ):
            out[-1] = {**msg, "delta": {**msg["delta"], "text": prev["delta"]["text"] + msg["delta"]["text"]}}
        else:
            out.append(msg)
    return out


def run_daemon(engine: Any, options: ServeOptions, announce=print) -> int:
    """Serve until SIGINT/SIGTERM: listeners in a thread, the decode loop in this (main) thread."""
    from engine import auth

    daemon = EngineDaemon(engine, options)
    port = daemon.start()
    host = options.host if ":" not in options.host else f"[{options.host}]"
    # The token first: a caller that waits for the "serving" line finds the token and its file there already.
    if options.token is not None and options.show_token:
        announce(f"fimble: token: {options.token}")
    published = publish_token(port, options.token, announce)
    announce(
        f"fimble: serving {engine.info().get('model')} on ws://{host}:{port} "
        f"(OpenAI API: http://{host}:{port}/v1/completions)" + (" (token required)" if options.token else "")
    )

    def stop(_signum: int, _frame: Any) -> None:
        # Not engine.close() here: the handler runs in this thread, between two bytecodes of whatever it was doing,
        # and the decode loop waits in queue.Queue.get, which holds the queue's (non-reentrant) lock around its
        # wait. close() puts on that queue: called here at such a moment it waited for itself, forever (a SIGTERM
        # that `fimble serve` ignored, seen once in the suite). From another thread it waits for the loop's get.
        threading.Thread(target=engine.close, name="fimble-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # The listeners' objects of start-up out of every later full collection (engine/serve/gc_pauses.py): a pause
    # in this process holds every session's frames.
    gc_pauses.freeze_startup()
    try:
        engine.serve_forever()
    finally:
        daemon.stop()
        if published is not None and options.token is not None:
            auth.withdraw_token(published, options.token)
    return 0


def publish_token(port: int, token: str | None, announce=print):
    """Leave ``token`` where this user's clients on this machine find it (engine/auth.py), saying where in
    one line; None when there is no token or the file cannot be written (then said too)."""
    from engine import auth

    if token is None:
        return None
    try:
        path = auth.publish_token(port, token)
    except OSError as exc:  # the listener still works: clients pass the token themselves
        announce(f"fimble: could not write the token file ({exc.strerror or exc}): clients need --engine-token-file")
        return None
    announce(f"fimble: token file: {path} (only you can read it; removed at exit)")
    return path
