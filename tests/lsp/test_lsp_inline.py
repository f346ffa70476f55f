"""Inline completion end to end: answers, streamed deltas, completion fallback, type-through, settings, telemetry."""

from __future__ import annotations

import pytest
import pytest_lsp
from lsp_helpers import (
    CLIENTS,
    SAMPLE,
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
from pytest_lsp import LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

# An unfinished line in the middle of a file: every model has something to say here.
DOC, CURSOR = UNFINISHED_DOC, UNFINISHED_CURSOR
# A statement start in a function body: the syntax policy decodes a few lines there (at
# CURSOR, one line, which may be as short as ")").
BLOCK_DOC = SAMPLE.replace("    config = {}\n", "    config = {}\n    \n")
BLOCK_CURSOR = (BLOCK_DOC.split("\n").index("    "), 4)


@pytest_lsp.fixture(config=SERVER, params=CLIENTS, scope="module")
async def client(request, lsp_client: LanguageClient):
    lsp_client.deltas = Deltas(lsp_client)
    await lsp_client.initialize_session(init_params(request.param))
    yield
    await lsp_client.shutdown_session()


def _uri(client: LanguageClient, name: str) -> str:
    return f"file:///tmp/fimble-tests/{id(client)}/{name}.py"


async def test_inline_completion_appears(client: LanguageClient):
    uri = _uri(client, "appears")
    open_doc(client, uri, DOC)
    result = await inline(client, uri, *CURSOR)
    items = items_of(result)
    assert len(items) == 1
    item = items[0]
    assert item.insert_text.strip()
    assert item.range == types.Range(types.Position(*CURSOR), types.Position(*CURSOR))
    assert item.command is not None and item.command.arguments


async def test_deltas_arrive_in_order_with_growing_text(client: LanguageClient):
    uri = _uri(client, "deltas")
    open_doc(client, uri, DOC, version=7)
    rid = f"deltas-{id(client)}"
    result = await inline(client, uri, *CURSOR, msg_id=rid)
    await client.deltas.wait(lambda p: p["requestId"] == rid and p["done"])
    deltas = client.deltas.of(rid)
    assert len(deltas) >= 2, deltas
    texts = [d["text"] for d in deltas]
    for before, after in zip(texts, texts[1:], strict=False):
        assert after.startswith(before) and len(after) >= len(before)
    assert [d["done"] for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert all(d["uri"] == uri and d["version"] == 7 for d in deltas)
    assert deltas[0]["position"] == {"line": CURSOR[0], "character": CURSOR[1]}
    # The early answer is a prefix of what the stream went on to produce.
    answer = items_of(result)[0].insert_text
    assert texts[-1].startswith(answer)
    assert deltas[-1]["finishReason"] in ("stop", "eos", "length")


async def test_completion_fallback_returns_one_item_with_text_edit(client: LanguageClient):
    uri = _uri(client, "fallback")
    text = DOC.replace("    config = read_config(sys.argv[1])", "    config = read_con")
    open_doc(client, uri, text)
    line = text.splitlines().index("    config = read_con")
    col = len("    config = read_con")
    result = await client.text_document_completion_async(
        types.CompletionParams(text_document=types.TextDocumentIdentifier(uri), position=types.Position(line, col))
    )
    assert isinstance(result, types.CompletionList)
    assert len(result.items) == 1
    edit = result.items[0].text_edit
    assert isinstance(edit, types.TextEdit)
    # It replaces the word before the cursor, so the editor's filter keeps it.
    assert edit.range == types.Range(types.Position(line, col - len("read_con")), types.Position(line, col))
    assert edit.new_text.startswith("read_con") and len(edit.new_text) > len("read_con")


async def test_type_through_answers_from_cache_without_the_model(client: LanguageClient):
    uri = _uri(client, "typethrough")
    # A half-typed `with` header: every answer is validated, and at an empty line this small model's
    # first line often runs past maxTokens (nothing valid to answer), at `print(key, ` it says `)`.
    doc = SAMPLE.replace("    with open(path) as f:", "    with op")
    cursor = (doc.split("\n").index("    with op"), len("    with op"))
    open_doc(client, uri, doc)
    first = items_of(await inline(client, uri, *cursor))[0].insert_text
    await client.deltas.wait(lambda p: p["uri"] == uri and p["done"])  # let the decode finish
    before = await stats(client)
    typed = first[:2]
    change(client, uri, 2, cursor, cursor, typed)
    line, col = cursor[0], cursor[1] + len(typed)
    assert "\n" not in typed
    again = items_of(await inline(client, uri, line, col))
    after = await stats(client)
    assert again and again[0].insert_text.startswith(first[2:].rstrip())
    assert again[0].range.start == types.Position(line, col)
    assert after["engine"]["counters"]["submitted"] == before["engine"]["counters"]["submitted"]
    hits = after["cache"]["typethrough_hits"] + after["cache"]["inflight_hits"]
    assert hits > before["cache"]["typethrough_hits"] + before["cache"]["inflight_hits"]
    assert after["latency_ms"]["cache_answer"]["max"] < 20  # server-side; typically well under 1 ms


async def test_max_lines_and_per_language_enable(client: LanguageClient):
    uri = _uri(client, "settings")
    open_doc(client, uri, DOC)
    await configure(client, enable={"python": False})
    assert items_of(await inline(client, uri, *CURSOR)) == []
    await configure(client, enable={"python": True}, maxLines=1, maxTokens=48)
    items = items_of(await inline(client, uri, *CURSOR))
    assert items and "\n" not in items[0].insert_text
    await configure(client, maxLines=4, maxTokens=24)


async def test_telemetry_show_partial_accept_and_accept(client: LanguageClient):
    uri = _uri(client, "telemetry")
    open_doc(client, uri, DOC)
    item = items_of(await inline(client, uri, *CURSOR))[0]
    before = (await stats(client))["counters"]
    wire = {
        "insertText": item.insert_text,
        "command": {"title": item.command.title, "command": item.command.command, "arguments": item.command.arguments},
    }
    client.protocol.notify("textDocument/didShowCompletion", {"item": wire})
    client.protocol.notify("textDocument/didPartiallyAcceptCompletion", {"item": wire, "acceptedLength": 1})
    await client.workspace_execute_command_async(
        types.ExecuteCommandParams(command=item.command.command, arguments=item.command.arguments)
    )
    after = (await stats(client))["counters"]
    for name in ("shown", "partially_accepted", "accepted"):
        assert after.get(name, 0) == before.get(name, 0) + 1, name
    assert after["accepted_chars"] >= before.get("accepted_chars", 0) + 1 + len(item.insert_text)


async def test_stats_report_stage_histograms(client: LanguageClient):
    s = await stats(client)
    lat = s["latency_ms"]
    for stage in ("queue", "prompt_build", "prefill", "first_token", "complete"):
        assert lat[stage]["count"] > 0, stage
        assert lat[stage]["p50"] is not None
    assert s["engine"]["state"] == "ready"
    assert {"typethrough_hits", "inflight_hits", "misses"} <= set(s["cache"])
