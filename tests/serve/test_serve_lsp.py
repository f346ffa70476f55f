"""Two real editors' servers (``fimble lsp --engine ws://...`` over stdio) share one ``fimble serve``.

Both open a document with the same URI and different text; each gets the completion of its own
text (the daemon keys documents per session). Then the daemon goes away: the LSP reports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from rel_helpers import StdioServer, did_open  # noqa: E402
from serve_helpers import ServeProcess, running_daemon  # noqa: E402

from engine.api import CompletionRequest, DecodeOptions  # noqa: E402
from engine.serve.client import WSEngine  # noqa: E402

URI = "file:///shared/name.py"
DOCS = {  # same URI in both editors; the cursor ends each text
    "alpha": "def compute_alpha_total(values):\n    return sum(values)\n\n\nresult = compute_al",
    "beta": "class BetaQueue:\n    def enqueue_beta_item(self, item):\n        pass\n\n\nq = BetaQueue()\nq.enqueue_be",
}


@pytest.fixture(scope="module")
def daemon():
    yield from running_daemon()


async def _complete(server: StdioServer, text: str, uri: str = URI) -> str:
    lines = text.split("\n")
    server.send(did_open(uri, text))
    r = await server.call(
        "textDocument/inlineCompletion",
        {
            "textDocument": {"uri": uri},
            "position": {"line": len(lines) - 1, "character": len(lines[-1])},
            "context": {"triggerKind": 1},
        },
    )
    items = r["result"]["items"] if isinstance(r["result"], dict) else r["result"]
    return items[0]["insertText"] if items else ""


async def test_two_lsp_clients_share_one_daemon(daemon):
    args = ("--engine", daemon.url, "--engine-token-file", daemon.token_file)
    opts = {"preload": True, "prewarm": False, "maxTokens": 12, "maxLines": 1}
    servers = [await StdioServer.start(*args) for _ in DOCS]
    probe = WSEngine(daemon.url, daemon.token)
    try:
        sessions_before = probe.counters()["sessions_total"]
        for s in servers:
            await s.initialize(opts)
        got = {name: await _complete(s, text) for s, (name, text) in zip(servers, DOCS.items(), strict=True)}
        assert got["alpha"] != got["beta"]
        assert (await servers[0].call("fimble/stats"))["result"] is not None
        counters = probe.counters()
        assert counters["sessions_total"] - sessions_before >= 2  # each editor its own session
        for name, text in DOCS.items():  # each answer is a completion of its own text
            stream = probe.submit(
                CompletionRequest(text, "", options=DecodeOptions(max_tokens=12, max_lines=1), document_id=name)
            )
            alone = "".join([d.text async for d in stream])
            # The editor's answer is the daemon's completion of that text (shaping may cut a closer).
            assert got[name] and (alone.startswith(got[name]) or got[name].startswith(alone)), (got[name], alone)
    finally:
        probe.close()
        for s in servers:
            await s.stop()


async def test_lsp_reports_a_daemon_that_goes_away_and_reconnects():
    own = ServeProcess()  # a daemon of its own: this test stops it
    server = await StdioServer.start("--engine", own.url, "--engine-token-file", own.token_file)
    again = None
    try:
        await server.initialize({"preload": True, "prewarm": False, "maxTokens": 4, "maxLines": 1})
        text = DOCS["alpha"]
        assert isinstance(await _complete(server, text), str)
        own.stop()
        notices = []
        while not any("closed the connection" in n for n in notices):  # the watchdog looks every 0.25 s
            m = await server.next()
            if isinstance(m, dict) and m.get("method") == "window/showMessage":
                notices.append(m["params"]["message"])
        assert any("the engine stopped" in n and own.url in n and "restarting" in n for n in notices), notices
        # The daemon comes back on the same port: the LSP's restart reconnects (with backoff) and serves.
        again = ServeProcess(port=own.port, token_file=own.token_file)
        # Another document (the first one's answer would come from the type-through cache).
        assert await _complete(server, DOCS["beta"], uri="file:///other.py")
        probe = WSEngine(again.url, again.token)
        try:
            assert probe.counters()["sessions_total"] >= 2  # the LSP's new session, and this probe
        finally:
            probe.close()
    finally:
        own.stop()
        if again is not None:
            again.stop()
        await server.stop()
