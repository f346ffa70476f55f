"""Unit tests of the pure pieces: position encodings, the line store, prompt windows, typed-since, settings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lsp_server.documents import Document, split_lines
from lsp_server.positions import PositionError, advance, from_codepoints, to_codepoints
from lsp_server.prompt import build_context, typed_since

LINE = "a😀é日b"  # 5 code points: 1, 4, 2, 3, 1 UTF-8 bytes; 😀 is 2 UTF-16 units


@pytest.mark.parametrize(
    "encoding, units, col",
    [
        ("utf-16", 0, 0),
        ("utf-16", 1, 1),
        ("utf-16", 3, 2),
        ("utf-16", 4, 3),
        ("utf-16", 6, 5),
        ("utf-16", 99, 5),
        ("utf-8", 1, 1),
        ("utf-8", 5, 2),
        ("utf-8", 7, 3),
        ("utf-8", 10, 4),
        ("utf-8", 11, 5),
        ("utf-32", 2, 2),
        ("utf-32", 5, 5),
        ("utf-32", 7, 5),
    ],
)
def test_to_codepoints(encoding, units, col):
    assert to_codepoints(LINE, units, encoding) == col
    if units <= {"utf-16": 6, "utf-8": 11, "utf-32": 5}[encoding]:
        assert from_codepoints(LINE, col, encoding) == units


@pytest.mark.parametrize("encoding, units", [("utf-16", 2), ("utf-8", 2), ("utf-8", 4), ("utf-8", 6), ("utf-8", 9)])
def test_inside_a_character_is_an_error(encoding, units):
    with pytest.raises(PositionError):
        to_codepoints(LINE, units, encoding)
    assert to_codepoints(LINE, units, encoding, strict=False) < len(LINE)


def test_lone_surrogates_count_as_one_utf16_unit():
    line = "x\udcffy"
    assert to_codepoints(line, 2, "utf-16") == 2
    assert from_codepoints(line, 3, "utf-8") == 5


def test_advance():
    assert advance(3, 4, "ab") == (3, 6)
    assert advance(3, 4, "ab\ncd") == (4, 2)
    assert advance(3, 4, "a\r\n\r\nb") == (5, 1)


def _offset(text: str, line: int, col: int) -> int:
    lines = split_lines(text)
    return sum(len(x) for x in lines[:line]) + col


pieces = st.sampled_from(["a", "b", " ", "\n", "\r\n", "\r", "é", "😀", "日", "\u2028", "\t"])
texts = st.lists(pieces, max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    texts,
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40), st.integers(0, 40), texts), max_size=8
    ),
)
def test_edits_match_a_whole_string_reference(text, edits):
    doc = Document("u", text, language_id="python")
    ref = text
    for a, b, c, d, new in edits:
        lines = split_lines(ref)
        l0, l1 = sorted((a % len(lines), c % len(lines)))
        c0 = b % (len(doc.line_text(l0)) + 1)
        c1 = d % (len(doc.line_text(l1)) + 1)
        if (l0, c0) > (l1, c1):
            c0, c1 = c1, c0
        start, end = _offset(ref, l0, c0), _offset(ref, l1, c1)
        ref = ref[:start] + new + ref[end:]
        doc.apply_edit((l0, c0), (l1, c1), new)
        assert doc.source == ref
        assert doc.lines == split_lines(ref)
        assert doc.length == len(ref)
        # The syntax layer's copy follows edit by edit, bare "\r" line ends included (as "\n" there).
        assert doc.syntax.text == ref.replace("\r\n", "\0").replace("\r", "\n").replace("\0", "\r\n")
        for i in range(len(doc.lines)):
            for col in {0, len(doc.line_text(i)) // 2, len(doc.line_text(i))}:
                assert doc.byte_offset(i, col) == len(ref[: _offset(ref, i, col)].encode("utf-8"))


def test_prefix_window_is_stable_while_typing_and_jumps_rarely():
    text = "".join(f"line {i} = {i * 7}\n" for i in range(400))
    doc = Document("u", text)
    last = len(doc.lines) - 1
    first = build_context(doc, last, 0, 1000, 200)
    windows = {first.window}
    for i in range(300):  # type 300 characters at the end
        doc.apply_edit((last, i), (last, i), "x")
        ctx = build_context(doc, last, i + 1, 1000, 200)
        windows.add(ctx.window)
        assert ctx.prefix.endswith("x" * (i + 1)) and len(ctx.prefix) <= 1000
    assert len(windows) <= 2  # one jump at most in 300 characters with a 1000-character budget


def test_suffix_ignores_typing_at_the_cursor():
    doc = Document("u", "def f():\n    return 1\n\nprint(f())\n")
    before = build_context(doc, 1, 4, 1000, 200)
    doc.apply_edit((1, 4), (1, 4), "x = 2\n    ")
    after = build_context(doc, 2, 4, 1000, 200)
    assert before.suffix == after.suffix == "return 1\n\nprint(f())\n"


def test_typed_since():
    doc = Document("u", "def f():\n    return \n")
    ctx = build_context(doc, 1, 11, 1000, 200)
    doc.apply_edit((1, 11), (1, 11), "x +")
    assert typed_since(doc, ctx) == "x +"
    doc.apply_edit((1, 13), (1, 14), "")  # backspace
    assert typed_since(doc, ctx) == "x "
    doc.apply_edit((0, 0), (0, 0), "#")  # an edit elsewhere: not typing at the cursor
    assert typed_since(doc, ctx) is None


def test_settings_merge():
    from lsp_server.settings import Settings

    s = Settings().merged(
        {
            "fimble": {
                "maxLines": 2,
                "enable": {"markdown": False},
                "drafter": "bogus",
                "maxTokens": "many",
                "somebodyElses": 1,
                "model": None,
            }
        }
    )
    assert s.max_lines == 2 and s.max_tokens == 128 and s.drafter == "auto" and s.model is None
    assert s.enabled_for("python") and not s.enabled_for("markdown")
    assert not s.merged({"enable": False}).enabled_for("python")
    assert s.merged({"model": "/m"}).engine_key() != s.engine_key()
    assert Settings().merged(None) == Settings()
    # The syntax policy's overrides: checked when set, a bad one ignored whole.
    p = s.merged({"policy": {"comment": {"max_tokens": 8}, "*": {"multiline": False}}})
    assert p.policy == {"comment": {"max_tokens": 8}, "*": {"multiline": False}}
    assert p.merged({"policy": {"comment": {"max_tokens": "lots"}}}).policy == p.policy
    assert p.merged({"policy": {"no_such_context": {}}}).policy == p.policy
    assert p.merged({"policy": None}).policy is None


def test_syntax_copy_skips_huge_documents(monkeypatch):
    import lsp_server.documents as documents

    monkeypatch.setattr(documents, "SYNTAX_MAX_CHARS", 50)
    small = Document("u", "def f():\n    return 1\n", language_id="python")
    assert small.syntax.has_tree
    big = Document("u", "x = 1\n" * 20, language_id="python")
    assert not big.syntax.has_tree and big.syntax.text == "x = 1\n" * 20  # plain text: no parse
    big.apply_edit((0, 0), (0, 0), "y")
    assert big.syntax.text == "yx = 1\n" + "x = 1\n" * 19


def test_with_edit_is_a_scratch_copy_with_its_own_syntax():
    """Document.with_edit: the document an accept will leave (the follow-up is planned there), the original
    untouched, lines and syntax tree alike."""
    doc = Document("file:///w.py", "def f(x):\n    return g(\n", 1, "python")
    text_before, tree_before = doc.source, str(doc.syntax.trees()[0].root_node)
    after = doc.with_edit((1, 13), (1, 13), "x)\n\ny = 1")
    assert after.source == "def f(x):\n    return g(x)\n\ny = 1\n"
    assert after.lines[3] == "y = 1\n" and after.length == len(after.source)
    assert not after.syntax.trees()[0].root_node.has_error
    assert doc.source == text_before and str(doc.syntax.trees()[0].root_node) == tree_before
    assert doc.syntax.trees()[0].root_node.has_error


def test_follow_up_after_an_accept_that_ends_its_line_decodes_the_next_lines():
    from engine.options import DecodeOptions
    from lsp_server.follow_up import FOLLOW_UP_LINES, FOLLOW_UP_MAX_TOKENS, follow_up_options

    doc = Document("file:///f.py", "def f(x):\n    y = g(x)\n    return y)\n", 1, "python")
    one_line = DecodeOptions(max_tokens=48, max_lines=1)
    at_end = follow_up_options(one_line, doc, (1, 12), max_lines=8)
    assert at_end.max_lines == FOLLOW_UP_LINES and at_end.max_tokens == FOLLOW_UP_MAX_TOKENS
    assert follow_up_options(one_line, doc, (2, 12), max_lines=8).max_lines == 1  # code after the cursor
    assert follow_up_options(one_line, doc, (1, 12), max_lines=1).max_lines == 1  # the user's cap
    block = DecodeOptions(max_tokens=128, max_lines=8)
    assert follow_up_options(block, doc, (1, 12), max_lines=8).max_lines == 8  # multi-line already


def test_a_follow_up_after_a_whole_line_starts_on_the_next_line():
    """Tab-Tab after an accept that ends its line: the model is asked for the next line (its prompt has the line
    break), not whether the middle goes on at the end of this one (where a FIM model says end-of-middle)."""
    from types import SimpleNamespace

    from lsp_server.follow_up import after_lead, next_line_follows

    doc = Document("file:///f.py", "def f(x):\n    y = g(x)\n    return y)\n", 1, "python")
    ended = SimpleNamespace(finish_reason="eos")
    assert next_line_follows(ended, doc, (1, 12))  # the accept ends line 1
    assert next_line_follows(SimpleNamespace(finish_reason="stop"), doc, (1, 12))  # a line limit or the guard
    assert not next_line_follows(SimpleNamespace(finish_reason="length"), doc, (1, 12))  # a token cap: mid-line
    assert not next_line_follows(ended, doc, (2, 12))  # code after the cursor: the line goes on
    ctx = build_context(doc, 1, 12, 4000, 1000)
    led = after_lead(ctx, "\n")
    assert led.prefix == ctx.prefix + "\n" and led.suffix == ctx.suffix == "\n    return y)\n"
    assert led.cursor == (2, 0) and led.doc_length == ctx.doc_length + 1 and led.window == ctx.window


def test_line_start_is_taken_only_on_an_indentation_only_line():
    """lsp_server/line_start.py: a decode from the line's start where the cursor ends the line's indentation."""
    from lsp_server.line_start import at_cursor, line_start

    doc = Document("file:///n.py", "def f(x):\n    if x:\n        return False\n        \n    y = 1\n", 1, "python")
    ctx = build_context(doc, 3, 8, 4000, 1000)
    ls = line_start(doc, ctx)
    assert ls is not None and ls.indent == " " * 8
    assert ls.ctx.cursor == (3, 0) and ls.ctx.prefix + ls.indent == ctx.prefix and ls.ctx.suffix == ctx.suffix
    assert typed_since(doc, ls.ctx) == ls.indent  # the indentation reads as typed since the line's start
    assert ls.doc.lines[3] == "\n" and doc.lines[3] == " " * 8 + "\n"  # a scratch copy, the editor's untouched
    assert line_start(doc, build_context(doc, 3, 4, 4000, 1000)) is not None  # inside the indentation, rest blank
    assert line_start(doc, build_context(doc, 2, 8, 4000, 1000)) is None  # code after the cursor
    assert line_start(doc, build_context(doc, 2, 20, 4000, 1000)) is None  # code before it
    assert line_start(doc, build_context(doc, 3, 0, 4000, 1000)) is None  # nothing to re-type
    assert at_cursor("        return", " " * 8) == "return"
    assert at_cursor("      ", " " * 8) == ""  # still inside the indentation: undecided
    assert at_cursor("    return True", " " * 8) is None  # a dedent


def test_a_line_start_stream_sends_text_past_the_indentation_or_a_dedent_from_the_line_start():
    from types import SimpleNamespace

    from lsp_server.generation import Generation
    from lsp_server.streaming import DeltaStreamer, Subscription

    doc = Document("file:///n.py", "def f(x):\n    if x:\n        return False\n        \n", 1, "python")
    ctx = build_context(doc, 3, 0, 4000, 1000)
    sent: list[dict] = []
    streamer = DeltaStreamer(lambda method, params: sent.append(params))
    position = {"line": 3, "character": 8}
    for text, expect in (("        return x", ("return x", None)), ("    return True", ("    return True", 0))):
        gen = Generation(ctx, SimpleNamespace(cancelled=False, cancel=lambda: None), 0.0, 0.0)
        sub = Subscription(gen, 0, 1, None, "c", doc.uri, 1, position, cached=False, indent=" " * 8)
        streamer.subscribe(sub)
        gen.add_text("    ")  # inside the indentation: nothing to show yet
        gen.changed()
        assert not sent
        gen.add_text(text[4:])
        gen.changed()
        gen.finish("stop")
        gen.changed()
        last = sent[-1]
        assert last["done"] and last["text"] == expect[0] and last["position"] == position
        assert last.get("replaceStart") == (None if expect[1] is None else {"line": 3, "character": 0})
        assert all(("replaceStart" in m) == (expect[1] is not None) for m in sent)
        sent.clear()


def test_a_blank_line_asks_the_model_to_say_something():
    """plan_at: on a line that is blank around the cursor (after Enter and its indentation) the decode may not end
    at once (DecodeOptions.no_empty); elsewhere an empty middle stays a valid answer."""
    from lsp_server.plan import plan_at
    from lsp_server.settings import Settings

    doc = Document("file:///b.py", "def f(x):\n    y = g(x)\n    \n    return y\n", 1, "python")
    settings = Settings()
    assert plan_at(doc, (2, 4), settings, shaped=False).options.no_empty
    assert plan_at(doc, (2, 2), settings, shaped=False).options.no_empty  # inside the indentation
    assert not plan_at(doc, (1, 12), settings, shaped=False).options.no_empty  # the end of a line of code
    assert not plan_at(doc, (3, 4), settings, shaped=False).options.no_empty  # code after the cursor


def test_a_prewarm_says_how_long_ago_the_user_acted():
    """A pre-warm carries the seconds since the user's latest event in its document (``idle_s``), and a ring
    change (not the user's event) does not reset that clock: the engine's background window counts from it."""
    import asyncio
    import time

    from lsp_server.context.service import CrossFileContext
    from lsp_server.documents import DocumentStore
    from lsp_server.plan import Planner
    from lsp_server.prewarm import Prewarmer
    from lsp_server.settings import Settings
    from lsp_server.stats import Stats

    sent = []

    class Engine:
        def prewarm(self, request) -> None:
            sent.append(request)

    class Host:
        state = "ready"

        def ready_engine(self):
            return Engine()

    class NoDecodes:
        def generations(self, uri):
            return []

    async def scenario() -> None:
        docs, stats = DocumentStore(), Stats()
        warm = Prewarmer(docs, Host(), stats, Planner(docs, stats, CrossFileContext(docs, stats)), NoDecodes())
        doc = docs.open("file:///a.py", "def f(x):\n    return x\n\n\nprint(f(1))\n", 1, "python")
        settings = Settings()

        async def sent_count(n: int) -> None:
            for _ in range(500):
                if len(sent) >= n:
                    return
                await asyncio.sleep(0.01)

        before = time.monotonic()
        warm.schedule(doc, (2, 0), settings, delay_ms=0)  # the user's edit
        await sent_count(1)
        await asyncio.sleep(0.3)
        warm.schedule(doc, (2, 0), settings, delay_ms=0, exact=True, activity=False)  # a ring changed
        await sent_count(2)
        ring = sent[1].idle_s
        assert 0.29 <= ring <= time.monotonic() - before  # counted from the edit, not from the ring change
        await asyncio.sleep(0.3)
        warm.schedule(doc, (2, 0), settings, delay_ms=0, exact=True)  # the user's cursor rests: the clock restarts
        await sent_count(3)
        assert len(sent) == 3 and 0 <= sent[0].idle_s < ring and 0 <= sent[2].idle_s < ring

    asyncio.run(scenario())


def test_a_decode_without_deltas_is_stopped_for_quiet_too():
    """The quiet stop for a decode that sends nothing (a follow-up's or a prefetch's prefill of seconds): a timer
    looks at it, not only the deltas. One a request still waits on is left to the deltas, text or not: cut between
    two, a block header whose body has not come yet would leave the answer empty."""
    import asyncio
    import time

    from lsp_server import decodes
    from lsp_server.stats import Stats

    class Gen:
        def __init__(self, waiting: int) -> None:
            self.done = self.quiet = self.cut = self.invoked = self.cancelled = False
            self.waiting, self.t_first = waiting, None
            self.t_user = time.perf_counter()
            self.ctx = type("Ctx", (), {"uri": "file:///a.py"})()

        def cancel(self) -> None:
            self.cancelled = True

    async def scenario() -> None:
        d = decodes.Decodes.__new__(decodes.Decodes)
        d.last_edit, d.stats = {}, Stats()
        idle, waited = Gen(waiting=0), Gen(waiting=1)
        for gen in (idle, waited):
            d._quiet_check(gen)  # too soon: looked at again later
        assert not idle.cancelled and not waited.cancelled
        idle.t_user = waited.t_user = time.perf_counter() - decodes.QUIET_AFTER_S - 1  # the user left

        async def until(pred) -> None:  # the timer looks again every QUIET_POLL_S; a loaded machine is slower
            for _ in range(500):
                if pred():
                    return
                await asyncio.sleep(0.01)

        await until(lambda: idle.cancelled)
        assert idle.cancelled and idle.quiet and d.stats.counters.get("quiet_stops") == 1
        assert not waited.cancelled  # a request waits on it and nothing came yet
        waited.t_first = time.perf_counter() - decodes.QUIET_MIN_SHOWN_S - 1  # text came long ago: still the deltas'
        await asyncio.sleep(decodes.QUIET_POLL_S * 3)
        assert not waited.cancelled
        waited.waiting = 0  # the editor gave up on it
        await until(lambda: waited.cancelled)
        assert waited.cancelled and d.stats.counters.get("quiet_stops") == 2

    asyncio.run(scenario())


def test_a_follow_up_starts_only_with_time_left_before_the_quiet(monkeypatch):
    """Tab-Tab's follow-up after an answer that came late would be cut by the quiet stop before it showed anything,
    while its pass ran on past it (the CPU busy 2-3 s after the key): it is not started then."""
    from lsp_server import decodes

    monkeypatch.setattr(decodes, "FOLLOW_UP_WITHIN_S", 1.5)
    monkeypatch.setattr(decodes, "QUIET_AFTER_S", 1.5)
    assert decodes.follow_up_in_time(0.3)
    assert decodes.follow_up_in_time(1.5 - decodes.FOLLOW_UP_MIN_LEFT_S)
    assert not decodes.follow_up_in_time(1.42)  # the answer of a cold prompt, 1.42 s after the key
    monkeypatch.setattr(decodes, "QUIET_AFTER_S", 0.0)  # no quiet stop: only the follow-up's own limit
    assert decodes.follow_up_in_time(1.42)
    assert not decodes.follow_up_in_time(1.6)


def test_the_follow_up_setting_is_range_checked(monkeypatch):
    """A bad value is an error (engine/env_settings.py; fimble stops at start), no longer the default kept."""
    from engine.env_settings import SettingError, read

    for bad in ("nonsense", "-3", "601"):
        monkeypatch.setenv("FIMBLE_FOLLOW_UP_WITHIN_S", bad)
        with pytest.raises(SettingError, match="FIMBLE_FOLLOW_UP_WITHIN_S"):
            read("FIMBLE_FOLLOW_UP_WITHIN_S")
    monkeypatch.setenv("FIMBLE_FOLLOW_UP_WITHIN_S", "2.5")
    assert read("FIMBLE_FOLLOW_UP_WITHIN_S") == 2.5
