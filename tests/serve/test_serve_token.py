"""``fimble serve`` requires a token by default, on loopback too, and this machine's
clients find it in the daemon's token file.

A web page can POST text/plain to a loopback port, request long URLs and open a WebSocket from any
Origin; none of that may reach the engine: asserted with the daemon's counters (``sessions_total``,
``refused_token``, the engine's ``submitted``), read by a client that has the token. Assertions are on
statuses, bodies, counters and files, never on timings.
"""

from __future__ import annotations

import json
import socket
import stat
import sys
from pathlib import Path

import pytest
from serve_helpers import ServeProcess, post

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from rel_helpers import StdioServer, did_open  # noqa: E402
from websockets.exceptions import InvalidMessage, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from engine.api import CompletionRequest, DecodeOptions  # noqa: E402
from engine.errors import FimbleError  # noqa: E402
from engine.remote import RemoteEngine, RemoteSpec  # noqa: E402
from engine.serve.client import WSEngine, serve_spec  # noqa: E402

EVIL = "http://evil.example"
LSP_INIT = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"capabilities":{}}}'


@pytest.fixture(scope="module")
def daemon():
    proc = ServeProcess(token="default")  # no token flag: the daemon makes one
    try:
        yield proc
    finally:
        proc.stop()


def raw(port: int, data: bytes) -> bytes:
    """Everything the daemon answers to ``data`` before it closes (or stops answering)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
                if b"\r\n\r\n" in got and b"Content-Length" in got:
                    head, _, body = got.partition(b"\r\n\r\n")
                    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                    if len(body) >= length:
                        break
        except (ConnectionResetError, TimeoutError):
            pass
    return got


def status_and_json(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def ws_refusal(url: str, **kwargs) -> int | None:
    try:
        connect(url, **kwargs).close()
    except InvalidStatus as exc:
        return exc.response.status_code
    except (InvalidMessage, OSError):
        return None
    raise AssertionError(f"handshake accepted: {kwargs}")


def test_the_token_is_printed_and_left_in_a_private_file(daemon):
    err = daemon.stderr()
    assert daemon.token and len(daemon.token) >= 32 and "(token required)" in err
    path = Path(daemon.runtime_dir) / f"port-{daemon.port}.token"
    assert f"fimble: token file: {path} " in err
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == daemon.token + "\n"


def test_browser_requests_without_the_token_never_reach_the_engine(daemon):
    probe = WSEngine(daemon.url, daemon.token)
    try:
        before = probe.counters()
        # fetch() without the token: 401 with a JSON body.
        status, _, body = post(daemon.port, {"prompt": "def f(", "max_tokens": 2}, None)
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        # A form POST / no-cors fetch: text/plain, a body of LSP frames, with and without the page's Origin.
        lsp = b"Content-Length: %d\r\n\r\n" % len(LSP_INIT) + LSP_INIT
        for origin, expected in ((None, 401), (EVIL, 403)):
            data = (
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                + (b"Origin: %s\r\n" % origin.encode() if origin else b"")
                + b"Content-Length: %d\r\n\r\n" % len(lsp)
                + lsp
            )
            code, err = status_and_json(raw(daemon.port, data))
            assert code == expected and "error" in err
        # A very long URL: a JSON 4xx, never served.
        code, err = status_and_json(
            raw(daemon.port, b"GET /v1/models?" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        )
        assert 400 <= code < 500 and "error" in err
        # WebSockets: none without the token; a page's (its Origin) not even with it.
        assert ws_refusal(daemon.url) == 401
        assert ws_refusal(daemon.url, origin=EVIL) in (401, 403)
        assert (
            ws_refusal(daemon.url, origin=EVIL, additional_headers={"Authorization": f"Bearer {daemon.token}"}) == 403
        )
        assert ws_refusal(f"{daemon.url}/?token={daemon.token}") == 401  # the daemon takes the header only
        after = probe.counters()
        assert after["sessions_total"] == before["sessions_total"]  # no session was opened
        assert after["submitted"] == before["submitted"]  # and nothing reached the engine
        assert after["refused_token"] - before["refused_token"] >= 4
    finally:
        probe.close()
    # With the token, the same endpoint answers.
    status, _, body = post(daemon.port, {"prompt": "def f(", "max_tokens": 2}, daemon.token)
    assert status == 200 and json.loads(body)["choices"]


def test_local_clients_find_the_token_file(daemon, monkeypatch):
    monkeypatch.setenv("FIMBLE_RUNTIME_DIR", daemon.runtime_dir)
    engine = serve_spec(daemon.url, None, 30.0, False).open()  # `fimble lsp --engine ws://...`, no token given
    try:
        assert engine.counters()["sessions_total"] >= 1
    finally:
        engine.close()
    remote = RemoteEngine(RemoteSpec("openai", f"http://127.0.0.1:{daemon.port}/v1", model="fimble"))
    assert remote.submit(CompletionRequest("def f(", "", DecodeOptions(max_tokens=2))).collect() is not None
    assert remote.counters()["errors"] == 0
    monkeypatch.setenv("FIMBLE_RUNTIME_DIR", str(Path(daemon.dir) / "elsewhere"))  # no file there: refused
    with pytest.raises(FimbleError, match="needs a valid token"):
        serve_spec(daemon.url, None, 5.0, False).open()


async def test_fimble_lsp_engine_ws_finds_the_token_file(daemon, monkeypatch):
    monkeypatch.setenv("FIMBLE_RUNTIME_DIR", daemon.runtime_dir)  # the LSP server process inherits it
    server = await StdioServer.start("--engine", daemon.url)
    try:
        await server.initialize({"preload": True, "prewarm": False, "maxTokens": 4, "maxLines": 1})
        text = "def add(a, b):\n    return a"
        server.send(did_open("file:///t.py", text))
        r = await server.call(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": "file:///t.py"},
                "position": {"line": 1, "character": 12},
                "context": {"triggerKind": 1},
            },
        )
        assert "result" in r, r
        stats = (await server.call("fimble/stats"))["result"]
        assert stats["engine"]["state"] == "ready", stats["engine"]
    finally:
        await server.stop()


def test_the_token_file_goes_at_exit_and_no_token_serves_loopback():
    own = ServeProcess(token="default")
    path = Path(own.runtime_dir) / f"port-{own.port}.token"
    assert path.is_file()
    own.stop()  # SIGTERM: a clean exit
    assert own.proc.returncode == 0 and not path.exists()
    free = ServeProcess(token="none")
    try:
        assert "WARNING: no token (--no-token)" in free.stderr() and "fimble: token" not in free.stderr()
        assert not Path(free.runtime_dir).exists() or not list(Path(free.runtime_dir).iterdir())
        status, _, body = post(free.port, {"prompt": "def f(", "max_tokens": 2}, None)
        assert status == 200
        assert ws_refusal(free.url, origin=EVIL) == 403  # web pages still cannot
    finally:
        free.stop()
