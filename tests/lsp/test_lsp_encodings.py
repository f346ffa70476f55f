"""Position encodings negotiated end to end: incremental edits around non-ASCII text land where the client meant."""

from __future__ import annotations

import pytest
import pytest_lsp
from lsp_helpers import SERVER, change, init_params, open_doc, server_text
from pytest_lsp import LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

# (capability set, encodings the client lists or None for the set's own, expected negotiated encoding)
CASES = {
    "visual-studio-code": ("visual-studio-code", None, "utf-16"),
    "neovim": ("neovim", None, "utf-8"),
    "utf-32": ("visual-studio-code", ["utf-32", "utf-16"], "utf-32"),
}

TEXT = "a = 'é😀x'\r\nb = '日本'\nc = 1\n"


def units(s: str, encoding: str) -> int:
    return {"utf-8": len(s.encode("utf-8")), "utf-16": len(s.encode("utf-16-le")) // 2, "utf-32": len(s)}[encoding]


@pytest_lsp.fixture(config=SERVER, params=list(CASES), scope="module")
async def client(request, lsp_client: LanguageClient):
    caps, encodings, expected = CASES[request.param]
    result = await lsp_client.initialize_session(init_params(caps, {"preload": False}, encodings))
    lsp_client.encoding = expected
    lsp_client.negotiated = result.capabilities.position_encoding
    yield
    await lsp_client.shutdown_session()


async def test_encoding_is_negotiated(client: LanguageClient):
    assert client.negotiated == client.encoding


async def test_incremental_edits_with_non_ascii(client: LanguageClient):
    enc = client.encoding
    uri = f"file:///tmp/fimble-enc/{enc}.py"
    open_doc(client, uri, TEXT)
    text = TEXT
    # Insert after the emoji on line 0 (its column depends on the encoding).
    col = units("a = 'é😀", enc)
    change(client, uri, 2, (0, col), (0, col), "🎉")
    text = text.replace("é😀x", "é😀🎉x")
    # Replace 日本 (3 UTF-8 bytes each) on line 1 with ASCII.
    start, end = units("b = '", enc), units("b = '日本", enc)
    change(client, uri, 3, (1, start), (1, end), "jp")
    text = text.replace("日本", "jp")
    # A multi-line edit that spans the CRLF line break.
    change(client, uri, 4, (0, units("a = 'é😀🎉x'", enc)), (1, 1), "\n\nB")
    text = text.replace("x'\r\nb", "x'\n\nB")
    # Past the end of a line clamps to its end, as the spec says.
    change(client, uri, 5, (3, 99), (3, 99), "  # one")
    text = text.replace("c = 1\n", "c = 1  # one\n")
    doc = await server_text(client, uri)
    assert doc["text"] == text
    assert doc["version"] == 5


async def test_line_breaks_are_only_lsp_ones(client: LanguageClient):
    # U+2028, form feed and NEL are not line breaks in LSP: line 1 must be "y".
    uri = f"file:///tmp/fimble-enc/breaks-{client.encoding}.py"
    text = "x = '\u2028\x0c\x85'\ny\n"
    open_doc(client, uri, text)
    change(client, uri, 2, (1, 0), (1, 1), "z")
    assert (await server_text(client, uri))["text"] == text.replace("\ny\n", "\nz\n")


async def test_crlf_joined_by_an_edit(client: LanguageClient):
    uri = f"file:///tmp/fimble-enc/crlf-{client.encoding}.py"
    open_doc(client, uri, "a\rb\n")  # a lone CR ends line 0
    change(client, uri, 2, (1, 0), (1, 0), "\n")  # now "a\r\nb": still two lines, not three
    doc = await server_text(client, uri)
    assert doc["text"] == "a\r\nb\n"
    assert doc["lines"] == 3  # "a\r\n", "b\n" and the empty last line
    change(client, uri, 3, (1, 0), (1, 1), "c")  # so line 1 is "b", as the client counts
    assert (await server_text(client, uri))["text"] == "a\r\nc\n"
