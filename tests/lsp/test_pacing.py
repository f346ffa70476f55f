"""One session's heavy messages run in slices (lsp_server/pacing.py), in process, on one event loop.

Two sessions share a loop as on a --tcp/--ws listener; frames are fed the way the transports
feed them (``receive`` then ``settle``). Slices are made as short as possible, so the test does
not depend on how fast this machine is: any work of more than one step yields.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from lsp_server import pacing
from lsp_server.documents import Document
from lsp_server.server import create_server

BASE = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300))
INIT = {"processId": None, "rootUri": None, "capabilities": {}, "initializationOptions": {"preload": False}}


class Session:
    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.ls = create_server()
        session = self

        class Writer:
            def write(self, data: bytes) -> None:
                body = data.split(b"\r\n\r\n", 1)[-1]
                session.sent.append(json.loads(body))

            def close(self) -> None:
                pass

        self.ls.protocol.set_writer(Writer())

    async def feed(self, message: dict) -> None:
        self.ls.protocol.receive(json.dumps(message).encode())
        await self.ls.pacer.settle()

    async def start(self) -> None:
        await self.feed({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": INIT})
        await self.feed({"jsonrpc": "2.0", "method": "initialized", "params": {}})

    def answered(self, msg_id: object) -> bool:
        return any(m.get("id") == msg_id and "method" not in m for m in self.sent)

    def text(self, uri: str) -> str:
        doc = self.ls.docs.get(uri)
        assert doc is not None
        return doc.source


def did_open(uri: str, text: str) -> dict:
    return {
        "jsonrpc": "2.0",
        "method": "textDocument/didOpen",
        "params": {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}},
    }


def did_change(uri: str, version: int, edits: list[tuple[int, int, int, int, str]]) -> dict:
    return {
        "jsonrpc": "2.0",
        "method": "textDocument/didChange",
        "params": {
            "textDocument": {"uri": uri, "version": version},
            "contentChanges": [
                {"range": {"start": {"line": a, "character": b}, "end": {"line": c, "character": d}}, "text": t}
                for a, b, c, d, t in edits
            ],
        },
    }


@pytest.fixture(autouse=True)
def tiny_slices(monkeypatch):
    monkeypatch.setattr(pacing, "SLICE_S", 0.0)
    monkeypatch.setattr(pacing.run_in_slices, "__defaults__", (0.0,))


def reference(text: str, edits: list[tuple[int, int, int, int, str]]) -> Document:
    """The same edits applied one at a time, each with its incremental reparse (the light path)."""
    doc = Document("file:///ref.py", text, 1, "python")
    for a, b, c, d, t in edits:  # positions read as the server reads them (clamped to the text)
        doc.apply_edit(doc.to_cp(a, b, lenient=True), doc.to_cp(c, d, lenient=True), t)
    return doc


async def test_a_heavy_change_lets_another_session_in_and_equals_the_light_path():
    a, b = Session(), Session()
    await a.start()
    await b.start()
    await a.feed(did_open("file:///a.py", BASE))
    rng = random.Random(7)
    edits = [
        (ln, 0, ln, rng.randrange(3), rng.choice(["x", "", "y\n", "(z"]))
        for ln in (rng.randrange(500) for _ in range(800))
    ]
    a_work = asyncio.ensure_future(a.feed(did_change("file:///a.py", 2, edits)))
    await asyncio.sleep(0)  # A's change has started
    assert not a_work.done()
    await b.feed({"jsonrpc": "2.0", "id": "b1", "method": "fimble/stats"})
    for _ in range(10):
        await asyncio.sleep(0)
    assert b.answered("b1")
    assert not a_work.done(), "B was answered while A's change was still being applied"
    await a_work
    ref = reference(BASE, edits)
    doc = a.ls.docs.get("file:///a.py")
    assert doc is not None and doc.source == ref.source and doc.version == 2
    assert doc.syntax.text == ref.syntax.text
    fresh = Document("file:///fresh.py", ref.source, 1, "python")  # the batch re-syncs the syntax copy whole
    assert doc.syntax.segment_ranges() == fresh.syntax.segment_ranges()
    assert [str(t.root_node) for t in doc.syntax.trees()] == [str(t.root_node) for t in fresh.syntax.trees()]
    assert a.ls.pacer.deferred == 1 and b.ls.pacer.deferred == 0


async def test_a_large_insertion_and_a_large_open_run_in_slices():
    a = Session()
    await a.start()
    await a.feed(did_open("file:///a.py", BASE))
    big = "y = 2\n" * 200_000  # 1.2 MB: over the parse limit, so plain text
    await a.feed(did_change("file:///a.py", 2, [(3, 0, 3, 0, big)]))
    lines = BASE.splitlines(keepends=True)
    assert a.text("file:///a.py") == "".join(lines[:3]) + big + "".join(lines[3:])
    doc = a.ls.docs.get("file:///a.py")
    assert doc is not None and not doc.syntax.has_tree
    await a.feed(did_open("file:///b.py", big + "\r\nz = 3\r"))
    assert a.text("file:///b.py") == big + "\r\nz = 3\r"
    assert a.ls.docs.get("file:///b.py").lines[-2:] == ["z = 3\r", ""]
    assert a.ls.pacer.deferred == 2


async def test_a_change_with_one_bad_edit_is_dropped_whole():
    a = Session()
    await a.start()
    await a.feed(did_open("file:///a.py", BASE))
    edits = [(1, 0, 1, 0, "x")] * 40
    message = did_change("file:///a.py", 2, edits)
    message["params"]["contentChanges"][30]["range"]["start"]["line"] = -1
    await a.feed(message)
    assert a.text("file:///a.py") == BASE


async def test_a_document_over_the_limit_is_not_kept(monkeypatch):
    monkeypatch.setattr(pacing, "MAX_DOCUMENT_CHARS", 1000)
    from lsp_server import server as server_module

    monkeypatch.setattr(server_module, "MAX_DOCUMENT_CHARS", 1000)
    a = Session()
    await a.start()
    await a.feed(did_open("file:///big.py", "x" * 1001))
    assert a.ls.docs.get("file:///big.py") is None
    await a.feed(did_open("file:///a.py", "x = 1\n"))
    await a.feed(did_change("file:///a.py", 2, [(0, 0, 0, 0, "y" * 1000)]))
    assert a.ls.docs.get("file:///a.py") is None  # grew past it: dropped
    assert a.ls.stats.counters["documents_too_large"] == 2


async def test_a_session_with_too_many_requests_in_flight_is_not_read(monkeypatch):
    monkeypatch.setattr(pacing, "MAX_IN_FLIGHT", 3)
    a = Session()
    release = asyncio.Event()

    @a.ls.feature("test/wait")
    async def wait(ls, params):
        await release.wait()
        return "done"

    await a.start()
    for i in range(2):
        await a.feed({"jsonrpc": "2.0", "id": i + 1, "method": "test/wait"})
    third = asyncio.ensure_future(a.feed({"jsonrpc": "2.0", "id": 3, "method": "test/wait"}))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not third.done() and a.ls.pacer.paused == 1  # the reader waits: nothing more is read
    release.set()
    await third
    for _ in range(10):
        await asyncio.sleep(0)
    assert all(a.answered(i) for i in (1, 2, 3))
