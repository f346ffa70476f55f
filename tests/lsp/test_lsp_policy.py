"""The syntax policy in the server: per-context decode options, the closer guard, shaped answers."""

from __future__ import annotations

import re

import pytest
import pytest_lsp
from lsp_helpers import (
    SAMPLE,
    SERVER,
    UNFINISHED_CURSOR,
    UNFINISHED_DOC,
    configure,
    init_params,
    inline,
    items_of,
    open_doc,
    stats,
)
from lsprotocol import types
from pytest_lsp import LanguageClient

from lsp_server.shaping.syntax.document import SyntaxDocument

pytestmark = pytest.mark.asyncio(loop_scope="module")

# `foo(bar, |)`: the editor auto-paired the `)` after the cursor.
CALL_DOC = "def foo(a, b):\n    return a + b\n\n\nbar = 1\nx = foo(bar, )\n"
CALL_CURSOR = (5, len("x = foo(bar, "))
# A comment being written, and code, in the same file.
COMMENT_DOC = SAMPLE.replace("    config = {}\n", "    # Parse each line of the\n    config = {}\n")
COMMENT_CURSOR = (6, len("    # Parse each line of the"))
CODE_DOC, CODE_CURSOR = UNFINISHED_DOC, UNFINISHED_CURSOR
# A statement start inside a function body: several lines are decoded there.
# (A cursor where the embedded model's greedy answer is a valid block: validation drops an answer that
# would add a parse error, so a cursor where the model writes invalid code tests nothing here.)
BLOCK_DOC = SAMPLE.replace("    return config\n", "    \n    return config\n")
BLOCK_CURSOR = (BLOCK_DOC.split("\n").index("    "), 4)


@pytest_lsp.fixture(config=SERVER, params=["visual-studio-code"], scope="module")
async def client(request, lsp_client: LanguageClient):
    await lsp_client.initialize_session(init_params(request.param, {"streaming": False, "answerAt": "end"}))
    yield
    await lsp_client.shutdown_session()


def _uri(name: str) -> str:
    return f"file:///tmp/fimble-policy/{name}.py"


def _apply(text: str, rng: types.Range, new: str) -> str:
    lines = text.split("\n")
    start = sum(len(x) + 1 for x in lines[: rng.start.line]) + rng.start.character
    end = sum(len(x) + 1 for x in lines[: rng.end.line]) + rng.end.character
    return text[:start] + new + text[end:]


def _unmatched_closers(text: str) -> int:
    """`)` with no `(` before it in ``text`` (string literals ignored)."""
    depth = unmatched = 0
    for ch in re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", "", text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth:
                depth -= 1
            else:
                unmatched += 1
    return unmatched


async def test_auto_paired_closer_is_never_duplicated(client: LanguageClient):
    uri = _uri("call")
    open_doc(client, uri, CALL_DOC)
    items = items_of(await inline(client, uri, *CALL_CURSOR))
    assert items, "the model has something to say inside a call"
    item = items[0]
    assert item.range.start == types.Position(*CALL_CURSOR)
    covers_closer = item.range.end == types.Position(CALL_CURSOR[0], CALL_CURSOR[1] + 1)
    assert covers_closer or _unmatched_closers(item.insert_text) == 0, item
    assert item.range.end in (item.range.start, types.Position(CALL_CURSOR[0], CALL_CURSOR[1] + 1))
    # Either way, accepting it leaves exactly one `)` closing the call.
    line = _apply(CALL_DOC, item.range, item.insert_text).split("\n")[5]
    assert _unmatched_closers(line) == 0 and line.count("(") == line.count(")") or "#" in line, line
    assert (await stats(client))["lastPolicy"]["context"] == "call_args"


async def test_comment_and_code_get_different_options(client: LanguageClient):
    open_doc(client, _uri("comment"), COMMENT_DOC)
    open_doc(client, _uri("code"), CODE_DOC)
    await inline(client, _uri("comment"), *COMMENT_CURSOR)
    comment = (await stats(client))["lastPolicy"]
    await inline(client, _uri("code"), *CODE_CURSOR)
    code = (await stats(client))["lastPolicy"]
    assert comment["uri"] == _uri("comment") and code["uri"] == _uri("code")
    assert comment["context"] == "comment" and code["context"] != "comment"
    assert comment["options"] != code["options"]
    assert comment["options"]["confidence_gate"] == 0.5 and code["options"]["confidence_gate"] == 0.3
    # Settings cap the decision (init: maxTokens 24, maxLines 4); `policy` overrides it per context.
    assert comment["options"]["max_tokens"] <= 24 and code["options"]["max_tokens"] <= 24
    await configure(client, policy={"comment": {"max_tokens": 5, "gamma": 1}})
    open_doc(client, _uri("comment2"), COMMENT_DOC)
    await inline(client, _uri("comment2"), *COMMENT_CURSOR)
    s = await stats(client)
    assert s["lastPolicy"]["options"]["max_tokens"] == 5 and s["lastPolicy"]["options"]["gamma"] == 1
    assert s["settings"]["policy"] == {"comment": {"max_tokens": 5, "gamma": 1}}
    await configure(client, policy=None)


async def test_multi_line_answer_adds_no_parse_error(client: LanguageClient):
    uri = _uri("block")
    open_doc(client, uri, BLOCK_DOC)
    assert not list(SyntaxDocument("python", BLOCK_DOC).error_nodes())
    items = items_of(await inline(client, uri, *BLOCK_CURSOR))
    s = await stats(client)
    assert s["lastPolicy"]["context"] in ("block_body", "block_start")
    assert s["lastPolicy"]["options"]["max_lines"] > 1
    assert items and "\n" in items[0].insert_text, "a multi-line completion at a statement start"
    after = _apply(BLOCK_DOC, items[0].range, items[0].insert_text)
    assert not list(SyntaxDocument("python", after).error_nodes()), after
