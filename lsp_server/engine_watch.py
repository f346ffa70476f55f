"""The watchdog's judgment of one engine: working, stalled or stuck (lsp_server/engine_host.py acts on it).

Three signs of life, each covering what the others cannot:
- messages: anything the engine sends, a pong to a ping included, says its process answers;
- progress: a delta, or the engine's own ``progress`` report (engine/process.py; before a prompt's
  pass it says how many tokens it is about to prefill), says a completion moves on;
- CPU time (engine/liveness.py): the process computes, even while its interpreter is held so long
  that no pong can go out, or while a loaded machine gives it a fraction of a core.

Verdicts:
- "stall": pinged, no answer for ``stall_s`` (counted from the ping, not from the last message:
  an idle engine has nothing to say), and the process does no work (stopped, or no CPU time).
- "stuck": a completion is open, no progress for ``step_s`` plus what the engine said its pass
  costs (``prefill_s_per_token`` per token it reported to prefill), and the process does no work.
A process that works is waited for instead (a "hold", counted), up to ``busy_ceiling_s`` without
any answer or progress: that is a runaway loop, not a long pass.

Every clock counts only time the watchdog itself saw. When its tick comes late (the server's own
event loop was blocked, so no ping could go out and nothing was checked), it starts watching
afresh (``lost_sight``) rather than blame the engine for its own absence: a blocked loop used to
get the shared, idle, healthy engine killed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.liveness import CpuMeter


@dataclass(frozen=True)
class WatchLimits:
    stall_s: float = 6.0  # pinged and silent this long, doing no work: stalled
    step_s: float = 30.0  # a completion without progress this long (plus its reported prefill), no work: stuck
    prefill_s_per_token: float = 0.1  # 2.4x the slowest prefill seen (42 ms a token, 2-core CPU, default model)
    busy_ceiling_s: float = 600.0  # working, yet silent or without progress this long: a runaway loop
    ping_after_s: float = 1.0  # quiet this long: ask for a sign of life


class Watch:
    """One engine under watch. ``check()`` each tick: None (fine, or waiting on a busy engine) or a verdict."""

    def __init__(
        self,
        engine: Any,
        limits: WatchLimits,
        *,
        clock: Callable[[], float] = time.monotonic,
        meter: CpuMeter | None = None,
        on_hold: Callable[[str, float], None] | None = None,
    ):
        self.engine, self.limits, self._clock, self._on_hold = engine, limits, clock, on_hold
        pid = engine.pid
        # A remote engine (no local pid) has no meter: messages alone decide, as before.
        self.meter = (
            meter if meter is not None else (CpuMeter(pid, clock=clock) if isinstance(pid, int) and pid > 0 else None)
        )
        self._since = clock()  # watching since (again, after a late tick)
        self._ping_at: float | None = None  # the first ping not answered yet
        self._last_ping = float("-inf")
        self.holding: str | None = None  # "ping" or "step" while waiting on a busy engine

    def lost_sight(self, now: float | None = None) -> None:
        """The watchdog could not look for a while (its loop was blocked): restart every clock."""
        self._since = self._clock() if now is None else now
        self._ping_at = None

    def working(self, now: float) -> bool:
        return self.meter is not None and self.meter.working(self.limits.stall_s, now)

    def step_limit(self) -> float:
        """How long a completion may go without progress: longer by what the engine said it must prefill."""
        work = self.engine.work
        left = 0
        if work.get("phase") == "prefill":
            left = max(0, int(work.get("total", 0)) - int(work.get("done", 0)))
        return self.limits.step_s + left * self.limits.prefill_s_per_token

    def check(self, now: float | None = None) -> tuple[str, str] | None:
        """("stall" | "stuck", what happened) when the engine must be replaced; else None (pings as needed)."""
        now = self._clock() if now is None else now
        lim, engine = self.limits, self.engine
        if self.meter is not None:
            self.meter.sample(now)
        heard = engine.last_heard
        if self._ping_at is not None and heard >= self._ping_at:
            self._ping_at = None  # answered
        hold: tuple[str, float] | None = None
        if self._ping_at is not None:
            silent = now - max(self._ping_at, self._since)
            if silent >= lim.stall_s:
                if self.working(now) and silent < lim.busy_ceiling_s:
                    hold = ("ping", silent)
                else:
                    return "stall", self._silent_why(silent, now)
        quiet = min(engine.stalled_for(), now - self._since)
        limit = self.step_limit()
        if quiet >= limit:
            if self.working(now) and quiet < max(lim.busy_ceiling_s, limit):
                hold = hold or ("step", quiet)
            else:
                return "stuck", self._stuck_why(quiet, now)
        self._hold(hold)
        if now - heard >= lim.ping_after_s and now - self._last_ping >= lim.ping_after_s:
            self._last_ping = now
            if self._ping_at is None:
                self._ping_at = now
            engine.ping()
        return None

    def _hold(self, hold: tuple[str, float] | None) -> None:
        kind = hold[0] if hold else None
        if kind is not None and self.holding is None and self._on_hold is not None:
            self._on_hold(kind, hold[1])  # once per stretch of waiting, not per tick
        self.holding = kind

    def _cpu_note(self) -> str:
        if self.meter is None or not self.meter.available:
            return ""
        return " (its process is stopped)" if self.meter.stopped else " and used no CPU"

    def _silent_why(self, silent: float, now: float) -> str:
        if self.working(now):
            return f"the engine computed for {silent:.0f} s without answering"
        return f"the engine did not respond for {silent:.0f} s{self._cpu_note()}"

    def _stuck_why(self, quiet: float, now: float) -> str:
        if self.working(now):
            return f"the engine computed for {quiet:.0f} s without any progress on a completion"
        return f"a completion made no progress for {quiet:.0f} s{self._cpu_note()}"
