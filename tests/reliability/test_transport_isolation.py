"""One session per connection on --tcp and --ws.

Before: a second connection took over the server's output, read the first client's text
through fimble/debug/document without initialize, got 1,550 of 1,600 responses that were
not its own, and its leaving ended the server; a client that left with a reset left a
server that still held (and served) the old session's documents.
"""

from __future__ import annotations

import asyncio

import pytest
from rel_helpers import Listener, TcpClient, WsClient, did_open

SECRET = "api_key = 'the first client wrote this'\n"


@pytest.fixture
def tcp_debug():
    server = Listener("--tcp", "--debug")  # --debug: fimble/debug/document exists, so the gate is initialize
    yield server
    server.close()


async def test_intruder_without_initialize_and_own_responses_tcp(tcp_debug):
    a = await TcpClient.connect(tcp_debug.port)
    await a.initialize()
    a.send(did_open("file:///a/secret.py", SECRET))
    got = await a.call("fimble/debug/document", {"uri": "file:///a/secret.py"})
    assert got["result"]["text"] == SECRET

    intruder = await TcpClient.connect(tcp_debug.port)
    before = await intruder.call("fimble/debug/document", {"uri": "file:///a/secret.py"})
    assert before["error"]["code"] == -32002  # not initialized: nothing served
    await intruder.initialize()
    after = await intruder.call("fimble/debug/document", {"uri": "file:///a/secret.py"})
    assert after["result"] is None  # its own session has no such document
    # Same request ids on both connections: each answer reaches its own client.
    a._ids = intruder._ids = 100
    sa, si = await asyncio.gather(a.call("fimble/stats"), intruder.call("fimble/stats"))
    assert sa["id"] == si["id"]
    assert sa["result"]["tables"]["documents"] == 1 and si["result"]["tables"]["documents"] == 0
    assert sa["result"]["server"]["sessions"] == 2
    await intruder.close()

    # The intruder left: the server and the first session go on.
    again = await a.call("fimble/debug/document", {"uri": "file:///a/secret.py"})
    assert again["result"]["text"] == SECRET
    assert (await a.call("fimble/stats"))["result"]["server"]["sessions"] == 1
    await a.close()
    assert tcp_debug.alive()


async def test_reset_leaves_no_zombie_session_tcp(tcp_debug):
    a = await TcpClient.connect(tcp_debug.port)
    await a.initialize()
    a.send(did_open("file:///a/secret.py", SECRET))
    assert (await a.call("fimble/stats"))["result"]["server"]["documents"] == 1
    a.reset()  # RST (SO_LINGER 0)

    b = await TcpClient.connect(tcp_debug.port)
    await b.initialize()
    for _ in range(200):  # the server sees the reset asynchronously
        server = (await b.call("fimble/stats"))["result"]["server"]
        if server["sessions"] == 1:
            break
        await asyncio.sleep(0.05)
    assert server == {"sessions": 1, "sessionsOpened": 2, "documents": 0}
    assert (await b.call("fimble/debug/document", {"uri": "file:///a/secret.py"}))["result"] is None
    # exit ends the session only: the listener stays up for the next client.
    await b.call("shutdown")
    b.send({"jsonrpc": "2.0", "method": "exit"})
    with pytest.raises(EOFError):
        await b.next()
    c = await TcpClient.connect(tcp_debug.port)
    await c.initialize()
    assert (await c.call("fimble/stats"))["result"]["server"]["sessions"] == 1
    await c.close()
    assert tcp_debug.alive()


async def test_two_websocket_sessions_are_isolated():
    server = Listener("--ws", "--debug")
    try:
        a = await WsClient.connect(server.port)
        await a.initialize()
        await a.send(did_open("file:///a/secret.py", SECRET))
        assert (await a.call("fimble/debug/document", {"uri": "file:///a/secret.py"}))["result"]["text"] == SECRET
        intruder = await WsClient.connect(server.port)
        assert (await intruder.call("fimble/debug/document", {"uri": "file:///a/secret.py"}))["error"]["code"] == -32002
        await intruder.initialize()
        assert (await intruder.call("fimble/debug/document", {"uri": "file:///a/secret.py"}))["result"] is None
        await intruder.close()
        assert (await a.call("fimble/debug/document", {"uri": "file:///a/secret.py"}))["result"]["text"] == SECRET
        await a.close()  # a WS close ends the session: its documents go
        b = await WsClient.connect(server.port)
        await b.initialize()
        for _ in range(200):
            stats = (await b.call("fimble/stats"))["result"]["server"]
            if stats["sessions"] == 1:
                break
            await asyncio.sleep(0.05)
        assert stats["documents"] == 0
        await b.close()
        assert server.alive()
    finally:
        server.close()


async def test_32_clients_50_requests_each_reach_their_own_client(tcp_debug):
    """The load bar: 32 concurrent TCP clients x 50 requests, every response its own, 0 errors."""
    clients, requests = 32, 50

    async def client(n: int) -> tuple[int, int]:
        c = await TcpClient.connect(tcp_debug.port)
        await c.initialize()
        uri, text = f"file:///c{n}/doc.py", f"client_{n} = {n}\n"
        c.send(did_open(uri, text))
        own = errors = 0
        for i in range(requests):
            r = await (c.call("fimble/debug/document", {"uri": uri}) if i % 2 else c.call("fimble/stats"))
            if "error" in r:
                errors += 1
            elif i % 2:
                own += r["result"]["text"] == text
            else:
                own += r["result"]["tables"]["documents"] == 1
        await c.close()
        return own, errors

    results = await asyncio.gather(*(client(n) for n in range(clients)))
    assert sum(e for _, e in results) == 0
    assert sum(o for o, _ in results) == clients * requests
    assert tcp_debug.alive()


async def test_sessions_are_capped_and_freed():
    server = Listener("--tcp", "--max-sessions", "2")
    try:
        a, b = await TcpClient.connect(server.port), await TcpClient.connect(server.port)
        await a.initialize()
        await b.initialize()
        c = await TcpClient.connect(server.port)
        busy = await c.next()
        assert busy["id"] is None and busy["error"]["code"] == -32000
        with pytest.raises(EOFError):
            await c.next()
        await b.close()
        for _ in range(200):  # b's session ends asynchronously
            if (await a.call("fimble/stats"))["result"]["server"]["sessions"] == 1:
                break
            await asyncio.sleep(0.05)
        d = await TcpClient.connect(server.port)
        assert "capabilities" in (await d.initialize())["result"]
        await d.close()
        await a.close()
    finally:
        server.close()


async def test_engine_keeps_documents_per_session_and_frees_them():
    """One engine, two sessions with the same URI: two KV documents; a reset frees its session's one."""
    server = Listener("--tcp")
    try:
        # Long enough that, within one session, a second document would borrow this one's KV blocks.
        head = "".join(f"def f{i}(x):\n    return x * {i} + {i}\n\n\n" for i in range(40))
        text = head + "def add(a, b):\n    return a + b\n\n\nprint(add(1, "
        line = text.count("\n")
        clients = [await TcpClient.connect(server.port) for _ in range(2)]
        for c in clients:
            await c.initialize({"preload": True, "maxTokens": 4, "maxLines": 1, "prewarm": False})
            c.send(did_open("file:///same.py", text))
            r = await c.call(
                "textDocument/inlineCompletion",
                {
                    "textDocument": {"uri": "file:///same.py"},
                    "position": {"line": line, "character": len("print(add(1, ")},
                    "context": {"triggerKind": 1},
                },
            )
            assert "result" in r
        a, b = clients
        assert (await b.call("fimble/stats"))["result"]["kvCache"]["documents"] == 2  # not shared across sessions
        a.reset()
        for _ in range(400):
            kv = (await b.call("fimble/stats"))["result"]["kvCache"]
            if kv["documents"] == 1:
                break
            await asyncio.sleep(0.05)
        assert kv["documents"] == 1 and kv["borrowedTokens"] == 0
        await b.close()
    finally:
        server.close()


async def test_connections_that_never_initialize_are_closed():
    from websockets.exceptions import ConnectionClosed

    tcp = Listener("--tcp", "--init-timeout", "0.5")
    ws = Listener("--ws", "--init-timeout", "0.5")
    try:
        idle = await TcpClient.connect(tcp.port)
        with pytest.raises((EOFError, ConnectionResetError)):
            await idle.next()  # closed by the server, not by this client
        ready = await TcpClient.connect(tcp.port)
        await ready.initialize()
        await asyncio.sleep(1.0)
        assert "latency_ms" in (await ready.call("fimble/stats"))["result"]  # initialized: kept
        idle_ws = await WsClient.connect(ws.port)
        with pytest.raises(ConnectionClosed) as closed:
            await idle_ws.next()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    finally:
        tcp.close()
        ws.close()
