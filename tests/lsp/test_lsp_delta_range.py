"""fimble/completionDelta carries ``replaceEnd``: a client that builds its item from a delta (VS Code's
streaming ghost text does) replaces the auto-paired closers the text re-types, as the answer's range does.

Before: deltas had no range, the VS Code extension inserted at the cursor, and accepting `1.0) / 2.0`
at `math.sqrt(|)` gave `math.sqrt(1.0) / 2.0)`.
"""

from __future__ import annotations

import pytest
import pytest_lsp
from lsp_helpers import SERVER, Deltas, init_params, inline, items_of, open_doc
from lsprotocol import types
from pytest_lsp import LanguageClient

from lsp_server.answer import RequestInfo
from lsp_server.documents import DocumentStore
from lsp_server.prompt import build_context
from lsp_server.shaping.stage import delta_replace_end

SQRT_DOC = "import math\n\n\ndef half_root():\n    return math.sqrt()\n"
SQRT_CURSOR = (4, len("    return math.sqrt("))


class _Gen:
    """The parts of a Generation the range function reads: a decode still streaming."""

    done = False
    replace_cols = None
    text = ""


def _replace_end(
    text: str, line_rest_doc: str, cursor: tuple[int, int], encoding: str = "utf-16", client_char: int | None = None
) -> dict:
    docs = DocumentStore()
    doc = docs.open("file:///t.py", line_rest_doc, 1, "python")
    ctx = build_context(doc, cursor[0], cursor[1], 4000, 1000)
    char = cursor[1] if client_char is None else client_char
    req = RequestInfo(1, None, {"line": cursor[0], "character": char}, 0.0, encoding=encoding)
    return delta_replace_end(doc, ctx, _Gen(), 0, req.position, req.encoding)(text, False)


def test_delta_range_covers_the_closer_the_text_retypes():
    assert _replace_end("1.0) / 2.0", SQRT_DOC, SQRT_CURSOR) == {"line": 4, "character": SQRT_CURSOR[1] + 1}
    # Still inside the call: nothing re-typed yet, a plain insertion.
    assert _replace_end("1.0", SQRT_DOC, SQRT_CURSOR) == {"line": 4, "character": SQRT_CURSOR[1]}
    # Its own call's closer is not the editor's: `g(a)` inside `sqrt(|)` replaces nothing.
    assert _replace_end("g(a)", SQRT_DOC, SQRT_CURSOR) == {"line": 4, "character": SQRT_CURSOR[1]}


def test_delta_range_is_in_client_units():
    # A non-BMP character before the cursor: UTF-16 counts it twice, the range end follows the request's units.
    doc = "import math\n\n\ndef half_root():\n    return '\U0001f600' + math.sqrt()\n"
    cursor = (4, len("    return '\U0001f600' + math.sqrt("))
    got = _replace_end("2.0)", doc, cursor, "utf-16", client_char=cursor[1] + 1)
    assert got == {"line": 4, "character": cursor[1] + 2}


@pytest_lsp.fixture(config=SERVER, params=["visual-studio-code"], scope="module")
async def client(request, lsp_client: LanguageClient):
    await lsp_client.initialize_session(init_params(request.param, {"streaming": True, "answerAt": "end"}))
    yield
    await lsp_client.shutdown_session()


@pytest.mark.asyncio(loop_scope="module")
async def test_every_delta_has_a_range_and_the_last_one_matches_the_answer(client: LanguageClient):
    deltas = Deltas(client)
    uri = "file:///tmp/fimble-delta-range/sqrt.py"
    open_doc(client, uri, SQRT_DOC)
    result = await inline(client, uri, *SQRT_CURSOR, msg_id=4242)
    got = await deltas.wait(lambda p: p["requestId"] == 4242 and p["done"])
    mine = [p for p in got if p["requestId"] == 4242]
    assert mine and all("replaceEnd" in p for p in mine), mine
    for p in mine:
        end = p["replaceEnd"]
        assert end["line"] == SQRT_CURSOR[0] and end["character"] in (SQRT_CURSOR[1], SQRT_CURSOR[1] + 1), p
    items = items_of(result)
    final = mine[-1]
    if items and items[0].insert_text == final["text"].rstrip():
        # The streamed end and the answer agree on what the text replaces.
        assert items[0].range.end == types.Position(**final["replaceEnd"]), (items[0], final)
