"""Raw JSON-RPC clients for the reliability suite: real servers over stdio, TCP and WebSocket.

No LSP client library here on purpose: these tests send bytes a library would never send.
Servers are started with ``preload: false`` and only cheap requests, so the engine (and a
model) loads only where a test asks for a completion.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SERVER_CMD = [sys.executable, "-m", "lsp_server", "lsp"]
INIT = {"processId": None, "rootUri": None, "capabilities": {}, "initializationOptions": {"preload": False}}
CALL_TIMEOUT = 60.0  # per call, wide: these tests assert outcomes, never speed


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    if (
        not env.get("FIMBLE_MODEL")
        and not (REPO / "models" / "fimble-target" / "config.json").is_file()
        and Path("/tmp/ftrain/fimble-target").is_dir()
    ):
        env["FIMBLE_MODEL"] = "/tmp/ftrain/fimble-target"
        env["FIMBLE_DRAFT"] = "/tmp/ftrain/fimble-draft"
    return env


def msg(i: Any, method: str, params: Any = None) -> dict:
    m: dict = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        m["params"] = params
    if i is not None:
        m["id"] = i
    return m


def frame(payload: dict | list | bytes) -> bytes:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def did_open(uri: str, text: str, language: str = "python") -> dict:
    return msg(
        None, "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": language, "version": 1, "text": text}}
    )


class Listener:
    """``fimble lsp --tcp/--ws 127.0.0.1:0 ...``: its port read from the line it prints; stderr kept in a file.

    ``no_token=True`` (the default here) passes ``--no-token``: most of these tests are about sessions, frames and
    supervision, where the token (required by default) would only be noise; the tests of who may connect pass
    ``no_token=False``. Token files go to a folder of the listener's own (``runtime_dir``)."""

    def __init__(self, flag: str, *extra: str, host: str = "127.0.0.1", no_token: bool = True):
        self.log = tempfile.NamedTemporaryFile(prefix="fimble-rel-", suffix=".log", delete=False)
        self.runtime_dir = tempfile.mkdtemp(prefix="fimble-rel-run-")
        env = dict(server_env(), FIMBLE_RUNTIME_DIR=self.runtime_dir)
        self.proc = subprocess.Popen(
            SERVER_CMD + [flag, f"{host}:0", *extra, *(["--no-token"] if no_token else [])],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        self.port = self._wait_port()

    def stderr(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def _wait_port(self) -> int:
        deadline = time.monotonic() + CALL_TIMEOUT
        while time.monotonic() < deadline:
            for line in self.stderr().splitlines():
                if line.startswith("fimble: listening on "):
                    return int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.stderr()}")
            time.sleep(0.05)
        raise TimeoutError("server did not start listening")

    def token(self) -> str:
        for line in self.stderr().splitlines():
            if line.startswith("fimble: token: "):
                return line.split(": ", 2)[2].strip()
        raise AssertionError("no token printed")

    def token_file(self) -> Path:
        """The token file the listener said it wrote."""
        for line in self.stderr().splitlines():
            if line.startswith("fimble: token file: "):
                return Path(line.split(": ", 2)[2].split(" (")[0])
        raise AssertionError("no token file named")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)  # killed: its token file is left behind


class FrameReader:
    """Reads Content-Length frames from a stream; keeps every message, answers by id."""

    def __init__(self, reader: asyncio.StreamReader):
        self.reader = reader
        self.seen: list[Any] = []

    async def next(self, timeout: float = CALL_TIMEOUT) -> Any:
        length = 0
        while True:
            line = await asyncio.wait_for(self.reader.readline(), timeout)
            if not line:
                raise EOFError("connection closed")
            if line in (b"\r\n", b"\n"):
                break
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        m = json.loads(await asyncio.wait_for(self.reader.readexactly(length), timeout))
        self.seen.append(m)
        return m

    async def response(self, i: Any, timeout: float = CALL_TIMEOUT) -> dict:
        for m in self.seen:
            if isinstance(m, dict) and m.get("id") == i and "method" not in m:
                self.seen.remove(m)
                return m
        while True:
            m = await self.next(timeout)
            if isinstance(m, dict) and m.get("id") == i and "method" not in m:
                self.seen.remove(m)
                return m


class FrameClient(FrameReader):
    """A FrameReader that also writes frames (``send_raw`` from the subclass) and numbers its calls."""

    _ids = 0

    def send_raw(self, data: bytes) -> None:
        raise NotImplementedError

    def send(self, m: dict | list) -> None:
        self.send_raw(frame(m))

    async def call(self, method: str, params: Any = None) -> dict:
        self._ids += 1
        self.send(msg(self._ids, method, params))
        return await self.response(self._ids)

    async def initialize(self, options: dict | None = None) -> dict:
        init = dict(INIT, initializationOptions={**INIT["initializationOptions"], **(options or {})})
        result = await self.call("initialize", init)
        self.send(msg(None, "initialized", {}))
        return result


class TcpClient(FrameClient):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        super().__init__(reader)
        self.writer = writer
        self._ids = 0

    @classmethod
    async def connect(cls, port: int) -> TcpClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=256 << 20)
        return cls(reader, writer)

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    def reset(self) -> None:
        """Leave with a TCP reset (RST), as a crashed client or a dropped network does."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass


class WsClient:
    def __init__(self, ws: Any):
        self.ws = ws
        self.seen: list[Any] = []
        self._ids = 0

    @classmethod
    async def connect(cls, port: int, path: str = "/", **kwargs: Any) -> WsClient:
        from websockets.asyncio.client import connect

        return cls(await connect(f"ws://127.0.0.1:{port}{path}", max_size=None, **kwargs))

    async def send(self, m: dict | list | str | bytes) -> None:
        await self.ws.send(m if isinstance(m, str | bytes) else json.dumps(m))

    async def next(self, timeout: float = CALL_TIMEOUT) -> Any:
        m = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        self.seen.append(m)
        return m

    async def response(self, i: Any, timeout: float = CALL_TIMEOUT) -> dict:
        return await FrameReader.response(self, i, timeout)  # type: ignore[arg-type]

    async def call(self, method: str, params: Any = None) -> dict:
        self._ids += 1
        await self.send(msg(self._ids, method, params))
        return await self.response(self._ids)

    async def initialize(self, options: dict | None = None) -> dict:
        init = dict(INIT, initializationOptions={**INIT["initializationOptions"], **(options or {})})
        result = await self.call("initialize", init)
        await self.send(msg(None, "initialized", {}))
        return result

    async def close(self) -> None:
        await self.ws.close()


class StdioServer(FrameClient):
    """``fimble lsp`` over stdio (asyncio subprocess), stderr in a file."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Any):
        assert proc.stdout is not None
        super().__init__(proc.stdout)
        self.proc, self.log = proc, log
        self._ids = 0

    @classmethod
    async def start(cls, *extra: str) -> StdioServer:
        log = tempfile.NamedTemporaryFile(prefix="fimble-rel-", suffix=".log", delete=False)
        proc = await asyncio.create_subprocess_exec(
            *SERVER_CMD,
            *extra,
            env=server_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            limit=256 << 20,
        )
        return cls(proc, log)

    def stderr(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def send_raw(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)

    async def stop(self) -> int | None:
        if self.proc.returncode is None:
            self.proc.kill()
        code = await self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
        return code
