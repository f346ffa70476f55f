"""With streaming on, every inline request gets exactly one ``done`` delta (PROTOCOL.md, completionDelta).

Also the requests answered without a decode: a language outside the model's list, nothing to complete
(an unknown document, a line past the end, a blank document), a position inside a character (an error
response), a request ``debounceMs`` drops for a newer request or an edit, one cancelled before its decode
starts, and a model that cannot load. Each gets one ``done`` with empty text and the reason, before its
response; a request that decodes still gets exactly one. Before, those got none, and a client waiting for
the ``done`` (bench/quality.py) waited 120 s for each.

Real server over stdio with the embedded model (its fimble.json lists only Python). The waits below are
safety nets: the assertions are on which deltas arrive and how many.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_lsp
from lsp_helpers import (
    SERVER,
    UNFINISHED_CURSOR,
    UNFINISHED_DOC,
    Deltas,
    change,
    configure,
    init_params,
    inline,
    items_of,
    open_doc,
    stats,
)
from lsprotocol import types
from pygls.exceptions import JsonRpcInvalidParams, JsonRpcRequestCancelled
from pytest_lsp import ClientServerConfig, LanguageClient

from bench.harness.raw_lsp import SERVER_CMD, SERVER_ENV

pytestmark = pytest.mark.asyncio(loop_scope="module")

GO_DOC = 'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println(\n}\n'
GO_CURSOR = (5, len("\tfmt.Println("))
EMOJI_LINE = 'label = "😀 done"'  # 😀: 4 UTF-8 bytes (the neovim capability set negotiates utf-8)
WAIT_S = 30.0  # a safety net only: the done of a request answered without a decode comes before its response

# A model folder that does not exist: the engine cannot start (EngineHost.get gives None).
BROKEN_SERVER = ClientServerConfig(
    server_command=SERVER_CMD + ["--debug"],
    server_env={**SERVER_ENV, "FIMBLE_MODEL": "/nonexistent/fimble-no-such-model"},
)


@pytest_lsp.fixture(config=SERVER, params=["neovim"], scope="module")
async def client(request, lsp_client: LanguageClient):
    lsp_client.deltas = Deltas(lsp_client)
    # No prefetch: an edit must not start a decode of its own.
    await lsp_client.initialize_session(init_params(request.param, {"prefetch": False}))
    yield
    await lsp_client.shutdown_session()


@pytest_lsp.fixture(config=BROKEN_SERVER, params=["neovim"], scope="module")
async def broken(request, lsp_client: LanguageClient):
    lsp_client.deltas = Deltas(lsp_client)
    await lsp_client.initialize_session(init_params(request.param))
    yield
    await lsp_client.shutdown_session()


def _uri(client: LanguageClient, name: str) -> str:
    return f"file:///tmp/fimble-done/{id(client)}/{name}"


async def _done(client: LanguageClient, rid: str) -> dict:
    """The request's one done delta, after a round trip more (a second one would have come by then)."""
    await client.deltas.wait(lambda p: p["requestId"] == rid and p["done"], WAIT_S)
    await stats(client)
    dones = [d for d in client.deltas.of(rid) if d["done"]]
    assert len(dones) == 1, client.deltas.of(rid)
    return dones[0]


async def _in_server(client: LanguageClient) -> None:
    """A request just started as a task has been sent and the server has read it (it is debouncing)."""
    await asyncio.sleep(0)  # the task sends it
    await stats(client)  # a round trip after it: the server handles messages in order


def _no_decode(done: dict, reason: str, version: int | None, position: tuple[int, int]) -> None:
    """A done delta of a request answered without a decode: empty text at the request's position."""
    pos = {"line": position[0], "character": position[1]}
    assert done["finishReason"] == reason
    assert done["text"] == "" and done["completionId"] is None and not done["cached"]
    assert done["version"] == version and done["position"] == pos and done["replaceEnd"] == pos


async def test_language_outside_the_enabled_list_gets_one_empty_done(client: LanguageClient):
    uri = _uri(client, "main.go")
    open_doc(client, uri, GO_DOC, language="go")
    rid = f"go-{id(client)}"
    assert items_of(await inline(client, uri, *GO_CURSOR, msg_id=rid)) == []
    # It came before the response: no waiting on a done that never comes.
    assert [d["done"] for d in client.deltas.of(rid)] == [True]
    _no_decode(await _done(client, rid), "disabled", 1, GO_CURSOR)
    assert client.deltas.of(rid)[0]["uri"] == uri


async def test_nothing_to_complete_gets_one_empty_done(client: LanguageClient):
    unknown = _uri(client, "never-opened.py")
    rid = f"unknown-{id(client)}"
    assert items_of(await inline(client, unknown, 0, 0, msg_id=rid)) == []
    _no_decode(await _done(client, rid), "empty", None, (0, 0))

    uri = _uri(client, "short.py")
    open_doc(client, uri, "x = 1\n")
    rid = f"past-end-{id(client)}"
    assert items_of(await inline(client, uri, 5, 0, msg_id=rid)) == []
    _no_decode(await _done(client, rid), "empty", 1, (5, 0))

    blank = _uri(client, "blank.py")
    open_doc(client, blank, "\n   \n\n", version=3)
    rid = f"blank-{id(client)}"
    assert items_of(await inline(client, blank, 1, 3, msg_id=rid)) == []
    _no_decode(await _done(client, rid), "empty", 3, (1, 3))


async def test_error_response_gets_one_done(client: LanguageClient):
    uri = _uri(client, "emoji.py")
    open_doc(client, uri, EMOJI_LINE + "\n")
    inside = len('label = "') + 2  # byte 2 of the emoji's 4
    rid = f"inside-{id(client)}"
    with pytest.raises(JsonRpcInvalidParams):
        await inline(client, uri, 0, inside, msg_id=rid)
    _no_decode(await _done(client, rid), "error", 1, (0, inside))


async def test_debounced_and_cancelled_requests_get_one_done(client: LanguageClient):
    uri = _uri(client, "debounce.py")
    open_doc(client, uri, UNFINISHED_DOC)
    await configure(client, debounceMs=1500)
    try:
        # Overtaken by a newer request (an invoked one: no debounce, it decodes).
        old, new = f"deb-old-{id(client)}", f"deb-new-{id(client)}"
        first = asyncio.ensure_future(inline(client, uri, *UNFINISHED_CURSOR, msg_id=old, invoked=False))
        await _in_server(client)
        second = await inline(client, uri, *UNFINISHED_CURSOR, msg_id=new)
        assert items_of(await first) == []
        _no_decode(await _done(client, old), "superseded", 1, UNFINISHED_CURSOR)
        assert items_of(second)  # the newer one decoded: its stream's own done, one
        assert (await _done(client, new))["finishReason"] in ("stop", "eos", "length")

        # Overtaken by an edit: the done names the version the request saw. (A document of its own: at the
        # cursor above, type-through would answer without debouncing.)
        uri = _uri(client, "debounce-edit.py")
        open_doc(client, uri, UNFINISHED_DOC)
        rid = f"deb-edit-{id(client)}"
        task = asyncio.ensure_future(inline(client, uri, *UNFINISHED_CURSOR, msg_id=rid, invoked=False))
        await _in_server(client)
        change(client, uri, 2, (0, 0), (0, 0), "# edited\n")
        assert items_of(await task) == []
        _no_decode(await _done(client, rid), "stale", 1, UNFINISHED_CURSOR)

        # Cancelled before its decode started.
        uri = _uri(client, "debounce-cancel.py")
        open_doc(client, uri, UNFINISHED_DOC)
        rid = f"deb-cancel-{id(client)}"
        task = asyncio.ensure_future(inline(client, uri, *UNFINISHED_CURSOR, msg_id=rid, invoked=False))
        await _in_server(client)
        client.cancel_request(types.CancelParams(id=rid))
        with pytest.raises(JsonRpcRequestCancelled):
            await task
        _no_decode(await _done(client, rid), "cancelled", 1, UNFINISHED_CURSOR)
        assert (await stats(client))["counters"]["debounced"] >= 2
    finally:
        await configure(client, debounceMs=0)


async def test_decoded_request_still_gets_exactly_one_done(client: LanguageClient):
    uri = _uri(client, "decoded.py")
    open_doc(client, uri, UNFINISHED_DOC, version=4)
    rid = f"decoded-{id(client)}"
    items = items_of(await inline(client, uri, *UNFINISHED_CURSOR, msg_id=rid))
    assert items
    done = await _done(client, rid)
    assert done["finishReason"] in ("stop", "eos", "length") and done["version"] == 4
    assert done["text"].startswith(items[0].insert_text) and done["completionId"]
    # The same cursor again: type-through answers from that decode, with one done of its own.
    again = f"decoded-again-{id(client)}"
    assert items_of(await inline(client, uri, *UNFINISHED_CURSOR, msg_id=again))
    assert (await _done(client, again))["cached"]


async def test_model_that_cannot_load_gets_one_done(broken: LanguageClient):
    uri = _uri(broken, "a.py")
    open_doc(broken, uri, UNFINISHED_DOC)
    rid = f"broken-{id(broken)}"
    assert items_of(await inline(broken, uri, *UNFINISHED_CURSOR, msg_id=rid)) == []
    _no_decode(await _done(broken, rid), "unavailable", 1, UNFINISHED_CURSOR)
    assert (await stats(broken))["engine"]["state"] == "error"
