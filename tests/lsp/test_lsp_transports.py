"""TCP and WebSocket transports (loopback), text frames over WS, and malformed params answered over the wire."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lsp_helpers import SERVER_CMD, SERVER_ENV

TOKEN = "transports-test-token-0123456789"  # every listener requires one (engine/auth.py): given in a file
INIT = {
    "processId": None,
    "rootUri": None,
    "capabilities": {"general": {"positionEncodings": ["utf-32", "utf-16"]}},
    "initializationOptions": {"preload": False, "token": TOKEN},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(flag: str, port: int, tmp_path: Path) -> subprocess.Popen:
    (tmp_path / "token").write_text(TOKEN + "\n")
    return subprocess.Popen(
        SERVER_CMD + [flag, f"127.0.0.1:{port}", "--token-file", str(tmp_path / "token")],
        env=SERVER_ENV,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _msg(i: int | None, method: str, params: object) -> dict:
    m = {"jsonrpc": "2.0", "method": method, "params": params}
    if i is not None:
        m["id"] = i
    return m


class TcpClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int, timeout: float = 20.0) -> TcpClient:
        deadline = time.perf_counter() + timeout
        while True:
            try:
                return cls(*await asyncio.open_connection("127.0.0.1", port))
            except OSError:
                if time.perf_counter() > deadline:
                    raise
                await asyncio.sleep(0.1)

    def send(self, msg: dict) -> None:
        body = json.dumps(msg).encode()
        self.writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    async def response(self, i: int) -> dict:
        while True:
            length = 0
            while (line := await asyncio.wait_for(self.reader.readline(), 30)) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            msg = json.loads(await self.reader.readexactly(length))
            if msg.get("id") == i and "method" not in msg:
                return msg


async def test_tcp_initialize_bad_params_and_exit(tmp_path):
    port = _free_port()
    proc = _spawn("--tcp", port, tmp_path)
    try:
        c = await TcpClient.connect(port)
        c.send(_msg(1, "initialize", INIT))
        caps = (await c.response(1))["result"]["capabilities"]
        assert caps["positionEncoding"] == "utf-32"
        assert caps["inlineCompletionProvider"] is not None
        assert caps["textDocumentSync"]["change"] == 2  # incremental
        assert "fimble.acceptCompletion" in caps["executeCommandProvider"]["commands"]
        c.send(_msg(None, "initialized", {}))
        # Params that don't fit the LSP types: an InvalidParams answer, not silence.
        c.send(
            _msg(
                2,
                "textDocument/inlineCompletion",
                {
                    "textDocument": {"uri": "file:///x.py"},
                    "position": {"line": -1, "character": "x"},
                    "context": {"triggerKind": 1},
                },
            )
        )
        assert (await c.response(2))["error"]["code"] == -32602
        c.send(_msg(3, "no/such/method", {}))
        assert (await c.response(3))["error"]["code"] == -32601
        c.send(_msg(4, "fimble/stats", None))
        assert "latency_ms" in (await c.response(4))["result"]
        c.send(_msg(5, "shutdown", None))
        await c.response(5)
        c.send(_msg(None, "exit", None))
        # exit ends this connection's session; the server listens on for the next client.
        assert await asyncio.wait_for(c.reader.read(), 30) == b""
        d = await TcpClient.connect(port)
        d.send(_msg(1, "initialize", INIT))
        assert "capabilities" in (await d.response(1))["result"]
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


async def test_websocket_uses_text_frames(tmp_path):
    from websockets.asyncio.client import connect

    port = _free_port()
    proc = _spawn("--ws", port, tmp_path)
    try:
        deadline = time.perf_counter() + 20
        while True:
            try:
                ws = await connect(f"ws://127.0.0.1:{port}", additional_headers={"Authorization": f"Bearer {TOKEN}"})
                break
            except OSError:
                assert time.perf_counter() < deadline
                await asyncio.sleep(0.1)
        async with ws:
            await ws.send(json.dumps(_msg(1, "initialize", INIT)))
            frame = await asyncio.wait_for(ws.recv(), 30)
            assert isinstance(frame, str)  # a text frame: browsers' WebSocket clients need these
            assert json.loads(frame)["result"]["capabilities"]["positionEncoding"] == "utf-32"
            await ws.send(json.dumps(_msg(2, "shutdown", None)))
            assert isinstance(await asyncio.wait_for(ws.recv(), 30), str)
            await ws.send(json.dumps(_msg(None, "exit", None)))
            await asyncio.wait_for(ws.wait_closed(), 30)  # exit closes this session's connection
        assert proc.poll() is None  # and the server listens on
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:99999"])
def test_bad_address_is_one_line_error(address):
    r = subprocess.run(
        SERVER_CMD + ["--tcp", address],
        env=SERVER_ENV,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2
    assert r.stderr.startswith("fimble: ") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr


def test_cli_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "lsp_server", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "fimble" in r.stdout
    # No benchmark behind the product's command line (they run as python -m bench.NAME in a checkout).
    r = subprocess.run(
        [sys.executable, "-m", "lsp_server", "bench-lsp", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "invalid choice: 'bench-lsp'" in r.stderr
