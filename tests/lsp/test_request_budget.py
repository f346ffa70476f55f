"""A request whose budget ends before the decode shows anything waits on for its first text (lsp_server/answer.py
wait_answer): the budget ends with the text so far, not with nothing. The completer's wait on a generation whose
text arrives after the budget; no engine."""

from __future__ import annotations

import asyncio

import pytest

import lsp_server.answer as answer_mod
from lsp_server.answer import wait_answer
from lsp_server.engine_host import EngineHost
from lsp_server.generation import Generation
from lsp_server.prompt import Context
from lsp_server.stats import Stats

BUDGET_S = 1.0


async def _wait(stats: Stats, gen: Generation, partial_ok: bool) -> str:
    """The completer's wait for an answer (no early-answer deadline, a host whose engine is not starting)."""
    return await wait_answer(gen, 0, deadline=0.0, at_end=False, partial_ok=partial_ok, host=EngineHost(), stats=stats)


def _generation() -> Generation:
    ctx = Context(uri="file:///a.py", version=1, doc_length=0, window=(0, 0), cursor=(0, 0), prefix="", suffix="")
    return Generation(ctx, stream=None, t_request=0.0, build_ms=0.0)


@pytest.mark.parametrize("invoked", [True, False])
async def test_text_after_the_budget_still_answers(monkeypatch, invoked):
    monkeypatch.setattr(answer_mod, "REQUEST_BUDGET_S", BUDGET_S)
    stats, gen = Stats(), _generation()

    def late_text() -> None:  # after the budget, well before three budgets
        gen.add_text("return total\n")
        gen.changed()

    asyncio.get_running_loop().call_later(1.5 * BUDGET_S, late_text)
    loop_time = asyncio.get_running_loop().time
    t0 = loop_time()
    text = await _wait(stats, gen, partial_ok=not invoked)
    assert text == "return total"
    assert loop_time() - t0 >= BUDGET_S  # (it did wait past the budget: the text came after it)
    assert stats.counters.get("request_budget_expired", 0) <= 1


async def test_nothing_at_all_ends_after_three_budgets(monkeypatch):
    monkeypatch.setattr(answer_mod, "REQUEST_BUDGET_S", 0.05)
    stats, gen = Stats(), _generation()
    assert await _wait(stats, gen, partial_ok=False) == ""
    assert stats.counters.get("request_budget_expired") == 1
