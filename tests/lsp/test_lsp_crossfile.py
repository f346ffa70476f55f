"""Cross-file context end to end: a real `fimble lsp` over stdio with the embedded model.

Open tabs and imports reach the engine's prompt (its counters count context tokens), the ring stays the
same while the user types (keystrokes prefill a few tokens), imports are read from disk only inside the
workspace folder and never through a link out of it, and 50 open files of 1 MB do not stop the server
from answering other requests while the context is worked out.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import pytest_lsp
from lsp_helpers import SERVER, change, configure, init_params, inline, open_doc, plain, server_text, stats
from pytest_lsp import LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

UTIL = '''"""Shapes."""


def scale_polygon(points, factor, origin=(0.0, 0.0)):
    """Scale every point of a polygon by ``factor`` around ``origin``."""
    ox, oy = origin
    return [(ox + (x - ox) * factor, oy + (y - oy) * factor) for x, y in points]


def polygon_perimeter(points):
    return sum(abs(complex(*a) - complex(*b)) for a, b in zip(points, points[1:] + points[:1]))
'''
MAIN = '''"""Draw shapes."""
from .util import scale_polygon, polygon_perimeter


def grow(points):
    bigger = scale_polygon(points, 2.0)
    print(polygon_perimeter(bigger))
    return '''
GEOMETRY = '''def area_of_rectangle(width, height, *, units="cm"):
    """The area of a width x height rectangle, in square ``units``."""
    return f"{width * height} {units}^2"
'''
SECRET = """def leaked_secret_function(token):
    return token
"""


# A package per language whose files import each other: the imported definition must reach the ring.
OTHER_LANGUAGE_FILES = {
    "go/util/strings.go": "package util\n\n// Reverse returns s reversed.\nfunc Reverse(s string) string {\n"
    "\tr := []rune(s)\n\treturn string(r)\n}\n",
    "go/util/strings_test.go": "package util\n\nfunc TestOnlyHelper() {}\n",
    "rs/src/shapes.rs": "pub struct Circle {\n    pub radius: f64,\n}\n\nimpl Circle {\n"
    "    pub fn area(&self) -> f64 {\n        3.14 * self.radius * self.radius\n    }\n}\n",
    "java/src/main/java/com/acme/util/Strings.java": "package com.acme.util;\n\npublic class Strings {\n"
    '    public static String padLeft(String s, int width) {\n        return String.format("%" + width + "s", s);\n'
    "    }\n}\n",
    "c/vec.h": "#ifndef VEC_H\n#define VEC_H\ntypedef struct { float x, y; } Vec2;\n"
    "Vec2 vec2_add(Vec2 a, Vec2 b);\n#endif\n",
}
IMPORTING = {  # (file opened, language, its text, the ring entry expected: "kind name path:first-last line")
    "go": (
        "go/cmd/main.go",
        "go",
        'package main\n\nimport (\n\t"fmt"\n\t"example.com/proj/util"\n)\n\n'
        'func main() {\n\tfmt.Println(util.Reverse("abc"), util.LeakedGoSecret())\n\t',
        "import Reverse go/util/strings.go:4-7",
    ),
    "rust": (
        "rs/src/main.rs",
        "rust",
        "mod shapes;\nuse crate::shapes::Circle;\n\nfn main() {\n"
        '    let c = Circle { radius: 2.0 };\n    println!("{}", c.',
        "import Circle rs/src/shapes.rs:1-9",
    ),  # the struct and its impl block's methods
    "java": (
        "java/src/main/java/com/acme/app/App.java",
        "java",
        "package com.acme.app;\n\nimport com.acme.util.Strings;\n\n"
        "public class App {\n    String show(String s) {\n        return Strings.",
        "import Strings java/src/main/java/com/acme/util/Strings.java:3-7",
    ),
    "c": (
        "c/main.c",
        "c",
        '#include <stdio.h>\n#include "vec.h"\n\nint main(void) {\n    Vec2 a = {1, 2};\n'
        "    Vec2 b = vec2_add(a, a);\n    ",
        "import vec2_add c/vec.h:4-4",
    ),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("xf")
    ws, outside = base / "ws", base / "outside"
    (ws / "pkg").mkdir(parents=True)
    outside.mkdir()
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "pkg" / "geometry.py").write_text(GEOMETRY)
    (outside / "secret.py").write_text(SECRET)
    os.symlink(outside / "secret.py", ws / "pkg" / "evil.py")  # a link out of the workspace
    (ws / "pkg" / "huge.py").write_text("def huge_function(x):\n    return x\n" + "# filler\n" * 40_000)  # > 256 KB
    for rel, text in OTHER_LANGUAGE_FILES.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    (outside / "leak.go").write_text('package util\n\nfunc LeakedGoSecret() string { return "x" }\n')
    os.symlink(outside / "leak.go", ws / "go" / "util" / "leak.go")  # a link out of the workspace: not read
    return ws


@pytest_lsp.fixture(config=SERVER, scope="module")
async def client(lsp_client: LanguageClient, workspace: Path):
    params = init_params("visual-studio-code", {"prefetch": False, "prewarmDelayMs": 50})
    params.root_uri = workspace.as_uri()
    await lsp_client.initialize_session(params)
    yield
    await lsp_client.shutdown_session()


async def _wait(client: LanguageClient, pred, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = await stats(client)
        if pred(snap):
            return snap
        assert time.monotonic() < deadline, f"timed out: {snap['tables']}, {snap['counters']}"
        await asyncio.sleep(0.05)


async def _settled(client: LanguageClient) -> dict:
    """Once the context's background work is done (fimble/stats tables.context_pending)."""
    return await _wait(client, lambda s: s["tables"]["context_pending"] == 0)


async def _ring(client: LanguageClient, uri: str) -> list[str]:
    rings = plain(await client.protocol.send_request_async("fimble/debug/context", {"uri": uri}))
    return next((r["chunks"] for r in rings if r["uri"] == uri), [])


def _engine(snap: dict) -> dict:
    return {
        "submitted": 0,
        "completed": 0,
        "cancelled": 0,
        "failed": 0,
        "context_prompts": 0,
        "context_tokens": 0,
        "tokens_prefilled": 0,
        **snap["engine"]["counters"],
    }


def _ended(counters: dict) -> int:
    return counters["completed"] + counters["cancelled"] + counters["failed"]


async def test_open_tab_definitions_reach_the_prompt_and_stay_while_typing(client: LanguageClient):
    util, main = "file:///tmp/fimble-tests/xf/pkg/util.py", "file:///tmp/fimble-tests/xf/pkg/main.py"
    open_doc(client, util, UTIL)
    open_doc(client, main, MAIN)
    await _settled(client)
    ring = await _ring(client, main)
    assert any(c.startswith("import scale_polygon pkg/util.py:4-") for c in ring), ring
    assert not any("main.py" in c for c in ring), ring  # never the file's own text
    lines = MAIN.split("\n")
    cursor = (len(lines) - 1, len(lines[-1]))
    before = _engine(await stats(client))
    await inline(client, main, *cursor)
    after = _engine(await _wait(client, lambda s: _ended(_engine(s)) > _ended(before)))
    assert after["context_prompts"] > before["context_prompts"]
    assert after["context_tokens"] - before["context_tokens"] > 30
    # Typing: the ring stays as it is, so each keystroke's prompt reuses the cached context and prefills little.
    version, (line, col) = 2, cursor
    start = after
    for ch in "  bigger.":
        change(client, main, version, (line, col), (line, col), ch)
        version, col = version + 1, col + 1
        await inline(client, main, line, col)
        assert await _ring(client, main) == ring
    end = _engine(await _wait(client, lambda s: _ended(_engine(s)) == _engine(s)["submitted"]))
    submitted = end["submitted"] - start["submitted"]
    assert submitted >= 3  # (the others were answered by type-through)
    assert end["context_prompts"] - start["context_prompts"] == submitted
    assert (end["tokens_prefilled"] - start["tokens_prefilled"]) / submitted <= 16, (end, start)
    assert (await _settled(client))["counters"].get("context_errors", 0) == 0


async def test_imports_read_from_the_workspace_folder_only(client: LanguageClient, workspace: Path):
    uri = (workspace / "pkg" / "app.py").as_uri()
    text = (
        "from .geometry import area_of_rectangle\nfrom .evil import leaked_secret_function\n"
        "from .huge import huge_function\n\n\ndef report(w, h):\n    return "
    )
    reads = (await stats(client))["counters"].get("context_disk_reads", 0)
    open_doc(client, uri, text)
    snap = await _settled(client)
    ring = await _ring(client, uri)
    assert any(c.startswith("import area_of_rectangle pkg/geometry.py:1-3") for c in ring), ring
    assert not any("secret" in c or "evil" in c or "huge" in c for c in ring), ring
    assert snap["counters"]["context_disk_reads"] - reads == 1  # geometry.py: not the link, not the big file


@pytest.mark.parametrize("language", sorted(IMPORTING))
async def test_imports_of_go_rust_java_and_c_reach_the_ring(client: LanguageClient, workspace: Path, language: str):
    rel, language_id, text, expected = IMPORTING[language]
    uri = (workspace / rel).as_uri()
    open_doc(client, uri, text, language=language_id)
    snap = await _settled(client)
    ring = await _ring(client, uri)
    assert any(c.startswith(expected) for c in ring), ring
    assert not any("Leaked" in c or "TestOnly" in c or "_test.go" in c for c in ring), ring
    assert snap["counters"].get("context_errors", 0) == 0


async def test_settings_turn_it_off(client: LanguageClient):
    main = "file:///tmp/fimble-tests/xf/pkg/main.py"
    if await server_text(client, main) is None:  # (an earlier test opens it; this one may also run alone)
        open_doc(client, main, MAIN)
    await configure(client, crossFileContext=False)
    before = _engine(await stats(client))
    lines = MAIN.split("\n")
    await inline(client, main, len(lines) - 1, 0)
    after = _engine(await _wait(client, lambda s: _ended(_engine(s)) > _ended(before)))
    assert after["context_prompts"] == before["context_prompts"]
    await configure(client, crossFileContext=True)


async def test_fifty_open_megabyte_files_leave_the_server_answering(client: LanguageClient):
    # Just over 1M characters: plain text for the syntax layer (no parse), so the work measured is the context's.
    body = "".join(f"def function_{i}(alpha, beta):\n    return alpha * {i} + beta\n\n" for i in range(1000))
    big = (body * (1_000_100 // len(body) + 1))[:1_000_100]
    for i in range(50):
        open_doc(client, f"file:///tmp/fimble-tests/xf/big/mod{i}.py", big)
    focus = "file:///tmp/fimble-tests/xf/big/focus.py"
    yields = (await stats(client))["counters"].get("context_yields", 0)
    open_doc(client, focus, "def use(alpha, beta):\n    return function_3(alpha, ")
    # Poll: at least one fimble/stats is answered in the middle of the context's work (between its slices).
    answered_mid_work = 0
    deadline = time.monotonic() + 120
    while True:
        snap = await stats(client)
        pending, now_yields = snap["tables"]["context_pending"], snap["counters"].get("context_yields", 0)
        if pending and now_yields > yields:
            answered_mid_work += 1
        if not pending and snap["counters"].get("context_refreshes", 0) and now_yields > yields:
            break
        assert time.monotonic() < deadline, snap["tables"]
        await asyncio.sleep(0.01)
    assert answered_mid_work >= 1
    ring = await _ring(client, focus)
    assert ring and all(c.startswith("tab ") for c in ring), ring
    assert snap["tables"]["context_indexed_docs"] <= 16 + 2  # the most recent 16 of them, and the earlier tabs
