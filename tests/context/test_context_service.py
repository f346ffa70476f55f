"""The session's cross-file context (lsp_server/context/service.py): ranking, threshold, stability, settings."""

from __future__ import annotations

import asyncio
import dataclasses

from lsp_server.context import CrossFileContext
from lsp_server.documents import DocumentStore
from lsp_server.settings import Settings
from lsp_server.stats import Stats

RELATED = "".join(
    f"def parse_record_{i}(record_line, field_sep):\n    fields = record_line.split(field_sep)\n"
    f"    return {{'key': fields[0], 'value': fields[{i % 3}]}}\n\n"
    for i in range(12)
)
UNRELATED = "".join(
    f"class Sprite{i}:\n    def draw(self, canvas, color):\n        canvas.blit(self.image, color)\n\n"
    for i in range(12)
)
FOCUS = (
    "def load(path, field_sep=','):\n    out = []\n    for record_line in open(path):\n"
    "        fields = record_line.split(field_sep)\n        out.append(parse_record_1(record_line, "
)


async def settle(cx: CrossFileContext) -> None:
    await asyncio.sleep(0.3)
    while cx.pending:
        await asyncio.sleep(0.02)


def setup(*docs: tuple[str, str], settings: Settings | None = None):
    store, stats = DocumentStore(), Stats()
    changes: list[str] = []
    cx = CrossFileContext(store, stats, on_change=lambda doc, cursor, s: changes.append(doc.uri))
    settings = settings or Settings()
    opened = [store.open(uri, text, 1, "python") for uri, text in docs]
    for d in opened:
        cx.touch(d, None, settings)
    return cx, store, stats, settings, opened, changes


async def test_the_related_tab_ranks_and_the_unrelated_does_not():
    cx, _, _, s, docs, changes = setup(
        ("file:///p/records.py", RELATED), ("file:///p/sprites.py", UNRELATED), ("file:///p/load.py", FOCUS)
    )
    await settle(cx)
    ctx = cx.for_request("file:///p/load.py", docs[2], s)
    assert ctx is not None and changes == ["file:///p/load.py"]
    assert {c["path"] for c in ctx["chunks"]} == {"p/records.py"}
    assert ctx["path"] == "p/load.py" and ctx["budget"] == s.cross_file_budget and ctx["comment"] == "#"


async def test_no_context_when_nothing_ranks_above_the_threshold():
    cx, _, _, s, docs, _ = setup(("file:///p/sprites.py", UNRELATED), ("file:///p/load.py", FOCUS))
    await settle(cx)
    assert cx.for_request("file:///p/load.py", docs[1], s) is None


async def test_typing_leaves_the_ring_alone_and_a_jump_refreshes_it():
    cx, store, stats, s, docs, changes = setup(("file:///p/records.py", RELATED), ("file:///p/load.py", FOCUS))
    await settle(cx)
    focus = docs[1]
    first = cx.for_request(focus.uri, focus, s)
    refreshes = stats.counters["context_refreshes"]
    line = len(focus.lines) - 1
    for i, ch in enumerate("field_sep))"):
        col = len(focus.lines[line])
        focus.apply_edit((line, col), (line, col), ch)
        focus.version += 1
        cx.touch(focus, (line, col + 1), s)
        assert cx.for_request(focus.uri, focus, s) is first  # the very same object: no work on a keystroke
        if i % 4 == 0:
            await settle(cx)  # a pause: the refresh finds nothing new
    await settle(cx)
    assert stats.counters["context_refreshes"] > refreshes
    assert cx.for_request(focus.uri, focus, s) is first and changes == [focus.uri]
    end = len(focus.lines)
    focus.apply_edit((end - 1, len(focus.lines[-1])), (end - 1, len(focus.lines[-1])), "\n" * 40 + "x = 1")
    focus.version += 1
    cx.touch(focus, (end + 39, 5), s)  # a jump of 40 lines: the ring is ranked again for the new spot
    await settle(cx)
    assert cx.debug_state(focus.uri)[0]["line"] == end + 39


async def test_settings_sources_budget_and_remote_engines():
    docs = (("file:///p/records.py", RELATED), ("file:///p/load.py", FOCUS))
    cx, _, _, s, opened, _ = setup(*docs, settings=Settings().merged({"crossFileSources": ["imports"]}))
    await settle(cx)
    assert cx.for_request("file:///p/load.py", opened[1], s) is None  # tabs were not a source
    small = Settings().merged({"crossFileBudget": 400})
    cx, _, _, s, opened, _ = setup(*docs, settings=small)
    await settle(cx)
    ctx = cx.for_request("file:///p/load.py", opened[1], s)
    assert ctx is not None and sum(len(c["text"]) / 3 + 12 for c in ctx["chunks"]) <= 400
    remote = dataclasses.replace(Settings(), engine_spec=object())
    assert cx.for_request("file:///p/load.py", opened[1], remote) is None  # never sent to another machine
    assert cx.for_request("file:///p/load.py", opened[1], Settings().merged({"crossFileContext": False})) is None


def test_setting_validation():
    s, problems = Settings().merge({"crossFileBudget": 99_999, "crossFileSources": ["tabs"], "crossFileContext": 1})
    assert s.cross_file_budget == 4096 and s.cross_file_sources == Settings().cross_file_sources
    assert s.cross_file_context is True and len(problems) == 3
    s, problems = Settings().merge(
        {"crossFileBudget": 0, "crossFileSources": ["imports", "openFiles"], "crossFileContext": False}
    )
    assert not problems and s.cross_file_budget == 0 and s.cross_file_sources == ("imports", "openFiles")
    assert not CrossFileContext.enabled(s)
