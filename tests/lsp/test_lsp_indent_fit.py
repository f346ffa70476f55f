"""No indentation added to the editor's auto-indent (found driving VS Code).

VS Code auto-indents the line after Enter; the model (token healing off, VS Code's default) re-typed
indentation there and the ghost text sat 2-4 columns deeper. lsp_server/indent.py drops it.
"""

from __future__ import annotations

import pytest
import pytest_lsp
from lsp_helpers import REPO, SERVER, init_params, inline, items_of, open_doc
from pytest_lsp import LanguageClient

from lsp_server.indent import IndentFit, applies


def _fit(chunks: list[str]) -> str:
    f = IndentFit()
    return "".join(f.feed(c) for c in chunks)


def test_first_line_indent_is_dropped_and_the_block_dedented_alike():
    assert _fit(["    return x"]) == "return x"
    # Streamed in pieces, whitespace split across chunks; the next lines (absolute columns: the model
    # put the block at 8, the editor's indentation is 4) lose the same 4 columns.
    assert _fit(["  ", "  data = f.read(", ")\n", "        return ", "data\n"]) == "data = f.read()\n    return data\n"
    # A deeper line keeps its relative indentation; a shallower one (a dedent) is left as it is.
    assert _fit(["    if x:\n            y()\n    z()\nw()"]) == "if x:\n        y()\nz()\nw()"


def test_nothing_added_nothing_dropped():
    assert _fit(["return x\n    ", "y"]) == "return x\n    y"
    assert _fit(["\n    x = 1"]) == "\n    x = 1"  # the first line ends at once: nothing to drop
    assert _fit(["    \n", "    x"]) == "\n    x"  # a blank first line's trailing whitespace


def test_applies_only_in_an_empty_lines_indentation():
    assert applies("    ", "")
    assert not applies("", "")  # column 0: the model's indentation is the line's own
    assert not applies("    x =", "")
    assert not applies("    ", "foo()")


@pytest_lsp.fixture(config=SERVER, params=["visual-studio-code"], scope="module")
async def client(request, lsp_client: LanguageClient):
    # VS Code's defaults: no token healing, streaming.
    await lsp_client.initialize_session(init_params(request.param, {"tokenHealing": False, "answerAt": "end"}))
    yield
    await lsp_client.shutdown_session()


@pytest.mark.asyncio(loop_scope="module")
async def test_answers_after_an_auto_indented_enter_start_at_the_cursor(client: LanguageClient):
    # A real file above, then a header and the editor's auto-indent. Before the fix every one of these
    # answered with 2-4 extra spaces (`    return x`, `  return x + y`).
    context = (REPO / "lsp_server" / "positions.py").read_text().rstrip("\n") + "\n\n\n"
    tails = [
        "def read_bytes(path):\n    ",
        "def area(radius):\n    ",
        "class Point:\n    def __init__(self, x, y):\n        ",
        "def square(x):\n    ",
        "def mean(values):\n    ",
        "def main():\n    ",
    ]
    answered = []
    for i, tail in enumerate(tails):
        text = context + tail
        uri = f"file:///tmp/fimble-indent/t{i}.py"
        open_doc(client, uri, text)
        items = items_of(await inline(client, uri, text.count("\n"), len(text.split("\n")[-1])))
        if items:
            answered.append(items[0].insert_text)
    assert len(answered) >= 3, answered
    assert not any(t[:1].isspace() for t in answered), answered
