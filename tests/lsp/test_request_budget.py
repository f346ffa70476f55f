"""A request whose budget ends before the decode shows anything waits on for its first text (lsp_server/completer.py
_wait_answer): the budget ends with the text so far, not with nothing. The completer's wait on a generation whose
text arrives after the budget; no engine."""

from __future__ import annotations

import asyncio

import pytest

import lsp_server.completer as completer_mod
from lsp_server.completer import Completer
from lsp_server.documents import DocumentStore
from lsp_server.engine_host import EngineHost
from lsp_server.generation import Generation
from lsp_server.prompt import Context
from lsp_server.stats import Stats
from lsp_server.telemetry import Telemetry

BUDGET_S = 1.0


def _completer() -> Completer:
    stats = Stats()
    return Completer(DocumentStore(), EngineHost(), stats, Telemetry(stats), lambda method, params: None)


def _generation() -> Generation:
    ctx = Context(uri="file:///a.py", version=1, doc_length=0, window=(0, 0), cursor=(0, 0), prefix="", suffix="")
    return Generation(ctx, stream=None, t_request=0.0, build_ms=0.0)


@pytest.mark.parametrize("invoked", [True, False])
async def test_text_after_the_budget_still_answers(monkeypatch, invoked):
    monkeypatch.setattr(completer_mod, "REQUEST_BUDGET_S", BUDGET_S)
    c, gen = _completer(), _generation()

    def late_text() -> None:  # after the budget, well before three budgets
        gen.add_text("return total\n")
        gen.changed()

    asyncio.get_running_loop().call_later(1.5 * BUDGET_S, late_text)
    loop_time = asyncio.get_running_loop().time
    t0 = loop_time()
    text = await c._wait_answer(gen, 0, deadline=0.0, at_end=False, partial_ok=not invoked)
    assert text == "return total"
    assert loop_time() - t0 >= BUDGET_S  # (it did wait past the budget: the text came after it)
    assert c.stats.counters.get("request_budget_expired", 0) <= 1


async def test_nothing_at_all_ends_after_three_budgets(monkeypatch):
    monkeypatch.setattr(completer_mod, "REQUEST_BUDGET_S", 0.05)
    c, gen = _completer(), _generation()
    assert await c._wait_answer(gen, 0, deadline=0.0, at_end=False, partial_ok=False) == ""
    assert c.stats.counters.get("request_budget_expired") == 1
