"""``fimble serve``'s engine in a child process: the daemon's listeners and the decode loop each get an interpreter.

In one process the websocket thread and the decode loop share one GIL. At 32 editors on the H200 (1.5B shape) the
round's Python and the listeners' Python (a websocket frame per delta, a relay hop per frame, two syscalls each,
every one a GIL hand-off) added up to 7.6 ms a round around a 3 ms graph: the GPU waited on the interpreter.
Here the child (``python -m engine.process --serve``, engine/process.py) runs the ServeEngine's loop alone in its
main thread and speaks engine/process.py's msgpack messages over its stdin/stdout; this process keeps the
listeners (engine/serve/daemon.py), which see the same Engine API as an in-process ServeEngine.

The daemon uses it by default on CUDA (``fimble serve --engine-process auto``); on a CPU the passes themselves
dominate, and the in-process engine stays the default there.
"""

from __future__ import annotations

import threading

from engine.api import CompletionRequest, CompletionStream
from engine.errors import FimbleError
from engine.process import SWITCH_INTERVAL_S, EngineProcess

__all__ = ["STARTUP_TIMEOUT_S", "SWITCH_INTERVAL_S", "ServeEngineProcess"]

STARTUP_TIMEOUT_S = 900.0  # loading a 7B model and capturing ~140 graphs takes minutes on a cold disk


class ServeEngineProcess:
    """The Engine API of engine/api.py (as the daemon uses it) over a ``ServeEngine`` in a child process."""

    def __init__(self, process: EngineProcess):
        self._proc = process
        self._closed = threading.Event()

    @classmethod
    def start(
        cls,
        model: str | None = None,
        draft: str | None = None,
        *,
        device: str = "cpu",
        use_draft: bool = True,
        batch: bool = True,
        max_active: int = 64,
        kv_budget_mb: int = 0,
        threads: int | None = None,
        command: list[str] | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
    ) -> ServeEngineProcess:
        """Start the child and wait until it has loaded (its progress lines go to this process's stderr).
        ``command``: another command line that ends in engine.process.serve_built (a benchmark's engine)."""
        extra = ["--serve", "--max-active", str(max_active), "--threads", str(threads or 0)]
        if not batch:
            extra.append("--no-batch")
        process = EngineProcess(
            model,
            draft,
            device=device,
            no_draft=not use_draft,
            kv_budget_mb=kv_budget_mb,
            startup_timeout=startup_timeout,
            extra_args=tuple(extra),
            command=command,
        )
        return cls(process)

    # -- supervision: the child's (engine/process.py) ------------------------------------------
    notify = None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def error(self) -> str | None:
        return self._proc.error

    @property
    def abandoned(self) -> bool:
        return self._proc.abandoned

    @property
    def started_at(self) -> float:
        return self._proc.started_at

    @property
    def last_heard(self) -> float:
        return self._proc.last_heard

    @property
    def work(self) -> dict:
        return self._proc.work

    def ping(self) -> None:
        self._proc.ping()

    def stalled_for(self) -> float:
        return self._proc.stalled_for()

    def abandon(self, error: str) -> None:
        self._proc.abandon(error)

    def kill(self) -> None:
        self._closed.set()
        self._proc.kill()

    # -- Engine API ----------------------------------------------------------------------------

    def info(self) -> dict:
        return {**self._proc.info(), "engine_process": self._proc.pid}

    def submit(self, request: CompletionRequest, on_delta=None) -> CompletionStream:
        return self._proc.submit(request, on_delta)

    def prewarm(self, request: CompletionRequest) -> None:
        self._proc.prewarm(request)

    def forget(self, document_id: str) -> None:
        self._proc.forget(document_id)

    def counters(self, timeout: float = 5.0) -> dict:
        return self._proc.counters(timeout)

    def alive(self) -> bool:
        return self._proc.alive()

    def serve_forever(self) -> None:
        """Block until close() (the daemon's main thread). If the child dies first, every open request has
        already ended with an error (EngineProcess); the daemon then stops, with that reason."""
        while not self._closed.wait(0.5):  # a timed wait: signals still reach the main thread
            if not self._proc.alive() and not self._closed.is_set():  # (close() may run in a signal handler here)
                raise FimbleError(self._proc.error or "the engine process ended")

    def close(self) -> None:
        self._closed.set()
        self._proc.close()
