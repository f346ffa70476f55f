"""Owns the engine child process: starts it off the event loop, restarts it when settings or a crash ask.

The model runs in ``engine.process.EngineProcess`` (its own process, main thread), so the
server never imports torch on its event loop: importing and starting happen in a worker
thread, and every blocking call (counters, close) goes through ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from lsp_server.settings import Settings

log = logging.getLogger(__name__)


def _start(settings: Settings) -> Any:
    from engine.process import EngineProcess  # imported here: pulls in torch (about a second)

    return EngineProcess(settings.model, settings.draft, device=settings.device, no_draft=settings.no_draft,
                         kv_budget_mb=settings.kv_cache_mb)


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run ``fn`` in a daemon thread: unlike asyncio.to_thread, a slow engine start can't hold up exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, False, exc)
        else:
            loop.call_soon_threadsafe(settle, True, result)

    threading.Thread(target=run, name="fimble-engine-start", daemon=True).start()
    return fut


class EngineHost:
    def __init__(self) -> None:
        self._engine: Any = None
        self._key: tuple | None = None
        self._starting: asyncio.Task | None = None
        self.error: str | None = None
        self.restarts = 0
        self.on_change: Callable[[], None] | None = None  # called after each state change (fimble/status)

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # a status report must never break the engine's start
                log.exception("engine state listener failed")

    @property
    def state(self) -> str:
        if self._starting is not None and not self._starting.done():
            return "starting"
        if self._engine is not None and not self._engine.error:
            return "ready"
        return "error" if self.error else "stopped"

    def info(self) -> dict:
        return {"state": self.state, "error": self.error, "restarts": self.restarts,
                "pid": getattr(self._engine, "pid", None), "info": getattr(self._engine, "info", None) or {}}

    def configure(self, settings: Settings) -> None:
        """Start (or restart) the engine if the model settings differ from the running one."""
        if settings.engine_key() == self._key and self.state != "stopped":
            return  # same model: keep it (or its start error: retrying would fail the same way)
        self._key = settings.engine_key()
        old, self._engine = self._engine, None
        self.error = None
        if old is not None:
            asyncio.get_running_loop().run_in_executor(None, old.close)
        # The child inherits our environment: this is how its torch thread count is set.
        if settings.engine_threads > 0:
            os.environ["OMP_NUM_THREADS"] = str(settings.engine_threads)
        else:
            os.environ.pop("OMP_NUM_THREADS", None)
        self._starting = asyncio.create_task(self._launch(settings))
        self._changed()  # -> "starting"

    async def _launch(self, settings: Settings) -> None:
        from engine.errors import FimbleError

        try:
            self._engine = await _in_daemon_thread(lambda: _start(settings))
            log.info("engine ready: %s", self._engine.info)
        except FimbleError as exc:
            self.error = str(exc)
            log.error("engine failed to start: %s", exc)
        except Exception as exc:  # an engine that cannot start must not take the server down
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("engine failed to start")
        finally:  # report once this task is done: until then the state still reads "starting"
            asyncio.get_running_loop().call_soon(self._changed)

    async def get(self, settings: Settings) -> Any | None:
        """The running engine, starting or restarting it as needed; None if it cannot start."""
        if self._engine is not None and self._engine.error and self.state != "starting":
            log.warning("engine process died (%s): restarting", self._engine.error)
            self.restarts += 1
            self._key = None
        self.configure(settings)
        if self._starting is not None:
            await asyncio.shield(self._starting)
        return self._engine if self._engine is not None and not self._engine.error else None

    def ready_engine(self) -> Any | None:
        """The engine if it is up right now (no waiting, no starting)."""
        engine = self._engine
        return engine if engine is not None and not engine.error else None

    async def wait_ready(self) -> Any | None:
        """The engine once a start under way has finished; None if none is running or starting.

        Unlike ``get`` it never starts (or restarts) one: for background work such as pre-warming.
        """
        if self.state == "starting":
            assert self._starting is not None
            await asyncio.shield(self._starting)
        return self.ready_engine()

    async def counters(self) -> dict:
        engine = self._engine
        if engine is None or engine.error:
            return {}
        return await asyncio.to_thread(engine.counters)

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if engine is not None:
            await asyncio.to_thread(engine.close)
