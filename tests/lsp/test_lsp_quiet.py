"""Quiet after the last key (lsp_server/decodes.py QUIET_AFTER_S): a decode nobody waits on any more stops a
while after the user's last key, its text kept; a request still waiting for the whole decode is never cut.
Real server over stdio, the embedded model; asserted on the server's and the engine's counters."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_lsp
from lsp_helpers import SERVER_CMD, SERVER_ENV, configure, init_params, inline, items_of, open_doc, stats
from pytest_lsp import ClientServerConfig, LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Rows the embedded model extends for as long as it may (checked: 300 tokens, no EOS), each a valid list
# item, so the first line is an answer: a decode that would run for half a minute unless something stops it.
LONG = "import math\n\nPRIMES = [\n    2,\n    3,\n    5,\n    7,\n    11,\n\n]\n"
CURSOR = (8, 0)
MAX_TOKENS = 4000
UNCAPPED = {"*": {"multiline": True, "max_lines": 0, "max_tokens": MAX_TOKENS, "stop": []}}
QUIET_S = 0.5  # the shortest the setting allows: the test waits little

SERVER = ClientServerConfig(
    server_command=SERVER_CMD + ["--debug"], server_env={**SERVER_ENV, "FIMBLE_QUIET_AFTER_S": str(QUIET_S)}
)


@pytest_lsp.fixture(config=SERVER, scope="module")
async def client(lsp_client: LanguageClient):
    settings = {
        "maxTokens": MAX_TOKENS,
        "maxLines": 0,
        "drafter": "none",
        "policy": UNCAPPED,
        "answerAt": "line",  # the request is answered at the first line; the decode streams on
        "prefetch": False,
    }
    await lsp_client.initialize_session(init_params("visual-studio-code", settings))
    yield
    await lsp_client.shutdown_session()


async def _until(client: LanguageClient, pred, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        counters = (await stats(client))["counters"]
        if pred(counters):
            return counters
        assert time.monotonic() < deadline, f"timed out; counters: {counters}"
        await asyncio.sleep(0.05)


def _finished(counters: dict) -> int:
    return sum(v for k, v in counters.items() if k.startswith("finish_"))


async def _engine_steps(client: LanguageClient) -> int:
    return (await stats(client))["engine"]["counters"].get("decode_steps", 0)


async def test_a_decode_nobody_waits_on_stops_after_the_last_key_and_keeps_its_text(client: LanguageClient):
    uri = "file:///tmp/fimble-quiet/a.py"
    open_doc(client, uri, LONG)
    before = (await stats(client))["counters"]
    items = items_of(await inline(client, uri, *CURSOR, invoked=False))  # as typing asks
    assert items, "answered at the first line"
    after = await _until(client, lambda c: _finished(c) > _finished(before))
    assert after.get("quiet_stops", 0) == before.get("quiet_stops", 0) + 1, after
    assert after.get("finish_length", 0) == before.get("finish_length", 0) + 1, after  # not "cancelled"
    tokens = after["tokens_generated"] - before.get("tokens_generated", 0)
    assert 0 < tokens < MAX_TOKENS
    steps = await _engine_steps(client)
    await asyncio.sleep(0.4)
    assert await _engine_steps(client) == steps, "the engine kept decoding"
    # Its text stays usable: the same request again is served from it, without a decode.
    again = items_of(await inline(client, uri, *CURSOR, invoked=False))
    assert again and again[0].insert_text.startswith(items[0].insert_text)  # the first line, and what followed
    final = (await stats(client))["counters"]
    assert final["generations"] == after["generations"], final


async def test_a_request_waiting_for_the_whole_decode_is_not_cut(client: LanguageClient):
    uri = "file:///tmp/fimble-quiet/b.py"
    open_doc(client, uri, LONG)
    await configure(client, answerAt="end", maxTokens=400, policy={"*": {**UNCAPPED["*"], "max_tokens": 400}})
    before = (await stats(client))["counters"]
    assert items_of(await inline(client, uri, *CURSOR)) is not None
    after = (await stats(client))["counters"]
    assert after.get("quiet_stops", 0) == before.get("quiet_stops", 0), after
    assert after["tokens_generated"] - before.get("tokens_generated", 0) == 400
    assert after.get("finish_length", 0) == before.get("finish_length", 0) + 1, after


async def test_a_decode_the_user_invoked_runs_to_its_end_after_its_answer_too(client: LanguageClient):
    """Answered at its first line, an invoked request's decode streams on past the quiet time: the user asked for
    the completion (a block's later lines), they did not stop asking."""
    uri = "file:///tmp/fimble-quiet/c.py"
    open_doc(client, uri, LONG)
    await configure(client, answerAt="line", maxTokens=400, policy={"*": {**UNCAPPED["*"], "max_tokens": 400}})
    before = (await stats(client))["counters"]
    assert items_of(await inline(client, uri, *CURSOR, invoked=True)), "answered at the first line"
    after = await _until(client, lambda c: _finished(c) > _finished(before))
    assert after.get("quiet_stops", 0) == before.get("quiet_stops", 0), after
    assert after["tokens_generated"] - before.get("tokens_generated", 0) == 400
