"""The garbage collector's pauses in ``fimble serve``'s processes: counted, and kept short by freezing start-up.

CPython's cyclic collector stops the process while it runs, and a full (generation 2) collection walks every
tracked object: after importing torch and building an engine that is ~300,000 objects and ~200 ms on a laptop
core. It comes once the objects that survived younger collections since the last full one reach a quarter of
those that survived it, which under a steady load of editors is minutes into serving: every sequence of the
decode loop (or every session of the listeners' loop) then waits for it, and each editor whose keystroke is in
flight sees its first delta that much later.

``freeze_startup`` collects once and moves every object alive at that point (modules, the model, its graphs,
the tokenizer) into the collector's permanent generation (``gc.freeze``), so later collections walk only what
serving created. ``FIMBLE_SERVE_GC_FREEZE=0`` leaves the collector as it is (to measure the difference).
``pauses()`` counts the collections and their time in this process, for the counters (one watcher a process,
however many engines and daemons it builds: tests build many).
"""

from __future__ import annotations

import gc
import threading
import time

from engine import env_settings

FULL = 2  # the oldest generation: a full collection


def freeze_enabled() -> bool:
    return env_settings.read("FIMBLE_SERVE_GC_FREEZE")


def freeze_startup() -> int:
    """Collect, then freeze what is alive (see the module docstring); the number of objects frozen (0: off)."""
    if not freeze_enabled():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Collections in this process and the time they took (a ``gc.callbacks`` entry)."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._values = {"collections": 0, "pause_ms": 0.0, "full": 0, "full_ms": 0.0, "max_ms": 0.0}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        # The collector runs in whichever thread allocated last and holds the GIL from "start" to "stop", so the
        # two pair up. No lock here: a collection can start inside any allocation, a locked snapshot's too.
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        ms = (time.perf_counter() - self._started) * 1e3
        self._started = None
        v = self._values
        v["collections"] += 1
        v["pause_ms"] += ms
        v["max_ms"] = max(v["max_ms"], ms)
        if info.get("generation") == FULL:
            v["full"] += 1
            v["full_ms"] += ms

    def snapshot(self, prefix: str) -> dict[str, float]:
        """The counts as ``{prefix + name: value}`` (e.g. ``gc_full_ms``); max_ms is over the process's life."""
        return {f"{prefix}{name}": round(value, 3) for name, value in list(self._values.items())}


_watcher: GcPauses | None = None
_watcher_lock = threading.Lock()


def pauses() -> GcPauses:
    """This process's watcher, installed at the first call."""
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = GcPauses()
        return _watcher
