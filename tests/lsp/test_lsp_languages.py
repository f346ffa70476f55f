"""Enabled languages follow the model (PROTOCOL.md, Languages) and fimble/status reports the engine's state.

Real server over stdio with the embedded model: its fimble.json lists only Python, so a Go
document gets nothing (no decode) while Python completes; the effective list is advertised in
InitializeResult; a `languages` setting overrides it; fimble/status goes loading -> ready and
then carries the first completion's latency.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import pytest_lsp
from lsp_helpers import (
    SERVER,
    UNFINISHED_CURSOR,
    UNFINISHED_DOC,
    configure,
    init_params,
    inline,
    items_of,
    open_doc,
    plain,
    stats,
)
from pytest_lsp import LanguageClient

from engine.model_info import EMBEDDED_TARGET, read_model_info

pytestmark = pytest.mark.asyncio(loop_scope="module")

GO_DOC = 'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println(\n}\n'
GO_CURSOR = (5, len("\tfmt.Println("))


@pytest_lsp.fixture(config=SERVER, params=["neovim"], scope="module")
async def client(request, lsp_client: LanguageClient):
    lsp_client.statuses = []

    def on_status(params: Any) -> None:
        lsp_client.statuses.append(plain(params))

    lsp_client.feature("fimble/status")(on_status)
    lsp_client.init_result = await lsp_client.initialize_session(init_params(request.param, {"streaming": False}))
    yield
    await lsp_client.shutdown_session()


async def _wait(pred, what: str, timeout: float = 120.0):
    deadline = time.perf_counter() + timeout
    while not (value := pred()):
        if time.perf_counter() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
    return value


async def test_model_info_reader(tmp_path):
    assert read_model_info(None).languages == ("python",)  # models/fimble-target/fimble.json
    assert read_model_info(str(EMBEDDED_TARGET)).name == "fimble-target"
    assert read_model_info(str(tmp_path)).languages is None  # no fimble.json: unknown, every language
    (tmp_path / "fimble.json").write_text(json.dumps({"languages": ["go", "rust", "go"]}))
    assert read_model_info(str(tmp_path)).languages == ("go", "rust")
    for bad in ("{not json", json.dumps({"languages": "python"}), json.dumps({"languages": [1]}), "[]"):
        (tmp_path / "fimble.json").write_text(bad)
        assert read_model_info(str(tmp_path)).languages is None, bad


async def test_advertised_languages_and_status(client: LanguageClient):
    exp = plain(client.init_result.capabilities.experimental)
    assert exp["fimble"] == {"languages": ["python"], "status": True}
    # The first status comes right after `initialized`: the model is loading (preload) or already up.
    await _wait(lambda: client.statuses, "a fimble/status")
    assert client.statuses[0]["state"] in ("loading", "ready")
    assert client.statuses[0]["model"] == "fimble-target" and client.statuses[0]["languages"] == ["python"]
    ready = await _wait(lambda: [s for s in client.statuses if s["state"] == "ready"], "state ready")
    assert ready[0]["firstLatencyMs"] is None
    if client.statuses[0]["state"] == "loading":
        assert "loading model" in client.statuses[0]["message"]
    uri = "file:///tmp/fimble-languages/a.py"
    open_doc(client, uri, UNFINISHED_DOC)
    got = items_of(await inline(client, uri, *UNFINISHED_CURSOR))
    assert got and got[0].insert_text.strip()
    last = await _wait(
        lambda: client.statuses[-1]["firstLatencyMs"] is not None and client.statuses[-1],
        "firstLatencyMs in a fimble/status",
    )
    assert last["state"] == "ready" and isinstance(last["firstLatencyMs"], int) and last["firstLatencyMs"] >= 0
    n = len(client.statuses)
    got = items_of(await inline(client, uri, *UNFINISHED_CURSOR))
    await stats(client)
    assert len(client.statuses) == n  # nothing changed: no new status


async def test_other_languages_get_nothing_until_enabled(client: LanguageClient):
    uri = "file:///tmp/fimble-languages/main.go"
    open_doc(client, uri, GO_DOC, language="go")
    before = (await stats(client))["counters"]
    for _ in range(3):
        assert items_of(await inline(client, uri, *GO_CURSOR)) == []
    snap = await stats(client)
    after = snap["counters"]
    assert after.get("generations", 0) == before.get("generations", 0)  # no decode for Go at all
    assert after["language_disabled"] - before.get("language_disabled", 0) == 3
    assert snap["settings"]["languages"] == ["python"]
    # The user's list overrides the model's; the status says so.
    await configure(client, languages=["python", "go"])
    await _wait(lambda: client.statuses[-1]["languages"] == ["python", "go"], "the new language list")
    got = items_of(await inline(client, uri, *GO_CURSOR))
    assert (await stats(client))["counters"].get("generations", 0) > after.get("generations", 0)
    assert isinstance(got, list)
    # ["*"]: every language (null in the status); null: back to the model's list.
    await configure(client, languages=["*"])
    await _wait(lambda: client.statuses[-1]["languages"] is None, "every language")
    await configure(client, languages=None)
    await _wait(lambda: client.statuses[-1]["languages"] == ["python"], "the model's list again")
    assert items_of(await inline(client, uri, *GO_CURSOR)) == []
    # A bad value is ignored (the list stays the model's).
    await configure(client, languages="go")
    assert items_of(await inline(client, uri, *GO_CURSOR)) == []
    # An explicit `enable` entry wins over the list.
    await configure(client, enable={"go": True})
    before = (await stats(client))["counters"]
    await inline(client, uri, *GO_CURSOR)
    after = (await stats(client))["counters"]
    assert after["language_disabled"] == before["language_disabled"]
    # Served by the model: a decode, or the one at line 113 at this very context (kept, even when it ended
    # with nothing to say, so the same request does not decode it again).
    served = ("generations", "typethrough_hits", "inflight_hits")
    assert sum(after.get(k, 0) - before.get(k, 0) for k in served) == 1, after
    await configure(client, enable={"go": False})
