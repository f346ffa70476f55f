"""The engine in a child process, spoken to with msgpack over its stdin/stdout.

Why a process: the decode loop runs fastest in a main thread (see engine/scheduler.py),
the editor-facing server stays free of torch, and these are the messages fimble serve's
daemon carries over a websocket.

Messages: engine/wire.py (one msgpack map each); the child answers them with engine/host_loop.py, as each
fimble serve session does. ``pong`` comes from the child's reader thread, whatever the decode loop does.

Supervision (engine/api.py ``Supervised``; the LSP server's engine host watches these): ``last_heard`` is when
the engine last sent anything, ``ping()`` asks for a sign of life, ``stalled_for()`` is how long the open requests
have gone without progress (a delta or a progress report), ``work`` is the engine's last progress
report, ``abandon()`` ends every open request now (with the text it has), ``kill()`` ends the
process and reaps it. Messages to the engine go through a writer thread: a stopped engine
(SIGSTOP) stops reading its stdin, and a blocking write would then hang the caller (the server's
event loop) once the pipe's buffer is full.

Every child is reaped: by the reader thread once its output ends, and after ``kill()`` by a
bounded wait of its own (a grandchild holding the pipe open must not leave a zombie behind).
``end_children()`` kills and reaps every engine process still running, one still loading
included: the server calls it on SIGTERM/SIGINT (its transports). The child ignores
SIGINT: a terminal's Ctrl-C reaches the whole process group, and its parent ends it instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from engine import env_settings
from engine.errors import EngineLost, FimbleError
from engine.host_loop import MessageHost
from engine.liveness import CpuMeter
from engine.wire_client import MessageClient

log = logging.getLogger("fimble.engine")
PROGRESS_EVERY_S = 0.5  # within one pass, a progress report at most this often (each is a message)
STARTUP_BUSY_FACTOR = 4.0  # a start still computing at its timeout (a loaded machine) may take up to 4x as long
STARTUP_IDLE_S = 5.0  # ... "still computing": CPU time advanced within this many seconds
REAP_TIMEOUT_S = 10.0  # how long a killed child's bounded wait lasts (SIGKILL ends it within milliseconds)
_children: set[subprocess.Popen] = set()  # engine processes started and not yet reaped (end_children)
_children_lock = threading.Lock()
_stopping = threading.Event()  # end_children ran: this process is stopping, so no new engine may start
# fimble serve's engine child (engine/serve/engine_process.py) and the daemon beside it each have one busy thread and
# one that only moves messages (the child: stdin's reader beside the decode loop; the daemon: the engine pipe's reader
# beside the listeners' loop). A message's thread waits for the busy one to drop the interpreter, up to the switch
# interval: 5 ms by default, per message, on every keystroke's cancel and submit. 0.5 ms bounds that; with no thread
# waiting the interval costs nothing. Set in both processes.
SWITCH_INTERVAL_S = 0.0005


# -- engine side ----------------------------------------------------------------------------
def stdio_sender() -> Callable[[dict], None]:
    """The engine side's ``send``: one msgpack message to stdout per call (any thread). Stray prints from
    libraries go to stderr from here on, so they cannot corrupt the message stream."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr
    write_lock = threading.Lock()

    def send(msg: dict) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        with write_lock:
            out.write(data)
            out.flush()

    return send


def serve_built(build: Callable[[], Any]) -> int:
    """Be an engine process: ``build()`` the engine (a LocalEngine or a ServeEngine), then answer stdin's
    messages until it closes. A build error is one ``fatal`` message (no traceback), exit status 1."""
    send = stdio_sender()
    try:
        engine = build()
    except FimbleError as exc:
        send({"op": "fatal", "error": str(exc)})
        return 1
    except Exception as exc:  # the client shows this line; the details stay in this process's stderr
        log.debug("engine failed to start", exc_info=True)  # a traceback only where debug logging is asked for
        send({"op": "fatal", "error": f"engine failed to start: {type(exc).__name__}"})
        return 1
    return run_engine(engine, send)


def progress_reporter(send: Callable[[dict], None]) -> Callable[[str, int, int], None]:
    """The engine's ``progress`` hook: a pass's start is always sent, its later reports at most every
    PROGRESS_EVERY_S (called from the decode loop, so it must stay cheap)."""
    last: list[Any] = [None, 0.0]

    def report(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done > 0 and phase == last[0] and now - last[1] < PROGRESS_EVERY_S:
            return
        last[:] = [phase, now]
        send({"op": "progress", "phase": phase, "done": int(done), "total": int(total)})

    return report


def run_engine(engine: Any, send: Callable[[dict], None]) -> int:
    """Answer stdin's messages with ``engine`` (its decode loop in this, the main, thread) until stdin closes."""
    if hasattr(engine, "progress"):  # the schedulers (engine/scheduler.py); an engine a benchmark builds may not report
        engine.progress = progress_reporter(send)
    send({"op": "ready", "info": engine.info()})
    host = MessageHost(engine, send)  # engine/host_loop.py: the op set, as fimble serve's sessions answer it

    def reader() -> None:
        unpacker = msgpack.Unpacker(raw=False)
        stdin = sys.stdin.buffer
        while chunk := stdin.read1(65536):
            unpacker.feed(chunk)
            for msg in unpacker:
                if not host.handle(msg):
                    break
        engine.close()  # stdin closed: the client is gone

    threading.Thread(target=reader, name="fimble-engine-reader", daemon=True).start()
    try:
        engine.serve_forever()
    except Exception as exc:  # a fault of the decode loop itself (a request's own error never gets here)
        log.debug("the decode loop failed", exc_info=True)  # a traceback only where debug logging is asked for
        send({"op": "fatal", "error": f"the engine's decode loop failed: {type(exc).__name__}"})
        sys.stderr.flush()
        os._exit(1)  # not a normal exit: the reader thread, blocked on stdin, would abort the interpreter's shutdown
    return 0


def serve(args: argparse.Namespace) -> int:
    """The engine process of ``fimble lsp`` (a LocalEngine), or with ``--serve`` of ``fimble serve`` (a ServeEngine:
    many requests stepped together; engine/serve/engine_process.py starts it)."""

    def build() -> Any:
        budget = args.kv_budget_mb << 20 if args.kv_budget_mb else None
        if not args.serve:
            from engine.local import open_engine

            engine = open_engine(
                args.model,
                args.draft,
                device=args.device,
                template=args.template,
                trust_remote_code=args.trust_remote_code,
                use_draft=not args.no_draft,
                start_thread=False,
                kv_budget_bytes=budget,
            )
            # Healing's prefix search answers by scanning until its index is sorted: sorted beside the first
            # requests, not before them (engine/decoding/healing.py).
            engine.target.token_index.build_soon()
            return engine
        from engine.serve.scheduler import open_serve_engine

        sys.setswitchinterval(SWITCH_INTERVAL_S)

        engine = open_serve_engine(
            args.model,
            args.draft,
            device=args.device,
            use_draft=not args.no_draft,
            batch=not args.no_batch,
            max_active=args.max_active,
            kv_budget_bytes=budget,
            threads=args.threads or None,
        )
        # CUDA: capture the batched rounds' graphs before the first keystroke (progress on stderr, which the
        # daemon's process shares).
        engine.warm_graphs(lambda line: print(line, file=sys.stderr, flush=True))
        return engine

    # The parent's log level (FIMBLE_LOG, fimble serve's --log-level default), on this process's stderr.
    logging.basicConfig(
        level=env_settings.log_level(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return serve_built(build)


# -- client side ----------------------------------------------------------------------------
class EngineProcess(MessageClient):
    """An ``Engine`` whose model runs in a child process, spoken to over its stdin/stdout (engine/wire_client.py)."""

    def __init__(
        self,
        model: str | Path | None = None,
        draft: str | Path | None = None,
        *,
        device: str = "cpu",
        template: str | None = None,
        no_draft: bool = False,
        trust_remote_code: bool = False,
        startup_timeout: float = 120.0,
        kv_budget_mb: int = 0,
        extra_args: tuple[str, ...] = (),
        command: list[str] | None = None,
    ):
        """``extra_args``: more of engine.process's flags (``--serve`` ...); ``command``: a whole command line to
        run instead (one that ends in ``serve_built``, e.g. a benchmark's engine)."""
        cmd = [sys.executable, "-m", "engine.process", "--device", device, *extra_args]
        if kv_budget_mb:
            cmd += ["--kv-budget-mb", str(int(kv_budget_mb))]
        for flag, value in (("--model", model), ("--draft", draft), ("--template", template)):
            if value:
                cmd += [flag, str(value)]
        if no_draft:
            cmd.append("--no-draft")
        if trust_remote_code:
            cmd.append("--trust-remote-code")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with _children_lock:  # (under the lock: end_children either sees this child or it never starts)
            if _stopping.is_set():
                raise EngineLost("the server is stopping")
            self._proc = subprocess.Popen(command or cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            _children.add(self._proc)
        super().__init__()
        self._fatal = False  # the engine said why it could not start (then another start would fail the same way)
        self._ready = threading.Event()
        self._info: dict = {}
        self._reader = threading.Thread(target=self._read, name="fimble-engine-client", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="fimble-engine-writer", daemon=True)
        self._writer.start()
        try:
            ready = self._wait_ready(startup_timeout)
        except BaseException:  # Ctrl-C while it loads (fimble serve): the child ignores SIGINT, so end it here
            self._proc.kill()
            _reap(self._proc, REAP_TIMEOUT_S)
            raise
        if not ready or self.error:
            self.close()
            if self._fatal:
                raise FimbleError(self.error or "engine failed to start")
            raise EngineLost(self.error or f"engine did not start within {startup_timeout:.0f}s")

    def _wait_ready(self, timeout: float) -> bool:
        """Wait for ``ready`` (or the end): up to ``timeout``, longer while the child still computes (a start
        on a loaded machine is slow, not stuck), up to STARTUP_BUSY_FACTOR times as long."""
        meter = CpuMeter(self.pid)
        deadline, ceiling = self.started_at + timeout, self.started_at + timeout * STARTUP_BUSY_FACTOR
        while not self._ready.wait(0.25):
            now = time.monotonic()
            meter.sample(now)
            if now >= deadline and not (now < ceiling and meter.working(STARTUP_IDLE_S, now)):
                return False
        return True

    @property
    def pid(self) -> int:
        return self._proc.pid

    # -- the pipe (engine/wire_client.py) ---------------------------------------------------------
    def _transmit(self, data: bytes) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        stdin.write(data)
        stdin.flush()

    def _shut(self) -> None:
        try:
            self._proc.stdin.close()
        except OSError:
            pass

    def _write_failed(self) -> str:
        return "engine process has exited"

    def _read(self) -> None:
        unpacker = msgpack.Unpacker(raw=False)
        assert self._proc.stdout is not None
        while chunk := self._proc.stdout.read1(65536):
            self.last_heard = time.monotonic()
            unpacker.feed(chunk)
            for msg in unpacker:
                self._dispatch(msg)
        # The process is gone: end every open stream rather than leave a caller waiting.
        reason = self.error or _exit_reason(_reap(self._proc))
        self.error = reason
        self._ready.set()
        self._lost(reason)

    def _other(self, op: str, msg: dict) -> None:
        if op == "ready":
            self._info = msg.get("info", {})
            self._ready.set()
        elif op == "fatal":
            self.error = msg.get("error", "engine failed to start")
            self._fatal = not self._ready.is_set()  # a start failure it explained (a decode-loop fault is not)
            self._ready.set()
        elif op == "progress":
            self.work = {k: msg.get(k) for k in ("phase", "done", "total")}
            self._last_progress = time.monotonic()

    # -- Engine API ------------------------------------------------------------------------
    def info(self) -> dict:
        return self._info

    # -- supervision (engine/api.py Supervised) ------------------------------------------------
    def alive(self) -> bool:
        """Whether the process still runs (a cheap waitpid): a kill is seen before the reader thread sees EOF."""
        if self.error:
            return False
        if self._proc.poll() is not None:
            self.error = _exit_reason(self._proc.returncode)
            return False
        return True

    def kill(self) -> None:
        """End the process now (SIGKILL also ends a stopped one) and reap it in the background; the reader
        thread then sees the exit."""
        try:
            self._proc.kill()
        except OSError:
            pass
        threading.Thread(
            target=_reap, args=(self._proc, REAP_TIMEOUT_S), name="fimble-engine-reaper", daemon=True
        ).start()

    def close(self) -> None:
        self._send({"op": "close"})
        self._outbox.put(None)  # the writer closes stdin after what is queued
        try:
            self._proc.wait(timeout=5)
        except (subprocess.TimeoutExpired, OSError):
            self._proc.kill()
        _reap(self._proc, REAP_TIMEOUT_S)


def _reap(proc: subprocess.Popen, timeout: float | None = None) -> int:
    """Wait for ``proc`` (so no zombie is left) and forget it; its exit status (-9 if it would not end in time)."""
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("engine process %d did not end within %.0f s of being killed", proc.pid, timeout or 0)
        return -signal.SIGKILL
    with _children_lock:
        _children.discard(proc)
    return code


def end_children(timeout: float = 5.0) -> int:
    """Kill every engine process this process started and has not reaped, one still loading included, and reap
    them (bounded by ``timeout`` each). For a server that stops on a signal: nothing may outlive it. How many."""
    with _children_lock:
        _stopping.set()
        procs = list(_children)
    for proc in procs:
        try:
            proc.kill()
        except OSError:
            pass
    for proc in procs:
        _reap(proc, timeout)
    return len(procs)


def _exit_reason(code: int) -> str:
    """One line on how the engine process ended: "killed by signal 9 (SIGKILL)" or "exited with code 1"."""
    if code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:
            name = ""
        return f"engine process was killed by signal {-code}{name}"
    return f"engine process exited with code {code}"


def main(argv: list[str] | None = None) -> int:
    # A terminal's Ctrl-C goes to the whole process group: the parent ends this process (kill and reap, no
    # traceback here); stdin's end ends it too when the parent goes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Bad FIMBLE_* settings (engine/env_settings.py) stop the start: one line each on stderr, and the parent
    # gets them as a start failure it explains (EngineProcess raises FimbleError; no restart loop).
    errors = env_settings.check_environment()
    if errors:
        for message in errors:
            print(f"fimble: {message}", file=sys.stderr, flush=True)
        stdio_sender()({"op": "fatal", "error": "; ".join(errors)})
        return 2
    ap = argparse.ArgumentParser(description="fimble engine process (msgpack over stdio)")
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--template")
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument(
        "--kv-budget-mb",
        type=int,
        default=0,
        help="KV cache memory budget in MiB for all documents (0: the engine's default per device)",
    )
    ap.add_argument("--serve", action="store_true", help="fimble serve's engine: many requests stepped together")
    ap.add_argument("--max-active", type=int, default=64, help="--serve: sequences stepped together")
    ap.add_argument("--no-batch", action="store_true", help="--serve: round-robin instead of batched passes")
    ap.add_argument("--threads", type=int, default=0, help="--serve: torch threads (0: torch's default)")
    return serve(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
