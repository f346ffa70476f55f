"""``fimble serve`` over real sockets: handshake, tokens, sessions, disconnects, the OpenAI endpoint.

One daemon (conftest.py) with the embedded models; a token is required on it, so every test
that connects passes one. Assertions are on outputs and counters, never on timings.
"""

from __future__ import annotations

import http.client
import json

import pytest
from serve_helpers import post, running_daemon, sse_events, wait_for
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from engine.api import CompletionRequest, DecodeOptions
from engine.errors import FimbleError
from engine.serve import protocol
from engine.serve.client import WSEngine

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


def request(doc: str, max_tokens: int = 12, **opts) -> CompletionRequest:
    return CompletionRequest(PREFIX, SUFFIX, options=DecodeOptions(max_tokens=max_tokens, **opts), document_id=doc)


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def daemon(request):
    # Every test against both layouts: the decode loop in the daemon's process (the CPU default) and in a child
    # process behind engine/serve/engine_process.py (the CUDA default).
    mode = "on" if request.param == "engine-process" else "off"
    yield from running_daemon("--max-message-mb", "1", "--engine-process", mode)  # small: the size-limit test


@pytest.fixture
def client(daemon):
    engine = WSEngine(daemon.url, daemon.token)
    yield engine
    engine.close()


def test_completion_over_websocket(daemon, client):
    stream = client.submit(request("file:///a.py"))
    text = stream.collect()
    assert text and stream.result is not None and stream.result.text == text
    assert client.info()["scheduler"] == "batched" and client.info()["model"] == "fimble-target"


def test_missing_or_wrong_token_is_refused(daemon):
    for token in (None, "wrong-token-0123456789"):
        with pytest.raises(FimbleError, match="needs a valid token"):
            WSEngine(daemon.url, token, startup_timeout=5)
        with pytest.raises(InvalidStatus) as info:
            connect(daemon.url, additional_headers={"Authorization": f"Bearer {token}"} if token else None)
        assert info.value.response.status_code == 401
        status, _, body = post(daemon.port, {"prompt": "x", "max_tokens": 1}, token)
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    assert daemon.token not in daemon.stderr()


def test_handshake_version_mismatch_is_refused(daemon):
    auth = {"Authorization": f"Bearer {daemon.token}"}
    for first in ({"op": "hello", "version": protocol.PROTOCOL_VERSION + 1}, {"op": "submit", "id": 1}):
        with connect(daemon.url, additional_headers=auth) as ws:
            ws.send(protocol.pack(first))
            reply = protocol.unpack(ws.recv(timeout=30))
            assert reply["op"] == "refused"
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == protocol.REFUSED_CLOSE_CODE
    assert "version mismatch" in protocol.check_hello({"op": "hello", "version": 99})
    with pytest.raises(FimbleError, match="refused this client: protocol version mismatch"):
        _old_client(daemon)


def _old_client(daemon) -> None:
    """A client of another protocol version, through WSEngine's own error path."""
    original = protocol.PROTOCOL_VERSION
    protocol.PROTOCOL_VERSION = original + 1  # the hello WSEngine sends reads it
    try:
        WSEngine(daemon.url, daemon.token, startup_timeout=5)
    finally:
        protocol.PROTOCOL_VERSION = original


def test_bad_messages_are_answered_not_fatal(daemon, client):
    auth = {"Authorization": f"Bearer {daemon.token}"}
    with connect(daemon.url, additional_headers=auth) as ws:
        ws.send(protocol.pack(protocol.hello()))
        assert protocol.unpack(ws.recv(timeout=30))["op"] == "ready"
        ws.send(b"\xc1 not msgpack")
        assert protocol.unpack(ws.recv(timeout=30))["op"] == "error"
        ws.send(
            protocol.pack({"op": "submit", "id": 7, "request": {"prefix": "x" * 10, "options": {"max_tokens": 10**6}}})
        )
        reply = protocol.unpack(ws.recv(timeout=30))
        assert reply["op"] == "delta" and reply["delta"]["finish_reason"] == "error"
        assert "max_tokens" in reply["delta"]["error"] and "x" * 10 not in reply["delta"]["error"]
        ws.send(protocol.pack({"op": "ping", "id": 8}))
        assert protocol.unpack(ws.recv(timeout=30)) == {"op": "pong", "id": 8}


def test_sessions_do_not_share_documents(daemon, client):
    other = WSEngine(daemon.url, daemon.token)
    try:
        alone = client.submit(request("file:///same.py")).collect()
        # Another session's document of the same name with other text: its own cache, its own answer.
        req = CompletionRequest(
            "class Stack:\n    def push(self, item):\n        ",
            "\n",
            options=DecodeOptions(max_tokens=12),
            document_id="file:///same.py",
        )
        theirs = other.submit(req).collect()
        again = client.submit(request("file:///same.py")).collect()
        assert again == alone and theirs != alone
        assert client.info()["session"] != other.info()["session"]
    finally:
        other.close()


def test_disconnect_mid_stream_frees_the_sequence(daemon, client):
    before = client.counters()
    leaver = WSEngine(daemon.url, daemon.token)
    # A prompt the embedded model continues for its whole budget (checked: 300 of 300 tokens).
    stream = leaver.submit(
        CompletionRequest(
            "# " + "a long comment line\n# " * 20,
            "",
            document_id="file:///gone.py",
            options=DecodeOptions(max_tokens=2000, drafter="none"),
        )
    )
    wait_for(lambda: stream.text)  # decoding has begun
    assert client.counters()["sched_active"] >= 1
    leaver.kill()  # the connection drops mid-stream, without a goodbye

    def freed() -> dict | None:
        c = client.counters()
        return (
            c
            if c["sched_active"] == 0
            and c["documents_freed"] > before["documents_freed"]
            and c["kv_documents"] <= before["kv_documents"]
            else None
        )

    after = wait_for(freed)
    assert after["disconnect_cancels"] == before["disconnect_cancels"] + 1
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["sessions_open"] == before["sessions_open"]
    assert after["tokens_generated"] - before["tokens_generated"] < 2000  # it stopped long before its budget


def test_openai_completion_matches_the_engine(daemon, client):
    expected = client.submit(request("file:///openai.py", max_tokens=10)).collect()
    body = {"model": "fimble", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 10, "temperature": 0}
    status, headers, text = post(daemon.port, body, daemon.token)
    assert status == 200 and headers["Content-Type"] == "application/json"
    reply = json.loads(text)
    assert reply["object"] == "text_completion" and reply["model"] == "fimble"
    choice = reply["choices"][0]
    assert choice["text"] == expected and choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    assert reply["usage"]["completion_tokens"] <= 10 and reply["usage"]["prompt_tokens"] > 0

    status, headers, text = post(daemon.port, dict(body, stream=True), daemon.token)
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_openai_errors_are_json_without_tracebacks(daemon):
    cases = [
        (b"{not json", 400),
        (json.dumps({"prompt": 5}).encode(), 400),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400),
        (json.dumps({"prompt": "x", "n": 2}).encode(), 400),
    ]
    for body, code in cases:
        status, _, text = post(daemon.port, body, daemon.token)
        err = json.loads(text)["error"]
        assert status == code and err["type"] == "invalid_request_error" and "Traceback" not in text
    status, _, text = post(daemon.port, {"prompt": "x"}, daemon.token, path="/v1/nothing")
    assert status == 404 and "error" in json.loads(text)
    assert "Traceback" not in daemon.stderr()


def test_browser_origins_and_rebound_hosts_are_refused(daemon):
    auth = {"Authorization": f"Bearer {daemon.token}"}
    with pytest.raises(InvalidStatus) as info:  # a web page's websocket
        connect(daemon.url, additional_headers={**auth, "Origin": "http://evil.example"})
    assert info.value.response.status_code == 403
    with pytest.raises(InvalidStatus) as info:  # a second Host header: refused, not a server error
        connect(daemon.url, additional_headers={**auth, "Host": "evil.example"})
    assert info.value.response.status_code == 400
    for extra in ({"Origin": "http://evil.example"}, {"Host": "evil.example:80"}):  # DNS rebinding
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "x"}),
            {**auth, **extra, "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 403 and "error" in json.loads(resp.read())
        conn.close()


def test_messages_over_the_size_limit_are_refused(daemon, client):
    big = "x" * (1 << 20)  # over --max-message-mb 1 once framed
    auth = {"Authorization": f"Bearer {daemon.token}"}
    with connect(daemon.url, additional_headers=auth, max_size=None) as ws:
        ws.send(protocol.pack(protocol.hello()))
        assert protocol.unpack(ws.recv(timeout=30))["op"] == "ready"
        ws.send(protocol.pack({"op": "submit", "id": 1, "request": {"prefix": big}}))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big
    status, _, text = post(daemon.port, {"prompt": big}, daemon.token)
    assert status == 413 and "error" in json.loads(text)
    assert client.submit(request("file:///after.py")).collect()  # the daemon serves on


def test_backlogged_deltas_of_one_request_are_sent_as_one():
    """The writer merges a request's consecutive deltas queued behind a slow socket; ends and errors stay apart."""
    from engine.serve.daemon import coalesce_deltas

    def delta(rid, text, finished=False, error=None):
        return {"op": "delta", "id": rid, "delta": {"text": text, "finished": finished, "error": error}}

    msgs = [
        delta(1, "a"),
        delta(1, "b"),
        delta(2, "x"),
        delta(1, "c"),
        delta(1, "d", finished=True),
        delta(1, "late"),  # after a finished delta: never merged into it
        {"op": "pong", "id": 9},
        delta(3, "e", error="boom"),
        delta(3, "f"),
    ]
    out = coalesce_deltas(msgs)
    assert [(m.get("id"), m.get("delta", {}).get("text")) for m in out] == [
        (1, "ab"), (2, "x"), (1, "cd"), (1, "late"), (9, None), (3, "e"), (3, "f")
    ]  # fmt: skip
    assert out[2]["delta"]["finished"] is True
    assert "".join(m["delta"]["text"] for m in out if m.get("id") == 1) == "abcdlate"  # nothing lost or reordered


def test_a_dead_engine_process_ends_requests_and_the_daemon():
    """The child that decodes is killed mid-stream: the open request ends with an error (no hang), the daemon
    exits with one line saying why, not a traceback."""
    import os
    import signal

    from serve_helpers import ServeProcess

    proc = ServeProcess("--engine-process", "on")
    try:
        engine = WSEngine(proc.url, proc.token)
        child = engine.info()["engine_process"]
        assert child != proc.proc.pid
        stream = engine.submit(request("file:///dies.py", max_tokens=2000, drafter="none"))
        wait_for(lambda: stream.text)  # decoding has begun in the child
        os.kill(child, signal.SIGKILL)
        with pytest.raises(FimbleError, match="killed by signal 9"):  # the stream's error, raised by its reader
            stream.collect()
        assert proc.proc.wait(60) != 0
        err = proc.stderr()
        assert "engine process was killed by signal 9" in err and "Traceback" not in err
        engine.close()
    finally:
        proc.stop()
