"""``WSEngine``: a ``fimble serve`` daemon as an engine, with ``EngineProcess``'s API.

``fimble lsp --engine ws://HOST:PORT`` uses it in place of the engine child process
(the LSP server's engine host picks it). Same calls (submit, prewarm, forget, counters, close)
and the same supervision surface (``alive``, ``last_heard``, ``ping``, ``stalled_for``,
``abandon``, ``kill``, ``error``), so the host's watchdog and restart path work unchanged:
when the daemon goes away, open requests end with a clear error, the host reports it and
makes a new ``WSEngine``, whose constructor reconnects with backoff (0.25 s doubling to 2 s)
until ``startup_timeout``.

Threads and messages as EngineProcess's (engine/wire_client.py): a reader thread receives messages, a writer
thread sends the outbox, so a daemon that stops reading never blocks the caller's event loop.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection, connect

from engine.errors import FimbleError
from engine.serve import protocol
from engine.wire_client import MessageClient

RETRY_FIRST_S, RETRY_MAX_S = 0.25, 2.0


def check_url(url: str) -> str:
    """A ws:// or wss:// URL with a host; FimbleError (one line) otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise FimbleError(f"--engine {url!r}: not a URL") from None
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise FimbleError(f"--engine {url!r}: expected ws://HOST:PORT (or wss://)")
    if port is not None and not 1 <= port <= 65535:
        raise FimbleError(f"--engine {url!r}: port must be from 1 to 65535")
    return url


class WSEngine(MessageClient):
    """An engine in a ``fimble serve`` daemon, reached over a websocket."""

    pid = None  # no local process

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        startup_timeout: float = 60.0,
        max_message: int = protocol.DEFAULT_MAX_MESSAGE,
        client: str = "fimble-lsp",
    ):
        self.url = check_url(url)
        self._ws = self._connect(token, startup_timeout, max_message)
        try:
            self._ws.send(protocol.pack(protocol.hello(client)))
            reply = protocol.unpack(self._ws.recv(timeout=startup_timeout))
        except (ConnectionClosed, TimeoutError, protocol.ProtocolError, OSError) as exc:
            self._ws.close()
            raise FimbleError(f"the engine at {url} did not complete the handshake ({type(exc).__name__})") from None
        if reply.get("op") != "ready":
            self._ws.close()
            raise FimbleError(f"the engine at {url} refused this client: {reply.get('error', 'no reason given')}")
        self._info: dict = dict(reply.get("info") or {}, session=reply.get("session"), url=url)
        self.work: dict = {}  # (the daemon reports no progress of a prompt's prefill)
        super().__init__()
        self.work: dict = {}  # (the daemon reports no progress of a prompt's prefill)
        self._reader = threading.Thread(target=self._read, name="fimble-ws-engine-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="fimble-ws-engine-writer", daemon=True)
        self._writer.start()

    def _connect(self, token: str | None, timeout: float, max_message: int) -> ClientConnection:
        headers = {"Authorization": f"Bearer {token}"} if token else None
        deadline, delay = time.monotonic() + timeout, RETRY_FIRST_S
        while True:
            try:
                # Entered as a context manager: websockets >= 17.1 deprecates using connect()'s result
                # directly (legacy=True is unknown before 17.1); close() ends it.
                return connect(
                    self.url,
                    additional_headers=headers,
                    max_size=max_message,
                    compression=None,
                    open_timeout=min(10.0, max(1.0, timeout)),
                    user_agent_header=None,
                ).__enter__()
            except InvalidStatus as exc:  # the daemon answered and said no: retrying will not help
                status = exc.response.status_code
                what = (
                    ("a valid token (--engine-token-file; on this machine, read from its token file by default)")
                    if status == 401
                    else f"HTTP {status}"
                )
                raise FimbleError(f"the engine at {self.url} refused the connection: it needs {what}") from None
            except InvalidURI:
                raise FimbleError(f"--engine {self.url!r}: not a websocket URL") from None
            except (OSError, InvalidHandshake, TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
                    raise FimbleError(f"cannot reach the engine at {self.url}: {reason}") from None
            time.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)

    # -- the websocket (engine/wire_client.py) ---------------------------------------------------------
    def _transmit(self, data: bytes) -> None:
        try:
            self._ws.send(data)
        except ConnectionClosed as exc:
            raise OSError("closed") from exc

    _shut_after_failure = False

    def _shut(self) -> None:
        try:
            self._ws.close()
        except (OSError, RuntimeError):
            pass

    def _read(self) -> None:
        try:
            for raw in self._ws:
                self.last_heard = time.monotonic()
                try:
                    self._dispatch(protocol.unpack(raw))
                except protocol.ProtocolError:
                    continue
        except (ConnectionClosed, OSError, RuntimeError):
            pass
        self._lost(f"the engine at {self.url} closed the connection")

    # -- Engine API and supervision (the rest: engine/wire_client.py) ---------------------------------
    def info(self) -> dict:
        return self._info

    def alive(self) -> bool:
        return not self.error

    def stalled_for(self) -> float:
        """Seconds since the open request that has gone longest without a delta (0 with none): the daemon runs
        requests together, so each one's own progress counts."""
        oldest = min(self._progress.values(), default=None)
        return 0.0 if oldest is None else time.monotonic() - oldest

    def kill(self) -> None:
        """Drop the connection now (a stopped daemon would never finish a closing handshake)."""
        try:
            self._ws.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._send({"op": "close"})
        self._outbox.put(None)
        self._writer.join(timeout=5)
        self.kill()


@dataclass(frozen=True)
class ServeSpec:
    """What ``fimble lsp --engine ws://HOST:PORT`` asks for (Settings.engine_spec; hashable)."""

    url: str
    token_file: str | None = None
    timeout_s: float = 60.0

    def open(self) -> WSEngine:
        # Without a token file, the one a daemon on this machine left for its port (engine/auth.py), read at
        # every (re)connect: a restarted daemon has a new token.
        token = read_token(self.token_file) if self.token_file else local_token(self.url)
        return WSEngine(self.url, token, startup_timeout=self.timeout_s)


def local_token(url: str) -> str | None:
    """The token a listener on this machine left for the URL's port; None if it is not on loopback or left none."""
    from engine.auth import find_token

    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
    except ValueError:
        return None
    return find_token(parts.hostname or "", port)


def serve_spec(url: str, token_file: str | None, timeout_s: float, allow_plain: bool) -> ServeSpec:
    """Check ``--engine ws://...`` and its token file now (a user error before any connection)."""
    from engine.auth import is_loopback

    check_url(url)
    host = urlsplit(url).hostname or ""
    if urlsplit(url).scheme == "ws" and not is_loopback(host) and not allow_plain:
        raise FimbleError(
            f"--engine {url}: plain ws to {host}, which is not loopback, would send document text "
            "(and the token) unencrypted. Use wss://, or pass --engine-allow-http to mean it"
        )
    if not 0.5 <= timeout_s <= 600:
        raise FimbleError("--engine-timeout must be from 0.5 to 600 seconds")
    if token_file:
        read_token(token_file)
    return ServeSpec(url, token_file, max(timeout_s, 60.0))


def read_token(path: str) -> str:
    from engine.auth import read_token as read

    try:
        return read(path)
    except FimbleError as exc:
        raise FimbleError(str(exc).replace("--token-file", "--engine-token-file", 1)) from None
