"""stdio, TCP and WebSocket transports. TCP and WS listen on loopback unless told otherwise.

Two departures from pygls' own loops:
- stdio reads through an asyncio pipe, not a thread-pool hop per header line and body
  (pygls' reader costs about 0.6 ms a message; a keystroke is several messages);
- WebSocket messages go out as text frames (pygls sends binary frames, which browser
  clients such as Monaco and vscode-ws-jsonrpc drop).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from typing import Any

from pygls.exceptions import JsonRpcException
from pygls.io_ import StdinAsyncReader, StdoutWriter, run_async

from lsp_server.server import FimbleServer

log = logging.getLogger(__name__)
DEFAULT_HOST = "127.0.0.1"


def parse_address(text: str) -> tuple[str, int]:
    """"HOST:PORT", ":PORT" or "PORT" -> (host, port); the host defaults to loopback."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or DEFAULT_HOST
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"bad address {text!r}: expected HOST:PORT") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"bad port {number}: expected 0-65535")
    return host, number


class TextFrameWriter:
    """pygls writer interface over a websocket connection, one text frame per message."""

    def __init__(self, ws: Any):
        self._ws = ws

    def close(self) -> Any:
        return self._ws.close()

    def write(self, data: bytes) -> Any:
        return self._ws.send(data.decode("utf-8"))


async def _ws_session(ls: FimbleServer, ws: Any, stop: threading.Event) -> None:
    from websockets.exceptions import ConnectionClosed

    ls.protocol.set_writer(TextFrameWriter(ws), include_headers=False)
    while not stop.is_set():
        try:
            data = await ws.recv()
        except ConnectionClosed:
            break
        try:
            ls.protocol.handle_message(json.loads(data, object_hook=ls.protocol.structure_message))
        except Exception as exc:  # one bad message must not end the session
            log.exception("unable to handle message")
            ls._report_server_error(exc, JsonRpcException)


def start_ws(ls: FimbleServer, host: str, port: int) -> None:
    """Serve one WebSocket client; return when it leaves (as pygls' TCP server does)."""
    from websockets.asyncio.server import serve

    stop = threading.Event()
    ls._stop_event = stop

    async def main() -> None:
        done = asyncio.Event()

        async def handler(ws: Any) -> None:
            await _ws_session(ls, ws, stop)
            done.set()

        async with serve(handler, host, port) as server:
            log.info("fimble: WebSocket server on %s", [s.getsockname() for s in server.sockets])
            await done.wait()

    try:
        asyncio.run(main())
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        ls.shutdown()


class _PipeReader:
    """pygls' AsyncReader interface over an asyncio StreamReader; EOF reads as b"" (pygls' loop then ends)."""

    def __init__(self, reader: asyncio.StreamReader):
        self._reader = reader

    async def readline(self) -> bytes:
        return await self._reader.readline()

    async def readexactly(self, n: int) -> bytes:
        try:
            return await self._reader.readexactly(n)
        except asyncio.IncompleteReadError:
            return b""


def start_stdio(ls: FimbleServer) -> None:
    stop = threading.Event()
    ls._stop_event = stop
    ls.protocol.set_writer(StdoutWriter(sys.stdout.buffer))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reader: Any
        try:
            stream = asyncio.StreamReader(limit=1 << 20)
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stream), sys.stdin.buffer)
            reader = _PipeReader(stream)
        except (ValueError, OSError):  # stdin is a regular file: asyncio can't watch it
            reader = StdinAsyncReader(sys.stdin.buffer, ls.thread_pool)
        await run_async(stop_event=stop, reader=reader, protocol=ls.protocol, logger=log,
                        error_handler=ls.report_server_error)

    try:
        asyncio.run(main())
    except BrokenPipeError:
        log.error("the client went away")
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        ls.shutdown()


def serve(ls: FimbleServer, tcp: str | None = None, ws: str | None = None) -> None:
    if tcp:
        ls.start_tcp(*parse_address(tcp))
    elif ws:
        start_ws(ls, *parse_address(ws))
    else:
        start_stdio(ls)
