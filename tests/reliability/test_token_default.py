"""A token by default on loopback too: ``fimble lsp --tcp/--ws`` over real sockets.

Threat: any web page the user has open can send requests to a loopback port (fetch/XHR and form POSTs
with text/plain bodies, long URLs, a WebSocket from any Origin), and any local user can connect.
So a listener makes a random token at start, prints it, leaves it in a 0600 file (removed at exit),
and nothing without it reaches a session: asserted through the listener's own count of sessions
(fimble/stats ``server.sessionsOpened``), read by the one client that has the token. ``--no-token``
opts out on loopback only. Assertions are on answers, counters and files, never on timings.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest
from rel_helpers import INIT, SERVER_CMD, Listener, TcpClient, WsClient, frame, msg, server_env
from websockets.exceptions import InvalidMessage, InvalidStatus

from engine import auth

EVIL = "http://evil.example"


def _initialize(token: str | None = None) -> dict:
    opts = dict(INIT["initializationOptions"], **({"token": token} if token else {}))
    return msg(1, "initialize", dict(INIT, initializationOptions=opts))


async def _closed_without_a_byte(c: TcpClient) -> bool:
    try:
        return await asyncio.wait_for(c.reader.read(1), 30) == b""
    except ConnectionResetError:
        return True


async def _ws_status(port: int, **kwargs) -> int | None:
    """The handshake's refusal status (None: closed without an answer); a handshake that succeeds fails the test."""
    try:
        c = await WsClient.connect(port, **kwargs)
    except InvalidStatus as refused:
        return refused.response.status_code
    except (InvalidMessage, ConnectionError, EOFError):
        return None
    await c.close()
    raise AssertionError(f"handshake accepted: {kwargs}")


async def _raw_http(port: int, data: bytes) -> bytes:
    """What a loopback port answers to ``data`` (a browser's request), up to its close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), 30)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


def _browser_post(path: str, body: bytes, origin: str | None = EVIL) -> bytes:
    """A form POST or a no-cors fetch from a web page: text/plain, any body (here: LSP frames)."""
    return (
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain;charset=UTF-8\r\n" % path.encode()
        + (b"Origin: %s\r\n" % origin.encode() if origin else b"")
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


def _check_token_file(server: Listener) -> Path:
    path = server.token_file()
    assert path.parent == Path(server.runtime_dir) and path.name == f"port-{server.port}.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_text().splitlines()[0] == server.token()  # the printed token, on the first line
    return path


def _stop(server: Listener, sig: int, status: int) -> None:
    server.proc.send_signal(sig)
    assert server.proc.wait(60) == status
    assert "Traceback" not in server.stderr()


async def test_tcp_requires_the_token_on_loopback_and_browser_requests_never_reach_a_session():
    server = Listener("--tcp", no_token=False)
    try:
        assert "(token required)" in server.stderr()
        path = _check_token_file(server)
        token = server.token()
        lsp = frame(_initialize())
        # A web page's requests: a text/plain POST whose body holds LSP frames, a very long URL, a WebSocket
        # upgrade. None opens with an LSP header: closed before a session exists, nothing answered.
        for data in (
            _browser_post("/", b"\r\n" + lsp),
            _browser_post("/" + "a" * 70_000, lsp),
            b"GET /?"
            + b"x" * 70_000
            + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: "
            + EVIL.encode()
            + b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        ):
            c = await TcpClient.connect(server.port)
            c.send_raw(data)
            assert await _closed_without_a_byte(c), data[:30]
        # An LSP client without the token, or with a wrong one, or the token elsewhere than initialize:
        # one error, then the connection closes.
        for first in (
            _initialize(),
            _initialize("wrong-" + token[6:]),
            msg(1, "fimble/stats"),
            msg(1, "initialize", dict(INIT, token=token)),
        ):
            c = await TcpClient.connect(server.port)
            c.send(first)
            assert (await c.response(1))["error"]["code"] == -32001
            assert await _closed_without_a_byte(c)
        c = await TcpClient.connect(server.port)
        c.send_raw(b"Content-Length: 3\r\n\r\n{x}")  # not even JSON: refused the same way
        assert (await c.next())["error"]["code"] == -32001
        # With the token: a session, and the only one that ever existed.
        ok = await TcpClient.connect(server.port)
        assert "capabilities" in (await ok.initialize({"token": token}))["result"]
        stats = (await ok.call("fimble/stats"))["result"]
        assert stats["server"]["sessionsOpened"] == 1 and stats["server"]["sessions"] == 1
        await ok.close()
        _stop(server, signal.SIGTERM, 0)
        assert not path.exists()  # removed at exit
    finally:
        server.close()


async def test_ws_requires_the_token_on_loopback_and_browser_handshakes_are_refused():
    server = Listener("--ws", no_token=False)
    try:
        path = _check_token_file(server)
        token = server.token()
        bearer = {"Authorization": f"Bearer {token}"}
        assert await _ws_status(server.port) == 401
        assert await _ws_status(server.port, additional_headers={"Authorization": "Bearer " + "x" * 43}) == 401
        # A web page's WebSocket: it sends its Origin and cannot set Authorization.
        assert await _ws_status(server.port, origin=EVIL) in (401, 403)
        assert await _ws_status(server.port, origin=EVIL, path="/?" + "a" * 70_000) in (None, 401, 403, 414)
        # Even a page that somehow had the token is refused for its Origin.
        assert await _ws_status(server.port, origin=EVIL, path=f"/?token={token}") == 403
        # A text/plain POST with LSP frames in its body, and a huge request line: no session, no LSP answer.
        for data in (_browser_post("/", frame(_initialize(token))), _browser_post("/" + "a" * 70_000, b"")):
            answer = await _raw_http(server.port, data)
            assert b"jsonrpc" not in answer and not answer.startswith(b"HTTP/1.1 101")
        # With the token (a header, or the URL's query for clients that cannot set headers): sessions.
        for kwargs in ({"additional_headers": bearer}, {"path": f"/?token={token}"}):
            c = await WsClient.connect(server.port, **kwargs)
            assert "capabilities" in (await c.initialize())["result"]
            stats = (await c.call("fimble/stats"))["result"]
            await c.close()
        assert stats["server"]["sessionsOpened"] == 2  # the two with the token, no other
        _stop(server, signal.SIGINT, 130)
        assert not path.exists()
    finally:
        server.close()


async def test_a_token_file_is_read_not_printed_and_published_for_local_clients(tmp_path):
    given = tmp_path / "token"
    given.write_text("a-token-of-the-users-own-0123456789\n")
    server = Listener("--tcp", "--token-file", str(given), no_token=False)
    try:
        assert "fimble: token: " not in server.stderr() and "a-token-of-the-users-own" not in server.stderr()
        path = server.token_file()
        assert path.read_text() == given.read_text() and stat.S_IMODE(path.stat().st_mode) == 0o600
        c = await TcpClient.connect(server.port)
        assert "capabilities" in (await c.initialize({"token": "a-token-of-the-users-own-0123456789"}))["result"]
        await c.close()
        _stop(server, signal.SIGTERM, 0)
        assert not path.exists() and given.exists()  # the copy goes; the user's own file stays
    finally:
        server.close()


@pytest.mark.parametrize("flag", ["--tcp", "--ws"])
async def test_no_token_serves_loopback_without_one(flag):
    server = Listener(flag)  # --no-token
    try:
        err = server.stderr()
        assert "WARNING: no token (--no-token)" in err and "(token required)" not in err
        assert "fimble: token" not in err and os.listdir(server.runtime_dir) == []  # no token, no file
        c = await (TcpClient.connect(server.port) if flag == "--tcp" else WsClient.connect(server.port))
        assert "capabilities" in (await c.initialize())["result"]
        await c.close()
        if flag == "--ws":  # web pages still cannot: their Origin is refused
            assert await _ws_status(server.port, origin=EVIL) == 403
    finally:
        server.close()


@pytest.mark.parametrize(
    "command",
    [
        ["lsp", "--tcp", "0.0.0.0:0", "--no-token"],
        ["lsp", "--ws", "0.0.0.0:0", "--no-token", "--allow-remote"],
        ["lsp", "--tcp", "127.0.0.1:0", "--no-token", "--require-token"],
        ["serve", "--host", "0.0.0.0", "--port", "0", "--no-token"],
        ["serve", "--host", "0.0.0.0", "--port", "0", "--no-token", "--allow-remote"],
    ],
    ids=["lsp-tcp", "lsp-ws-allow-remote", "lsp-contradiction", "serve", "serve-allow-remote"],
)
def test_no_token_is_refused_off_loopback(command):
    r = subprocess.run(
        [*SERVER_CMD[:-1], *command],
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--no-token" in r.stderr
    assert "Traceback" not in r.stderr


def test_token_files_are_private_and_only_their_own_listener_removes_them(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o755)
    monkeypatch.setenv("FIMBLE_RUNTIME_DIR", str(folder))
    old_umask = os.umask(0)  # a permissive umask must not widen the file
    try:
        path = auth.publish_token(4242, "first-listener-token-0123456789")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert auth.find_token("127.0.0.1", 4242) == auth.find_token("localhost", 4242) == "first-listener-token-0123456789"
    assert auth.find_token("192.0.2.1", 4242) is None  # another machine's port: no local file applies
    assert auth.find_token("127.0.0.1", 4243) is None
    auth.publish_token(4242, "second-listener-token-0123456789")  # the port's next listener
    auth.withdraw_token(path, "first-listener-token-0123456789")  # the first one's exit leaves it alone
    assert auth.find_token("127.0.0.1", 4242) == "second-listener-token-0123456789"
    auth.withdraw_token(path, "second-listener-token-0123456789")
    assert not path.exists() and [p.name for p in folder.iterdir()] == []  # no temporary file left either
    assert auth.find_token("127.0.0.1", 4242) is None
