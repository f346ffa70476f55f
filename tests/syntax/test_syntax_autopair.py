"""Auto-paired closers are never duplicated: >= 100 generated cases over every language.

Each case is real code: a statement inside a function of that language, the cursor inside
closers an editor auto-inserted, and a model output that re-types some, all, or too many of
them. After validation + rest-of-line fitting the cursor line must read exactly as intended
and the file must parse without errors.
"""

from __future__ import annotations

import pytest

from .util import doc_at, finalize

# language id -> (file template with {stmt}, statement template with {expr}, terminator)
LANGS: dict[str, tuple[str, str, str]] = {
    "python": ("def main():\n    {stmt}\n", "x = {expr}", ""),
    "javascript": ("function main() {\n  {stmt}\n}\n", "x = {expr}", ";"),
    "javascriptreact": ("function Main() {\n  {stmt}\n  return <div />;\n}\n", "x = {expr}", ";"),
    "typescript": ("function main(): void {\n  {stmt}\n}\n", "x = {expr}", ";"),
    "typescriptreact": ("function Main() {\n  {stmt}\n  return <div />;\n}\n", "x = {expr}", ";"),
    "go": ("package main\n\nfunc main() {\n\t{stmt}\n}\n", "x = {expr}", ""),
    "rust": ("fn main() {\n    {stmt}\n}\n", "let x = {expr}", ";"),
    "java": ("class A {\n  void main() {\n    {stmt}\n  }\n}\n", "x = {expr}", ";"),
    "c": ("int main() {\n  {stmt}\n}\n", "x = {expr}", ";"),
    "cpp": ("int main() {\n  {stmt}\n}\n", "x = {expr}", ";"),
}

# (expression with cursor inside auto-paired closers, raw model output, intended expression)
EXPRS: list[tuple[str, str, str]] = [
    ("f(<|>)", "a)", "f(a)"),
    ("f(<|>)", "a, b)", "f(a, b)"),
    ("f(<|>)", "a", "f(a)"),
    ("f(g(<|>))", "x))", "f(g(x))"),
    ("f(g(<|>))", "x)", "f(g(x))"),
    ("f(g(<|>))", "x), y)", "f(g(x), y)"),
    ("f(<|>)", '"s")', 'f("s")'),
    ('f("<|>")', 's")', 'f("s")'),
    ("f(L<|>R)", "1, 2R)", "f(L1, 2R)"),  # L/R: the language's list literal brackets
    ("f(<|>)", "h(a))", "f(h(a))"),
    ("f(<|>)", "a)))", "f(a)"),
    ("f(<|>)", '")")', 'f(")")'),
    ("f(a[<|>])", "0])", "f(a[0])"),
    ("f(a[<|>])", "i + 1])", "f(a[i + 1])"),
]

# List literal (open, close) where `[1, 2]` is not an expression.
LISTS = {"go": ("[]int{", "}"), "java": ("new int[]{", "}"), "c": ("(int[]){", "}"), "cpp": ("{", "}")}


def _cases() -> list[tuple[str, str, str, str]]:
    out = []
    for lang, (_, _, term) in LANGS.items():
        lo, hi = LISTS.get(lang, ("[", "]"))
        for expr, raw, want in EXPRS:
            expr, raw, want = (t.replace("L", lo).replace("R", hi) for t in (expr, raw, want))
            out.append((lang, expr, raw, want))
            if term and raw.endswith((")", "]", "}")):
                out.append((lang, expr, raw + term, want))  # the model also re-types the `;`
    return out


CASES = _cases()


def test_case_count() -> None:
    assert len(CASES) >= 100
    assert {c[0] for c in CASES} == set(LANGS)


@pytest.mark.parametrize(("lang", "expr", "raw", "want"), CASES, ids=[f"{c[0]}:{c[1]}:{c[2]}" for c in CASES])
def test_no_duplicated_closers(lang: str, expr: str, raw: str, want: str) -> None:
    file_tpl, stmt_tpl, term = LANGS[lang]
    stmt = stmt_tpl.format(expr=expr) + term
    code = file_tpl.replace("{stmt}", stmt)
    _, applied, _ = finalize(lang, code, raw)
    expected = file_tpl.replace("{stmt}", stmt_tpl.format(expr=want) + term)
    assert applied == expected
    line = next(ln for ln in applied.splitlines() if "f(" in ln)
    for o, c in ("()", "[]"):
        assert line.replace('")"', "").count(c) == line.replace('")"', "").count(o)
    doc, _ = doc_at(lang, applied + "<|>")
    assert not list(doc.error_nodes()), applied
