"""An engine's counters: named integers and figures that the worker adds to and any thread reads."""

from __future__ import annotations

import threading


class Counters:
    def __init__(self, names: tuple[str, ...]):
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(names, 0)
        self._published: dict = {}

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._values[name] += n

    def set(self, **values: float) -> None:
        with self._lock:
            self._values.update(values)

    def peak(self, name: str, value: float) -> None:
        """Keep the largest value seen."""
        with self._lock:
            self._values[name] = max(self._values[name], value)

    def publish(self, figures: dict) -> None:
        """Figures computed by the worker (the KV store's summary), shown with the counters."""
        with self._lock:
            self._published = figures

    def get(self, name: str) -> float:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict:
        with self._lock:
            return {**self._values, **self._published}
