from __future__ import annotations

from lsp_server.shaping.syntax.context import classify
from lsp_server.shaping.syntax.validate import CutReason, validate_completion

from .util import doc_at, finalize


def test_untouched_completion_has_no_reason() -> None:
    res, applied, replaced = finalize("python", "def f(x):\n    return <|>\n", "x + 1")
    assert res.text == "x + 1" and res.cut_reason is None and replaced == 0
    assert applied == "def f(x):\n    return x + 1\n"


def test_empty_completion() -> None:
    doc, cur = doc_at("python", "x = <|>\n")
    res = validate_completion(doc, cur, "")
    assert res.text == "" and res.cut_reason is None and res.replace_range == (cur, cur)


def test_reuses_given_context_and_language_override() -> None:
    doc, cur = doc_at("python", "print(<|>)\n")
    ctx = classify(doc, cur)
    res = validate_completion(doc, cur, "a))", "python", context=ctx)
    assert res.text == "a)" and res.cut_reason is CutReason.BRACKET


def test_errors_elsewhere_do_not_block() -> None:
    code = "def broken(:\n    pass\n\ndef ok():\n    return <|>\n"
    res, _, _ = finalize("python", code, "compute(1, 2)")
    assert res.text == "compute(1, 2)" and res.cut_reason is None


def test_completion_may_fix_the_error_at_the_cursor() -> None:
    res, applied, _ = finalize("python", "def foo(<|>", "a, b):\n    return a + b")
    assert res.text == "a, b):\n    return a + b"
    assert applied == "def foo(a, b):\n    return a + b"


def test_garbage_is_dropped() -> None:
    res, _, _ = finalize("python", "x = <|>\n", "= = =")
    assert res.text == "" and res.cut_reason is CutReason.DROPPED


def test_syntax_cut_at_line_boundary() -> None:
    code = "def f(a):\n    <|>\n"
    raw = "b = a * 2\n    c = b + 1\n    d = c +* 3"
    res, _, _ = finalize("python", code, raw)
    assert res.cut_reason is CutReason.SYNTAX_ERROR
    assert res.text.startswith("b = a * 2\n    c = b + 1")
    assert "+*" not in res.text


def test_python_scope_ignores_lines_inside_strings_and_brackets() -> None:
    code = "def f():\n    x = <|>\n"
    raw = 'g(\n1,\n2)\n    y = """\nnot a dedent\n"""\n    return y'
    res, _, _ = finalize("python", code, raw)
    assert res.text == raw and res.cut_reason is None


def test_python_scope_with_tabs() -> None:
    code = "def f():\n\tif a:\n\t\tb = <|>\n"
    res, _, _ = finalize("python", code, "1\n\t\tc = 2\n\treturn c\nprint(f())")
    assert res.text == "1\n\t\tc = 2\n\treturn c" and res.cut_reason is CutReason.SCOPE_END


def test_python_scope_floor_is_the_enclosing_def_not_the_inner_block() -> None:
    # A middle that ends a nested block goes on at the function's level: kept.
    code = "def f(xs):\n    for x in xs:\n        if x:\n            <|>\n"
    raw = "return False\n    return True\n\n\ndef g():\n    pass"
    res, applied, _ = finalize("python", code, raw)
    assert res.text == "return False\n    return True" and res.cut_reason is CutReason.SCOPE_END
    assert applied.endswith("            return False\n    return True\n")
    # In a method, the class's next method (the def's own level) still ends it.
    code = "class A:\n    def m(self, x):\n        while x:\n            <|>\n"
    res, _, _ = finalize("python", code, "x -= 1\n        return x\n\n    def n(self):\n        pass")
    assert res.text == "x -= 1\n        return x" and res.cut_reason is CutReason.SCOPE_END


def test_python_block_opened_on_the_cursor_line_may_be_followed_at_its_level() -> None:
    # `for ...:` written at a body statement start: the loop's body, then the function goes on.
    code = "def f(n):\n    ret = 1\n    <|>\n"
    raw = "for i in range(n):\n        ret *= 2\n    return ret\nprint(f(3))"
    res, _, _ = finalize("python", code, raw)
    assert res.text == "for i in range(n):\n        ret *= 2\n    return ret"
    # A def opened on the cursor line ends at the next line at its own level.
    code = "class A:\n    <|>\n"
    res, _, _ = finalize("python", code, "def m(self):\n        return 1\n    def n(self):\n        pass")
    assert res.text == "def m(self):\n        return 1" and res.cut_reason is CutReason.SCOPE_END


def test_python_module_level_block_keeps_its_header_as_floor() -> None:
    code = "for x in range(3):\n    if x:\n        <|>\n"
    res, _, _ = finalize("python", code, "print(x)\n    y = x\nprint(y)")
    assert res.text == "print(x)\n    y = x" and res.cut_reason is CutReason.SCOPE_END


def test_python_top_level_has_no_dedent_floor() -> None:
    res, _, _ = finalize("python", "x = <|>\n", "1\ny = 2\nz = 3")
    assert res.text == "1\ny = 2\nz = 3"


def test_brace_scope_end_keeps_call_tail() -> None:
    code = "run(function () {\n  <|>\n"
    res, applied, _ = finalize("javascript", code, "go();\n});\n\nrun(other);")
    assert res.text == "go();\n});" and res.cut_reason is CutReason.SCOPE_END
    assert applied == "run(function () {\n  go();\n});\n"


def test_duplicate_line_ignores_lines_closing_own_brackets() -> None:
    code = "function f() {\n  <|>\n}\n"
    raw = "if (a) {\n    b();\n  }\n  return 1;"
    # the `}` line after b() equals the `}` below only after strip, but it closes the
    # completion's own `{`: not a repeat of the suffix.
    res, _, _ = finalize("javascript", code, raw)
    assert res.text == raw


def test_replace_range_in_bytes_with_non_ascii() -> None:
    doc, cur = doc_at("python", 'x = ünï("<|>")\n')
    res = validate_completion(doc, cur, 'é")')
    assert res.text == 'é")'
    assert res.replace_range == (cur, cur + 2)


def test_plain_text_skips_syntax_stage() -> None:
    res, applied, replaced = finalize("plaintext", "say(<|>)\n", "hello, world) and more")
    assert res.text == "hello, world) and more" and replaced == 1
    assert applied == "say(hello, world) and more\n"
