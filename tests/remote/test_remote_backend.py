"""The remote backend (engine/remote.py) against HTTP servers over real sockets.

A small asyncio server written here (fake_servers.py) checks what is sent and every failure path
(down, 4xx/5xx, malformed events, silence, a dropped connection, cancellation). The real servers:
``fimble serve``'s own OpenAI endpoint (a subprocess), and llama.cpp's llama-server where it is
installed (env LLAMA_SERVER or /work/llbuild/build/bin/llama-server; skipped with the reason if not).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import DRAFT_DIR, TARGET_DIR
from fake_servers import FakeServer, Script

from engine.api import CompletionRequest, DecodeOptions
from engine.errors import FimbleError
from engine.fim import TEMPLATES
from engine.remote import RemoteEngine, RemoteSpec

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture
def server():
    srv = FakeServer()
    yield srv
    srv.close()


def _request(max_tokens: int = 32, **opts) -> CompletionRequest:
    return CompletionRequest(PREFIX, SUFFIX, DecodeOptions(max_tokens=max_tokens, **opts), document_id="s\x00doc")


def _wait(pred, timeout: float = 30.0) -> bool:
    """Poll for a condition (outcomes, not speed: the timeout only bounds a broken run)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


# -- what is sent ----------------------------------------------------------------------------------
def test_openai_streams_prompt_and_suffix_with_the_options_and_token(server, tmp_path):
    token = tmp_path / "token"
    token.write_text("sk-test-0123456789\n")
    engine = RemoteEngine(RemoteSpec("openai", server.url + "/v1", token_file=str(token)))
    assert engine.info()["model"] == "fake-model" and engine.info()["template"] == "server"
    stream = engine.submit(_request(max_tokens=20, temperature=0.2, top_p=0.9, stop=("\n\n",), seed=7))
    assert stream.collect() == "def add(a, b):\n    return a + b\n"
    assert stream.result.finish_reason == "length"
    req = server.requests[-1]
    assert req["path"] == "/v1/completions"
    assert req["headers"]["authorization"] == "Bearer sk-test-0123456789"
    body = req["body"]
    assert body["prompt"] == PREFIX and body["suffix"] == SUFFIX  # the model's template is unknown
    assert body["stream"] is True and body["model"] == "fake-model"
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["stop"], body["seed"]) == (
        20,
        0.2,
        0.9,
        ["\n\n"],
        7,
    )


def test_openai_with_a_known_template_gets_fimbles_fim_prompt(server):
    engine = RemoteEngine(RemoteSpec("openai", server.url + "/v1", model="Qwen2.5-Coder-1.5B"))
    engine.submit(_request()).collect()
    body = server.requests[-1]["body"]
    qwen = TEMPLATES["qwen2.5-coder"]
    assert body["prompt"] == qwen.build(PREFIX, SUFFIX) and "suffix" not in body
    assert body["model"] == "Qwen2.5-Coder-1.5B"
    assert len(body["stop"]) <= 4 and set(body["stop"]) <= set(qwen.stop_tokens)
    # --remote-template wins over the name
    engine = RemoteEngine(RemoteSpec("openai", server.url + "/v1", model="my-finetune", template="starcoder2"))
    engine.submit(_request()).collect()
    assert server.requests[-1]["body"]["prompt"] == TEMPLATES["starcoder2"].build(PREFIX, SUFFIX)


def test_llamacpp_infill_sends_prefix_suffix_and_cache_prompt(server):
    server.script = Script(finish="limit")
    engine = RemoteEngine(RemoteSpec("llamacpp", server.url))
    stream = engine.submit(_request(max_tokens=12))
    assert stream.collect() == "def add(a, b):\n    return a + b\n"
    assert stream.result.finish_reason == "length"
    req = server.requests[-1]
    assert req["path"] == "/infill"
    body = req["body"]
    assert (body["input_prefix"], body["input_suffix"]) == (PREFIX, SUFFIX)
    assert body["cache_prompt"] is True and body["stream"] is True and body["n_predict"] == 12


def test_stop_strings_and_line_limit_are_applied_here_too(server):
    # The fake server ignores "stop": the client cuts the text itself and ends the stream there.
    engine = RemoteEngine(RemoteSpec("openai", server.url + "/v1"))
    stream = engine.submit(_request(stop=("return",)))
    assert stream.collect() == "def add(a, b):\n    "
    assert stream.result.finish_reason == "stop"
    stream = engine.submit(_request(max_lines=1))
    assert stream.collect() == "def add(a, b):"
    assert server.requests[-1]["body"]["stop"] == ["\n"]  # a single line: the server is told to stop too


def test_a_server_that_ignores_stream_still_answers(server):
    server.script = Script(stream=False)
    engine = RemoteEngine(RemoteSpec("openai", server.url + "/v1"))
    assert engine.submit(_request()).collect() == "def add(a, b):\n    return a + b\n"


def test_keep_alive_connections_are_reused(server):
    engine = RemoteEngine(RemoteSpec("openai", server.url + "/v1", model="m"))
    for _ in range(3):
        engine.submit(_request()).collect()
    c = engine.counters()
    assert c["connections"] == 1 and c["reused_connections"] == 2 and c["completed"] == 3


# -- failures: one line each, never a traceback ------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAILURES = {
    "down": (None, r"connection refused \(is the server running\?\)"),
    "404": (Script(status=404, error_body="not here"), r"HTTP 404 Not Found \(check the URL's path"),
    "500": (Script(status=500), r"HTTP 500 Internal Server Error: model not found"),
    "401": (Script(status=401, error_body='{"error": "bad key"}'), r"HTTP 401 .*--engine-token-file.*bad key"),
    "malformed": (Script(malformed=True), r"sent a malformed event: '\{not json'"),
    "stalled": (Script(stall_after=1), r"no answer within 1 s"),
    "dropped": (Script(drop_after=1), r"closed the connection mid-answer|ended before its last event"),
    "no end": (Script(done=False, finish=None), r"ended before its last event"),
}


@pytest.mark.parametrize("case", list(FAILURES))
async def test_failures_are_one_line_errors(server, case):
    script, pattern = FAILURES[case]
    url = server.url if script is not None else f"http://127.0.0.1:{_free_port()}"
    if script is not None:
        server.script = script
    engine = RemoteEngine(RemoteSpec("openai", url + "/v1", model="m", timeout_s=1.0))
    stream = engine.submit(_request())
    with pytest.raises(FimbleError) as info:
        async for _ in stream:
            pass
    message = str(info.value)
    assert re.search(pattern, message), message
    assert message.startswith(f"remote engine {url}/v1: ") and "\n" not in message and "Traceback" not in message
    assert stream.result.finish_reason == "error"
    assert engine.counters()["errors"] == 1


def test_cancel_closes_the_http_stream(server):
    server.script = Script(chunks=["x = 1\n"] * 200, delay_s=0.05)
    engine = RemoteEngine(RemoteSpec("llamacpp", server.url))
    stream = engine.submit(_request(max_tokens=200))
    first = next(iter(stream))
    assert first.text
    stream.cancel()
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
    assert _wait(lambda: server.disconnects == 1), "the server did not see the connection close"
    assert engine.counters()["cancelled"] == 1


def test_https_verifies_the_certificate(tmp_path, monkeypatch):
    import ssl

    pytest.importorskip("cryptography", reason="cryptography makes the test certificate")
    from fake_servers import self_signed

    cert, key = self_signed(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    server = FakeServer(tls=ctx)
    try:
        # not trusted: a one-line error, nothing sent in clear
        engine = RemoteEngine(RemoteSpec("openai", server.url + "/v1", model="m"))
        with pytest.raises(FimbleError, match="TLS certificate not trusted"):
            engine.submit(_request()).collect()
        # trusted through the standard SSL_CERT_FILE: answers
        monkeypatch.setenv("SSL_CERT_FILE", cert)
        engine = RemoteEngine(RemoteSpec("openai", server.url + "/v1", model="m"))
        assert engine.submit(_request()).collect() == "def add(a, b):\n    return a + b\n"
    finally:
        server.close()


def test_plain_http_to_another_machine_is_refused_unless_asked():
    with pytest.raises(FimbleError, match="plain http to 10.0.0.7"):
        RemoteEngine(RemoteSpec("openai", "http://10.0.0.7:8000/v1", model="m"))
    RemoteEngine(RemoteSpec("openai", "http://10.0.0.7:8000/v1", model="m", allow_remote=True))  # no connection yet
    RemoteEngine(RemoteSpec("openai", "https://10.0.0.7:8000/v1", model="m"))


def test_cli_errors_are_one_line():
    cases = [
        (["--engine", "vllm://x"], "expected openai+http(s)://HOST:PORT/v1"),
        (["--engine", "openai+http://10.0.0.7:8000/v1"], "Use https, or pass --engine-allow-http"),
        (["--remote-model", "m"], "need --engine"),
        (["--engine", "openai+http://127.0.0.1:9/v1", "--remote-template", "nope"], "unknown FIM template 'nope'"),
    ]
    for args, expected in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "lsp_server", "lsp", *args],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )
        assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# -- the LSP server with a remote engine ------------------------------------------------------------------
async def test_lsp_answers_from_a_remote_engine(server):
    from reliability.rel_helpers import StdioServer, did_open

    server.script = Script(chunks=["return ", "a + b", "\n"], finish="stop")
    lsp = await StdioServer.start("--engine", f"openai+{server.url}/v1", "--remote-model", "m")
    try:
        await lsp.initialize({"preload": True})
        uri = "file:///tmp/fimble-remote/add.py"
        lsp.send(did_open(uri, PREFIX + SUFFIX))
        answer = await lsp.call(
            "textDocument/inlineCompletion",
            {"textDocument": {"uri": uri}, "position": {"line": 1, "character": 4}, "context": {"triggerKind": 1}},
        )
        items = answer["result"]["items"] if isinstance(answer["result"], dict) else answer["result"]
        assert items and items[0]["insertText"].startswith("return a + b"), answer
        sent = [r for r in server.requests if r["path"] == "/v1/completions"]
        assert sent and sent[-1]["body"]["prompt"].endswith("def add(a, b):\n    ")

        # The server fails: the editor is told once, in one line (not at every request), and again when it is back.
        async def complete_new_document(n: int) -> None:
            doc = f"file:///tmp/fimble-remote/add{n}.py"
            lsp.send(did_open(doc, PREFIX + SUFFIX))
            await lsp.call(
                "textDocument/inlineCompletion",
                {"textDocument": {"uri": doc}, "position": {"line": 1, "character": 4}, "context": {"triggerKind": 1}},
            )

        server.script = Script(status=500)
        for n in range(3):
            await complete_new_document(n)
        failed = len(server.requests)
        server.script = Script(chunks=["return ", "a + b", "\n"], finish="stop")
        await complete_new_document(3)

        def shown() -> list[str]:
            return [m["params"]["message"] for m in lsp.seen if m.get("method") == "window/showMessage"]

        end = time.monotonic() + 30
        while not any("answers again" in m for m in shown()) and time.monotonic() < end:
            try:
                await lsp.next(timeout=1)
            except TimeoutError:
                pass
        failing = [m for m in shown() if "HTTP 500" in m]
        assert failing == [f"fimble: remote engine {server.url}/v1: HTTP 500 Internal Server Error: model not found"]
        assert any("answers again" in m for m in shown())
        assert failed >= 4  # the three failing completions reached the server
    finally:
        await lsp.stop()


# An indentation-only line (the editor's auto-indent after Enter), one level too deep for the line that belongs there.
NESTED = "def f(x):\n    if x:\n        return False\n        \n    return None\n"
NESTED_CURSOR = {"line": 3, "character": 8}


async def _line_start_session(server, replace_start: bool):
    from reliability.rel_helpers import INIT, StdioServer

    lsp = await StdioServer.start("--engine", f"openai+{server.url}/v1", "--remote-model", "m")
    caps = {"experimental": {"fimble": {"completionDelta": True, "replaceStart": replace_start}}}
    await lsp.call("initialize", {**INIT, "capabilities": caps, "initializationOptions": {"preload": True}})
    lsp.send({"jsonrpc": "2.0", "method": "initialized", "params": {}})
    return lsp


async def _complete_nested(lsp, uri: str) -> tuple[dict, dict]:
    """(the inline item, the stream's done delta) at NESTED_CURSOR in a new document."""
    from reliability.rel_helpers import did_open

    lsp.send(did_open(uri, NESTED))
    answer = await lsp.call(
        "textDocument/inlineCompletion",
        {"textDocument": {"uri": uri}, "position": NESTED_CURSOR, "context": {"triggerKind": 1}},
    )
    items = answer["result"]["items"]
    assert items, answer

    def done() -> dict | None:
        return next(
            (
                m["params"]
                for m in lsp.seen
                if m.get("method") == "fimble/completionDelta" and m["params"]["uri"] == uri and m["params"]["done"]
            ),
            None,
        )

    end = time.monotonic() + 30
    while done() is None and time.monotonic() < end:
        await lsp.next(timeout=30)
    assert done() is not None
    return items[0], done()


def _last_prompt(server) -> str:
    """The prompt of the last /v1/completions request the fake server got."""
    return [r for r in server.requests if r["path"] == "/v1/completions"][-1]["body"]["prompt"]


async def test_an_indentation_only_line_is_decoded_from_its_start_and_may_dedent(server):
    """lsp_server/line_start.py: the model writes the line's indentation; a dedent replaces the editor's."""
    lsp = await _line_start_session(server, replace_start=True)
    try:
        server.script = Script(chunks=["    return", " True", "\n"], finish="stop")
        item, done = await _complete_nested(lsp, "file:///tmp/fimble-remote/dedent.py")
        prompt = _last_prompt(server)
        assert prompt.endswith("        return False\n"), prompt  # from the line's start: no indentation
        assert item["insertText"] == "    return True"
        assert item["range"] == {"start": {"line": 3, "character": 0}, "end": NESTED_CURSOR}
        assert done["text"].rstrip() == "    return True" and done["replaceStart"] == {"line": 3, "character": 0}
        assert done["position"] == NESTED_CURSOR and done["replaceEnd"] == NESTED_CURSOR

        # The model keeps the editor's indentation: answered at the cursor, as without this.
        server.script = Script(chunks=["        return", " True", "\n"], finish="stop")
        item, done = await _complete_nested(lsp, "file:///tmp/fimble-remote/same.py")
        assert item["insertText"] == "return True"
        assert item["range"] == {"start": NESTED_CURSOR, "end": NESTED_CURSOR}
        assert done["text"].rstrip() == "return True" and "replaceStart" not in done
        deltas = [m["params"] for m in lsp.seen if m.get("method") == "fimble/completionDelta"]
        assert all(not d["text"].startswith(" ") for d in deltas if d["uri"].endswith("same.py")), deltas
    finally:
        await lsp.stop()


async def test_a_client_that_cannot_show_a_dedent_gets_the_cursor_s_prompt(server):
    lsp = await _line_start_session(server, replace_start=False)
    try:
        server.script = Script(chunks=["return", " True", "\n"], finish="stop")
        item, done = await _complete_nested(lsp, "file:///tmp/fimble-remote/plain.py")
        prompt = _last_prompt(server)
        assert prompt.endswith("        return False\n        "), prompt
        assert item["insertText"] == "return True" and item["range"]["start"] == NESTED_CURSOR
        assert "replaceStart" not in done
    finally:
        await lsp.stop()


# -- real servers ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def serve_expected():
    """The prompts' text from fimble serve's engine, run here."""
    from engine.serve.scheduler import open_serve_engine

    local = open_serve_engine(str(TARGET_DIR), str(DRAFT_DIR), threads=1)
    threading.Thread(target=local.serve_forever, daemon=True).start()
    out = [local.submit(CompletionRequest(p, s, DecodeOptions(max_tokens=24))).collect() for p, s in REAL_PROMPTS]
    local.close()
    return out


REAL_PROMPTS = [
    (PREFIX, SUFFIX),
    ("import os\n\ndef list_files(path):\n    ", "\n"),
    ("def fib(n):\n    if n < 2:\n        return n\n    return ", "\n"),
]


def _start(cmd: list[str], ready: str, log: Path, env: dict | None = None) -> tuple[subprocess.Popen, re.Match]:
    """Start a server; wait for the stderr line matching ``ready`` (bounded: a broken start fails, not hangs)."""
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    found: list[re.Match] = []

    def seen() -> bool:
        m = re.search(ready, log.read_text(errors="replace"))
        if m:
            found.append(m)
        return bool(m) or proc.poll() is not None

    _wait(seen, timeout=180)
    if not found:
        proc.kill()
        pytest.fail(f"{cmd[0]} did not start: {log.read_text(errors='replace')[-2000:]}")
    return proc, found[0]


def test_fimble_serves_own_openai_endpoint(tmp_path, serve_expected, monkeypatch):
    token = tmp_path / "token"
    token.write_text("fimble-remote-test-token-0123456789\n")
    cmd = [
        sys.executable,
        "-m",
        "lsp_server",
        "serve",
        "--port",
        "0",
        "--threads",
        "1",
        "--require-token",
        "--token-file",
        str(token),
        "--model",
        str(TARGET_DIR),
        "--draft",
        str(DRAFT_DIR),
    ]
    # The daemon leaves its token in a folder of this test's (not the user's), which this process does not read yet.
    env = dict(os.environ, FIMBLE_RUNTIME_DIR=str(tmp_path / "run"))
    proc, m = _start(cmd, r"on ws://127\.0\.0\.1:(\d+)", tmp_path / "serve.log", env=env)
    try:
        url = f"http://127.0.0.1:{m.group(1)}/v1"
        engine = RemoteEngine(RemoteSpec("openai", url, token_file=str(token)))
        assert engine.info()["template"] == "server"  # fimble serve lays out the FIM prompt from prompt + suffix
        for (prefix, suffix), expected in zip(REAL_PROMPTS, serve_expected, strict=True):
            stream = engine.submit(CompletionRequest(prefix, suffix, DecodeOptions(max_tokens=24)))
            assert stream.collect() == expected
            assert stream.result.finish_reason in ("length", "eos")
        # cancel mid-stream: the stream ends cancelled and the next request is served normally
        stream = engine.submit(CompletionRequest(PREFIX, SUFFIX, DecodeOptions(max_tokens=200)))
        stream.cancel()
        assert list(stream)[-1].finish_reason == "cancelled"
        assert (
            engine.submit(CompletionRequest(*REAL_PROMPTS[0], DecodeOptions(max_tokens=24))).collect()
            == serve_expected[0]
        )
        # no token (none given, none in this process's token folder) is a one-line error naming the status
        bad = RemoteEngine(RemoteSpec("openai", url, model="fimble"))
        with pytest.raises(FimbleError, match=r"HTTP 401 .*check --engine-token-file"):
            bad.submit(_request()).collect()
        # without --engine-token-file, a client on this machine reads the daemon's token file for that port
        monkeypatch.setenv("FIMBLE_RUNTIME_DIR", str(tmp_path / "run"))
        assert (
            bad.submit(CompletionRequest(*REAL_PROMPTS[0], DecodeOptions(max_tokens=24))).collect() == serve_expected[0]
        )
    finally:
        proc.terminate()
        proc.wait(30)


def _llama_server() -> str | None:
    path = os.environ.get("LLAMA_SERVER") or "/work/llbuild/build/bin/llama-server"
    return path if Path(path).is_file() and os.access(path, os.X_OK) else shutil.which("llama-server")


@pytest.mark.skipif(_llama_server() is None, reason="llama-server not installed (set LLAMA_SERVER to its path)")
def test_llama_server_infill_and_openai_endpoints(tmp_path):
    from engine.runtimes.gguf_export import export_gguf

    gguf = export_gguf(TARGET_DIR, tmp_path / "fimble-target-f32.gguf", "f32")
    port = _free_port()
    cmd = [
        _llama_server(),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        "1",
        "-c",
        "2048",
        "-np",
        "1",
        "--no-webui",
    ]
    proc, _ = _start(cmd, r"server is listening|HTTP server listening|listening on", tmp_path / "llama.log")
    try:
        infill = RemoteEngine(RemoteSpec("llamacpp", f"http://127.0.0.1:{port}"))
        opts = DecodeOptions(max_tokens=16)
        texts = []
        for prefix, suffix in REAL_PROMPTS:
            stream = infill.submit(CompletionRequest(prefix, suffix, opts))
            texts.append(stream.collect())
            assert stream.result.finish_reason in ("length", "eos", "stop")
            assert 1 <= stream.result.tokens <= 17
        assert any(t.strip() for t in texts), texts
        # the same server's /v1/completions with fimble's own FIM layout (the embedded template)
        oai = RemoteEngine(RemoteSpec("openai", f"http://127.0.0.1:{port}/v1", template="fimble"))
        stream = oai.submit(CompletionRequest(*REAL_PROMPTS[0], opts))
        text = stream.collect()
        assert stream.result.finish_reason in ("length", "eos", "stop")
        assert "<|fim" not in text
        # cancel closes the stream; the server goes on serving
        stream = infill.submit(CompletionRequest(PREFIX, SUFFIX, DecodeOptions(max_tokens=400)))
        stream.cancel()
        assert list(stream)[-1].finish_reason == "cancelled"
        again = infill.submit(CompletionRequest(*REAL_PROMPTS[0], opts))
        assert again.collect() == texts[0]  # greedy, same prompt: the same text
        assert infill.counters()["errors"] == 0 and oai.counters()["errors"] == 0
    finally:
        proc.terminate()
        proc.wait(30)
