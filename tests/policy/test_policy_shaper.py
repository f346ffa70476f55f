"""lsp_server.shaping.shaper.CompletionShaper on real tree-sitter documents (no model)."""

from __future__ import annotations

import ast

import pytest

from lsp_server.shaping.shaper import CompletionShaper
from lsp_server.shaping.syntax import SyntaxDocument

MARK = "<|>"


def shaper_at(code: str, lang: str = "python", **kw) -> tuple[CompletionShaper, SyntaxDocument, int]:
    i = code.index(MARK)
    text = code.replace(MARK, "", 1)
    doc = SyntaxDocument(lang, text)
    cursor = len(text[:i].encode())
    return CompletionShaper(doc, cursor, **kw), doc, cursor


def applied(doc: SyntaxDocument, shaped) -> str:
    data = doc.bytes
    return (data[: shaped.replace_start] + shaped.text.encode() + data[shaped.replace_end :]).decode()


def test_feed_stops_at_a_closer_past_the_scope_and_finish_covers_the_typeover():
    sh, doc, cursor = shaper_at("x = foo(<|>)\n")
    assert sh.feed("a, ") is None and not sh.stopped
    stop = sh.feed("b)) + 1")
    assert stop == len("a, b)") and sh.stopped and sh.text == "a, b)"
    assert sh.feed("more") == stop  # once stopped it stays stopped
    shaped = sh.finish()
    assert shaped.text == "a, b)" and shaped.cut_reason == "bracket" and shaped.raw == "a, b)) + 1more"[:10]
    # The completion re-types the auto-inserted `)`: it is replaced, not doubled.
    assert (shaped.replace_start, shaped.replace_end) == (cursor, cursor + 1)
    assert shaped.range == ((0, 8), (0, 9))
    assert applied(doc, shaped) == "x = foo(a, b)\n"
    assert sh.finish() is shaped  # idempotent


def test_finish_with_text_equals_streaming_it():
    code = "def f(xs):\n    return sorted(<|>)\n"
    streamed, _, _ = shaper_at(code)
    for chunk in ("xs, ", "key=len", ")", ")\n"):
        streamed.feed(chunk)
    whole, _, _ = shaper_at(code)
    assert whole.finish("xs, key=len))\n") == streamed.finish()
    with pytest.raises(ValueError):
        streamed.finish("again")


def test_a_good_line_is_shown_untouched():
    sh, doc, _ = shaper_at("def f(x):\n    y = x * 2\n<|>\n    return y\n")
    shaped = sh.finish("    y += 1")
    assert shaped.text == "    y += 1" and shaped.cut_reason is None and shaped.context == "top_level"
    ast.parse(applied(doc, shaped))


def test_python_stage_drops_a_header_without_a_body():
    # tree-sitter-python accepts `if x:` followed by a line at the same indentation; CPython
    # does not ("expected an indented block"), so the shaper must not show it.
    sh, doc, _ = shaper_at("def f(x):\n    y = 1\n<|>\n    return y\n")
    shaped = sh.finish("    if x > 0:")
    assert shaped.text == "" and shaped.cut_reason == "dropped"
    assert shaped.replace_end == shaped.replace_start


def test_python_stage_drops_a_dedent_to_no_enclosing_width():
    sh, _, _ = shaper_at("def f(x):\n    for i in x:\n        y = i\n<|>\n        z = y\n    return z\n")
    assert sh.finish("      y += 1").text == ""


def test_python_stage_cuts_back_to_whole_lines():
    sh, doc, _ = shaper_at("def f(x):\n    y = 1\n<|>\n    return y\n")
    shaped = sh.finish("    y = y + x\n    if y:")
    assert shaped.text == "    y = y + x" and shaped.cut_reason in ("python_syntax", "syntax_error")
    ast.parse(applied(doc, shaped))


def test_a_document_broken_above_still_gets_checked_on_the_cursor_line():
    # The empty `if` body is CPython's first error before and after any completion below it,
    # so CPython cannot judge here; tree-sitter's check of the touched lines still does.
    code = "def f(x):\n    if x:\n\n    y = 1<|>\n    return y\n"
    good, _, _ = shaper_at(code)
    assert good.finish(" + x").text == " + x"
    bad, _, _ = shaper_at(code)
    assert bad.finish(" +* 2").text == ""


def test_duplicate_of_the_next_line_is_cut():
    sh, _, _ = shaper_at("def f(x):\n    y = 1\n    <|>\n    return y\n")
    shaped = sh.finish("y += x\n    return y")
    assert shaped.text == "y += x" and shaped.cut_reason == "duplicate_line"


def test_the_shaper_keeps_its_own_snapshot():
    sh, doc, cursor = shaper_at("x = foo(<|>)\n")
    doc.apply_edit(0, 0, "# edited meanwhile\n")  # the editor keeps typing
    shaped = sh.finish("1)")
    assert shaped.replace_start == cursor and shaped.range == ((0, 8), (0, 9))


def test_utf16_and_utf8_ranges():
    sh, _, cursor = shaper_at("s = '€' + foo(<|>)\n", encoding="utf-16")
    shaped = sh.finish("1)")
    assert shaped.range == ((0, 14), (0, 15))
    sh8, _, _ = shaper_at("s = '€' + foo(<|>)\n", encoding="utf-8")
    assert sh8.finish("1)").range == ((0, 16), (0, 17))


def test_plain_text_and_brace_languages():
    # No grammar: the lexical guard still stops at a closer past the scope.
    sh, _, _ = shaper_at("call(<|>)\n", lang="cobol")
    assert sh.feed("a)) junk") == 2
    assert sh.finish().text == "a)"
    # JavaScript: the completion may not close the function body it sits in.
    sh, _, _ = shaper_at("function f(a) {\n  const b = <|>\n}\n", lang="javascript")
    shaped = sh.finish("a + 1;\n}\nfunction g() {}")
    assert shaped.text == "a + 1;"


def test_mid_line_gap_of_several_lines_is_shown_with_the_line_rest_after_it():
    # A random-span hole: the rest of the cursor's line belongs to a later line of the program.
    code = 'def f(s):\n    count = <|>     if s[i] in "AEIOU":\n            count += 1\n    return count\n'
    sh, doc, cursor = shaper_at(code)
    text = "0\n    for i in range(0, len(s), 2):\n   "
    shaped = sh.finish(text)
    assert shaped.text == text and shaped.cut_reason is None and shaped.replace_end == cursor
    after = applied(doc, shaped)
    ast.parse(after)
    assert "    count = 0\n    for i in range(0, len(s), 2):\n        if s[i]" in after
    # Its first line alone does not parse before the rest: one line would show nothing here.
    one, _, _ = shaper_at(code)
    assert one.finish("0").text == ""


def test_mid_line_gap_that_breaks_the_file_is_cut_to_lines_that_parse():
    code = "def f(xs):\n    n = <|> + 1\n    return n\n"
    sh, doc, _ = shaper_at(code)
    raw = "len(xs)\n    m = (n"  # `(` never closed: the file would not parse
    shaped = sh.finish(raw)
    assert shaped.cut_reason is not None and raw.startswith(shaped.text) and shaped.text.startswith("len(xs)\n")
    after = applied(doc, shaped)
    ast.parse(after)  # cut back to text the line's rest still follows validly (here `m = + 1`)
    assert after.startswith("def f(xs):\n    n = len(xs)\n    m") and after.endswith(" + 1\n    return n\n")


def test_a_middle_that_ends_a_nested_block_goes_on_at_the_function_level():
    code = "def f(n):\n    for k in range(2, n):\n        if n % k == 0:\n            <|>\n"
    sh, doc, _ = shaper_at(code)
    shaped = sh.finish("return False\n    return True\n\n\nprint(f(7))")
    assert shaped.text == "return False\n    return True" and shaped.cut_reason == "scope_end"
    after = applied(doc, shaped)
    ast.parse(after)
    assert after.endswith("            return False\n    return True\n")
