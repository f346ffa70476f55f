"""Engine supervision: a killed or stalled engine is noticed, the user is told, requests are
answered, and the engine comes back; restart loops are bounded.

End to end: a real ``fimble lsp`` over stdio with the real engine process, killed with SIGKILL
and stopped with SIGSTOP under it. The stall timeout is shortened through the environment
(FIMBLE_ENGINE_STALL_S) so the test waits seconds, not the default's six.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import lsp_server.engine_host as engine_host
from bench.harness.raw_lsp import SERVER_ENV, Pinger, RawServer, kill_engine
from lsp_server.settings import Settings

URI = "file:///supervised/demo.py"
# About 6 KB: each request's prompt is several KB, so a few dozen fill a stopped engine's stdin pipe.
BODY = "".join(f"def helper_{i}(values):\n    return sorted(values)[:{i}]\n\n\n" for i in range(120))
TEXT = BODY + "def main(paths):\n    for path in paths:\n        print(path, \n"
CURSOR = (TEXT.count("\n") - 1, len("        print(path, "))
ANSWER_TIMEOUT_S = 180.0  # a cold start on a loaded 2-core machine; the report has the real figures


def _items(response: dict) -> list:
    return (response.get("result") or {}).get("items", [])


@pytest.fixture(scope="module")
def server():
    srv = RawServer(env=dict(SERVER_ENV, FIMBLE_ENGINE_STALL_S="3"))
    srv.initialize()
    srv.open(URI, TEXT)
    yield srv
    srv.close()


def _edit_and_ask(server: RawServer, version: int, text: str) -> dict:
    """Insert a line at the top (so no cached completion applies), then ask at the cursor below it."""
    server.change(URI, version, (0, 0), (0, 0), text + "\n")
    line, col = CURSOR
    return server.wait(server.inline(URI, line + version - 1, col), ANSWER_TIMEOUT_S)


def test_sigkill_is_reported_and_the_next_completion_comes_from_a_restarted_engine(server):
    assert _items(server.wait(server.inline(URI, *CURSOR), ANSWER_TIMEOUT_S)), "no completion before the kill"
    before = server.stats()["engine"]
    old_pid = kill_engine(server, signal.SIGKILL)
    answer = _edit_and_ask(server, 2, "import os")
    assert _items(answer), "the completion after the kill was empty"
    notice = server.wait_message("window/showMessage", lambda p: "killed by signal 9" in p["message"], 10)
    assert "restarting" in notice["message"] and "Traceback" not in notice["message"]
    engine = server.stats()["engine"]
    assert engine["state"] == "ready" and engine["pid"] != old_pid
    assert engine["supervision"]["deaths"] == before["supervision"]["deaths"] + 1
    assert engine["restarts"] == before["restarts"] + 1


def test_sigstop_answers_waiting_requests_restarts_and_never_blocks_the_loop(server):
    assert _items(_edit_and_ask(server, 3, "import sys")), "no completion before the stall"
    stopped = kill_engine(server, signal.SIGSTOP)
    try:
        with Pinger(server) as pinger:
            # Requests pile up on the stopped engine: their prompts fill its stdin pipe (the server
            # must not block writing to it), and each is answered once the watchdog gives up on it.
            line, col = CURSOR
            rids = []
            for v in range(4, 24):
                server.change(URI, v, (0, 0), (0, 0), f"x{v} = {v}\n")
                rids.append(server.inline(URI, line + v - 1, col))
            for rid in rids:
                assert "result" in server.wait(rid, 60), "a request to a stalled engine was not answered"
        assert pinger.max_block < 2.0, f"event loop blocked {pinger.max_block:.2f} s by a stalled engine"
        notice = server.wait_message("window/showMessage", lambda p: "did not respond" in p["message"], 30)
        assert "restarting" in notice["message"]
        assert _items(_edit_and_ask(server, 24, "import re")), "no completion after the stalled engine was replaced"
        engine = server.stats()["engine"]
        assert engine["state"] == "ready" and engine["pid"] != stopped and engine["supervision"]["stalls"] == 1
    finally:
        try:
            os.kill(stopped, signal.SIGKILL)  # normally killed by the server already
        except OSError:
            pass


# -- bounded restart loops (a fake engine that dies as soon as it starts) ---------------------------
class _DyingEngine:
    """Starts, then is found dead at the first look: the worst restart loop."""

    abandoned, notify, work = False, None, {}

    def __init__(self) -> None:
        self.error: str | None = None
        self.pid = 0
        self.started_at = self.last_heard = time.monotonic()

    def info(self) -> dict:
        return {}

    def alive(self) -> bool:
        self.error = "engine process exited with code 1"
        return False


class _Notices:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def hear(self, level: str, message: str) -> None:
        self.items.append((level, message))


async def test_a_restart_loop_backs_off_and_gives_up_with_a_clear_error(monkeypatch):
    starts: list[float] = []

    def start(settings: Settings) -> _DyingEngine:
        starts.append(time.monotonic())
        return _DyingEngine()

    monkeypatch.setattr(engine_host, "_start", start)
    monkeypatch.setattr(engine_host, "WATCH_INTERVAL_S", 0.01)
    monkeypatch.setattr(engine_host, "RESTART_BACKOFF_S", (0.0, 0.05, 0.1))
    monkeypatch.setattr(engine_host, "MAX_QUICK_FAILURES", 3)
    host, notices = engine_host.EngineHost(), _Notices()
    host.add_notice_listener(notices.hear)
    host.configure(Settings())
    for _ in range(500):
        if host.state == "error":
            break
        await asyncio.sleep(0.01)
    assert host.state == "error" and "failed 4 times in a row" in host.error  # the first start plus 3 restarts
    assert len(starts) == 4 and host.supervision["gave_up"] == 1
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[2] >= 0.1  # the backoff grew (a lower bound only: never a timing upper bound)
    assert [level for level, _ in notices.items] == ["warning", "warning", "warning", "error"]
    assert "not restarted again" in notices.items[-1][1]
    await asyncio.sleep(0.1)
    assert len(starts) == 4  # and it stays given up
    assert await host.get(Settings()) is None and len(starts) == 4  # a request does not restart it either
    await host.close()


def test_a_request_on_a_silent_engine_answers_within_its_budget():
    """The request budget (FIMBLE_REQUEST_BUDGET_S) answers before the stall watchdog acts, and the
    decode it waited on still counts nothing against the next keystroke (the loop stays free)."""
    env = dict(SERVER_ENV, FIMBLE_ENGINE_STALL_S="600", FIMBLE_REQUEST_BUDGET_S="2")
    srv = RawServer(env=env)
    try:
        srv.initialize()
        srv.open(URI, TEXT)
        # A 2 s budget can end the first (cold) request empty on a loaded machine; the next reuse its cache.
        assert any(_items(srv.wait(srv.inline(URI, *CURSOR), ANSWER_TIMEOUT_S)) for _ in range(10)), (
            "no completion before the stop"
        )
        stopped = kill_engine(srv, signal.SIGSTOP)
        try:
            with Pinger(srv) as pinger:
                srv.change(URI, 2, (0, 0), (0, 0), "import os\n")
                line, col = CURSOR
                answer = srv.wait(srv.inline(URI, line + 1, col), 60)  # not the watchdog's 600 s
            assert "result" in answer and pinger.max_block < 2.0
            assert srv.stats()["counters"].get("request_budget_expired", 0) >= 1
        finally:
            os.kill(stopped, signal.SIGCONT)
    finally:
        srv.close()
