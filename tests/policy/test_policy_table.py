"""lsp_server.shaping.policy: real tree-sitter documents -> the decision for each cursor context."""

from __future__ import annotations

import pytest

from lsp_server.shaping.policy import (
    CONTEXT_NAMES,
    DEFAULTS,
    MID_LINE_ONE_LINE,
    PolicyDecision,
    check_overrides,
    decide,
    decide_for_context,
    policy_table,
)
from lsp_server.shaping.syntax import ContextKind, SyntaxDocument, classify

MARK = "<|>"

# One Python cursor per context kind (the classifier's own tests cover the other languages).
CASES = {
    "comment": "def f(x):\n    # compute the <|>\n    return x\n",
    "string": 'def f(x):\n    """Return the <|>\n    """\n    return x\n',
    "import": "import os.<|>\n",
    "attribute_chain": "import os\n\npath = os.path.<|>\n",
    "call_args": "print(len(<|>\n",
    "parameters": "def area(<|>\n",
    "block_start": "def f(x):\n    <|>\n",
    "block_body": "def f(x):\n    y = x + 1\n    <|>\n",
    "mid_statement": "def f(x):\n    y = x +<|>\n",
    "top_level": "import os\n\n<|>\n",
}


def doc_at(code: str, lang: str = "python") -> tuple[SyntaxDocument, int]:
    i = code.index(MARK)
    text = code.replace(MARK, "", 1)
    return SyntaxDocument(lang, text), len(text[:i].encode())


def test_every_context_kind_has_a_row_and_a_case():
    assert set(CONTEXT_NAMES) == {k.value for k in ContextKind} == set(CASES)
    assert set(CONTEXT_NAMES) <= set(DEFAULTS)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_decide_uses_the_row_of_the_cursor_context(kind):
    doc, cursor = doc_at(CASES[kind])
    assert classify(doc, cursor).kind.value == kind  # the case really is that context
    d = decide(doc, cursor, "python")
    assert d.context == kind and not d.plain_text
    assert not d.mid_line  # (mid-line cursors: the tests below)
    assert d == PolicyDecision(context=kind, **DEFAULTS[kind])


def test_block_contexts_are_multiline_and_line_contexts_single_line():
    table = policy_table()
    for kind in ("block_start", "block_body", "top_level"):
        assert table[kind]["multiline"] and table[kind]["max_lines"] > 1
    for kind in ("comment", "string", "import", "attribute_chain", "call_args", "parameters", "mid_statement"):
        assert not table[kind]["multiline"]
        assert PolicyDecision(**{**table[kind], "stop": tuple(table[kind]["stop"])}).to_options().max_lines == 1


def test_mid_line_code_cursor_may_fill_several_lines():
    # Code after the cursor: the gap may hold lines, the line's rest after the last one
    # (`count = |    if s[i] ...` wants `0` and a loop header before the rest).
    for code, kind in (
        ("def f(s):\n    count = <|>    if s[0]:\n        count += 1\n", "mid_statement"),
        ("def f(x):\n    <|>return x\n", "block_body"),
        ("def f(a):\n    n = len(<|> range(n):\n", "call_args"),
    ):
        doc, cursor = doc_at(code)
        ctx = classify(doc, cursor)
        assert not ctx.at_line_end and ctx.kind.value == kind
        d = decide(doc, cursor)
        assert d.mid_line and d.multiline and d.stop == ()
        o = d.to_options()
        assert o.max_lines == DEFAULTS["mid_line"]["max_lines"] > 1
        assert o.max_tokens == DEFAULTS["mid_line"]["max_tokens"]


def test_mid_line_prose_and_import_cursors_stay_one_line():
    for code, kind in (
        ("def f(x):\n    # compute <|> here\n    return x\n", "comment"),
        ('def f(x):\n    """Return <|> doubled."""\n    return x\n', "string"),
        ("from os import <|>, path\n", "import"),
    ):
        doc, cursor = doc_at(code)
        ctx = classify(doc, cursor)
        assert not ctx.at_line_end and ctx.kind.value == kind, (code, ctx.kind)
        d = decide(doc, cursor)
        assert d.mid_line and not d.multiline and d.to_options().max_lines == 1
        assert d.max_tokens == MID_LINE_ONE_LINE["max_tokens"]


def test_block_rows_stop_at_two_blank_lines_not_one():
    # The default model writes blank lines inside a middle; two blank lines end a definition.
    for kind in ("block_start", "block_body"):
        o = decide_for_context(kind).to_options()
        assert o.stop == ("\n\n\n",) and o.max_lines == 8


def test_unknown_language_falls_back_to_plain_text():
    doc, cursor = doc_at("def f(x):\n    <|>\n", lang="cobol")
    d = decide(doc, cursor, "cobol")
    assert d.plain_text and not d.multiline and d.temperature == 0.0
    # A known document asked about under an id with no grammar is plain text too.
    doc, cursor = doc_at(CASES["block_start"])
    assert decide(doc, cursor, "no-such-language").plain_text


def test_overrides_apply_in_order_star_then_context_then_modifiers():
    over = {
        "*": {"temperature": 0.2, "max_tokens": 10, "gamma": 3},
        "block_body": {"max_tokens": 20, "stop": ["\n\n\n"]},
        "mid_line": {"max_tokens": 5},
    }
    d = decide_for_context("block_body", overrides=over)
    assert (d.temperature, d.max_tokens, d.gamma, d.stop) == (0.2, 20, 3, ("\n\n\n",))
    assert decide_for_context("comment", overrides=over).max_tokens == 10
    assert decide_for_context("block_body", mid_line=True, overrides=over).max_tokens == 5
    # A user setting beats the built-in modifiers too.
    assert decide_for_context("top_level", mid_line=True, overrides={"top_level": {"multiline": True}}).multiline


def test_bad_overrides_are_reported_and_refused():
    bad = {"nope": {}, "comment": {"temperature": -1, "colour": 1, "stop": [""]}, "call_args": 3}
    problems = check_overrides(bad)
    assert len(problems) == 5, problems
    with pytest.raises(ValueError):
        decide_for_context("comment", overrides=bad)
    with pytest.raises(ValueError):
        decide_for_context("not_a_context")
    assert check_overrides({"*": {"gamma": 8.0, "stop": "\n\n", "multiline": False}}) == []
    assert decide_for_context("comment", overrides={"*": {"gamma": 8.0, "stop": "x"}}).stop == ("x",)
    assert check_overrides({"*": {"multiline": 1}})  # a bool setting wants a bool


def test_to_options_carries_every_decided_field():
    d = PolicyDecision(
        context="block_body",
        temperature=0.3,
        top_p=0.9,
        gamma=6,
        max_gamma=10,
        confidence_gate=0.4,
        multiline=True,
        max_lines=3,
        stop=("\n\n", "END"),
        max_tokens=77,
    )
    o = d.to_options(seed=5, drafter="model")
    assert (o.temperature, o.top_p, o.gamma, o.max_gamma, o.confidence_gate) == (0.3, 0.9, 6, 10, 0.4)
    assert (o.max_lines, o.stop, o.max_tokens, o.seed, o.drafter) == (3, ("\n\n", "END"), 77, 5, "model")
    o.validate()
    # Single line: the line limit is 1, and stop strings holding a newline could never fire first.
    one = PolicyDecision(context="comment", multiline=False, max_lines=6, stop=("\n\n", "#"))
    assert one.to_options().max_lines == 1 and one.to_options().stop == ("#",)
    # gamma above max_gamma lifts max_gamma (the decoder's cap) rather than failing.
    assert PolicyDecision(gamma=16, max_gamma=12).to_options().max_gamma == 16


def test_context_argument_skips_reclassification_only_for_its_cursor():
    doc, cursor = doc_at(CASES["call_args"])
    other = classify(doc, 0)
    assert decide(doc, cursor, context=other).context == "call_args"  # stale context ignored
    assert decide(doc, cursor, context=classify(doc, cursor)).context == "call_args"
