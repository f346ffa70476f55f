"""``fimble serve``'s HTTP endpoint and websocket options under hostile or sloppy clients.

Each test is an attack from the audit (bench/reports/attacks-audit-2026-12-03.md), over real sockets to a real
daemon (embedded model, loopback, a token): pipelined requests, a request followed by garbage, an extra CRLF after a
body, huge numbers, deep nesting, bodies over the limit, options that fail validation on the websocket, 100,000 stop
strings, and a prompt that cannot fit the context. Before the fix each of the HTTP ones closed the connection with
no status and each websocket one left its request open. Assertions are on statuses, bodies and counters, never on
timings.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket

import pytest
from serve_helpers import running_daemon
from websockets.sync.client import connect

from engine.api import CompletionRequest, DecodeOptions
from engine.serve import protocol
from engine.serve.client import WSEngine

LIMIT_MB = 8  # --max-message-mb: the body limit too
COMPLETION = {"prompt": "def add(a, b):\n    ", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def daemon():
    yield from running_daemon("--max-message-mb", str(LIMIT_MB), "--engine-process", "off")


@pytest.fixture
def client(daemon):
    engine = WSEngine(daemon.url, daemon.token)
    yield engine
    engine.close()


def http_request(
    token: str,
    method: str = "GET",
    path: str = "/v1/models",
    body: dict | bytes | None = None,
    extra: tuple[str, ...] = (),
) -> bytes:
    data = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {token}", *extra]
    if not any(line.lower().startswith("transfer-encoding") for line in extra):
        lines.append(f"Content-Length: {len(data)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


class RawHTTP:
    """One TCP connection; responses read one by one (Content-Length, chunked, or to the end)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        self.buf = b""

    def __enter__(self) -> RawHTTP:
        return self

    def __exit__(self, *_exc) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise EOFError
        self.buf += data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status = int(self._line().split(b" ", 2)[1])
        headers: dict[str, str] = {}
        while line := self._line():
            name, _, value = line.partition(b":")
            headers[name.decode().strip().lower()] = value.decode().strip()
        if "content-length" in headers:
            return status, headers, self._take(int(headers["content-length"]))
        body = b""
        while size := int(self._line(), 16):  # chunked (the SSE stream)
            body += self._take(size)
            self._take(2)
        self._line()
        return status, headers, body

    def closed(self) -> bool:
        """The server has closed the connection and sent nothing more."""
        try:
            self._fill()
        except EOFError:
            return not self.buf
        except ConnectionResetError:
            return True
        return False


def error_of(status: int, body: bytes) -> dict:
    """The OpenAI-shaped error of a 4xx reply (asserting its shape)."""
    assert 400 <= status < 500
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"]
    return error


def test_pipelined_requests_are_answered_in_order(daemon):
    t = daemon.token
    with RawHTTP(daemon.port) as conn:
        conn.send(
            http_request(t)
            + http_request(t, "POST", "/v1/completions", COMPLETION)
            + http_request(t, "POST", "/v1/completions", b"{not json")
            + http_request(t, "GET", "/v1/nothing")
            + http_request(t)
        )
        replies = [conn.response() for _ in range(5)]
        assert [status for status, _, _ in replies] == [200, 200, 400, 404, 200]
        assert json.loads(replies[0][2])["object"] == "list"
        completion = json.loads(replies[1][2])
        assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] <= 4
        assert error_of(*replies[2][::2])["type"] == "invalid_request_error"
        assert error_of(*replies[3][::2])["type"] == "not_found_error"
        conn.send(http_request(t))  # errors did not end the connection
        assert conn.response()[0] == 200


def test_a_request_followed_by_garbage_is_answered_then_refused(daemon):
    with RawHTTP(daemon.port) as conn:
        conn.send(http_request(daemon.token) + b"\x00\x01 garbage that is no request line\r\n\r\n")
        assert conn.response()[0] == 200
        status, headers, body = conn.response()
        assert status == 400 and headers["connection"] == "close"
        error_of(status, body)
        assert conn.closed()


def test_empty_lines_after_a_body_are_skipped(daemon):
    t = daemon.token
    with RawHTTP(daemon.port) as conn:
        conn.send(http_request(t, "POST", "/v1/completions", COMPLETION) + b"\r\n")  # one CRLF too many
        assert conn.response()[0] == 200
        conn.send(http_request(t))  # the next request on the same connection
        assert conn.response()[0] == 200
        conn.send(b"\r\n\r\n" + http_request(t) + b"\r\n" + http_request(t))  # and in one write with two more
        assert [conn.response()[0] for _ in range(2)] == [200, 200]


@pytest.mark.parametrize(
    "field,literal",
    [
        ("max_tokens", "1" + "0" * 400),  # 10**400: an OverflowError met it before
        ("max_tokens", "-" + "9" * 5000),  # past Python's int-to-str digit limit
        ("temperature", "1e400"),  # parses as inf
        ("temperature", "NaN"),
        ("top_p", "-Infinity"),
        ("max_tokens", "1e300"),  # finite, out of range
        ("seed", str(2**64)),
    ],
)
def test_huge_and_non_finite_numbers_are_400(daemon, field, literal):
    body = b'{"prompt": "x", "%s": %s}' % (field.encode(), literal.encode())
    with RawHTTP(daemon.port) as conn:
        conn.send(http_request(daemon.token, "POST", "/v1/completions", body))
        status, _, reply = conn.response()
        message = error_of(status, reply)["message"]
        assert status == 400 and "0" * 30 not in message and "9" * 30 not in message  # the literal is not echoed
        conn.send(http_request(daemon.token))
        assert conn.response()[0] == 200  # the connection serves on


@pytest.mark.parametrize("depth", [100_000, 20])
def test_deep_nesting_is_400(daemon, depth):
    body = b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
    with RawHTTP(daemon.port) as conn:
        conn.send(http_request(daemon.token, "POST", "/v1/completions", body))
        status, _, reply = conn.response()
        assert status == 400 and "JSON" in error_of(status, reply)["message"]
        conn.send(http_request(daemon.token))
        assert conn.response()[0] == 200


def test_bodies_over_the_limit_are_413_and_the_connection_closes(daemon):
    """Answered before the body is read, with ``Connection: close``: the body is drained (so the client reads
    the answer, not a reset) and the connection ends; a request pipelined behind it is not answered (HTTP has
    clients retry those on a new connection)."""
    big = b'{"prompt": "' + b"x" * (LIMIT_MB << 20) + b'"}'
    for request in (
        http_request(daemon.token, "POST", "/v1/completions", big),
        http_request(
            daemon.token,
            "POST",
            "/v1/completions",
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big),
            extra=("Transfer-Encoding: chunked",),
        ),
    ):
        with RawHTTP(daemon.port) as conn:
            conn.send(request + http_request(daemon.token))
            status, headers, body = conn.response()
            assert status == 413 and headers["connection"] == "close"
            error_of(status, body)
            assert conn.closed()
    with RawHTTP(daemon.port) as conn:  # the daemon serves on
        conn.send(http_request(daemon.token))
        assert conn.response()[0] == 200


def test_malformed_heads_get_a_json_4xx(daemon):
    cases = [
        (http_request(daemon.token, extra=("X-Big: " + "a" * (20 << 10),)), 431),
        (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: nope\r\n\r\n", 400),
        (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nbad header line\r\n\r\n", 400),
    ]
    for request, code in cases:
        with RawHTTP(daemon.port) as conn:
            conn.send(request)
            status, _, body = conn.response()
            assert status == code
            error_of(status, body)
            assert conn.closed()
    assert "Traceback" not in daemon.stderr()


def test_lone_surrogates_are_400(daemon):
    with RawHTTP(daemon.port) as conn:
        conn.send(http_request(daemon.token, "POST", "/v1/completions", b'{"prompt": "x\\ud800"}'))
        status, _, body = conn.response()
        assert status == 400 and error_of(status, body)["param"] == "prompt"


def test_a_kept_alive_connection_serves_completions_and_streams(daemon):
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
    headers = {"Authorization": f"Bearer {daemon.token}", "Content-Type": "application/json"}
    try:
        texts = []
        for stream in (False, True, False):
            conn.request("POST", "/v1/completions", json.dumps(dict(COMPLETION, stream=stream)), headers)
            resp = conn.getresponse()
            body = resp.read().decode()
            assert resp.status == 200
            if stream:
                events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                texts.append("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]))
            else:
                texts.append(json.loads(body)["choices"][0]["text"])
        assert texts[0] == texts[1] == texts[2]  # greedy: the same text each way, on one connection
    finally:
        conn.close()


def test_fimbles_remote_client_reuses_its_connections(daemon, client):
    """engine/remote.py (``fimble lsp --engine openai+URL``) keeps connections alive: they now stay open."""
    from engine.remote import RemoteEngine, RemoteSpec

    expected = client.submit(CompletionRequest(COMPLETION["prompt"], "", document_id="r")).collect()
    remote = RemoteEngine(RemoteSpec("openai", f"http://127.0.0.1:{daemon.port}/v1", token_file=daemon.token_file))
    try:
        for _ in range(3):
            stream = remote.submit(CompletionRequest(COMPLETION["prompt"], "", document_id="r"))
            assert stream.collect() == expected
        counters = remote.counters()
        assert counters["errors"] == 0 and counters["reused_connections"] >= 2
    finally:
        remote.close()


@contextlib.contextmanager
def _ws(daemon):
    with connect(daemon.url, additional_headers={"Authorization": f"Bearer {daemon.token}"}) as ws:
        ws.send(protocol.pack(protocol.hello()))
        assert protocol.unpack(ws.recv(timeout=30))["op"] == "ready"
        yield ws


@pytest.mark.parametrize(
    "options,reason",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"drafter": "bogus"}, "drafter"),
        ({"stop": ["x"] * 100_000}, "stop"),
        ({"gamma": -1}, "gamma"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_websocket_options_that_fail_validation_end_the_request(daemon, options, reason):
    with _ws(daemon) as ws:
        ws.send(protocol.pack({"op": "submit", "id": 5, "request": {"prefix": "def f(", "options": options}}))
        reply = protocol.unpack(ws.recv(timeout=60))
        assert reply["op"] == "delta" and reply["id"] == 5, reply
        delta = reply["delta"]
        assert delta["finished"] and delta["finish_reason"] == "error" and reason in delta["error"]
        assert "could not be handled" not in delta["error"]
        ws.send(protocol.pack({"op": "ping", "id": 6}))  # the session serves on
        assert protocol.unpack(ws.recv(timeout=30)) == {"op": "pong", "id": 6}


def long_code(chars: int) -> str:
    """Many short lines of code: what a real oversized file looks like."""
    line = "    total = compute(value, other) + 1  # keep going\n"
    return ("def f(value, other):\n" + line * (chars // len(line) + 1))[:chars]


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenised(daemon, client):
    before = client.counters()
    body = {"prompt": long_code(3_900_000), "max_tokens": 8}
    with RawHTTP(daemon.port) as conn:
        conn.send(http_request(daemon.token, "POST", "/v1/completions", body))
        status, _, reply = conn.response()
    error = error_of(status, reply)
    assert status == 400 and "does not fit" in error["message"] and "total = compute" not in error["message"]
    # Over the websocket too, one line of 600,000 characters (no line piece to count: refused by its length).
    stream = client.submit(CompletionRequest("x = [" + "1, " * 200_000, "", document_id="one-line"))
    with pytest.raises(Exception, match="does not fit"):
        stream.collect()
    after = client.counters()
    assert after["sched_refused_unfit"] == before["sched_refused_unfit"] + 2


def test_a_prompt_that_may_be_truncated_is_not_refused(client):
    before = client.counters()
    request = CompletionRequest(long_code(60_000), "", options=DecodeOptions(max_tokens=4), document_id="t.py")
    request.truncate = True
    stream = client.submit(request)
    stream.collect()
    assert stream.result is not None and stream.result.finish_reason != "error"
    assert client.counters()["sched_refused_unfit"] == before["sched_refused_unfit"]
