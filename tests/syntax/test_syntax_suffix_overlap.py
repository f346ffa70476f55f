"""lsp_server.shaping.syntax.suffix_overlap: where a completion starts re-typing the text after the cursor."""

from __future__ import annotations

from lsp_server.shaping.syntax.suffix_overlap import (
    SuffixOverlap,
    repeats_a_suffix_line,
    suffix_overlap_cut,
    text_after,
)

MARK = "<|>"


def cut_at(code: str, completion: str) -> str | None:
    """The kept completion (None: not cut) for a cursor at MARK in `code`."""
    i = code.index(MARK)
    before, after = code[:i], code[i + len(MARK) :]
    line_prefix = before[before.rfind("\n") + 1 :]
    cut = suffix_overlap_cut(completion, line_prefix, after)
    return None if cut is None else completion[:cut]


# flask/app.py, Flask.process_response and the signature after it (the case seen in VS Code and Neovim).
FLASK = '''\
    def process_response(self, response: Response) -> Response:
        ctx = request_ctx._get_current_object()  # type: ignore[attr-defined]

        for func in ctx._after_request_functions:
            response = self.ensure_sync(func)(response)
<|>
        if not self.session_interface.is_null_session(ctx._session):
            self.session_interface.save_session(self, ctx._session, response)

        return response

    def do_teardown_request(
        self,
        exc: BaseException | None = _sentinel,  # type: ignore[assignment]
    ) -> None:
        """Called after the request is dispatched and the response is
'''
FLASK_RETYPE = (
    "        return response\n\n    def do_teardown_request(\n        self,\n"
    "        exc: BaseException | None = _sentinel,  # type: ignore[assignment]\n    ) -> None:"
)


def test_flask_return_and_the_next_signature_are_cut_to_nothing() -> None:
    assert cut_at(FLASK, FLASK_RETYPE) == ""


def test_new_code_before_the_retype_is_kept_and_trailing_blank_lines_dropped() -> None:
    completion = "        log.debug('done')\n\n\n" + FLASK_RETYPE
    assert cut_at(FLASK, completion) == "        log.debug('done')"


def test_exact_repeat_of_the_next_line() -> None:
    code = "def f(x):\n    y = x + 1\n    <|>\n    total = compute(y, x)\n    return total\n"
    assert cut_at(code, "total = compute(y, x)") == ""
    assert cut_at(code, "z = y * 2\n    total = compute(y, x)") == "z = y * 2"


def test_near_repeat_of_the_next_line() -> None:
    code = "def f(a, b):\n    <|>\n    if float(a) == float(b): return None\n    return a\n"
    assert cut_at(code, "if float(b) == float(a): return None") == ""
    # Not near: a different statement that shares a few words.
    assert cut_at(code, "if a is None: raise ValueError(a)") is None
    # Short lines must be equal: a char or two makes another statement (HumanEval/64).
    code = "def f(s):\n    n_vowels = count(s)\n    <|>\n    return n_vowels\n"
    assert cut_at(code, "return vowels") is None


def test_indentation_and_spacing_do_not_matter() -> None:
    code = "def f(x):\n    <|>\n    result = compute(x, 1)\n    return result\n"
    assert cut_at(code, "  result=compute( x,1 )") == ""
    assert cut_at(code, "\tresult = compute(x, 1)\n\treturn result") == ""


def test_short_common_lines_alone_are_not_cut() -> None:
    code = "def f(x):\n    if x:\n        <|>\n    else:\n        return x\n    return x\n"
    assert cut_at(code, "return x") is None  # 7 chars: a common line, not evidence
    js = "function f(a) {\n  if (a) {\n    <|>\n  }\n}\n"
    assert cut_at(js, "a += 1;\n  }") is None  # a closer alone
    assert cut_at(js, "a += 1;\n  }\n}") is None  # closers only: the bracket guard's business


def test_short_lines_in_a_run_are_cut() -> None:
    code = "def f(x):\n    if x:\n        <|>\n    else:\n        pass\n    return x\n"
    assert cut_at(code, "y = 1\n    else:\n        pass") == "y = 1"
    assert cut_at(code, "y = 1\n    else:") is None  # one short line: not evidence yet


def test_a_line_that_recurs_in_another_branch_is_kept() -> None:
    # HumanEval/1: the canonical middle is the statement the other branch also has.
    code = (
        "    for c in s:\n        if c == '(':\n            depth += 1\n            <|>\n"
        "        elif c == ')':\n            depth -= 1\n            current_string.append(c)\n"
    )
    assert cut_at(code, "current_string.append(c)") is None
    # A different depth below is another statement too (HumanEval/111).
    code = "    t = 0\n    <|>\n        t = 1\n    if t > 0:\n        for i in list1:\n            d[i] = t\n"
    assert cut_at(code, "for i in list1:") is None


def test_a_line_further_down_in_the_same_block_is_cut() -> None:
    code = "def f(xs):\n    <|>\n    n = len(xs)\n    if n:\n        n -= 1\n    return total_of(xs)\n"
    assert cut_at(code, "return total_of(xs)") == ""
    assert cut_at(code, "xs = sorted(xs)\n    return total_of(xs)") == "xs = sorted(xs)"


def test_mid_line_cursor_leaves_the_first_line_to_fit_to_line_rest() -> None:
    code = "x = foo(<|>)\nresult = compute(x)\n"
    assert cut_at(code, "a, b)") is None  # re-types the rest of the line: a replace range, not a cut
    assert cut_at(code, "a)\nresult = compute(x)") == "a)"  # a whole next line re-typed is cut
    code = "x = <|>compute_value(1)\nother_line_here = 2\n"
    assert cut_at(code, "bar(2) +\n    compute_value(1)") is None  # the rest alone: fit_to_line_rest's
    assert cut_at(code, "compute_value(1)") is None  # the first line continues the cursor's line


def test_rest_of_line_counts_in_runs() -> None:
    code = "def f():\n    <|>return compute_value(1)\n    other_line_here = 2\n"
    assert cut_at(code, "return compute_value(1)\n    other_line_here = 2") == ""


def test_javascript_braces() -> None:
    code = (
        "function total(items) {\n  let sum = 0;\n  <|>\n  for (const item of items) {\n"
        "    sum += item.price * item.count;\n  }\n  return sum;\n}\n"
    )
    retype = "for (const item of items) {\n    sum += item.price * item.count;\n  }"
    assert cut_at(code, retype) == ""
    assert cut_at(code, "const tax = 0.2;\n  " + retype) == "const tax = 0.2;"
    assert cut_at(code, "if (!items) return 0;") is None


def test_window_is_bounded() -> None:
    filler = "".join(f"    v{i} = step_number({i})\n" for i in range(12))
    code = "def f():\n    <|>\n" + filler + "    done_marker_call()\n"
    assert cut_at(code, "done_marker_call()") is None  # 13 lines down: past the window
    assert cut_at(code, "v3 = step_number(3)") == ""


def test_streaming_prefix_never_cuts_later_than_the_whole() -> None:
    ov = SuffixOverlap("", FLASK.split(MARK)[1])
    lines = FLASK_RETYPE.split("\n")
    whole = ov.cut(FLASK_RETYPE)
    for n in range(1, len(lines)):
        part = ov.cut("\n".join(lines[:n]) + "\n")
        assert part is None or part >= whole
    assert whole == 0


def test_text_after_reads_a_bounded_window() -> None:
    data = ("x = 1<rest>\n" + "\n".join(f"line{i}" if i % 2 else "" for i in range(60)) + "\n").encode()
    got = text_after(data, 5)
    assert got.startswith("<rest>\n") and got.count("line") == 10
    assert text_after(b"abc", 1) == "bc" and text_after(b"", 0) == ""


def test_loose_measure_counts_a_recurring_line() -> None:
    code = "    if c:\n        <|>\n    else:\n        return None\n"
    assert cut_at(code, "return None") is None
    i = code.index(MARK)
    assert repeats_a_suffix_line("return None", "        ", code[i + len(MARK) :])
    assert not repeats_a_suffix_line("return x", "        ", code[i + len(MARK) :])
