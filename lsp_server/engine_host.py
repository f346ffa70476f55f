"""Owns the engine child process: starts it off the event loop, restarts it when settings or a crash ask.

The model runs in ``engine.process.EngineProcess`` (its own process, main thread), so the
server never imports torch on its event loop: importing and starting happen in a worker
thread, and every blocking call (counters, close) goes through ``asyncio.to_thread``.

Supervision: while an engine runs, a watchdog task on the event loop looks at it every
``WATCH_INTERVAL_S`` (the judgment is lsp_server/engine_watch.py's):
- died (SIGKILL, crash): the user is told (``notice``), its open requests already ended with
  their text (engine/process.py), and a new engine starts at once;
- stalled (SIGSTOP, a hung process): pinged, no answer for ``STALL_TIMEOUT_S``, and its process
  does no work: its open requests end now with what they have, it is killed (and reaped) and
  restarted;
- stuck (answers pings, but a request gets no progress for ``STEP_TIMEOUT_S`` plus what the
  engine said its prefill costs, and its process does no work): the same.
Busy is not stuck: an engine whose process accumulates CPU time (a long prefill on a loaded
machine, Python work that holds its interpreter so no pong goes out) is waited for, and each
such wait is counted (``supervision["busy_holds"]``), up to ``BUSY_CEILING_S`` without any sign.
A decode lost to an engine that died (not one that stalled: those answer with what they
have) is submitted once more to the restarted engine (``SupervisedStream``), so the request
that was waiting on it is served after the cold start instead of answering empty.
An engine that dies while it loads (``EngineLost``) is restarted the same way; one that says why it
cannot start (a bad model folder) is not: that would fail the same way, until the settings change.
Restarts back off (``RESTART_BACKOFF_S``) when engines keep failing soon after starting, and
after ``MAX_QUICK_FAILURES`` in a row the host gives up with a clear error (state "error")
until the settings change. A request that arrives meanwhile waits for the restart (``get``).
On SIGTERM/SIGINT the server calls ``kill_now``: the engine ends at once, reaped.

A change of model settings (model, draft, device, ...) while an engine serves never leaves the user
without one: the new engine loads beside the working one (``_replacement``), which keeps serving, and
takes its place only once it is loaded and its weights checked (its ``ready``). A new engine that
fails (a corrupt or truncated weights file, NaN weights, config or tokenizer files that are not what
they claim, a device this machine lacks) is one notice, level "rejected", which the session shows,
and is not tried again until the settings change (``running_settings`` still say what serves).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from engine import env_settings
from lsp_server.engine_watch import Watch, WatchLimits
from lsp_server.settings import Settings

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 0.25
LOOP_LAG_S = 1.0  # a watchdog tick this late: the loop was blocked, the watch starts afresh (engine_watch.py)
PING_AFTER_S = 1.0  # quiet this long: ask for a sign of life
STALL_TIMEOUT_S = env_settings.read("FIMBLE_ENGINE_STALL_S")  # pinged, silent this long, idle: stalled
STEP_TIMEOUT_S = env_settings.read("FIMBLE_ENGINE_STEP_S")  # a request without progress, idle: stuck
PREFILL_S_PER_TOKEN = env_settings.read("FIMBLE_ENGINE_PREFILL_S_PER_TOKEN")  # ... plus this per token
BUSY_CEILING_S = env_settings.read("FIMBLE_ENGINE_BUSY_CEILING_S")  # computing, no sign: runaway
QUICK_FAILURE_S = 60.0  # an engine that fails sooner than this after starting counts as a quick failure
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0)  # delay before restart n+1 after n quick failures in a row
MAX_QUICK_FAILURES = len(RESTART_BACKOFF_S)


def _start(settings: Settings) -> Any:
    from engine.remote import RemoteSpec  # no torch
    from engine.serve.client import ServeSpec  # no torch

    if isinstance(settings.engine_spec, ServeSpec):  # a shared `fimble serve` daemon, over a websocket
        return settings.engine_spec.open()

    if isinstance(settings.engine_spec, RemoteSpec):  # an OpenAI-compatible or llama.cpp server
        from engine.remote import open_remote

        return open_remote(settings.engine_spec)
    from engine.process import EngineProcess  # imported here: pulls in torch (about a second)

    return EngineProcess(
        settings.model,
        settings.draft,
        device=settings.device,
        no_draft=settings.no_draft,
        kv_budget_mb=settings.kv_cache_mb,
    )


def _set_threads(settings: Settings) -> None:
    """The engine child inherits our environment: this is how its torch thread count is set."""
    if settings.engine_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(settings.engine_threads)
    else:
        os.environ.pop("OMP_NUM_THREADS", None)


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


class SupervisedStream:
    """A CompletionStream that survives one engine death: the request goes once more to the next engine.

    Only when the engine died before this stream produced any text, and not when the host gave up
    on a stalled engine (``abandoned``: its requests answer with what they have, at once).
    """

    def __init__(self, host: EngineHost, engine: Any, request: Any):
        self._host, self._engine, self._request = host, engine, request
        self._inner = engine.submit(request)
        self._cancelled = False
        self.retried = False

    @property
    def id(self) -> Any:
        return self._inner.id

    @property
    def result(self) -> Any:
        return self._inner.result

    @property
    def text(self) -> str:
        return self._inner.text

    @property
    def cancelled(self) -> bool:
        return self._cancelled or self._inner.cancelled

    def cancel(self) -> None:
        self._cancelled = True
        self._inner.cancel()

    def _retryable(self, got_text: bool) -> bool:
        engine = self._engine
        return not (
            self.retried
            or got_text
            or self._cancelled
            or engine.alive()
            or engine.abandoned
            or self._host.state == "error"
        )

    async def __aiter__(self):
        from engine.errors import FimbleError

        while True:
            got_text = False
            try:
                async for delta in self._inner:
                    got_text = got_text or bool(delta.text)
                    yield delta
                return
            except FimbleError:
                if not self._retryable(got_text):
                    raise
            self.retried = True
            self._host.supervision["retried"] += 1
            engine = await self._host.restarted()
            if engine is None or self._cancelled:
                raise FimbleError("the engine stopped and could not be restarted")
            self._engine, self._inner = engine, engine.submit(self._request)


class SupervisedEngine:
    """The engine as callers see it: ``submit`` returns a SupervisedStream; the rest is the engine's own."""

    def __init__(self, host: EngineHost, engine: Any):
        self._host, self._engine = host, engine

    def submit(self, request: Any) -> SupervisedStream:
        return SupervisedStream(self._host, self._engine, request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class EngineHost:
    def __init__(self) -> None:
        self._engine: Any = None
        self._key: tuple | None = None
        self._starting: asyncio.Task | None = None
        self.error: str | None = None
        self.restarts = 0
        self.on_change: Callable[[], None] | None = None  # called after each state change (fimble/status)
        self.notices = Notices()  # supervision news for every session
        self.add_notice_listener = self.notices.add_listener
        self._settings: Settings | None = None
        self._watchdog: asyncio.Task | None = None
        self._quick_failures = 0  # engines in a row that failed soon after starting
        # A new engine loading beside the working one (its settings' key), and the last one that failed to.
        self._replacement: asyncio.Task | None = None
        self._replacement_key: tuple | None = None
        self._rejected_key: tuple | None = None
        self.watchdog = Watchdog(self)
        self.supervision = {
            "deaths": 0,
            "stalls": 0,
            "stuck": 0,
            "gave_up": 0,
            "retried": 0,
            "start_deaths": 0,
            "busy_holds": 0,
        }

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
        if self._engine is None and self._replacement_key is not None:  # the engine died; its replacement loads
            return "starting"
        if self._engine is not None and not self._engine.error:
            return "ready"
        return "error" if self.error else "stopped"

    @property
    def running(self) -> Any:
        """The engine the host runs right now, as it is (None while none does): for the watchdog."""
        return self._engine

    @property
    def running_settings(self) -> Settings | None:
        """The settings of the engine that runs (or starts, or last failed): not those of a replacement."""
        return self._settings

    def info(self) -> dict:
        return {
            "state": self.state,
            "error": self.error,
            "restarts": self.restarts,
            "supervision": self.supervision,
            "pid": self._engine.pid if self._engine else None,
            "info": self._engine.info() if self._engine else {},
            "replacing": self._replacement_key is not None,
        }

    def configure(self, settings: Settings) -> None:
        """Start (or restart) the engine if the model settings differ from the running one.

        While an engine serves, a new one loads beside it and replaces it once ready (``_replace_with``)."""
        key = settings.engine_key()
        if key != self._rejected_key:
            self._rejected_key = None  # other settings: the user may have fixed the cause; the same again are tried
        if key == self._key and self.state != "stopped":
            self._replacement_key = None  # back to the running settings: a replacement loading is not wanted
            return  # same model: keep it (or its start error: retrying would fail the same way)
        if key in (self._rejected_key, self._replacement_key):
            return  # failed to load beside the working engine (the user was told), or loading now
        if self._serving():
            self._replacement_key = key
            self._replacement = asyncio.create_task(self._replace_with(settings))
            self._changed()
            return
        self._replacement_key = None
        self._quick_failures = 0  # new settings: the user may have fixed the cause
        self._key = key
        self._settings = settings
        old, self._engine = self._engine, None
        self.error = None
        if old is not None:
            asyncio.get_running_loop().run_in_executor(None, old.close)
        _set_threads(settings)
        self._starting = asyncio.create_task(self._launch(settings))
        self._changed()  # -> "starting"

    def _serving(self) -> bool:
        """An engine is up and answering (not starting, not failed): a settings change must not take it away."""
        engine = self._engine
        return self.state == "ready" and engine is not None and engine.alive() and self._key is not None

    async def _replace_with(self, settings: Settings) -> None:
        """Load an engine for ``settings`` while the working one serves; swap them once it is ready, or keep
        the working one and say why not (one notice, level "rejected")."""
        from engine.errors import FimbleError

        key = settings.engine_key()
        _set_threads(settings)
        engine, reason = None, None
        try:
            engine = await _in_daemon_thread(lambda: _start(settings))
        except FimbleError as exc:  # the engine's own one-line reason (a bad folder, a missing device, lost)
            reason = str(exc)
        except Exception as exc:  # an engine that cannot start must not take the server down
            log.exception("the new engine failed to start")
            reason = f"the engine failed to start: {type(exc).__name__}"
        finally:
            _set_threads(self._settings or settings)  # a restart of the working engine keeps its own
        if self._replacement_key != key:  # not wanted any more (the settings changed again, the host closed)
            if engine is not None:
                asyncio.get_running_loop().run_in_executor(None, engine.close)
            return
        self._replacement_key = None
        if engine is None:
            self._rejected_key = key
            log.error("the new model settings did not load (%s); the engine that was running goes on serving", reason)
            # The message is the reason alone: the session words it.
            self.notices.tell("rejected", str(reason), logged=True)
            if self._engine is None and (self._starting is None or self._starting.done()):
                self._restart("the engine stopped while the new one loaded", 0.0)  # died meanwhile: it restarts
            self._changed()
            return
        old = self._engine  # (a restart of it still loading closes itself: _launch sees the new key)
        self._engine, self._key, self._settings = engine, key, settings
        self._quick_failures, self.error = 0, None
        self.watchdog.forget()
        log.info("engine ready (replacing the previous one): %s", engine.info)
        if old is not None:
            asyncio.get_running_loop().run_in_executor(None, old.close)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.create_task(self.watchdog.run())
        self._changed()

    async def _launch(self, settings: Settings, delay: float = 0.0) -> None:
        from engine.errors import EngineLost, FimbleError

        try:
            if delay:
                await asyncio.sleep(delay)  # backoff: engines have been failing soon after starting
            launched = time.monotonic()
            try:
                engine = await _in_daemon_thread(lambda: _start(settings))
            except EngineLost as exc:  # killed or crashed while loading: restarted like any other failure
                self.supervision["start_deaths"] += 1
                self._restart(f"the engine stopped while starting ({exc})", launched)
                return
            if settings.engine_key() != self._key:  # the settings changed while it loaded: another start runs
                asyncio.get_running_loop().run_in_executor(None, engine.close)
                return
            self._engine = engine
            log.info("engine ready: %s", self._engine.info())
            # (a remote engine tells the editor when its server fails and when it is back; others never call it)
            loop = asyncio.get_running_loop()
            self._engine.notify = lambda level, text: loop.call_soon_threadsafe(self.notices.tell, level, text)
            if self._watchdog is None or self._watchdog.done():
                self._watchdog = asyncio.create_task(self.watchdog.run())
        except FimbleError as exc:
            self.error = str(exc)
            log.error("engine failed to start: %s", exc)
        except Exception as exc:  # an engine that cannot start must not take the server down
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("engine failed to start")
        finally:  # report once this task is done: until then the state still reads "starting"
            asyncio.get_running_loop().call_soon(self._changed)

    # -- supervision (the watchdog: class Watchdog below) -------------------------------------
    def replace_failed(self, engine: Any, what: str, *, kill: bool = False) -> None:
        """The engine failed (``what``): end its requests, stop it, start another after the backoff, or give up."""
        if kill:
            engine.abandon(what)  # its waiting requests answer now, with the text they have
            engine.kill()  # (an EngineProcess also reaps it)
        self._engine = None
        self.watchdog.forget()
        self._restart(what, engine.started_at)

    def _restart(self, what: str, started_at: float) -> None:
        """An engine started at ``started_at`` failed (``what``): start another after the backoff, or give up."""
        self.restarts += 1
        if self._replacement_key is not None:  # a new engine is loading: it takes over (or, failing, this restarts)
            log.warning("%s; the engine loading for the new settings takes over", what)
            self._starting = None
            return
        quick = time.monotonic() - started_at < QUICK_FAILURE_S
        self._quick_failures = self._quick_failures + 1 if quick else 1
        settings = self._settings
        if settings is None:
            return
        if self._quick_failures > MAX_QUICK_FAILURES:
            self.supervision["gave_up"] += 1
            self.error = (
                f"{what}; it failed {self._quick_failures} times in a row within "
                f"{QUICK_FAILURE_S:.0f} s of starting, so it is not restarted again. "
                "Check the server log, then change a model setting or restart the server"
            )
            self.notices.tell("error", f"fimble: {self.error}")
            self._changed()
            return
        delay = RESTART_BACKOFF_S[self._quick_failures - 1]
        self.notices.tell("warning", f"fimble: {what}; restarting it" + (f" in {delay:.0f} s" if delay else ""))
        self._starting = asyncio.create_task(self._launch(settings, delay))
        self._changed()  # -> "starting"

    async def get(self, settings: Settings) -> Any | None:
        """The running engine, starting or restarting it as needed; None if it cannot start."""
        engine = self._engine
        if engine is not None and not engine.alive() and self.state != "starting":  # died since the watchdog looked
            self.supervision["deaths"] += 1
            self.replace_failed(engine, f"the engine stopped ({engine.error})")
        self.configure(settings)
        await self._started()
        return self.ready_engine()

    async def _started(self) -> None:
        """Wait until no start is under way: a start that fails may schedule the next one (backoff) itself.
        A replacement loading counts only where no engine is left to serve meanwhile."""
        while True:
            if self._starting is not None and not self._starting.done():
                await asyncio.shield(self._starting)
            elif self._engine is None and self._replacement is not None and not self._replacement.done():
                await asyncio.shield(self._replacement)
            else:
                return

    async def restarted(self) -> Any | None:
        """The engine once the restart after a failure is done (no new start of its own); None if none."""
        engine = self._engine
        if engine is not None and not engine.alive() and self.state != "starting":
            self.supervision["deaths"] += 1
            self.replace_failed(engine, f"the engine stopped ({engine.error})")
        return await self.wait_ready()

    def ready_engine(self) -> Any | None:
        """The engine if it is up right now (no waiting, no starting)."""
        engine = self._engine
        return SupervisedEngine(self, engine) if engine is not None and engine.alive() else None

    async def wait_ready(self) -> Any | None:
        """The engine once a start under way has finished; None if none is running or starting.

        Unlike ``get`` it never starts (or restarts) one: for background work such as pre-warming.
        """
        await self._started()
        return self.ready_engine()

    async def counters(self) -> dict:
        engine = self._engine
        if engine is None or engine.error:
            return {}
        return await asyncio.to_thread(engine.counters)

    def _detach(self) -> Any:
        """Stop starting and watching; the engine that was running (None if none), no longer the host's."""
        engine, self._engine = self._engine, None
        self._replacement_key = None  # a replacement that finishes loading closes itself
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
        return engine

    def kill_now(self) -> None:
        """Stop at once (SIGTERM/SIGINT): no new start, the engine killed and reaped, one still loading too."""
        engine = self._detach()
        if engine is not None:
            engine.abandon("the server is stopping")
            if engine.pid is None:
                engine.kill()  # no process of its own (a remote engine: drop the connection)
        from engine.process import end_children  # no torch; it knows every engine child, loading ones included

        end_children(timeout=2.0)

    async def close(self) -> None:
        engine = self._detach()
        if engine is not None:
            await asyncio.to_thread(engine.close)


class Notices:
    """Listeners for supervision news, (level "error"|"warning"|"info"|"rejected", message): each session's
    window/showMessage. Weak: a session that ended must not be kept alive (or told) by the engine."""

    def __init__(self) -> None:
        self._listeners: list[weakref.WeakMethod] = []

    def add_listener(self, method: Callable[[str, str], None]) -> None:
        """``method`` (a bound method) hears of engine deaths, stalls, restarts and giving up."""
        self._listeners.append(weakref.WeakMethod(method))

    def tell(self, level: str, message: str, *, logged: bool = False) -> None:
        """Tell every session (``level``: "error", "warning", "info", or "rejected": new model settings did not
        load beside the working engine, ``message`` being the reason); logged here unless ``logged``."""
        if not logged:
            log.log(logging.WARNING if level == "warning" else logging.ERROR, "%s", message)
        alive = []
        for ref in self._listeners:
            fn = ref()
            if fn is None:
                continue
            alive.append(ref)
            try:
                fn(level, message)
            except Exception:  # telling the user must never break supervision
                log.exception("engine notice listener failed")
        self._listeners = alive


class Watchdog:
    """Looks at the host's running engine every WATCH_INTERVAL_S (the judgment is lsp_server/engine_watch.py's);
    an engine that died, stalled or is stuck goes to the host, which replaces it."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.watching: Watch | None = None

    def forget(self) -> None:
        """A new engine (or none) runs: the next look starts a fresh watch."""
        self.watching = None

    async def run(self) -> None:
        """Look at the running engine every WATCH_INTERVAL_S: died, stalled or stuck -> replace it."""
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            late, last_tick = now - last_tick - WATCH_INTERVAL_S > LOOP_LAG_S, now
            engine = self.host.running
            if engine is None or engine.last_heard is None:  # (an engine with nothing to watch: engine/api.py)
                if self.host.state != "starting":
                    return  # closed, or gave up: the next configure starts a new watchdog
                continue
            try:
                self.check(engine, late)
            except Exception:  # the watchdog must outlive any surprise
                log.exception("engine watchdog failed")

    def watch_of(self, engine: Any) -> Watch:
        if self.watching is None or self.watching.engine is not engine:
            limits = WatchLimits(
                stall_s=STALL_TIMEOUT_S,
                step_s=STEP_TIMEOUT_S,
                prefill_s_per_token=PREFILL_S_PER_TOKEN,
                busy_ceiling_s=BUSY_CEILING_S,
                ping_after_s=PING_AFTER_S,
            )
            self.watching = Watch(engine, limits, on_hold=self.held)
        return self.watching

    def held(self, kind: str, seconds: float) -> None:
        """The watchdog waits on an engine that computes though it is silent or shows no progress."""
        self.host.supervision["busy_holds"] += 1
        what = "answered no ping" if kind == "ping" else "reported no progress"
        log.info("the engine %s for %.0f s but is computing: waiting for it", what, seconds)

    def check(self, engine: Any, late: bool = False) -> None:
        if not engine.alive():
            self.host.supervision["deaths"] += 1
            self.host.replace_failed(engine, f"the engine stopped ({engine.error})")
            return
        watch = self.watch_of(engine)
        if late:  # this loop was blocked: nothing was pinged or seen meanwhile, so nothing can be blamed
            watch.lost_sight()
        verdict = watch.check()
        if verdict is not None:
            kind, what = verdict
            self.host.supervision["stalls" if kind == "stall" else "stuck"] += 1
            self.host.replace_failed(engine, what, kill=True)
