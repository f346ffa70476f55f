"""KV cache pre-warming end to end: didOpen, settled edits and fimble/cursor fill the cache; fimble/stats shows it."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_lsp
from lsp_helpers import SERVER, change, init_params, inline, open_doc, stats
from lsprotocol import types
from pytest_lsp import LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

# About 150 lines of Python: a prompt of several hundred tokens, far more than the bound below.
DOC = (
    "import math\n\n\n"
    + "".join(
        f"def scale_{i}(values, factor={i}):\n"
        f'    """Multiply every value by {i} and round it."""\n'
        f"    out = [round(v * factor, {i % 4}) for v in values]\n"
        f"    return [math.floor(v) for v in out if v > {i}]\n\n\n"
        for i in range(25)
    )
    + "def main():\n    data = [1.5, 2.5, 3.5]\n"
)
LINES = DOC.split("\n")
END = (len(LINES) - 1, 0)  # DOC ends with a newline: the cursor at its end is on an empty last line
PREFILL_BOUND = 16


@pytest_lsp.fixture(config=SERVER, scope="module")
async def client(lsp_client: LanguageClient):
    # prefetch off: an edit alone must be what pre-warms (a prefetch would decode there itself).
    await lsp_client.initialize_session(init_params("visual-studio-code", {"prefetch": False, "prewarmDelayMs": 50}))
    yield
    await lsp_client.shutdown_session()


async def _wait_stats(client: LanguageClient, pred, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = await stats(client)
        if pred(snap):
            return snap
        assert time.monotonic() < deadline, f"timed out; engine counters: {snap['engine']['counters']}"
        await asyncio.sleep(0.1)


def _engine(snap: dict) -> dict:
    return snap["engine"]["counters"]


async def test_prewarm_after_open_then_completion_prefills_little(client: LanguageClient):
    assert len(LINES) > 140
    uri = "file:///tmp/fimble-tests/prewarm/open.py"
    open_doc(client, uri, DOC)
    snap = await _wait_stats(client, lambda s: _engine(s).get("prewarms_done", 0) >= 1)
    before = _engine(snap)
    assert before["tokens_prewarmed"] > 100, before
    assert snap["counters"]["prewarms_sent"] >= 1
    await inline(client, uri, *END)
    after = _engine(await stats(client))
    assert after["submitted"] == before["submitted"] + 1
    prefilled = after["tokens_prefilled"] - before["tokens_prefilled"]
    assert prefilled <= PREFILL_BOUND, (prefilled, after["tokens_reused"] - before["tokens_reused"])
    assert after["tokens_reused"] - before["tokens_reused"] > 100


async def test_prewarm_after_edits_settle(client: LanguageClient):
    uri = "file:///tmp/fimble-tests/prewarm/edit.py"
    open_doc(client, uri, DOC)
    snap = await _wait_stats(client, lambda s: _engine(s).get("prewarms_done", 0) >= 2)
    # Type a new statement at the top of a function in the middle of the file: everything
    # after it moves, so without a pre-warm the next completion would recompute it all.
    row = LINES.index("def scale_12(values, factor=12):")
    change(client, uri, 2, (row, len(LINES[row])), (row, len(LINES[row])), "\n")
    typed = "    m = "
    for i, ch in enumerate(typed):
        change(client, uri, 3 + i, (row + 1, i), (row + 1, i), ch)
    done = _engine(snap)["prewarms_done"]
    snap = await _wait_stats(client, lambda s: _engine(s)["prewarms_done"] > done)
    before = _engine(snap)
    await inline(client, uri, row + 1, len(typed))
    after = _engine(await stats(client))
    prefilled = after["tokens_prefilled"] - before["tokens_prefilled"]
    assert prefilled <= PREFILL_BOUND, prefilled


def _cursor(client: LanguageClient, uri: str, line: int, character: int) -> None:
    client.protocol.notify(
        "fimble/cursor", {"textDocument": {"uri": uri}, "position": {"line": line, "character": character}}
    )


async def test_cursor_notification_prewarms_where_the_cursor_rests(client: LanguageClient):
    uri = "file:///tmp/fimble-tests/prewarm/cursor.py"
    done = _engine(await stats(client)).get("prewarms_done", 0)
    open_doc(client, uri, DOC)  # pre-warms for a cursor at the end: wait for it
    snap = await _wait_stats(client, lambda s: _engine(s).get("prewarms_done", 0) > done)
    # Jump to the middle of the file: an empty line between two functions.
    row = LINES.index("def scale_12(values, factor=12):") - 1
    assert LINES[row] == ""
    done, counters = _engine(snap)["prewarms_done"], snap["counters"]
    _cursor(client, uri, row, 0)
    snap = await _wait_stats(client, lambda s: _engine(s)["prewarms_done"] > done)
    assert snap["counters"]["cursor_notifications"] == counters.get("cursor_notifications", 0) + 1
    before = _engine(snap)
    assert before["tokens_prewarmed"] > 100
    await inline(client, uri, row, 0)
    after = _engine(await stats(client))
    prefilled = after["tokens_prefilled"] - before["tokens_prefilled"]
    assert prefilled <= PREFILL_BOUND, prefilled
    # The same cursor again (editors report the cursor after a completion, after typing): nothing to do.
    _cursor(client, uri, row, 0)
    snap = await stats(client)
    assert snap["counters"]["cursor_skipped"] >= 1 and snap["tables"]["prewarms_pending"] == 0
    # Bad params are ignored (no error for a notification); the server goes on.
    _cursor(client, uri, -1, 0)
    client.protocol.notify("fimble/cursor", {"textDocument": {}})
    _cursor(client, "file:///tmp/fimble-tests/prewarm/never-opened.py", 3, 0)
    snap = await stats(client)
    assert snap["counters"]["cursor_invalid"] >= 2 and snap["tables"]["prewarms_pending"] == 0
    # The control: a jump without fimble/cursor recomputes about the whole prompt.
    other = LINES.index("def scale_5(values, factor=5):") - 1
    before = _engine(snap)
    await inline(client, uri, other, 0)
    after = _engine(await stats(client))
    prefilled = after["tokens_prefilled"] - before["tokens_prefilled"]
    assert prefilled > 100, prefilled


async def test_stats_report_the_kv_cache_and_close_forgets(client: LanguageClient):
    snap = await stats(client)
    kv = snap["kvCache"]
    assert kv["bytes"] > 0 and kv["budgetBytes"] >= kv["bytes"] and kv["documents"] >= 1, kv
    for key in (
        "hits",
        "misses",
        "evictions",
        "segments",
        "tokens",
        "prewarmedTokens",
        "prewarmsDone",
        "prefilledTokens",
        "reusedTokens",
        "hitRate",
        "prewarmsSent",
    ):
        assert key in kv, key
    assert kv["prewarmedTokens"] > 0 and kv["hits"] > 0
    assert snap["settings"]["prewarm"] is True and snap["settings"]["kvShiftReuse"] is False
    docs = kv["documents"]
    client.text_document_did_close(
        types.DidCloseTextDocumentParams(types.TextDocumentIdentifier("file:///tmp/fimble-tests/prewarm/open.py"))
    )
    snap = await _wait_stats(client, lambda s: s["kvCache"]["documents"] < docs, timeout=20)
    assert snap["tables"]["prewarms_pending"] == 0
