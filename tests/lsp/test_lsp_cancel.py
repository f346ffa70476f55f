"""Cancellation and a free event loop, checked through the engine's counters rather than timing."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import pytest_lsp
from lsp_helpers import (
    CLIENTS,
    SERVER,
    Deltas,
    change,
    configure,
    init_params,
    inline,
    items_of,
    open_doc,
    server_text,
    stats,
)
from lsprotocol import types
from pygls.exceptions import JsonRpcRequestCancelled
from pytest_lsp import LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Repetitive rows the embedded model keeps extending (checked: 400 tokens, no EOS), decoded
# without drafts and with the policy's per-context caps lifted, so a decode runs for seconds.
# LONG_B is for a document with code after the cursor (the model stops LONG early there).
LONG = "TABLE = {\n    'a': 1,\n    'b': 2,\n    'c': 3,\n    'd': 4,\n"
LONG_B = "import math\n\nPRIMES = [\n    2,\n    3,\n    5,\n    7,\n    11,\n"
LONG_CURSOR = (LONG.count("\n"), 0)
LONG_B_CURSOR = (LONG_B.count("\n"), 0)
UNCAPPED = {"*": {"multiline": True, "max_lines": 0, "max_tokens": 400, "stop": []}}


@pytest_lsp.fixture(config=SERVER, params=CLIENTS, scope="module")
async def client(request, lsp_client: LanguageClient):
    lsp_client.deltas = Deltas(lsp_client)
    # answerAt=end: the request stays open for the whole decode, so there is something to cancel.
    # No prefetch: an edit must not start a decode of its own while we watch the counters.
    settings = {
        "maxTokens": 400,
        "maxLines": 0,
        "drafter": "none",
        "policy": UNCAPPED,
        "answerAt": "end",
        "prefetch": False,
    }
    await lsp_client.initialize_session(init_params(request.param, settings))
    yield
    await lsp_client.shutdown_session()


async def _counters(client: LanguageClient) -> dict:
    """The engine's counters (waiting for the engine to be up: it loads in the background)."""
    deadline = time.perf_counter() + 60
    while not (counters := (await stats(client))["engine"]["counters"]):
        assert time.perf_counter() < deadline, "engine did not start"
        await asyncio.sleep(0.1)
    return counters


async def _until(pred, timeout: float = 20.0, step: float = 0.05) -> None:
    deadline = time.perf_counter() + timeout
    while not await pred():
        assert time.perf_counter() < deadline, "condition not reached"
        await asyncio.sleep(step)


async def _decoding_stopped(client: LanguageClient, cancelled_before: int) -> dict:
    """Wait for the engine to count the cancellation, then check it takes no more steps."""

    async def counted() -> bool:
        return (await _counters(client))["cancelled"] > cancelled_before

    await _until(counted)
    first = await _counters(client)
    await asyncio.sleep(0.4)
    second = await _counters(client)
    assert second["decode_steps"] == first["decode_steps"], "the engine kept decoding after the cancel"
    assert second["tokens_generated"] == first["tokens_generated"]
    return second


async def _start_long(
    client: LanguageClient, uri: str, rid: str, cursor: tuple[int, int] = LONG_CURSOR
) -> asyncio.Task:
    task = asyncio.ensure_future(inline(client, uri, *cursor, msg_id=rid))
    await client.deltas.wait(lambda p: p["requestId"] == rid and p["text"])  # it is decoding now
    assert not task.done()
    return task


async def test_cancel_request_stops_decoding(client: LanguageClient):
    uri = f"file:///tmp/fimble-cancel/{id(client)}/a.py"
    open_doc(client, uri, LONG)
    # The longest decode a request may ask for (4,096 tokens: ~12 s on an idle machine, longer on a busy one), so the
    # cancel lands while it runs however slow the test's own loop is: with 400 (~1 s) the decode once finished first
    # under two test workers.
    await configure(client, maxTokens=4096, policy={"*": {**UNCAPPED["*"], "max_tokens": 4096}})
    try:
        before = await _counters(client)
        rid = f"long-{id(client)}"
        task = await _start_long(client, uri, rid)
        client.cancel_request(types.CancelParams(id=rid))
        with pytest.raises(JsonRpcRequestCancelled):
            await task
        after = await _decoding_stopped(client, before["cancelled"])
        assert after["tokens_generated"] - before["tokens_generated"] < 4096
        assert client.deltas.of(rid)[-1]["done"] and client.deltas.of(rid)[-1]["finishReason"] == "cancelled"
    finally:
        await configure(client, maxTokens=400, policy=UNCAPPED)


async def test_newer_request_cancels_older_decode(client: LanguageClient):
    uri = f"file:///tmp/fimble-cancel/{id(client)}/b.py"
    open_doc(client, uri, LONG_B + "\n\nx = math.")
    before = await _counters(client)
    old = await _start_long(client, uri, f"old-{id(client)}", LONG_B_CURSOR)
    await configure(client, maxTokens=8)
    new = await inline(client, uri, LONG_B_CURSOR[0] + 2, len("x = math."))  # other place: a new decode
    await _decoding_stopped(client, before["cancelled"])
    await old  # answered with what it had, not left hanging
    assert isinstance(new, types.InlineCompletionList)
    await configure(client, maxTokens=400)


async def test_diverging_edit_cancels_decode_and_drops_stale_answer(client: LanguageClient):
    uri = f"file:///tmp/fimble-cancel/{id(client)}/c.py"
    open_doc(client, uri, LONG)
    before = await _counters(client)
    old = await _start_long(client, uri, f"edit-{id(client)}")
    change(client, uri, 2, (0, 0), (0, 0), "# edited\n")  # not typing along the completion
    await _decoding_stopped(client, before["cancelled"])
    assert items_of(await old) == []  # computed for version 1, which is gone: dropped, never shown wrong
    assert (await stats(client))["counters"]["cancelled_by_edit"] >= 1


async def test_event_loop_stays_free_while_decoding(client: LanguageClient):
    uri = f"file:///tmp/fimble-cancel/{id(client)}/d.py"
    other = f"file:///tmp/fimble-cancel/{id(client)}/e.py"
    open_doc(client, uri, LONG)
    open_doc(client, other, "def add(a, b):\n    return \n")
    old = await _start_long(client, uri, f"busy-{id(client)}")
    # The server answers while the engine decodes: each answer says the decode is still running, and it is. (Not
    # a bound on the answer's time: on a busy machine that measures the machine; a blocked loop would answer only
    # after the decode, with nothing active.)
    for _ in range(5):
        s = await stats(client)
        assert s["tables"]["active"] == 1
        assert not old.done()
    await configure(client, maxTokens=8)
    t = time.perf_counter()
    change(client, other, 2, (1, 11), (1, 11), "a")
    result = await inline(client, other, 1, 12)
    assert isinstance(result, types.InlineCompletionList)
    assert time.perf_counter() - t < 15
    await old
    assert (await server_text(client, other))["text"].startswith("def add(a, b):\n    return a")
    await configure(client, maxTokens=400)


async def test_request_after_a_cancel_gets_a_decode_of_its_own(client: LanguageClient):
    """A request at the same cursor right after a cancel must not attach to the cancelled decode.

    The engine stops that decode one step later; a request arriving in between used to wait on it and
    be answered with its cut-off text (in Neovim often none: no ghost text at all).
    """
    for attempt in range(5):
        uri = f"file:///tmp/fimble-cancel/{id(client)}/f{attempt}.py"
        open_doc(client, uri, LONG)
        before = (await stats(client))["counters"]
        fid, sid = f"first-{id(client)}-{attempt}", f"second-{id(client)}-{attempt}"
        first = await _start_long(client, uri, fid)
        client.cancel_request(types.CancelParams(id=fid))
        second = asyncio.ensure_future(inline(client, uri, *LONG_CURSOR, msg_id=sid))  # no wait
        try:
            await first
        except JsonRpcRequestCancelled:
            break  # the cancel landed while the first decoded: what this test is about
        # A fast machine finished all 400 tokens before the cancel arrived (CI once did): nothing was
        # cancelled, so there is nothing to check. Clear up and try again in a fresh document.
        client.cancel_request(types.CancelParams(id=sid))
        with contextlib.suppress(JsonRpcRequestCancelled):
            await second
    else:
        pytest.fail("the first decode ended before its cancel arrived in 5 tries")

    async def second_started() -> bool:
        counters = (await stats(client))["counters"]
        return counters.get("generations", 0) >= before.get("generations", 0) + 2 or second.done()

    await _until(second_started)
    after = (await stats(client))["counters"]
    diff = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert after.get("generations", 0) == before.get("generations", 0) + 2, f"no decode of its own: {diff}"
    assert after.get("inflight_hits", 0) == before.get("inflight_hits", 0)
    client.cancel_request(types.CancelParams(id=sid))
    try:
        result = await second
    except JsonRpcRequestCancelled:
        return  # the usual case: still decoding its own 400 tokens when the cancel came
    # On a fast machine its own decode can finish before the cancel lands (CI once did). Then it must
    # have been that whole decode (400 tokens, ~7 per row, streamed in full), not the first's cut-off
    # text. (The final answer may be empty: shaping drops a 400-token run of rows cut mid-row here.)
    deltas = client.deltas.of(sid)
    assert deltas[-1]["done"] and deltas[-1]["finishReason"] == "length", deltas[-1]
    rows = max(d["text"].count("\n") for d in deltas)
    assert rows >= 30, f"streamed only {rows} rows: not a decode of its own"
    assert isinstance(result, types.InlineCompletionList)
