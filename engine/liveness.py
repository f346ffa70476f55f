"""Is a process working? Its run state and CPU time from /proc, which no busy interpreter can delay.

Why not only messages: the engine's pong comes from a thread that needs the interpreter, so a
long C call that holds the GIL, or a machine loaded by other work, delays it although the engine
computes. The kernel's accounting needs nothing from the engine: a process that runs and
accumulates CPU time is busy; one that is stopped (state T) or uses no CPU and is silent is stuck.
Linux only: elsewhere (or once the process is gone) ``read_proc`` gives None and callers fall back
to messages alone. No torch here: the LSP server's engine watchdog uses it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

# CPU seconds per wall second that count as working. An idle engine uses ~0 (its threads block);
# answering a ping costs well under a millisecond; a prefill or decode uses most of a core, and
# still several percent on a machine loaded many times over.
BUSY_CPU_SHARE = 0.05
SAMPLE_S = 0.5  # shortest stretch a CPU reading is judged over (the kernel counts in 10 ms ticks)
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcSample:
    state: str  # R running, S sleeping, D disk wait, T stopped, t traced, Z zombie, X dead
    cpu_s: float  # user + system time of all its threads


def read_proc(pid: int) -> ProcSample | None:
    """``pid``'s state and CPU time from /proc/<pid>/stat; None without /proc or once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return parse_stat(data)


def parse_stat(data: bytes) -> ProcSample | None:
    """The fields after the command name: it is in parentheses and may itself hold spaces and ')'."""
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return ProcSample(fields[0].decode("ascii"), (int(fields[11]) + int(fields[12])) / _TICKS)
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


class CpuMeter:
    """Samples a process's CPU time: ``last_busy`` is when a stretch of at least SAMPLE_S last showed work."""

    def __init__(
        self,
        pid: int,
        reader: Callable[[int], ProcSample | None] = read_proc,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pid, self._read, self._clock = pid, reader, clock
        self.last_busy = float("-inf")
        self.state = "?"
        self.available = True  # False once /proc could not be read: no verdict from here
        self._base: tuple[float, float] | None = None  # (time, cpu seconds) the next stretch starts from

    def sample(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        got = self._read(self.pid)
        if got is None:
            self.available = False
            return
        self.available, self.state = True, got.state
        if self._base is None:
            self._base = (now, got.cpu_s)
            return
        t0, cpu0 = self._base
        used, span = got.cpu_s - cpu0, now - t0
        # Busy as soon as the stretch holds a whole stretch's worth of work (a pass that just began counts at
        # once); idle only once a full stretch went by without it.
        if used >= BUSY_CPU_SHARE * max(span, SAMPLE_S):
            self.last_busy = now
        if span >= SAMPLE_S:
            self._base = (now, got.cpu_s)

    @property
    def stopped(self) -> bool:
        """Stopped (SIGSTOP, a debugger) or gone: it does no work whatever its CPU time said before."""
        return self.state in ("T", "t", "Z", "X")

    def working(self, within: float, now: float | None = None) -> bool:
        """Known to be computing: not stopped, and busy in a stretch that ended less than ``within`` s ago."""
        now = self._clock() if now is None else now
        return self.available and not self.stopped and now - self.last_busy < within
