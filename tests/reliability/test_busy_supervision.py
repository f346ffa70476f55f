"""Supervision that tells busy from stuck, and recovers: the judgment.

The watchdog's verdicts (lsp_server/engine_watch.py) on a fake engine, a fake clock and a fake
/proc: a process that computes is never stalled or stuck, however long it stays silent (up to the
runaway ceiling); one that is stopped or idle is; a watchdog that could not look (its loop was
blocked) blames nobody. Then the host (lsp_server/engine_host.py): an engine lost while it loads
is restarted with back-off, a blocked loop does not get a healthy engine killed. No model here:
tests/reliability/test_supervision_processes.py drives real processes.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

import lsp_server.engine_host as engine_host
from engine.errors import EngineLost, FimbleError
from engine.liveness import CpuMeter, ProcSample, parse_stat, read_proc
from lsp_server.engine_watch import Watch, WatchLimits
from lsp_server.settings import Settings

LIMITS = WatchLimits(stall_s=6.0, step_s=30.0, prefill_s_per_token=0.1, busy_ceiling_s=600.0, ping_after_s=1.0)
TICK = 0.25


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Proc:
    """A fake /proc entry: ``share`` of a core used per second of the fake clock while state is R."""

    def __init__(self, clock: Clock, share: float = 0.0, state: str = "S"):
        self.clock, self.share, self.state = clock, share, state
        self.cpu, self._at = 0.0, clock.t

    def read(self, pid: int) -> ProcSample:
        if self.state not in ("T", "Z"):
            self.cpu += self.share * (self.clock.t - self._at)
        self._at = self.clock.t
        return ProcSample(self.state, self.cpu)


class Engine:
    """The supervision surface of engine/process.py's EngineProcess; answers pings only when told to."""

    def __init__(self, clock: Clock, answers: bool = False):
        self.clock, self.answers = clock, answers
        self.pid = 4242
        self.last_heard = clock.t
        self.pings = 0
        self.open_since: float | None = None  # a request open, no progress since then
        self.work: dict = {}

    def ping(self) -> None:
        self.pings += 1
        if self.answers:
            self.last_heard = self.clock.t

    def stalled_for(self) -> float:
        return 0.0 if self.open_since is None else self.clock.t - self.open_since


def watch_of(engine: Engine, clock: Clock, proc: Proc | None, holds: list | None = None) -> Watch:
    meter = CpuMeter(engine.pid, reader=proc.read, clock=clock) if proc is not None else None
    on_hold = (lambda kind, s: holds.append(kind)) if holds is not None else None
    return Watch(engine, LIMITS, clock=clock, meter=meter, on_hold=on_hold)


def run(watch: Watch, clock: Clock, seconds: float) -> tuple[str, str] | None:
    """Tick every TICK s for ``seconds``: the first verdict (its time in clock.t), or None."""
    end = clock.t + seconds
    while clock.t < end:
        clock.t += TICK
        verdict = watch.check()
        if verdict is not None:
            return verdict
    return None


# -- /proc ----------------------------------------------------------------------------------------
def test_proc_stat_is_parsed_after_the_last_parenthesis():
    line = b"77 (a) b) (c) R 1 77 77 0 -1 4194304 10 0 0 0 150 50 0 0 20 0 3 0 100 0 0\n"
    got = parse_stat(line)
    assert got is not None and got.state == "R"
    assert got.cpu_s == pytest.approx(200 / os.sysconf("SC_CLK_TCK"))
    assert parse_stat(b"garbage") is None
    own = read_proc(os.getpid())
    assert own is not None and own.state in "RS" and own.cpu_s > 0
    assert read_proc(2**22 + 12345) is None  # no such process


def test_cpu_meter_counts_a_pass_that_has_just_begun_and_idle_only_after_a_whole_stretch():
    clock = Clock()
    proc = Proc(clock, share=0.0)
    meter = CpuMeter(1, reader=proc.read, clock=clock)
    meter.sample()
    clock.t += 5.0
    meter.sample()
    assert not meter.working(6.0)  # five idle seconds
    proc.share = 1.0
    clock.t += 0.1  # a tenth of a second into a pass: 0.1 CPU-s is already a whole stretch's worth
    meter.sample()
    assert meter.working(6.0)
    proc.state = "T"  # stopped (SIGSTOP): no work, whatever it did a moment ago
    meter.sample()
    assert meter.stopped and not meter.working(6.0)


# -- stalls ----------------------------------------------------------------------------------------
def test_an_engine_that_computes_without_answering_is_held_not_killed_until_the_runaway_ceiling():
    clock = Clock()
    engine, proc, holds = Engine(clock), Proc(clock, share=0.6, state="R"), []
    watch = watch_of(engine, clock, proc, holds)
    assert run(watch, clock, 300.0) is None  # 50 times the stall limit: it computes, it is busy
    assert holds == ["ping"] and engine.pings > 100  # one hold (not one per tick); pinged all along
    verdict = run(watch, clock, 400.0)
    assert verdict is not None and verdict[0] == "stall" and "computed for" in verdict[1]
    assert clock.t - 1000.0 >= LIMITS.busy_ceiling_s


@pytest.mark.parametrize(
    ("state", "share", "note"), [("T", 0.0, "is stopped"), ("S", 0.0, "used no CPU"), ("S", 0.01, "used no CPU")]
)
def test_a_silent_engine_that_does_no_work_is_stalled(state, share, note):
    clock = Clock()
    engine, proc = Engine(clock), Proc(clock, share=share, state=state)
    watch = watch_of(engine, clock, proc)
    verdict = run(watch, clock, 60.0)
    assert verdict is not None and verdict[0] == "stall"
    assert "did not respond" in verdict[1] and note in verdict[1]
    # counted from the first unanswered ping (sent after ping_after_s of quiet), not from the last message
    assert clock.t - 1000.0 >= LIMITS.ping_after_s + LIMITS.stall_s


def test_without_proc_a_remote_engine_is_judged_by_messages_as_before():
    clock = Clock()
    engine = Engine(clock)
    engine.pid = None
    watch = watch_of(engine, clock, None)
    assert watch.meter is None
    verdict = run(watch, clock, 60.0)
    assert verdict is not None and verdict[0] == "stall" and "did not respond for" in verdict[1]


def test_an_idle_engine_that_answers_is_never_stalled():
    clock = Clock()
    engine = Engine(clock, answers=True)
    watch = watch_of(engine, clock, Proc(clock))
    assert run(watch, clock, 120.0) is None
    assert engine.pings >= 100


def test_a_watchdog_that_could_not_look_blames_nobody():
    """Its loop blocked for 10 s just after a ping went out, and the answer was not read meanwhile (the
    block held the interpreter). Without lost_sight that reads as 10 s of silence; with it the clocks
    start again, and the answer, read once the interpreter is free, comes in time."""
    for blind in (False, True):
        clock = Clock()
        engine = Engine(clock)
        watch = watch_of(engine, clock, Proc(clock))
        assert run(watch, clock, 1.5) is None and engine.pings == 1
        clock.t += 10.0  # the loop was blocked
        if blind:
            watch.lost_sight()
        verdict = watch.check()
        if not blind:
            assert verdict is not None and verdict[0] == "stall"  # what lost_sight prevents
            continue
        assert verdict is None
        engine.last_heard, engine.answers = clock.t + 0.01, True  # the pong, read now
        assert run(watch, clock, 60.0) is None


# -- stuck -----------------------------------------------------------------------------------------
def test_a_request_without_progress_on_an_idle_engine_is_stuck_after_the_step_limit():
    clock = Clock()
    engine = Engine(clock, answers=True)
    watch = watch_of(engine, clock, Proc(clock))
    engine.open_since = clock.t
    verdict = run(watch, clock, 120.0)
    assert verdict is not None and verdict[0] == "stuck" and "no progress" in verdict[1]
    assert LIMITS.step_s <= clock.t - engine.open_since < LIMITS.step_s + 1


def test_the_step_limit_grows_with_the_prefill_the_engine_reported():
    clock = Clock()
    engine = Engine(clock, answers=True)
    watch = watch_of(engine, clock, Proc(clock))
    engine.open_since = clock.t
    engine.work = {"phase": "prefill", "done": 0, "total": 1250}
    assert watch.step_limit() == pytest.approx(LIMITS.step_s + 125.0)
    assert run(watch, clock, LIMITS.step_s + 120.0) is None
    verdict = run(watch, clock, 60.0)
    assert verdict is not None and verdict[0] == "stuck"


def test_a_long_prefill_on_a_loaded_machine_is_held_while_it_computes():
    """Seen with the default model: a cold prompt prefill took tens of seconds on a loaded 2-core machine and was killed
    three times as 'no progress for 30 s'. Computing (even a tenth of a core) is life."""
    clock = Clock()
    engine, proc, holds = Engine(clock, answers=True), Proc(clock, share=0.1, state="R"), []
    watch = watch_of(engine, clock, proc, holds)
    engine.open_since = clock.t  # no prefill report at all: the CPU alone keeps it alive
    assert run(watch, clock, 200.0) is None and holds == ["step"]
    engine.open_since = clock.t  # a delta came: the hold ends; the next long pass is a new hold
    assert run(watch, clock, 5.0) is None
    assert watch.holding is None
    assert run(watch, clock, 40.0) is None and holds == ["step", "step"]
    proc.share = 0.0  # then it stops computing without progress: stuck once the CPU went quiet
    verdict = run(watch, clock, 30.0)
    assert verdict is not None and verdict[0] == "stuck" and "used no CPU" in verdict[1]


# -- the host ----------------------------------------------------------------------------------------
class _Healthy:
    """An engine that answers pings (from another thread, as the real one does) and has no process."""

    pid = None
    abandoned, notify, work = False, None, {}

    def __init__(self) -> None:
        self.error: str | None = None
        self.started_at = self.last_heard = time.monotonic()
        self.pings = 0
        self.closed = False

    def info(self) -> dict:
        return {}

    def alive(self) -> bool:
        return self.error is None

    def ping(self) -> None:
        self.pings += 1
        threading.Timer(0.01, lambda: setattr(self, "last_heard", time.monotonic())).start()

    def stalled_for(self) -> float:
        return 0.0

    def abandon(self, error: str) -> None:
        self.error = error

    def kill(self) -> None:
        self.error = self.error or "killed"

    def close(self) -> None:
        self.closed = True


class _Notices:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def hear(self, level: str, message: str) -> None:
        self.items.append((level, message))


async def _settle(host: engine_host.EngineHost, pred, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not pred() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def test_an_engine_lost_while_loading_is_restarted_with_backoff_and_the_waiting_request_gets_it(monkeypatch):
    starts: list[float] = []
    engines: list[_Healthy] = []

    def start(settings: Settings) -> _Healthy:
        starts.append(time.monotonic())
        if len(starts) <= 2:
            raise EngineLost("engine process was killed by signal 9 (SIGKILL)")
        engines.append(_Healthy())
        return engines[-1]

    monkeypatch.setattr(engine_host, "_start", start)
    monkeypatch.setattr(engine_host, "RESTART_BACKOFF_S", (0.0, 0.05, 0.1))
    monkeypatch.setattr(engine_host, "MAX_QUICK_FAILURES", 3)
    host, notices = engine_host.EngineHost(), _Notices()
    host.add_notice_listener(notices.hear)
    got = await host.get(Settings())  # a request that arrived as the first start began: served by the third
    assert got is not None and host.state == "ready" and len(starts) == 3
    assert host.restarts == 2 and host.supervision["start_deaths"] == 2 and host.error is None
    assert [level for level, _ in notices.items] == ["warning", "warning"]
    assert all("while starting" in m and "restarting it" in m for _, m in notices.items)
    assert starts[2] - starts[1] >= 0.05  # backed off (a lower bound only)
    await host.close()


async def test_an_engine_lost_at_every_start_gives_up_with_a_clear_error(monkeypatch):
    starts: list[float] = []

    def start(settings: Settings) -> None:
        starts.append(time.monotonic())
        raise EngineLost("engine process exited with code 1")

    monkeypatch.setattr(engine_host, "_start", start)
    monkeypatch.setattr(engine_host, "RESTART_BACKOFF_S", (0.0, 0.01))
    monkeypatch.setattr(engine_host, "MAX_QUICK_FAILURES", 2)
    host = engine_host.EngineHost()
    assert await host.get(Settings()) is None
    assert host.state == "error" and len(starts) == 3 and "not restarted again" in (host.error or "")
    assert host.supervision["gave_up"] == 1
    await host.close()


async def test_a_start_the_engine_reported_failing_is_not_retried(monkeypatch):
    starts: list[float] = []

    def start(settings: Settings) -> None:
        starts.append(time.monotonic())
        raise FimbleError("model folder /nowhere not found")

    monkeypatch.setattr(engine_host, "_start", start)
    host = engine_host.EngineHost()
    assert await host.get(Settings()) is None
    await asyncio.sleep(0.1)
    assert host.state == "error" and host.error == "model folder /nowhere not found" and len(starts) == 1
    await host.close()


async def test_a_blocked_event_loop_does_not_get_the_idle_healthy_engine_killed(monkeypatch):
    """Seen in the attack audit: a loop block over the stall limit made the watchdog kill the shared, idle engine."""
    monkeypatch.setattr(engine_host, "_start", lambda settings: _Healthy())
    monkeypatch.setattr(engine_host, "WATCH_INTERVAL_S", 0.02)
    monkeypatch.setattr(engine_host, "PING_AFTER_S", 0.1)
    monkeypatch.setattr(engine_host, "STALL_TIMEOUT_S", 0.5)
    host = engine_host.EngineHost()
    engine = await host.get(Settings())
    assert engine is not None
    await _settle(host, lambda: engine.pings >= 2)
    for _ in range(2):
        time.sleep(1.5)  # the server's loop blocked (three stall limits): no ping went out meanwhile
        await asyncio.sleep(0.3)  # the watchdog looks again: pings, hears back
    assert host.state == "ready" and host.restarts == 0
    assert host.supervision["stalls"] == 0 and engine.pings >= 4
    await host.close()
