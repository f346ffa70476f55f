from __future__ import annotations

import random

import pytest

from lsp_server.shaping.syntax.brackets import (
    BracketGuard,
    closers_after_cursor,
    fit_to_line_rest,
    open_brackets_before,
)

from .util import doc_at

# (language, code, expected open stack at the cursor)
OPEN_TABLE = [
    ("python", "foo(a, [1, {'k': '(['}, <|>", "(["),
    ("python", "foo(a, '(', \"[\", <|>)", "("),
    ("python", "x = (1,  # ( [ {\n     <|>\n", "("),
    ("python", 'x = f"{foo(<|>)}"\n', "{("),
    ("python", 'x = """ ( [\n""" + (<|>\n', "("),
    ("python", "x = 'abc(<|>\n", ""),  # inside an unterminated string: nothing open in code
    ("javascript", "foo(`${bar(<|>)}`)", "(${("),
    ("javascript", "foo('(', /* ( */ [<|>])", "(["),
    ("javascript", "foo(a, // (\n  <|>)", "("),
    ("javascriptreact", "const e = <p>(text {fn(<|>)}</p>;", "{("),
    ("typescript", "function f<T>(a: Array<T>, <|>) {}", "("),
    ("go", "package main\nfunc main() {\n\tf(\"(\", `[`, '(', <|>)\n}\n", "{("),
    ("rust", 'fn main() {\n    let c = \'(\';\n    g("[", r#"("#, <|>);\n}\n', "{("),
    ("java", "class A {\n  void f() {\n    g(\"(\", '[', <|>);\n  }\n}\n", "{{("),
    ("c", 'int main() {\n  printf("(%d", /* [ */ <|>);\n}\n', "{("),
    ("cpp", 'int main() {\n  auto s = R"x( ( )x"; f(<|>);\n}\n', "{("),
    ("plaintext", "call(a, '(', [<|>])", "(["),
]


@pytest.mark.parametrize(("lang", "code", "want"), OPEN_TABLE, ids=[f"{t[0]}:{t[1]!r}" for t in OPEN_TABLE])
def test_open_brackets_before(lang: str, code: str, want: str) -> None:
    doc, cur = doc_at(lang, code)
    assert "".join(f.open for f in open_brackets_before(doc, cur)) == want


def test_open_brackets_know_their_closers() -> None:
    doc, cur = doc_at("python", "foo(bar(<|>), 1)\nbaz(\n")
    outer, inner = open_brackets_before(doc, cur)
    assert doc.bytes[inner.close_pos : inner.close_pos + 1] == b")" and inner.close_pos == cur
    assert outer.close_pos == doc.bytes.index(b"1)") + 1
    doc, cur = doc_at("javascript", "function f() {\n  g(<|>\n")
    assert [f.close_pos for f in open_brackets_before(doc, cur)] == [None, None]


@pytest.mark.parametrize(
    ("rest", "run"),
    [
        (")", ")"),
        (")]}", ")]}"),
        ('")', '")'),
        ("');", "')"),
        (") + 1", ")"),
        ('"abc")', ""),
        ("", ""),
        ("`;", "`"),
        (" )", ""),
        ("}}", "}}"),
        ("x)", ""),
    ],
)
def test_closers_after_cursor(rest: str, run: str) -> None:
    assert closers_after_cursor(rest) == run


def _guard_stop(lang: str, code: str, completion: str) -> int | None:
    doc, cur = doc_at(lang, code)
    guard = BracketGuard.from_document(doc, cur)
    guard.feed(completion)
    return guard.finish()


# (language, code, completion, expected stop index or None)
GUARD_TABLE = [
    ("python", "print(<|>)", "a)", None),
    ("python", "print(<|>)", "a))", 2),
    ("python", "print(<|>)", "a]", 1),  # mismatched closer
    ("python", "foo(a, <|>, c)", "b)", 1),  # the `(` is closed later on the line: out of scope
    ("python", "x = <|>", "1)", 1),
    ("python", "x = <|>", "')' + \")\"  # )", None),
    ("python", "x = <|>", '"""\n)\n"""', None),
    ("python", "x = <|>", 'f"{a}) {{)"', None),
    ("python", "x = <|>", 'f"{g(1)}" + f(2))', 16),
    ("python", "x = <|>", "r'\\' )", None),
    ("python", "def f():\n    '''<|>'''", "doc ) ''')", 9),
    ("javascript", "f(<|>);", "`${g(1)} )`)", None),
    ("javascript", "f(<|>);", "`${g(1)}})`", None),  # `})` after the interpolation is text
    ("javascript", "f(<|>);", "`${g(1))}`", 7),
    ("javascript", "f(<|>);", "/[)]/.test(s))", None),
    ("javascript", "f(<|>);", "a / b)", None),
    ("javascript", "f(<|>);", "a /* ) */ // )\n)", None),
    ("javascript", "f(<|>);", "a /* ) */ // )\n))", 16),
    ("javascriptreact", "const e = <p>{f(<|>)}</p>;", "<i>x</i>)}", None),
    ("go", "package main\nfunc m() {\n\tf(<|>)\n}", "`)` + \")\" + ')')", None),
    ("go", "package main\nfunc m() {\n\t<|>\n}", "x()\n}", 4),  # block closed further down
    ("rust", "fn m() {\n    f(<|>);\n}", "')' as u8, r#\")\"#)", None),
    ("rust", "fn m<'a>() {\n    f(<|>);\n}", "&'a x, '\\'')", None),
    ("rust", "fn m() {\n    f(<|>);\n}", "/* /* ) */ ) */ x)", None),
    ("java", "class A { void m() {\n    f(<|>);\n} }", '"""\n )\n""")', None),
    ("c", "int m() {\n  f(<|>);\n}", "'\\'', \")\")", None),
    ("cpp", "int m() {\n  f(<|>);\n}", 'R"d()")d")', None),
    ("plaintext", "call(<|>)", "x) )", 3),
]


@pytest.mark.parametrize(
    ("lang", "code", "completion", "stop"), GUARD_TABLE, ids=[f"{t[0]}:{t[2]!r}" for t in GUARD_TABLE]
)
def test_guard(lang: str, code: str, completion: str, stop: int | None) -> None:
    assert _guard_stop(lang, code, completion) == stop


@pytest.mark.parametrize(("lang", "code", "completion", "stop"), GUARD_TABLE)
def test_guard_is_chunking_invariant(lang: str, code: str, completion: str, stop: int | None) -> None:
    rng = random.Random(len(completion))
    doc, cur = doc_at(lang, code)
    for _ in range(5):
        guard = BracketGuard.from_document(doc, cur)
        i, seen = 0, None
        while i < len(completion):
            j = i + rng.randint(1, 3)
            seen = guard.feed(completion[i:j])
            if seen is not None:
                assert seen == stop, "reported as soon as it is known, and never a different index"
            i = j
        assert guard.finish() == stop
        assert guard.text == (completion if stop is None else completion[:stop])


def test_guard_reports_closer_without_waiting() -> None:
    doc, cur = doc_at("python", "print(<|>)")
    guard = BracketGuard.from_document(doc, cur)
    assert guard.feed("a)") is None
    assert guard.feed(")") == 2
    assert guard.feed("more") == 2


# (completion, rest of line, expected replace extension)
FIT_TABLE = [
    ("bar: str):", ")", 1),
    ("bar: str):", "):", 2),
    ("a, b)", ")", 1),
    ("a", ")", 0),
    ("g(a)", ")", 0),  # closes its own opener: nothing re-typed
    ("g(a))", ")", 1),
    ("x))", "))", 2),
    ("x)", "))", 1),
    ("x), y)", "))", 2),
    ('hello")', '")', 2),
    ('a\\")', '")', 0),  # escaped quote does not end the string
    ("x) + 1", ") + 1", 5),
    ("x); g();", ");", 2),
    ("bar + foo", "foo", 3),
    ("foo(x", "x", 0),  # `x` sits inside the completion's own open bracket
    ("\n  a,\n  b\n)", ")", 1),
    ("a,\n    b):", "):", 2),
    ("a", "", 0),
    ("a) {\n  b();\n}", ") {", 3),
    ("  ", ")   ", 0),
]


@pytest.mark.parametrize(("completion", "rest", "ext"), FIT_TABLE)
def test_fit_to_line_rest(completion: str, rest: str, ext: int) -> None:
    shown, got = fit_to_line_rest(completion, rest, "python")
    assert shown == completion and got == ext


def test_fit_language_aware_strings() -> None:
    assert fit_to_line_rest("`${a})`)", ")", "javascript")[1] == 1
    assert fit_to_line_rest("'a') + x", ")", "rust")[1] == 1  # 'a' is a char literal, not a string
    assert fit_to_line_rest("'a')", ")", "rust")[1] == 1
