"""Tab-Tab: once a shown completion's decode ends, the completion after its accept is decoded in the background,
and the request after the accept is served from it (lsp_server/follow_up.py). Real server over stdio, the
embedded model; asserted on the server's counters and texts."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_lsp
from lsp_helpers import (
    SERVER_CMD,
    SERVER_ENV,
    UNFINISHED_CURSOR,
    UNFINISHED_DOC,
    change,
    init_params,
    inline,
    items_of,
    open_doc,
    stats,
)
from pytest_lsp import ClientServerConfig, LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

DOC, CURSOR = UNFINISHED_DOC, UNFINISHED_CURSOR  # every model has something to say there


# The follow-up starts only this soon after the request (FOLLOW_UP_WITHIN_S, and the quiet after the last
# key, QUIET_AFTER_S): wide and off here, so that a busy machine's slow decode (the first waits for the engine
# to load) still gets its follow-up. What the tests check is which decode serves the accept.
SERVER = ClientServerConfig(
    server_command=SERVER_CMD + ["--debug"],
    server_env={**SERVER_ENV, "FIMBLE_FOLLOW_UP_WITHIN_S": "120", "FIMBLE_QUIET_AFTER_S": "0"},
)


@pytest_lsp.fixture(config=SERVER, scope="module")
async def client(lsp_client: LanguageClient):
    # answerAt "end": the answer is the whole decode, so accepting it leaves the cursor the follow-up was
    # decoded at. (With an early answer, a busy machine shows the first line; its accept is then served by
    # type-through from the rest of that decode, and the follow-up waits for the Tab after that.)
    opts = {"prefetch": True, "answerAt": "end"}
    await lsp_client.initialize_session(init_params("visual-studio-code", opts))
    yield
    await lsp_client.shutdown_session()


async def _counters(client: LanguageClient, pred, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = (await stats(client))["counters"]
        if pred(snap):
            return snap
        assert time.monotonic() < deadline, f"timed out; counters: {snap}"
        await asyncio.sleep(0.05)


def _finished(counters: dict) -> int:
    return sum(v for k, v in counters.items() if k.startswith("finish_"))


def _insert_point(line: int, col: int, text: str) -> tuple[int, int]:
    lines = text.split("\n")
    return (line + len(lines) - 1, (col if len(lines) == 1 else 0) + len(lines[-1]))


async def test_the_completion_after_an_accept_is_decoded_before_it(client: LanguageClient):
    uri = "file:///tmp/fimble-tests/follow_up/a.py"
    open_doc(client, uri, DOC)
    items = items_of(await inline(client, uri, *CURSOR))
    assert items, "the embedded model answers here"
    shown = items[0].insert_text
    shown = shown if isinstance(shown, str) else shown.value
    rng = items[0].range
    end = (rng.end.line, rng.end.character) if rng is not None else CURSOR
    # the shown decode ends, then its follow-up is submitted and ends too (whatever it found to say: CI once
    # saw a follow-up that ended with nothing forgotten, and the request after the accept decode it again)
    await _counters(client, lambda c: c.get("follow_ups", 0) >= 1 and _finished(c) >= 2)
    # Tab: the editor inserts the shown text, then asks again at the cursor after it
    change(client, uri, 2, CURSOR, end, shown)
    line, col = _insert_point(*CURSOR, shown)
    before = (await stats(client))["counters"]
    await inline(client, uri, line, col)
    after = (await stats(client))["counters"]
    assert after.get("follow_up_hits", 0) == before.get("follow_up_hits", 0) + 1, after
    assert after.get("misses", 0) == before.get("misses", 0)
    # No decode at the accept's cursor: the only one started since is the next follow-up (Tab-Tab-Tab)
    started, follow_ups = (after.get(k, 0) - before.get(k, 0) for k in ("generations", "follow_ups"))
    assert started == follow_ups <= 1, after


async def test_typing_something_else_is_not_served_by_the_follow_up(client: LanguageClient):
    uri = "file:///tmp/fimble-tests/follow_up/b.py"
    open_doc(client, uri, DOC)
    assert items_of(await inline(client, uri, *CURSOR))
    before = await _counters(client, lambda c: c.get("follow_ups", 0) >= 2)
    change(client, uri, 2, CURSOR, CURSOR, "#")  # not the shown text
    await inline(client, uri, CURSOR[0], CURSOR[1] + 1)
    after = (await stats(client))["counters"]
    assert after.get("follow_up_hits", 0) == before.get("follow_up_hits", 0)
    served = ("misses", "prefetch_hits")  # a decode of its own (the keystroke's prefetch, or the request's)
    assert sum(after.get(k, 0) - before.get(k, 0) for k in served) == 1, after


async def test_after_an_accept_that_ends_its_line_the_next_line_is_suggested(client: LanguageClient):
    """The shown call's arguments end their line: the follow-up is decoded after a line break, so the suggestion
    after the accept starts on the next line (a FIM model asked at the line's end says end-of-middle)."""
    uri = "file:///tmp/fimble-tests/follow_up/c.py"
    open_doc(client, uri, DOC)
    start = await _counters(client, lambda c: True)
    items = items_of(await inline(client, uri, *CURSOR))
    assert items, "the embedded model answers here"
    shown = items[0].insert_text
    shown = shown if isinstance(shown, str) else shown.value
    assert "\n" not in shown.strip(), shown  # a call's arguments: one line (the syntax policy)
    rng = items[0].range
    end = (rng.end.line, rng.end.character) if rng is not None else CURSOR
    # the shown decode and its follow-up have ended; the follow-up was led by a line break
    before = await _counters(
        client, lambda c: c.get("follow_ups", 0) > start.get("follow_ups", 0) and _finished(c) >= _finished(start) + 2
    )
    assert before.get("follow_ups_next_line", 0) > start.get("follow_ups_next_line", 0), before
    change(client, uri, 2, CURSOR, end, shown)
    line, col = _insert_point(*CURSOR, shown)
    after_items = items_of(await inline(client, uri, line, col))
    after = (await stats(client))["counters"]
    assert after.get("follow_up_hits", 0) == before.get("follow_up_hits", 0) + 1, after
    if after_items:  # the model may have nothing more to say; what it says starts on the next line
        text = after_items[0].insert_text
        assert (text if isinstance(text, str) else text.value).startswith("\n"), after_items
