"""Segment lines for the engine's KV cache: top-level definitions from the document's own tree-sitter parse."""

from __future__ import annotations

from lsp_server.documents import Document
from lsp_server.prompt import build_context
from lsp_server.segments import block_start_rows, is_block_type, segment_lines
from lsp_server.settings import Settings
from lsp_server.shaping.syntax.document import SyntaxDocument

PY = """import os
# a comment
from sys import argv


@decorator
def first():
    return 1


class Second:
    x = 1

    def method(self):
        pass


VALUE = 3


async def third():
    pass


if __name__ == "__main__":
    first()
"""


def _rows(language: str, text: str) -> list[int]:
    return block_start_rows(SyntaxDocument(language, text).trees())


def test_python_definitions_start_blocks_at_decorators():
    lines = PY.split("\n")
    assert _rows("python", PY) == [
        lines.index("@decorator"),
        lines.index("class Second:"),
        lines.index("async def third():"),
    ]


def test_other_languages():
    js = "import x from 'y';\n// c\nfunction f() {}\nexport function g() {}\nconst h = 1;\nf();\nexport default 3;\n"
    assert _rows("javascript", js) == [2, 3, 4]
    rust = "use std::io;\nfn f() {}\n\n#[derive(Debug)]\n#[allow(dead_code)]\nstruct D;\nimpl D {}\nmod m {}\n"
    assert _rows("rust", rust) == [1, 3, 6, 7]
    go = 'package main\nimport "fmt"\nfunc f() {}\ntype A struct{}\n'
    assert _rows("go", go) == [2, 3]
    assert is_block_type("class_definition") and is_block_type("interface_declaration")
    assert not is_block_type("import_declaration") and not is_block_type("expression_statement")
    assert not is_block_type("comment") and not is_block_type("use_declaration")


def test_segment_lines_are_relative_to_the_prompt_window():
    doc = Document("file:///a.py", PY, 1, "python")
    rows = doc.block_rows()
    assert rows == _rows("python", PY)
    # A window starting at "class Second:" (line 10): that block is line 0 of the prompt.
    ctx = build_context(doc, 20, 4, 4000, 1000)
    assert ctx.window == (0, 0)
    assert segment_lines(doc, ctx.window, ctx.cursor[0], ctx.suffix) == rows
    assert segment_lines(doc, (10, 0), 20, "") == [0, 10]
    assert segment_lines(doc, (5, 0), 12, "") == [0, 5]  # rows past the suffix's last line are left out
    assert segment_lines(doc, (6, 0), 12, "\n" * 8) == [4, 14]  # the suffix's lines count too
    # The prefix starts mid-line (a very long line): its line 0 is no document line.
    assert segment_lines(doc, (10, 3), 20, "") is None


def test_segment_lines_follow_edits():
    doc = Document("file:///a.py", PY, 1, "python")
    before = doc.block_rows()
    doc.apply_edit((0, 0), (0, 0), "def zero():\n    pass\n\n")
    assert doc.block_rows() == [0] + [r + 3 for r in before]
    doc.apply_edit((0, 0), (3, 0), "")
    assert doc.block_rows() == before


def test_no_parse_no_segment_lines():
    plain = Document("file:///a.txt", "def f():\n    pass\n", 1, "plaintext")
    assert plain.block_rows() is None
    assert segment_lines(plain, (0, 0), 1, "") is None
    # A lone "\r" ends a line for LSP and (as "\n" in the syntax copy) for tree-sitter too: rows agree.
    bare_cr = Document("file:///b.py", "x = 1\rdef f():\r    pass\n", 1, "python")
    assert bare_cr.block_rows() == [1]


def test_engine_cuts_segments_at_those_lines():
    from engine.caching.prompt_plan import segment_breaks

    doc = Document("file:///a.py", PY, 1, "python")
    lines = segment_lines(doc, (0, 0), len(doc.lines) - 1, "")
    cut_at: list[set[int]] = []  # lines starting in each piece that starts a segment (after the first)
    line = 0
    for piece, starts_segment in segment_breaks(PY, 0, lines):
        started = set(range(line + 1, line + piece.count("\n") + 1))
        if starts_segment and line:
            cut_at.append(started)
        line += piece.count("\n")
    # One segment per definition, each beginning with the piece where its first line starts
    # (pieces begin at the newline ending the last non-blank line before it).
    assert len(cut_at) == len(lines) and all(n in c for n, c in zip(lines, cut_at, strict=True))


def test_new_settings():
    s = Settings().merged({"kvCacheMB": 64, "kvShiftReuse": True, "prewarm": False, "prewarmDelayMs": 50})
    assert (s.kv_cache_mb, s.kv_shift_reuse, s.prewarm, s.prewarm_delay_ms) == (64, True, False, 50)
    assert s.reuse == "shift" and Settings().reuse == "exact"
    assert s.engine_key() != Settings().engine_key()  # a new KV budget restarts the engine
    assert Settings().merged({"kvShiftReuse": True}).engine_key() == Settings().engine_key()
    assert Settings().merged({"kvCacheMB": -1}).kv_cache_mb == 0  # ignored
