"""Bad params get an LSP error or an empty result, never a crash; huge and odd files work."""

from __future__ import annotations

import time

import pytest
import pytest_lsp
from lsp_helpers import (
    CLIENTS,
    SAMPLE,
    SERVER,
    change,
    init_params,
    inline,
    items_of,
    open_doc,
    server_text,
    stats,
)
from lsprotocol import types
from pygls.exceptions import JsonRpcInvalidParams
from pytest_lsp import LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

EMOJI_LINE = 'label = "😀 done"'  # 😀 is U+1F600: 2 UTF-16 units, 4 UTF-8 bytes


@pytest_lsp.fixture(config=SERVER, params=CLIENTS, scope="module")
async def client(request, lsp_client: LanguageClient):
    # A generic client (no streaming), small windows: the huge-file tests stay quick.
    await lsp_client.initialize_session(
        init_params(request.param, {"maxTokens": 8, "streaming": False, "prefixChars": 1500, "suffixChars": 500})
    )
    lsp_client.encoding = "utf-8" if request.param == "neovim" else "utf-16"  # what each set negotiates
    yield
    await lsp_client.shutdown_session()


def _uri(client: LanguageClient, name: str) -> str:
    return f"file:///tmp/fimble-bad/{id(client)}/{name}"


async def _alive(client: LanguageClient) -> None:
    assert (await stats(client))["engine"]["state"] in ("ready", "starting")


async def test_unknown_uri_gives_empty_result(client: LanguageClient):
    result = await inline(client, _uri(client, "never-opened.py"), 0, 0)
    assert items_of(result) == []
    completion = await client.text_document_completion_async(
        types.CompletionParams(
            text_document=types.TextDocumentIdentifier(_uri(client, "never-opened.py")), position=types.Position(0, 0)
        )
    )
    assert completion is None or not completion.items
    change(client, _uri(client, "never-opened.py"), 3, (0, 0), (0, 0), "x")  # ignored, no crash
    await _alive(client)


async def test_position_past_end_of_line_is_clamped(client: LanguageClient):
    uri = _uri(client, "eol.py")
    text = "def f(x):\n    return x +"
    open_doc(client, uri, text)
    result = await inline(client, uri, 1, 500)
    for item in items_of(result):  # clamped to the line's end, as the LSP spec says
        assert item.range.start == types.Position(1, len("    return x +"))
    await _alive(client)


async def test_position_past_end_of_file_gives_empty_result(client: LanguageClient):
    uri = _uri(client, "eof.py")
    open_doc(client, uri, "x = 1\n")
    assert items_of(await inline(client, uri, 2, 0)) == []
    assert items_of(await inline(client, uri, 10_000, 3)) == []
    await _alive(client)


async def test_position_inside_a_character_is_invalid_params(client: LanguageClient):
    uri = _uri(client, "emoji.py")
    open_doc(client, uri, EMOJI_LINE + "\n")
    start = len('label = "')
    inside = start + 1 if client.encoding == "utf-16" else start + 2  # the pair's middle / byte 2 of 4
    with pytest.raises(JsonRpcInvalidParams):
        await inline(client, uri, 0, inside)
    after = start + (2 if client.encoding == "utf-16" else 4)  # just after the emoji: fine
    result = await inline(client, uri, 0, after)
    for item in items_of(result):
        assert item.range.start == types.Position(0, after)
    await _alive(client)


async def test_non_utf8_file(client: LanguageClient, tmp_path):
    # What an editor sends for a Latin-1 file it decoded with surrogateescape: lone surrogates.
    raw = "# caf\xe9 r\xe9sum\xe9\nname = 'caf\xe9'\nprint(name".encode("latin-1")
    path = tmp_path / "latin1.py"
    path.write_bytes(raw)
    uri = path.as_uri()
    text = raw.decode("utf-8", "surrogateescape")
    open_doc(client, uri, text)
    result = await inline(client, uri, 2, len("print(name"))
    assert isinstance(result, types.InlineCompletionList)
    assert (await server_text(client, uri))["text"] == text  # kept exactly, lone surrogates and all
    # Never opened, only on disk: the server does not read files behind the editor's back.
    other = tmp_path / "other.py"
    other.write_bytes(raw)
    assert items_of(await inline(client, other.as_uri(), 0, 0)) == []
    await _alive(client)


async def test_ten_megabyte_file(client: LanguageClient):
    uri = _uri(client, "big.py")
    copies = 10_000_000 // len(SAMPLE) + 1
    text = SAMPLE * copies + "def tail():\n    return "
    assert len(text) >= 10_000_000
    t = time.perf_counter()
    open_doc(client, uri, text)
    last = text.count("\n")
    result = await inline(client, uri, last, len("    return "))
    assert isinstance(result, types.InlineCompletionList)
    mid = last // 2
    change(client, uri, 2, (mid, 0), (mid, 0), "# an edit in the middle\n")
    result = await inline(client, uri, mid, len("# an edit"))
    assert isinstance(result, types.InlineCompletionList)
    doc = await server_text(client, uri)
    assert doc["length"] == len(text) + len("# an edit in the middle\n")
    assert time.perf_counter() - t < 60
    client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri)))
    await _alive(client)


async def test_very_long_line(client: LanguageClient):
    uri = _uri(client, "long-line.js")
    line = "var data = [" + "1, 😀, " * 150_000  # about 1 MB on one line, non-BMP characters throughout
    open_doc(client, uri, line, language="javascript")
    units = len(line.encode("utf-16-le")) // 2 if client.encoding == "utf-16" else len(line.encode("utf-8"))
    result = await inline(client, uri, 0, units)
    for item in items_of(result):
        assert item.range.start == types.Position(0, units)
    await _alive(client)
