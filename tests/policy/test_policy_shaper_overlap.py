"""CompletionShaper cuts a completion where it starts re-typing the text after the cursor (no model)."""

from __future__ import annotations

import ast

from lsp_server.shaping.shaper import CompletionShaper
from lsp_server.shaping.syntax import SyntaxDocument

MARK = "<|>"

# flask/app.py around Flask.process_response; the cursor on an empty, auto-indented line.
FLASK = '''\
class Flask:
    def process_response(self, response):
        ctx = request_ctx._get_current_object()

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
        """Called after the request is dispatched."""
        return None
'''
# What the default model wrote there: text that follows a few lines below.
RETYPE = (
    "return response\n\n    def do_teardown_request(\n        self,\n"
    "        exc: BaseException | None = _sentinel,  # type: ignore[assignment]\n    ) -> None:\n"
)


def shaper_at(code: str, lang: str = "python") -> tuple[CompletionShaper, SyntaxDocument]:
    i = code.index(MARK)
    text = code.replace(MARK, "", 1)
    doc = SyntaxDocument(lang, text)
    return CompletionShaper(doc, len(text[:i].encode())), doc


def applied(doc: SyntaxDocument, shaped) -> str:
    data = doc.bytes
    return (data[: shaped.replace_start] + shaped.text.encode() + data[shaped.replace_end :]).decode()


def stream(sh: CompletionShaper, text: str, size: int = 4) -> int | None:
    """Feed `text` in chunks as a decoder would; the stop index, if the shaper stopped it."""
    for i in range(0, len(text), size):
        stop = sh.feed(text[i : i + size])
        if stop is not None:
            return stop
    return None


def test_streaming_stops_once_the_retype_is_plain_and_nothing_is_shown():
    sh, _ = shaper_at(FLASK)
    stop = stream(sh, RETYPE)
    # `return response` alone is ambiguous; with the next line it is a run re-typing the suffix.
    assert stop == 0 and sh.stopped and sh.stop_reason == "suffix_overlap" and sh.text == ""
    assert len(sh._raw) < len(RETYPE)  # the decode could stop before the signature's end
    assert sh.feed("more") == 0
    shaped = sh.finish()
    assert shaped.text == "" and shaped.cut_reason == "suffix_overlap"


def test_new_code_is_kept_up_to_the_retype_and_the_file_still_parses():
    sh, doc = shaper_at(FLASK)
    new = "response.headers['X-Done'] = '1'\n"
    stop = stream(sh, new + "        " + RETYPE)
    assert stop == len(new.rstrip()) and sh.text == new.rstrip()
    shaped = sh.finish()
    assert shaped.text == new.rstrip() and shaped.cut_reason == "suffix_overlap"
    ast.parse(applied(doc, shaped))


def test_finish_with_text_cuts_as_streaming_does():
    whole, _ = shaper_at(FLASK)
    streamed, _ = shaper_at(FLASK)
    stream(streamed, RETYPE)
    assert whole.finish(RETYPE).text == streamed.finish().text == ""


def test_a_retype_on_the_last_unfinished_line_is_cut_at_finish():
    sh, _ = shaper_at("def f(xs):\n    <|>\n    n = len(xs)\n    total = sum(xs) / n\n    return total\n")
    assert stream(sh, "xs = list(xs)\n    total = sum(xs) / n") is None  # no line break after it yet
    shaped = sh.finish()
    assert shaped.text == "xs = list(xs)" and shaped.cut_reason == "suffix_overlap"


def test_other_completions_are_untouched():
    sh, doc = shaper_at(FLASK)
    text = "response = self.finalize_headers(response)"
    shaped = sh.finish(text)
    assert shaped.text == text and shaped.cut_reason is None
    ast.parse(applied(doc, shaped))


def test_mid_line_typeover_still_replaces_the_rest_of_the_line():
    sh, doc = shaper_at("def f(a):\n    x = compute(<|>)\n    return x\n")
    shaped = sh.finish("a, 2)")
    assert shaped.text == "a, 2)" and shaped.cut_reason is None
    assert shaped.replace_end == shaped.replace_start + 1  # the auto-paired `)` is re-typed, not doubled
    assert applied(doc, shaped) == "def f(a):\n    x = compute(a, 2)\n    return x\n"
    sh, doc = shaper_at("def f(a):\n    x = compute(<|>)\n    return x_value_of(a)\n")
    shaped = sh.finish("a, 2)\n    return x_value_of(a)")
    assert shaped.text == "a, 2)" and shaped.cut_reason == "suffix_overlap"
    assert applied(doc, shaped) == "def f(a):\n    x = compute(a, 2)\n    return x_value_of(a)\n"


def test_javascript():
    code = (
        "function total(items) {\n  let sum = 0;\n  <|>\n  for (const item of items) {\n"
        "    sum += item.price * item.count;\n  }\n  return sum;\n}\n"
    )
    sh, _ = shaper_at(code, "javascript")
    shaped = sh.finish("const tax = 0.2;\n  for (const item of items) {\n    sum += item.price * item.count;\n  }")
    assert shaped.text == "const tax = 0.2;" and shaped.cut_reason == "suffix_overlap"
