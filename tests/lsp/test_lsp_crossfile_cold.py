"""Cross-file context reaches a typist's prompts, end to end: a real `fimble lsp` over stdio, embedded model.

The engine runs as on a slow CPU where the user never pauses: the cold window on with a tiny budget
(FIMBLE_COLD_BUDGET_S), so every completion whose full prompt is not cached answers from the small one, and no
background work (FIMBLE_BACKGROUND_S=0), so the full prompt never fills. The ring lands after the first
completion (the context is turned on then, as when the ring's refresh ends after the editor's first request).
The keystrokes after it must carry the imported module's definitions: they did not while the cold prompt
dropped the context (bench/lsp_typing.py --root on pygls: 0 of 110 requests with context used it).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import pytest_lsp
from lsp_helpers import SERVER, change, configure, init_params, inline, open_doc, plain, stats
from pytest_lsp import ClientServerConfig, LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

COLD_SERVER = ClientServerConfig(
    server_command=SERVER.server_command,
    server_env={
        **(SERVER.server_env or {}),
        "FIMBLE_COLD_WINDOW": "on",
        "FIMBLE_COLD_BUDGET_S": "0.0005",  # a few prompt tokens at the embedded model's rate
        "FIMBLE_BACKGROUND_S": "0",
        # The mode where the cold prompt carries the context: with no background work, the other mode (the
        # default) would never put it in (the engine test of that mode is in tests/engine/test_anchored_layout.py).
        "FIMBLE_CONTEXT_WAIT": "off",
    },
)
UTIL = '''"""Shapes."""


def scale_polygon(points, factor, origin=(0.0, 0.0)):
    """Scale every point of a polygon by ``factor`` around ``origin``."""
    ox, oy = origin
    return [(ox + (x - ox) * factor, oy + (y - oy) * factor) for x, y in points]


def polygon_perimeter(points):
    return sum(abs(complex(*a) - complex(*b)) for a, b in zip(points, points[1:] + points[:1]))
'''
# Long enough that the cold window is much smaller than the full prompt (engine/caching/cold_window.py).
FILLER = "".join(
    f"\n\ndef helper_{i}(values, limit={i}):\n    total = 0\n    for v in values:\n        if v > limit:\n"
    f"            total += v * {i}\n    return total\n"
    for i in range(20)
)
BEFORE = (
    '"""Draw shapes."""\nfrom pkg.util import polygon_perimeter, scale_polygon\n'
    + FILLER
    + ("\n\ndef grow(points):\n    bigger = scale_polygon(points, 2.0)\n    ")
)
AFTER = "\n\n\ndef shrink(points):\n    return scale_polygon(points, 0.5)\n\n\nprint(grow([(0, 0), (1, 0)]))\n"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("xfcold")
    (ws / "pkg").mkdir()
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "pkg" / "util.py").write_text(UTIL)  # on disk only: the import resolves inside the workspace folder
    return ws


@pytest_lsp.fixture(config=COLD_SERVER, scope="module")
async def client(lsp_client: LanguageClient, workspace: Path):
    params = init_params("visual-studio-code", {"prefetch": False, "crossFileContext": False})
    params.root_uri = workspace.as_uri()
    await lsp_client.initialize_session(params)
    yield
    await lsp_client.shutdown_session()


def _engine(snap: dict) -> dict:
    base = {"submitted": 0, "completed": 0, "cancelled": 0, "failed": 0, "cold_prompts": 0}
    return {**base, "context_prompts": 0, "context_tokens": 0, **snap["engine"]["counters"]}


async def _wait(client: LanguageClient, pred, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = await stats(client)
        if pred(snap):
            return snap
        assert time.monotonic() < deadline, f"timed out: {snap['tables']}, {snap['counters']}"
        await asyncio.sleep(0.05)


def _idle(snap: dict) -> bool:
    e = _engine(snap)
    return e["completed"] + e["cancelled"] + e["failed"] == e["submitted"]


async def test_keystrokes_after_the_first_completion_carry_the_imported_modules_context(
    client: LanguageClient, workspace: Path
):
    uri = (workspace / "pkg" / "main.py").as_uri()
    open_doc(client, uri, BEFORE + AFTER)
    lines = BEFORE.split("\n")
    line, col = len(lines) - 1, len(lines[-1])
    await inline(client, uri, line, col)  # the first completion: the full prompt, no context yet
    first = _engine(await _wait(client, lambda s: _idle(s) and _engine(s)["submitted"] >= 1))
    assert first["context_prompts"] == 0 and first["completed"] >= 1

    await configure(client, crossFileContext=True)
    version = 2
    change(client, uri, version, (line, col), (line, col), "p")  # an event: the ring is worked out
    col += 1
    await _wait(client, lambda s: s["tables"]["context_pending"] == 0 and s["tables"]["context_rings"] >= 1)
    rings = plain(await client.protocol.send_request_async("fimble/debug/context", {"uri": uri}))
    ring = next((r["chunks"] for r in rings if r["uri"] == uri), [])
    assert any(c.startswith("import scale_polygon pkg/util.py:4-") for c in ring), ring  # (read from disk)

    before = _engine(await stats(client))
    for ch in "rint(":
        version += 1
        change(client, uri, version, (line, col), (line, col), ch)
        col += 1
        await inline(client, uri, line, col)
    after = _engine(await _wait(client, _idle))
    served = after["completed"] - before["completed"]
    assert served >= 1
    assert after["cold_prompts"] > before["cold_prompts"]  # the full prompt never filled: cold answers
    assert after["context_prompts"] - before["context_prompts"] >= 1, (before, after)
    assert after["context_tokens"] - before["context_tokens"] > 30
