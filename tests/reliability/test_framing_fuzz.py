"""Malformed frames and params over stdio, TCP and WebSocket: answered, resynced, never fatal.

Before: a stdio header line over 1 MiB ended the server (exit 1); a missing, negative,
non-numeric, too-small or huge Content-Length left it alive but deaf; over WS a message over
1 MiB or one invalid-UTF-8 text frame ended the server; a body of invalid UTF-8 and a batch
were never answered.
"""

from __future__ import annotations

import json
import random

import pytest
from rel_helpers import Listener, StdioServer, TcpClient, WsClient, did_open, frame, msg

FUZZ_MESSAGES = 10_000
SEED = 14


def _valid(i: int) -> bytes:
    return frame(msg(i, "fimble/stats"))


# One malformed frame each, then a valid request that must be answered (the stream resynced).
BAD_FRAMES = {
    "header line over 1 MiB": b"X-Junk: " + b"a" * (1 << 20) + b"\r\n\r\n",
    "no Content-Length": b"Content-Type: application/json\r\n\r\n",
    "negative Content-Length": b"Content-Length: -5\r\n\r\n{}",
    "non-numeric Content-Length": b"Content-Length: lots\r\n\r\n{}",
    "huge Content-Length": b"Content-Length: 100000000000000000000000000000\r\n\r\n{}",
    "too-small Content-Length": b"Content-Length: 12\r\n\r\n" + json.dumps(msg(77, "fimble/stats")).encode(),
    "invalid JSON": frame(b'{"jsonrpc": "2.0", "id": 1,'),
    "garbage line": b"hello there\r\n\r\n",
}


@pytest.fixture
async def stdio():
    s = await StdioServer.start()
    await s.initialize()
    yield s
    await s.stop()


@pytest.mark.parametrize("name", list(BAD_FRAMES))
async def test_bad_frame_is_answered_and_the_stream_resyncs_stdio(stdio, name):
    stdio.send_raw(BAD_FRAMES[name] + _valid(1000))
    assert "latency_ms" in (await stdio.response(1000))["result"]
    errors = [m for m in stdio.seen if isinstance(m, dict) and m.get("error", {}).get("code") == -32700]
    assert errors and all(e["id"] is None for e in errors)
    assert stdio.proc.returncode is None


async def test_invalid_utf8_body_is_answered_to_its_id(stdio):
    stdio.send_raw(frame(b'{"jsonrpc": "2.0", "id": 31, "method": "fimble/stats", "params": {"x": "\xff\xfe"}}'))
    r = await stdio.response(31)
    assert r["error"]["code"] == -32700 and "UTF-8" in r["error"]["message"]


async def test_fuzz_10000_messages_stdio():
    """The fuzz bar: >= 10,000 generated messages, then the server is alive and answers."""
    rng = random.Random(SEED)
    s = await StdioServer.start()
    try:
        await s.initialize()
        sent = {"messages": 0, "requests": 0}
        chunks: list[bytes] = []
        next_id = 10_000
        uris = [f"file:///fuzz/{n}.py" for n in range(8)]

        def rand_value(depth: int = 0):
            makers = [
                lambda: None,
                lambda: True,
                lambda: rng.randint(-(10**6), 10**6),
                lambda: 10**400 if rng.random() < 0.2 else -1,
                lambda: rng.random() * 1e308,
                lambda: "".join(rng.choice('ab\r\n\t"\\\u00e9\U0001f600 ') for _ in range(8)),
                lambda: [rand_value(depth + 1) for _ in range(3)],
                lambda: {"k": rand_value(depth + 1)},
                lambda: {"line": rand_value(depth + 1), "character": rand_value(depth + 1)},
            ]
            return makers[rng.randrange(len(makers) if depth < 3 else 6)]()

        def position():
            return (
                {"line": rng.choice([0, 1, 5, -1, 10**400, "x"]), "character": rng.choice([0, 3, 10**6, -1, None])}
                if rng.random() < 0.3
                else {"line": rng.randrange(4), "character": rng.randrange(12)}
            )

        setting_keys = [
            "maxLines",
            "maxTokens",
            "debounceMs",
            "earlyAnswerMs",
            "streaming",
            "prefixChars",
            "suffixChars",
            "answerAt",
            "drafter",
            "tokenHealing",
            "policy",
            "kvShiftReuse",
            "prewarm",
            "prewarmDelayMs",
            "prefetch",
            "languages",
        ]
        while sent["messages"] < FUZZ_MESSAGES:
            r = rng.random()
            uri = rng.choice(uris)
            if r < 0.2:  # requests of every kind, with fuzzed params; each must be answered
                next_id += 1
                method = rng.choice(
                    [
                        "fimble/stats",
                        "textDocument/inlineCompletion",
                        "textDocument/completion",
                        "no/such",
                        "fimble/debug/document",
                        "workspace/executeCommand",
                    ]
                )
                params = rng.choice(
                    [
                        None,
                        {},
                        rand_value(),
                        {
                            "textDocument": {"uri": "file:///none.py"},
                            "position": position(),
                            "context": {"triggerKind": rng.choice([1, 2, 9])},
                        },
                    ]
                )
                m = msg(next_id, method, params)
                if method == "fimble/stats" and rng.random() < 0.5:
                    m.pop("params", None)
                chunks.append(frame(m))
                sent["requests"] += 1
            elif r < 0.45:  # text sync on a few small documents
                kind = rng.random()
                if kind < 0.15:
                    chunks.append(frame(did_open(uri, "def f(x):\n    return x\n" * rng.randrange(3))))
                elif kind < 0.2:
                    chunks.append(frame(msg(None, "textDocument/didClose", {"textDocument": {"uri": uri}})))
                else:
                    text = rand_value() if rng.random() < 0.2 else rng.choice(["a", "\n", "\r", "\r\n", "é", "😀", ""])
                    chunks.append(
                        frame(
                            msg(
                                None,
                                "textDocument/didChange",
                                {
                                    "textDocument": {"uri": uri, "version": rng.randrange(100)},
                                    "contentChanges": [
                                        {"range": {"start": position(), "end": position()}, "text": text}
                                    ],
                                },
                            )
                        )
                    )
            elif r < 0.55:
                settings = {rng.choice(setting_keys): rand_value() for _ in range(rng.randrange(1, 4))}
                chunks.append(frame(msg(None, "workspace/didChangeConfiguration", {"settings": {"fimble": settings}})))
            elif r < 0.65:
                chunks.append(
                    frame(
                        msg(
                            None,
                            rng.choice(
                                [
                                    "fimble/cursor",
                                    "$/cancelRequest",
                                    "textDocument/didSave",
                                    "textDocument/didShowCompletion",
                                ]
                            ),
                            rng.choice(
                                [
                                    rand_value(),
                                    {"textDocument": {"uri": uri}, "position": position()},
                                    {"id": rand_value()},
                                ]
                            ),
                        )
                    )
                )
            elif r < 0.8:  # structurally wrong JSON-RPC
                chunks.append(
                    frame(
                        rng.choice(
                            [
                                b"[]",
                                b"[1, 2]",
                                b"null",
                                b"42",
                                b'"text"',
                                b'{"jsonrpc": "1.0", "id": 1, "method": "x"}',
                                json.dumps({"jsonrpc": "2.0", "id": rand_value(), "method": "fimble/stats"}).encode(),
                                json.dumps({"jsonrpc": "2.0", "id": 5, "method": rand_value()}).encode(),
                                json.dumps([msg(1, "fimble/stats"), msg(None, "initialized", {})]).encode(),
                                b"[" * 5000 + b"]" * 5000,
                                b'{"jsonrpc": "2.0", "id": 9, "result": null}',
                                b'{"jsonrpc": "2.0", "id": 3, "method": "fimble/stats", "params": 7}',
                            ]
                        )
                    )
                )
            else:  # broken frames
                body = json.dumps(msg(None, "fimble/cursor", {})).encode()
                chunks.append(
                    rng.choice(
                        [
                            b"Content-Length: %d\r\n\r\n" % rng.randrange(1, len(body)) + body,
                            b"Content-Length: %d\r\n\r\n" % (len(body) + rng.randrange(1, 40)) + body,
                            b"Content-Length: -%d\r\n\r\n" % len(body) + body,
                            b"Content-Length: x\r\n\r\n",
                            b"Content-Length: 99999999999999999999\r\n\r\n",
                            b"\r\n\r\n",
                            b"Content-Length: 10\r\nContent-Length: 10\r\n\r\n0123456789",
                            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) + b"\r\n\r\n",
                            frame(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))),
                            frame(
                                b'{"jsonrpc": "2.0", "id": 1, "method": "fimble/stats", "params": {"a": "\xc3\x28"}}'
                            ),
                            b"X-Long: " + b"z" * 70_000 + b"\r\n\r\n" if rng.random() < 0.05 else b"\r\n\r\n",
                        ]
                    )
                )
            sent["messages"] += 1
        # Whatever state the last frames left: a filler completes a pending body, then a blank
        # line ends a header block, and the stream is at a frame boundary.
        chunks.append(b" " * 256 + b"\r\n\r\n")
        data = b"".join(chunks)
        for start in range(0, len(data), 1 << 16):
            s.send_raw(data[start : start + (1 << 16)])
            await s.proc.stdin.drain()
        s.send(msg("final", "fimble/stats"))  # an id no generated message uses
        final = await s.response("final", timeout=300)
        assert "latency_ms" in final["result"]
        assert s.proc.returncode is None
        answered = sum(1 for m in s.seen if isinstance(m, dict) and "id" in m and "method" not in m)
        parse_errors = sum(1 for m in s.seen if isinstance(m, dict) and m.get("error", {}).get("code") == -32700)
        print(
            f"fuzz: {sent['messages']} messages ({sent['requests']} requests), {answered} answers, "
            f"{parse_errors} parse errors, seed {SEED}"
        )
        assert sent["messages"] >= FUZZ_MESSAGES and answered > sent["requests"] // 2 and parse_errors > 100
        assert not any("traceback" in json.dumps(m).lower() for m in s.seen)
        assert final["result"]["counters"]["bad_frames"] > 100
        assert s.stderr().count("bad frame") <= 20  # counted, not each logged: a flood can't fill the log
        # And it still does real work: a document opened now is there, in full.
        s.send(did_open("file:///after.py", "after = 1\n"))
        assert (await s.call("fimble/stats"))["result"]["tables"]["documents"] >= 1
    finally:
        await s.stop()


async def test_tcp_bad_frames_answered_and_other_sessions_unaffected():
    server = Listener("--tcp")
    try:
        other = await TcpClient.connect(server.port)
        await other.initialize()
        c = await TcpClient.connect(server.port)
        await c.initialize()
        for n, bad in enumerate(BAD_FRAMES.values()):
            c.send_raw(bad + _valid(500 + n))
            assert "result" in await c.response(500 + n)
        c.reset()
        assert "latency_ms" in (await other.call("fimble/stats"))["result"]
        await other.close()
        assert server.alive()
    finally:
        server.close()


async def test_websocket_invalid_utf8_oversize_and_a_10mb_file():
    from websockets.exceptions import ConnectionClosed

    server = Listener("--ws", "--max-message-mb", "16")
    try:
        a = await WsClient.connect(server.port)
        await a.initialize()
        await a.ws.send(b'{"jsonrpc": "2.0", "id": 5, "method": "fimble/stats", "x": "\xff"}')  # binary frame
        r = await a.response(5)
        assert r["error"]["code"] == -32700
        assert "latency_ms" in (await a.call("fimble/stats"))["result"]

        # A 10 MB file opens (the default limit allows 64 MiB; this server 16).
        text = "x = 1\n" * (10_000_000 // 6 + 1)
        await a.send(did_open("file:///big.py", text))
        assert (await a.call("fimble/stats"))["result"]["tables"]["documents"] == 1

        b = await WsClient.connect(server.port)
        await b.initialize()
        await b.send(did_open("file:///too-big.py", "y" * (17 << 20)))  # over --max-message-mb 16
        with pytest.raises(ConnectionClosed) as closed:
            await b.call("fimble/stats")
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big
        assert "latency_ms" in (await a.call("fimble/stats"))["result"]  # the other session goes on
        await a.close()
        assert server.alive()
    finally:
        server.close()


async def test_websocket_text_frame_of_invalid_utf8():
    server = Listener("--ws")
    try:
        a = await WsClient.connect(server.port)
        await a.initialize()
        await _send_raw_text_frame(a.ws, b'{"jsonrpc": "2.0", "id": 6, "method": "fimble/stats", "x": "\xc3\x28"}')
        r = await a.response(6)
        assert r["error"]["code"] == -32700 and "UTF-8" in r["error"]["message"]
        assert "latency_ms" in (await a.call("fimble/stats"))["result"]
        await a.close()
        assert server.alive()
    finally:
        server.close()


async def _send_raw_text_frame(ws, payload: bytes) -> None:
    """A text frame whose payload is not UTF-8: websockets' send() would not make one."""
    from websockets.frames import Frame, Opcode

    async with ws.send_context():
        ws.protocol.send_frame(Frame(Opcode.TEXT, payload))
