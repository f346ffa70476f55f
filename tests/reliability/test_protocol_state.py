"""The session's life cycle over stdio: before initialize, after shutdown, exit, batches, text edits.

Found in a review of the protocol's states: requests before initialize were served and started the engine; requests
after shutdown got no response; a batch was not answered; ``didChange`` with ``text: null``
put "None" into the server's copy; fimble/stats with its params omitted failed with -32602.
"""

from __future__ import annotations

import asyncio

from rel_helpers import StdioServer, did_open, msg

URI = "file:///p/state.py"


async def test_before_initialize_nothing_is_served_and_no_engine_starts():
    s = await StdioServer.start("--debug")
    try:
        s.send(did_open(URI, "x = 1\n"))  # dropped: not initialized
        for i, method in enumerate(("fimble/stats", "textDocument/inlineCompletion", "fimble/debug/document")):
            s.send(
                msg(
                    100 + i,
                    method,
                    {
                        "textDocument": {"uri": URI},
                        "position": {"line": 0, "character": 1},
                        "context": {"triggerKind": 1},
                        "uri": URI,
                    },
                )
            )
            assert (await s.response(100 + i))["error"]["code"] == -32002
        s.send(
            {
                "jsonrpc": "2.0",
                "id": 200,
                "method": "initialize",
                "params": {"capabilities": {}, "initializationOptions": {"preload": False}},
            }
        )
        assert "capabilities" in (await s.response(200))["result"]
        s.send(msg(None, "initialized", {}))
        stats = (await s.call("fimble/stats"))["result"]
        assert stats["engine"]["state"] == "stopped" and stats["engine"]["pid"] is None
        assert stats["tables"]["documents"] == 0  # the didOpen sent before initialize was not taken
        # A second initialize is refused.
        assert (await s.call("initialize", {"capabilities": {}}))["error"]["code"] == -32600
    finally:
        await s.stop()


async def test_after_shutdown_requests_get_invalid_request_and_exit_ends_the_process():
    s = await StdioServer.start()
    try:
        await s.initialize()
        assert (await s.call("shutdown"))["result"] is None
        for method in ("fimble/stats", "textDocument/inlineCompletion", "shutdown"):
            assert (await s.call(method, {}))["error"]["code"] == -32600
        s.send(msg(None, "exit"))
        assert await asyncio.wait_for(s.proc.wait(), 60) == 0
    finally:
        await s.stop()


async def test_exit_without_shutdown_exits_with_status_1():
    s = await StdioServer.start()
    try:
        await s.initialize()
        s.send(msg(None, "exit"))
        assert await asyncio.wait_for(s.proc.wait(), 60) == 1  # as the LSP spec says
    finally:
        await s.stop()


async def test_batches_params_omitted_and_null_text():
    s = await StdioServer.start("--debug")
    try:
        await s.initialize()
        s.send([msg(1, "fimble/stats"), msg(None, "initialized", {}), 7])
        batch = await s.next()
        while not isinstance(batch, list):
            batch = await s.next()
        assert [e["error"]["code"] for e in batch] == [-32600, -32600, -32600]
        assert [e["id"] for e in batch] == [1, None, None]
        assert (await s.call("fimble/stats"))["result"]["tables"]["documents"] == 0  # params omitted: fine
        s.send({"jsonrpc": "2.0", "id": 9, "method": "fimble/stats"})
        assert "latency_ms" in (await s.response(9))["result"]

        s.send(did_open(URI, "keep = 1\n"))
        for text in (None, 5, ["x"], {"a": 1}):
            s.send(
                msg(
                    None,
                    "textDocument/didChange",
                    {"textDocument": {"uri": URI, "version": 2}, "contentChanges": [{"text": text}]},
                )
            )
            s.send(
                msg(
                    None,
                    "textDocument/didChange",
                    {
                        "textDocument": {"uri": URI, "version": 2},
                        "contentChanges": [
                            {
                                "range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}},
                                "text": text,
                            }
                        ],
                    },
                )
            )
        doc = (await s.call("fimble/debug/document", {"uri": URI}))["result"]
        assert doc["text"] == "keep = 1\n" and doc["version"] == 1  # refused, never coerced to "None"
        assert "None" not in doc["text"]
        # A request whose params have a null where a string belongs: InvalidParams, not a coerced "None".
        r = await s.call(
            "textDocument/inlineCompletion",
            {"textDocument": {"uri": None}, "position": {"line": 0, "character": 0}, "context": {"triggerKind": 1}},
        )
        assert r["error"]["code"] == -32602
    finally:
        await s.stop()


async def test_error_responses_carry_no_traceback():
    """pygls put a traceback (with install paths) in every internal error's ``data``."""
    from pygls.exceptions import JsonRpcInternalError

    from lsp_server.server import create_server

    sent: list[bytes] = []

    class Writer:
        def write(self, data: bytes) -> None:
            sent.append(data)

        def close(self) -> None:
            pass

    ls = create_server()
    ls.protocol.set_writer(Writer())
    try:
        raise OverflowError(f"int too large in {__file__}")
    except OverflowError:
        import sys

        err = JsonRpcInternalError.of(sys.exc_info())
    assert "traceback" in err.data  # what pygls would send
    ls.protocol._send_response(7, error=err.to_response_error())
    body = b"".join(sent).decode()
    assert '"id": 7' in body and "-32603" in body
    assert "traceback" not in body and __file__ not in body and "OverflowError" not in body


async def test_initialize_with_bad_params_leaves_the_session_uninitialized():
    s = await StdioServer.start()
    try:
        assert (await s.call("initialize", {"capabilities": 5}))["error"]["code"] == -32602
        assert (await s.call("fimble/stats"))["error"]["code"] == -32002  # still not initialized
        assert "capabilities" in (await s.initialize())["result"]
        assert "latency_ms" in (await s.call("fimble/stats"))["result"]
    finally:
        await s.stop()
