"""No unbounded growth: 20,000 keystrokes leave every internal table small (pygls' future leak included).

The 20,000 run in the heavy suite (tests/heavy.sh); the default suite types 5,000, where a leak of one entry per
notification (pygls' futures) is still a thousand times the bound."""

from __future__ import annotations

import pytest
import pytest_lsp
from lsp_helpers import SERVER, change, init_params, inline, items_of, open_doc, server_text, stats
from lsprotocol import types
from pytest_lsp import LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEYSTROKES = 20_000  # tests/heavy.sh: about 20 s on 2 cores
DEFAULT_KEYSTROKES = 5_000


@pytest_lsp.fixture(config=SERVER, params=["visual-studio-code"], scope="module")
async def client(request, lsp_client: LanguageClient):
    await lsp_client.initialize_session(
        init_params(request.param, {"maxTokens": 8, "prefixChars": 1000, "streaming": False})
    )
    yield
    await lsp_client.shutdown_session()


@pytest.mark.parametrize("keystrokes", [pytest.param(KEYSTROKES, marks=pytest.mark.heavy), DEFAULT_KEYSTROKES])
async def test_keystrokes_keep_tables_bounded(client: LanguageClient, keystrokes: int):
    uri = "file:///tmp/fimble-bounded/typing.py"
    baseline = (await stats(client))["tables"]
    open_doc(client, uri, "def f():\n    return 1\n")
    # Type the characters, one didChange each, in lines of 40; ask for a completion every 5,000.
    line, col = 2, 0
    for i in range(keystrokes):
        ch = "\n" if i % 40 == 39 else "abcdefghij"[i % 10]
        change(client, uri, i + 2, (line, col), (line, col), ch)
        line, col = (line + 1, 0) if ch == "\n" else (line, col + 1)
        if i % 5000 == 4999:
            assert isinstance(await inline(client, uri, line, col), types.InlineCompletionList)
    doc = await server_text(client, uri)
    assert doc["version"] == keystrokes + 1
    assert doc["length"] == len("def f():\n    return 1\n") + keystrokes
    tables = (await stats(client))["tables"]
    assert tables["pygls_request_futures"] <= 5, tables  # unpatched pygls: one per notification
    assert tables["pygls_result_types"] <= 5, tables
    assert tables["documents"] == baseline["documents"] + 1
    assert tables["subscriptions"] <= 1 and tables["recent_generations"] <= 3
    assert tables["telemetry_items"] <= 512
    assert tables["asyncio_tasks"] <= baseline["asyncio_tasks"] + 5, tables
    client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri)))
    tables = (await stats(client))["tables"]
    assert tables["documents"] == baseline["documents"]
    assert tables["recent_docs"] == 0 and tables["request_seq"] == 0
    assert items_of(await inline(client, uri, 0, 0)) == []  # closed: gone
