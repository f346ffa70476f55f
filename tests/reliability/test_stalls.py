"""No stalls on pathological text: bounded work, asserted by counters or wide per-call limits.

- the plain-text fallback lexer is linear (it copied the rest of the buffer per character);
- a cursor under a 1 MB line lexes a bounded window, not the line;
- a lone "\\r" keeps edits incremental (it used to force a whole-document parse per keystroke),
  and the incremental trees still equal a fresh parse;
- the parse limits hold on every edit (size, and long lines), both ways;
- end to end over stdio with the real engine: no keystroke or request blocks the server's event
  loop for more than 2 s (the target is 250 ms: bench figures in the issue's report), measured by
  a ping sent during the work, on a 1M-character document with a 1 MB line above the cursor and
  on a 900 KB file with a lone "\\r".
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lsp_server.documents as documents
from bench.harness.raw_lsp import Pinger, RawServer, big_line_document, lone_cr_document, type_and_ask
from lsp_server.documents import Document, split_lines, syntax_text
from lsp_server.shaping.syntax import lexer
from lsp_server.shaping.syntax.context import classify
from lsp_server.shaping.syntax.document import SyntaxDocument


def _run_within(seconds: float, fn) -> None:
    """Run ``fn`` in a thread; fail if it has not finished after ``seconds`` (a wide bound, not a timing)."""
    done = threading.Event()
    error: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test
            error.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(seconds), f"did not finish within {seconds} s"
    if error:
        raise error[0]


# -- lexer -----------------------------------------------------------------------------------------
def test_fallback_lexer_is_linear_on_a_megabyte():
    # About 3 s on an idle 2-core machine; the quadratic version took about a minute.
    text = ('x = "a" + (b / c) ' * 60_000)[:1_000_000]
    scanner = lexer.Scanner(lexer.SPECS["javascript"], strict=False)
    _run_within(25.0, lambda: scanner.feed(text, final=True))
    assert scanner.pos == len(text)


def test_cursor_under_a_megabyte_line_lexes_a_bounded_window(monkeypatch):
    text, (line, col) = big_line_document()
    doc = Document("file:///big.py", text, 1, "python")
    assert len(text) > documents.SYNTAX_MAX_CHARS and not doc.syntax.has_tree  # plain text: the fallback path
    fed: list[int] = []
    feed = lexer.Scanner.feed
    monkeypatch.setattr(lexer.Scanner, "feed", lambda self, t, final=False: fed.append(len(t)) or feed(self, t, final))
    ctx = classify(doc.syntax, doc.byte_offset(line, col))
    assert sum(fed) <= 20_000  # the old 60-line window read the whole 1 MB line
    assert [f.open for f in ctx.frames][-1:] == ["("]  # still finds the open call on the cursor line


# -- lone "\r" ------------------------------------------------------------------------------------
class _ParseCounter:
    """Counts whole-document parses of SyntaxDocument (set_text) while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.count = 0
        original = SyntaxDocument.set_text

        def counting(doc: SyntaxDocument, text) -> None:
            self.count += doc.has_tree and len(text) > 0
            original(doc, text)

        monkeypatch.setattr(SyntaxDocument, "set_text", counting)


def test_lone_cr_keeps_typing_incremental(monkeypatch):
    text = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(400)).replace("+ 3\n", "+ 3\r", 1)
    doc = Document("file:///cr.py", text, 1, "python")
    parses = _ParseCounter(monkeypatch)
    line = len(doc.lines) - 2
    for i in range(50):  # typing below the lone "\r", then above it
        doc.apply_edit((line, 4 + i), (line, 4 + i), "x")
    for i in range(50):
        doc.apply_edit((1, 4 + i), (1, 4 + i), "y")
    doc.apply_edit((8, 0), (8, 0), "\r")  # a new lone "\r" (a line start): still no whole parse
    assert parses.count == 0
    assert doc.block_rows() is not None  # rows agree with the document's lines: segments stay usable
    assert doc.block_rows()[:3] == [0, 2, 4]


def _position(text: str, offset: int) -> tuple[int, int]:
    """(line, code point column) of a character offset, with LSP's line breaks."""
    head = split_lines(text[:offset])
    return len(head) - 1, len(head[-1])


pieces = st.sampled_from(["a", " ", "(", ")", ":", "\n", "\r\n", "\r", "x = 1", "def f():", "    ", "'", "é"])
texts = st.lists(pieces, max_size=25).map("".join)


@settings(max_examples=150, deadline=None)
@given(texts, st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60), texts), max_size=6))
def test_incremental_trees_with_lone_cr_equal_a_fresh_parse(text, edits):
    doc = Document("u", text, language_id="python")
    ref = text
    for a, b, new in edits:
        start = min(a, len(ref))
        end = min(start + b % 4, len(ref))
        if any(ref[off - 1 : off + 1] == "\r\n" for off in (start, end)):
            continue  # between "\r" and "\n": not a position a client can name
        (l0, c0), (l1, c1) = _position(ref, start), _position(ref, end)
        ref = ref[:start] + new + ref[end:]
        doc.apply_edit((l0, c0), (l1, c1), new)
        assert doc.source == ref
    fresh = SyntaxDocument("python", syntax_text(ref))
    assert doc.syntax.text == fresh.text
    assert [str(t.root_node) for t in doc.syntax.trees()] == [str(t.root_node) for t in fresh.trees()]


# -- parse limits on every edit ----------------------------------------------------------------------
def test_document_that_grows_past_the_limit_stops_being_parsed_and_resumes(monkeypatch):
    monkeypatch.setattr(documents, "SYNTAX_MAX_CHARS", 1000)
    monkeypatch.setattr(documents, "SYNTAX_RESUME_CHARS", 900)
    doc = Document("u", "def f():\n    return 1\n", 1, "python")
    assert doc.syntax.has_tree
    big = "x = 1\n" * 200
    doc.apply_edit((2, 0), (2, 0), big)  # grown past the limit by an edit
    assert not doc.syntax.has_tree and doc.syntax.text == doc.source
    parses = _ParseCounter(monkeypatch)
    doc.apply_edit((0, 0), (0, 0), "#")  # typing while too big: no parse at all
    assert parses.count == 0 and not doc.syntax.has_tree
    doc.apply_edit((2, 0), (202, 0), "")  # shrunk back well below: parsed again
    assert doc.syntax.has_tree and parses.count == 1
    assert str(doc.syntax.trees()[0].root_node) == str(SyntaxDocument("python", doc.source).trees()[0].root_node)


def test_a_huge_line_stops_parsing_until_it_is_gone(monkeypatch):
    monkeypatch.setattr(documents, "SYNTAX_MAX_LINE", 100)
    doc = Document("u", "def f():\n    return 1\n", 1, "python")
    assert doc.syntax.has_tree
    doc.apply_edit((1, 12), (1, 12), " + 1" * 40)  # the line is now 172 characters long
    assert not doc.syntax.has_tree
    parses = _ParseCounter(monkeypatch)
    doc.apply_edit((1, 20), (1, 20), "2")  # typing inside it: no parse
    assert parses.count == 0
    doc.apply_edit((1, 12), (1, 173), "")
    assert doc.syntax.has_tree and doc.source == "def f():\n    return 1\n"


def _top_level(syntax: SyntaxDocument) -> list[str]:
    return [str(child) for tree in syntax.trees() for child in tree.root_node.children]


async def test_a_big_whole_parse_runs_in_slices_and_replays_the_edits_made_meanwhile(monkeypatch):
    monkeypatch.setattr(documents, "SLICED_PARSE_CHARS", 10_000)
    monkeypatch.setattr(documents, "PARSE_SLICE_S", 0.0005)
    text = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(2000))
    doc = Document("u", text, 1, "python")
    assert doc.parsing and not doc.syntax.has_tree and doc.syntax.text == text  # plain text meanwhile
    doc.apply_edit((0, 0), (0, 0), "import os\n")  # typing while the parse runs
    doc.apply_edit((5, 0), (5, 0), "y = 1\n")
    turns = 0
    while doc.parsing:
        await asyncio.sleep(0)  # the loop runs other work between slices
        turns += 1
        assert turns < 100_000
    assert turns > 1 and doc.syntax.has_tree and doc.full_parses == 1
    fresh = SyntaxDocument("python", doc.source)
    assert doc.syntax.text == doc.source
    assert _top_level(doc.syntax) == _top_level(fresh)  # (segment cuts may differ: edits keep the old ones)
    doc.set_text("x = 1\n" * 3000)  # a new whole text while idle: sliced again; closing stops it
    store = documents.DocumentStore()
    store._docs["u"] = doc
    store.close("u")
    assert not doc.parsing


# -- end to end: the event loop stays free ------------------------------------------------------------
LOOP_BLOCK_LIMIT_S = 2.0  # the target is 0.25 s; this wide bound keeps the test honest on a busy machine


@pytest.fixture(scope="module")
def server():
    srv = RawServer()
    srv.initialize()
    srv.engine_ready()
    yield srv
    srv.close()


@pytest.mark.parametrize("make", [big_line_document, lone_cr_document], ids=["1MB-line", "lone-cr-900KB"])
def test_keystrokes_and_requests_never_block_the_event_loop(server, make):
    text, cursor = make()
    uri = f"file:///stall/{make.__name__}.py"
    with Pinger(server) as pinger:
        t0 = time.perf_counter()
        server.open(uri, text)  # its whole parse runs in slices: the loop stays free during the open too
        _, answers = type_and_ask(server, uri, cursor, "abcde", timeout=120)
        elapsed = time.perf_counter() - t0
    assert all("result" in a for a in answers), answers
    assert len(pinger.latencies) >= 3, "the pinger could not run"
    assert pinger.max_block < LOOP_BLOCK_LIMIT_S, f"event loop blocked {pinger.max_block:.2f} s in {elapsed:.1f} s"
    server.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
