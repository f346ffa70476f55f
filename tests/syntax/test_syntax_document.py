from __future__ import annotations

import random

import pytest
from tree_sitter import Parser, Range

from lsp_server.shaping.syntax.document import SEGMENT_LINES, SyntaxDocument

PY = 'def grüß(name):\n    """Sagt Hallo 👋."""\n    return f"Hallo {name}!"  # ß\n\nx = [1, 2, 3]\n'


def _fresh(doc: SyntaxDocument) -> str:
    return str(SyntaxDocument(doc.language_id, doc.text).root_at(0))


def _assert_segments_match_fresh_parses(doc: SyntaxDocument) -> None:
    """Every segment's incrementally edited tree equals a fresh parse of the same range."""
    parser = Parser(doc.language)
    ranges = doc.segment_ranges()
    assert ranges[0][0] == 0 and ranges[-1][1] == len(doc.bytes)
    for (_, e), (s2, _) in zip(ranges, ranges[1:], strict=False):
        assert e == s2 and doc.bytes[s2 - 1 : s2] == b"\n"  # segments tile the text at line starts
    for (s, e), tree in zip(ranges, doc.trees(), strict=True):
        parser.included_ranges = [Range(doc.point_at(s), doc.point_at(e), s, e)]
        assert str(tree.root_node) == str(parser.parse(doc.bytes).root_node)
        assert tree.root_node.start_byte >= s and tree.root_node.end_byte <= e


def test_accessors_and_utf8_offsets() -> None:
    doc = SyntaxDocument("python", PY)
    assert doc.text == PY and doc.bytes == PY.encode()
    start = doc.bytes.index("grüß".encode())
    node = doc.root_at(start).descendant_for_byte_range(start, start + 1)
    assert node.text.decode() == "grüß"


def test_apply_edit_non_ascii_matches_fresh_parse() -> None:
    doc = SyntaxDocument("python", PY)
    at = doc.bytes.index(b"[1")
    doc.apply_edit(at, at + 1, "(ä, ")
    assert doc.text == PY.replace("[1", "(ä, 1", 1)
    assert str(doc.root_at(0)) == _fresh(doc)


@pytest.mark.parametrize("lang", ["python", "javascript", "go", "rust", "cpp"])
def test_random_edits_stay_in_sync(lang: str) -> None:
    rng = random.Random(7)
    text = {
        "python": PY,
        "javascript": "const s = `é ${a}`;\nfunction f(x) {\n  return x + 1; // ü\n}\n",
        "go": 'package main\n\nfunc main() {\n\ts := "ñ"\n\t_ = s\n}\n',
        "rust": 'fn main() {\n    let s = "日本";\n    println!("{}", s);\n}\n',
        "cpp": 'int main() {\n  auto s = u8"é";\n  return 0;\n}\n',
    }[lang]
    doc = SyntaxDocument(lang, text)
    pieces = ["x", "é", "(", ")", "\n", "  ", '"', "👋", "{", "}", "; ", "ab\ncd"]
    for _ in range(120):
        data = doc.bytes
        text = doc.text
        # choose char positions so edits never split a UTF-8 sequence
        a = rng.randint(0, len(text))
        b = min(len(text), a + rng.choice([0, 0, 1, 2, 5]))
        start, end = len(text[:a].encode()), len(text[:b].encode())
        new = rng.choice(pieces) if rng.random() < 0.8 else ""
        doc.apply_edit(start, end, new)
        assert doc.bytes == data[:start] + new.encode() + data[end:]
        assert str(doc.root_at(0)) == _fresh(doc)


def test_with_edit_leaves_original_untouched() -> None:
    doc = SyntaxDocument("python", "x = 1\n")
    before = str(doc.root_at(0))
    other = doc.with_edit(4, 5, "foo(")
    assert other.text == "x = foo(\n" and other.root_at(0).has_error
    assert doc.text == "x = 1\n" and str(doc.root_at(0)) == before


def test_lsp_positions_utf16() -> None:
    doc = SyntaxDocument("python", "a = '👋é'\nb = 2\n")
    # 👋 is 2 UTF-16 units, 4 UTF-8 bytes
    assert doc.byte_at_position(0, 5) == 5
    assert doc.byte_at_position(0, 7) == 9
    assert doc.byte_at_position(0, 8) == 11
    assert doc.position_at_byte(11) == (0, 8)
    assert doc.position_at_byte(11, encoding="utf-8") == (0, 11)
    assert doc.position_at_byte(11, encoding="utf-32") == (0, 7)
    assert doc.byte_at_position(1, 99) == doc.bytes.index(b"b") + 5  # clamps to line end
    assert doc.byte_at_position(9, 0) == len(doc.bytes)
    doc.apply_lsp_edit((0, 7), (0, 8), "e")
    assert doc.text.startswith("a = '👋e'")


def test_plain_text_document_has_no_tree() -> None:
    doc = SyntaxDocument("cobol", "MOVE A TO B.\n")
    assert not doc.has_tree and doc.root_at(0) is None
    doc.apply_edit(0, 4, "ADD")
    assert doc.text == "ADD A TO B.\n"
    assert list(doc.error_nodes()) == []


def test_bad_range_rejected_and_set_text() -> None:
    doc = SyntaxDocument("python", "x = 1\n")
    with pytest.raises(ValueError):
        doc.apply_edit(3, 99, "")
    doc.set_text("def f(:\n")
    assert doc.root_at(0).has_error and doc.text == "def f(:\n"


def _big_python(functions: int) -> str:
    body = "def f{i}(a, b):\n    '''Doc {i} ü.'''\n    x = [a, b]  # ({i}\n    return x\n\n\n"
    return "".join(body.format(i=i) for i in range(functions))


def test_large_file_is_segmented_at_top_level_lines() -> None:
    doc = SyntaxDocument("python", _big_python(200))
    ranges = doc.segment_ranges()
    assert len(ranges) >= 4
    for s, e in ranges:
        assert doc.bytes.count(b"\n", s, e) <= 2 * SEGMENT_LINES
        assert doc.bytes[s:].startswith(b"def f")
    _assert_segments_match_fresh_parses(doc)


def test_segmented_random_edits_stay_in_sync() -> None:
    rng = random.Random(11)
    doc = SyntaxDocument("python", _big_python(150))
    pieces = ["x", "(", ")", "\n", "    ", '"""', "é", "def g():\n    pass\n", ""]
    for step in range(300):
        text = doc.text
        if step % 25 == 0:  # sometimes straddle a segment boundary
            s, _ = rng.choice(doc.segment_ranges())
            a = max(0, len(doc.bytes[:s].decode()) - rng.randint(0, 5))
        else:
            a = rng.randint(0, len(text))
        b = min(len(text), a + rng.choice([0, 0, 1, 3, 12]))
        start, end = len(text[:a].encode()), len(text[:b].encode())
        new = rng.choice(pieces)
        data = doc.bytes
        doc.apply_edit(start, end, new)
        assert doc.bytes == data[:start] + new.encode() + data[end:]
        if step % 10 == 0:
            _assert_segments_match_fresh_parses(doc)
    _assert_segments_match_fresh_parses(doc)


def test_errors_stay_inside_their_segment() -> None:
    doc = SyntaxDocument("python", _big_python(150))
    first_end = doc.segment_ranges()[0][1]
    doc.apply_edit(10, 10, "(((")  # unclosed brackets in the first function
    errors = list(doc.error_nodes())
    assert errors and all(e.end_byte <= first_end + 3 for e in errors)
    assert not doc.root_at(len(doc.bytes) - 1).has_error


def test_growing_segment_is_split_again() -> None:
    doc = SyntaxDocument("python", _big_python(100))
    count = len(doc.segment_ranges())
    at = doc.segment_ranges()[0][1]
    doc.apply_edit(at, at, "x = 1\n" * (5 * SEGMENT_LINES))
    assert len(doc.segment_ranges()) > count
    _assert_segments_match_fresh_parses(doc)


def test_empty_document() -> None:
    doc = SyntaxDocument("python", "")
    assert doc.segment_ranges() == [(0, 0)]
    doc.apply_edit(0, 0, "x = 1\n")
    _assert_segments_match_fresh_parses(doc)
