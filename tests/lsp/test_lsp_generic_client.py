"""A generic client (no streaming): early answer, decoding continued in the background, version safety."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import pytest_lsp
from lsp_helpers import (
    SAMPLE,
    SERVER,
    UNFINISHED_CURSOR,
    UNFINISHED_DOC,
    Deltas,
    change,
    configure,
    init_params,
    inline,
    items_of,
    open_doc,
    stats,
)
from lsprotocol import types
from pytest_lsp import LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

DOC, CURSOR = UNFINISHED_DOC, UNFINISHED_CURSOR
# A loop body to write: the syntax policy decodes several lines there (at CURSOR, one line),
# so the decode goes on well past its early answer.
BLOCK_DOC = SAMPLE.replace("        print(key, config[key])\n", "        \n")
BLOCK_CURSOR = (BLOCK_DOC.split("\n").index("        "), len("        "))


@pytest_lsp.fixture(config=SERVER, params=["visual-studio-code"], scope="module")
async def client(request, lsp_client: LanguageClient):
    lsp_client.deltas = Deltas(lsp_client)
    await lsp_client.initialize_session(
        init_params(
            request.param, {"streaming": False, "maxTokens": 48, "maxLines": 0, "earlyAnswerMs": 1, "prefetch": False}
        )
    )
    yield
    await lsp_client.shutdown_session()


async def _idle(client: LanguageClient) -> dict:
    deadline = time.perf_counter() + 60
    while (s := await stats(client))["tables"]["active"]:
        assert time.perf_counter() < deadline
        await asyncio.sleep(0.05)
    return s


async def test_early_answer_then_background_decode_feeds_type_through(client: LanguageClient):
    uri = "file:///tmp/fimble-generic/a.py"
    open_doc(client, uri, BLOCK_DOC)
    answer = items_of(await inline(client, uri, *BLOCK_CURSOR))[0].insert_text
    assert client.deltas.items == []  # a generic client gets no custom notifications
    s = await _idle(client)  # the decode went on after the answer
    assert s["engine"]["counters"]["tokens_generated"] > len(answer) // 8
    # Type part of the answer through: the rest comes from the cache, without the model. (Every
    # answer is validated, so the early answer may already be all the decode's shaped text.)
    line, col = BLOCK_CURSOR
    typed = answer[: max(1, len(answer) // 2)].rstrip("\n")
    change(client, uri, 2, BLOCK_CURSOR, BLOCK_CURSOR, typed)
    for ch in typed:
        line, col = (line + 1, 0) if ch == "\n" else (line, col + 1)
    before = (await stats(client))["engine"]["counters"]["submitted"]
    rest = items_of(await inline(client, uri, line, col))
    after = await stats(client)
    assert rest and (typed + rest[0].insert_text).startswith(answer.rstrip()), (answer, typed, rest)
    assert after["cache"]["typethrough_hits"] >= 1
    assert after["engine"]["counters"]["submitted"] == before  # no model call
    assert after["latency_ms"]["cache_answer"]["count"] >= 1


async def test_stale_answer_is_rebased_onto_what_was_typed(client: LanguageClient):
    uri = "file:///tmp/fimble-generic/b.py"
    await configure(client, answerAt="end", maxTokens=64, streaming=True)  # watch the stream, answer at the end
    open_doc(client, uri, BLOCK_DOC)
    rid = "rebase-1"
    task = asyncio.ensure_future(inline(client, uri, *BLOCK_CURSOR, msg_id=rid))
    deltas = await client.deltas.wait(lambda p: p["requestId"] == rid and p["text"])
    first = next(p["text"] for p in deltas if p["requestId"] == rid and p["text"])
    typed = first[0]
    change(client, uri, 2, BLOCK_CURSOR, BLOCK_CURSOR, typed)  # the user types what is being suggested
    items = items_of(await task)
    await _idle(client)
    s = await stats(client)
    if task.done() and s["counters"].get("stale_rebased", 0):
        assert items, "rebased answers keep the rest of the completion"
        line, col = (BLOCK_CURSOR[0] + 1, 0) if typed == "\n" else (BLOCK_CURSOR[0], BLOCK_CURSOR[1] + 1)
        assert items[0].range.start == types.Position(line, col)
    else:  # the decode ended before the edit arrived: then the answer is for the version it was asked on
        assert items and items[0].range.start == types.Position(*BLOCK_CURSOR)
    await configure(client, answerAt="line", maxTokens=48, streaming=False)


async def test_engine_crash_is_survived(client: LanguageClient):
    uri = "file:///tmp/fimble-generic/c.py"
    open_doc(client, uri, DOC)
    s = await _idle(client)
    pid = s["engine"]["pid"]
    assert pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.perf_counter() + 30
    while (await stats(client))["engine"]["state"] == "ready" and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)  # until the server has noticed
    result = await inline(client, uri, *CURSOR)  # restarts the engine, then answers
    assert isinstance(result, types.InlineCompletionList)
    s = await stats(client)
    assert s["engine"]["restarts"] == 1 and s["engine"]["pid"] != pid and s["engine"]["state"] == "ready"


async def test_debounce_drops_a_request_overtaken_by_a_newer_one(client: LanguageClient):
    uri = "file:///tmp/fimble-generic/d.py"
    open_doc(client, uri, DOC.replace("print(key, ", "print(ke"))
    await configure(client, debounceMs=300)
    line = CURSOR[0]
    first = asyncio.ensure_future(inline(client, uri, line, len("        print(k"), invoked=False))
    await asyncio.sleep(0.05)
    second = await inline(client, uri, line, len("        print(ke"), invoked=False)
    assert items_of(await first) == []  # never reached the model
    assert isinstance(second, types.InlineCompletionList)
    assert (await stats(client))["counters"]["debounced"] >= 1
    await configure(client, debounceMs=0)


async def test_model_setting_restarts_the_engine_and_reports_errors(client: LanguageClient, tmp_path):
    uri = "file:///tmp/fimble-generic/e.py"
    open_doc(client, uri, DOC)
    await configure(client, model=str(tmp_path / "no-such-model"))
    # Refused before the engine: one message whatever is wrong with the path (no existence oracle).
    assert any(m.message == "fimble: setting model: model not found or not usable" for m in client.messages)
    assert await _state(client, "ready")  # still the previous model (its first load may still be running)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{ not json")
    await configure(client, model=str(tmp_path / "broken"))
    # It loads beside the working engine, fails, and the working engine serves on (lsp_server/engine_host.py).
    rejected = await _message(client, "the new model settings did not load")
    assert "model not found or not usable" in rejected and "keeping the model that was running" in rejected
    assert isinstance(await inline(client, uri, *CURSOR), types.InlineCompletionList)
    s = await stats(client)
    assert s["engine"]["state"] == "ready" and s["engine"]["error"] is None
    await configure(client, model=None)  # back to the default model
    assert isinstance(await inline(client, uri, *CURSOR), types.InlineCompletionList)
    assert await _state(client, "ready")


async def _state(client: LanguageClient, state: str, timeout: float = 180.0) -> bool:
    deadline = time.monotonic() + timeout
    while (await stats(client))["engine"]["state"] != state:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def _message(client: LanguageClient, part: str, timeout: float = 180.0) -> str:
    deadline = time.monotonic() + timeout
    while not (found := [m.message for m in client.messages if part in m.message]):
        assert time.monotonic() < deadline, f"no message saying {part!r}: {[m.message for m in client.messages]}"
        await asyncio.sleep(0.1)
    return found[0]
