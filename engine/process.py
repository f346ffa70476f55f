"""The engine in a child process, spoken to with msgpack over its stdin/stdout.

Why a process: the decode loop runs fastest in a main thread (see engine/local.py),
the editor-facing server stays free of torch, and this is the same message
format a shared engine daemon will speak over a websocket.

Messages (each one msgpack map):
  client -> engine: {op: submit, id, request} | {op: cancel, id} | {op: counters, id}
                    | {op: prewarm, request} | {op: forget, document} | {op: ping, id} | {op: close}
  engine -> client: {op: ready, info} | {op: fatal, error} | {op: delta, id, delta}
                    | {op: result, id, result} (sent just before the final delta) | {op: counters, id, counters}
                    | {op: pong, id} (from the engine's reader thread, whatever the decode loop does)
                    | {op: progress, phase, done, total} (from the decode loop: "prefill" before a prompt's
                      pass, with the tokens it will compute; the host's watchdog scales its patience with it)

Supervision (lsp_server/engine_host.py watches these): ``last_heard`` is when the engine last
sent anything, ``ping()`` asks for a sign of life, ``stalled_for()`` is how long the open requests
have gone without progress (a delta or a progress report), ``work`` is the engine's last progress
report, ``abandon()`` ends every open request now (with the text it has), ``kill()`` ends the
process and reaps it. Messages to the engine go through a writer thread: a stopped engine
(SIGSTOP) stops reading its stdin, and a blocking write would then hang the caller (the server's
event loop) once the pipe's buffer is full.

Every child is reaped: by the reader thread once its output ends, and after ``kill()`` by a
bounded wait of its own (a grandchild holding the pipe open must not leave a zombie behind).
``end_children()`` kills and reaps every engine process still running, one still loading
included: the server calls it on SIGTERM/SIGINT (lsp_server/transports.py). The child ignores
SIGINT: a terminal's Ctrl-C reaches the whole process group, and its parent ends it instead.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgpack

from engine.api import CompletionRequest, CompletionResult, CompletionStream, DecodeOptions, Delta
from engine.caching.context_prompt import context_from_wire
from engine.errors import EngineLost, FimbleError
from engine.liveness import CpuMeter

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


def request_from_dict(d: dict) -> CompletionRequest:
    opts = dict(d.get("options") or {})
    if "stop" in opts:
        opts["stop"] = tuple(opts["stop"])
    lines = d.get("segment_lines")
    return CompletionRequest(prefix=d.get("prefix", ""), suffix=d.get("suffix", ""),
                             options=DecodeOptions(**opts), document_id=d.get("document_id"),
                             segment_lines=None if lines is None else [int(x) for x in lines],
                             reuse=str(d.get("reuse", "exact")),
                             truncate=bool(d.get("truncate", False)), heal=bool(d.get("heal", True)),
                             cold_window=bool(d.get("cold_window", False)),
                             background=bool(d.get("background", False)),
                             context=_context(d.get("context")))


def _context(data: Any) -> dict | None:
    """The request's cross-file context, checked and bounded here (a ValueError is a bad request)."""
    context_from_wire(data)
    return data


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
    if hasattr(engine, "progress"):  # a LocalEngine (engine/local.py); other engines report nothing
        engine.progress = progress_reporter(send)
    send({"op": "ready", "info": engine.info()})
    streams: dict[int, CompletionStream] = {}

    def reader() -> None:
        unpacker = msgpack.Unpacker(raw=False)
        stdin = sys.stdin.buffer
        while chunk := stdin.read1(65536):
            unpacker.feed(chunk)
            for msg in unpacker:
                op, rid = msg.get("op"), msg.get("id")
                if op == "submit":
                    def forward(delta: Delta, rid: int = rid) -> None:
                        stream = streams.get(rid)
                        if delta.finished:
                            streams.pop(rid, None)
                            if stream is not None and stream.result is not None:
                                        send({"op": "result", "id": rid, "result": asdict(stream.result)})
                        send({"op": "delta", "id": rid, "delta": dict(vars(delta))})  # plain values
                    try:
                        req = request_from_dict(msg["request"])
                    except (TypeError, KeyError, ValueError) as exc:
                        send({"op": "delta", "id": rid,
                              "delta": asdict(Delta("", True, "error", f"bad request: {exc}"))})
                        continue
                    streams[rid] = engine.submit(req, on_delta=forward)
                elif op == "prewarm":  # no reply: a pre-warm is only an optimisation
                    try:
                        engine.prewarm(request_from_dict(msg["request"]))
                    except (TypeError, KeyError, ValueError):
                        pass
                elif op == "forget":
                    engine.forget(str(msg.get("document", "")))
                elif op == "cancel" and rid in streams:
                    streams[rid].cancel()
                elif op == "counters":
                    send({"op": "counters", "id": rid, "counters": engine.counters()})
                elif op == "ping":
                    send({"op": "pong", "id": rid})
                elif op == "close":
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

            return open_engine(args.model, args.draft, device=args.device, template=args.template,
                               trust_remote_code=args.trust_remote_code, use_draft=not args.no_draft,
                               start_thread=False, kv_budget_bytes=budget)
        from engine.serve.scheduler import open_serve_engine

        sys.setswitchinterval(SWITCH_INTERVAL_S)

        engine = open_serve_engine(args.model, args.draft, device=args.device, use_draft=not args.no_draft,
                                   batch=not args.no_batch, max_active=args.max_active, kv_budget_bytes=budget,
                                   threads=args.threads or None)
        # CUDA: capture the batched rounds' graphs before the first keystroke (progress on stderr, which the
        # daemon's process shares).
        engine.warm_graphs(lambda line: print(line, file=sys.stderr, flush=True))
        return engine

    # The parent's log level (FIMBLE_LOG, fimble serve's --log-level default), on this process's stderr.
    level = getattr(logging, os.environ.get("FIMBLE_LOG", "WARNING").upper(), logging.WARNING)
    logging.basicConfig(level=level if isinstance(level, int) else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return serve_built(build)


# -- client side ----------------------------------------------------------------------------
class EngineProcess:
    """An ``Engine`` whose model runs in a child process. Same API as ``LocalEngine``."""

    def __init__(self, model: str | Path | None = None, draft: str | Path | None = None, *,
                 device: str = "cpu", template: str | None = None, no_draft: bool = False,
                 trust_remote_code: bool = False, startup_timeout: float = 120.0, kv_budget_mb: int = 0,
                 extra_args: tuple[str, ...] = (), command: list[str] | None = None):
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
        self._ids = itertools.count(1)
        self._streams: dict[int, CompletionStream] = {}
        self._submitted: dict[int, float] = {}  # open request id -> when it was submitted
        self._last_progress = 0.0  # when the engine last sent a delta or a progress report
        self.work: dict = {}  # the engine's last progress report: phase, done, total
        self._fatal = False  # the engine said why it could not start (then another start would fail the same way)
        self._pending_counters: dict[int, tuple[threading.Event, list]] = {}
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._info: dict = {}
        self.error: str | None = None
        self.notify = None  # (an engine child reports nothing on its own: its host watches it)
        self.last_heard = time.monotonic()  # when the engine last sent anything
        self.abandoned = False
        self.started_at = time.monotonic()
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

    def _send(self, msg: dict) -> None:
        """Queue ``msg`` for the writer thread: never blocks, even when the engine has stopped reading."""
        self._outbox.put(msgpack.packb(msg, use_bin_type=True))

    def _write(self) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        while (data := self._outbox.get()) is not None:
            try:
                stdin.write(data)
                stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.error = self.error or "engine process has exited"
                self._end_streams(self.error)
                break
        try:
            stdin.close()
        except OSError:
            pass

    def _read(self) -> None:
        unpacker = msgpack.Unpacker(raw=False)
        assert self._proc.stdout is not None
        while chunk := self._proc.stdout.read1(65536):
            self.last_heard = time.monotonic()
            unpacker.feed(chunk)
            for msg in unpacker:
                self._dispatch(msg)
        # The process is gone: end every open stream rather than leave a caller waiting.
        self.error = self.error or _exit_reason(_reap(self._proc))
        self._ready.set()
        self._end_streams(self.error)
        for event, _ in self._pending_counters.values():
            event.set()

    def _end_streams(self, error: str) -> None:
        """End every open request with ``error`` (each keeps the text it had)."""
        for rid, stream in list(self._streams.items()):
            if self._streams.pop(rid, None) is not None:
                self._submitted.pop(rid, None)
                stream.push(Delta("", True, "error", error))

    def _dispatch(self, msg: dict) -> None:
        op = msg.get("op")
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
        elif op == "result" and msg["id"] in self._streams:
            self._streams[msg["id"]].result = CompletionResult(**msg["result"])
        elif op == "delta":
            stream = self._streams.get(msg["id"])
            if stream is not None:
                delta = Delta(**msg["delta"])
                self._last_progress = time.monotonic()
                if delta.finished:
                    if self._streams.pop(msg["id"], None) is None:
                        return  # abandoned meanwhile: already ended
                    self._submitted.pop(msg["id"], None)
                stream.push(delta)
        elif op == "counters" and msg["id"] in self._pending_counters:
            event, box = self._pending_counters.pop(msg["id"])
            box.append(msg["counters"])
            event.set()

    # -- Engine API ------------------------------------------------------------------------
    def info(self) -> dict:
        return self._info

    def submit(self, request: CompletionRequest, on_delta=None) -> CompletionStream:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        rid = next(self._ids)
        stream = CompletionStream(rid, loop, on_delta, on_cancel=lambda: self._send({"op": "cancel", "id": rid}))
        if self.error:
            stream.push(Delta("", True, "error", self.error))
            return stream
        self._submitted[rid] = time.monotonic()
        self._streams[rid] = stream
        self._send({"op": "submit", "id": rid, "request": request.to_dict()})
        return stream

    def prewarm(self, request: CompletionRequest) -> None:
        """Ask the engine to fill ``request.document_id``'s KV cache for this prompt when idle (no reply)."""
        if not self.error:
            self._send({"op": "prewarm", "request": request.to_dict()})

    def forget(self, document_id: str) -> None:
        """Drop a document's KV caches in the engine (the document was closed)."""
        if not self.error:
            self._send({"op": "forget", "document": document_id})

    def counters(self, timeout: float = 5.0) -> dict:
        rid = next(self._ids)
        event, box = threading.Event(), []
        self._pending_counters[rid] = (event, box)
        self._send({"op": "counters", "id": rid})
        event.wait(timeout)
        return box[0] if box else {}

    # -- supervision (lsp_server/engine_host.py) ----------------------------------------------
    def alive(self) -> bool:
        """Whether the process still runs (a cheap waitpid): a kill is seen before the reader thread sees EOF."""
        if self.error:
            return False
        if self._proc.poll() is not None:
            self.error = _exit_reason(self._proc.returncode)
            return False
        return True

    def ping(self) -> None:
        """Ask for a sign of life: the engine's reader thread answers at once (it moves ``last_heard``)."""
        if not self.error:
            self._send({"op": "ping", "id": next(self._ids)})

    def stalled_for(self) -> float:
        """Seconds without progress while requests are open (0 with none): since the engine's last delta or
        progress report, or since the oldest open request was submitted if that came later. The engine runs
        requests in turn, so progress on any of them is progress for those queued behind it."""
        oldest = min(self._submitted.values(), default=None)
        return 0.0 if oldest is None else time.monotonic() - max(oldest, self._last_progress)

    def abandon(self, error: str) -> None:
        """Give up on the engine: end every open request now, with ``error``, and refuse new ones."""
        self.error = self.error or error
        self.abandoned = True  # its requests were answered with what they had: not to be retried
        self._end_streams(error)

    def kill(self) -> None:
        """End the process now (SIGKILL also ends a stopped one) and reap it in the background; the reader
        thread then sees the exit."""
        try:
            self._proc.kill()
        except OSError:
            pass
        threading.Thread(target=_reap, args=(self._proc, REAP_TIMEOUT_S), name="fimble-engine-reaper",
                         daemon=True).start()

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
    ap = argparse.ArgumentParser(description="fimble engine process (msgpack over stdio)")
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--template")
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--kv-budget-mb", type=int, default=0,
                    help="KV cache memory budget in MiB for all documents (0: the engine's default per device)")
    ap.add_argument("--serve", action="store_true", help="fimble serve's engine: many requests stepped together")
    ap.add_argument("--max-active", type=int, default=64, help="--serve: sequences stepped together")
    ap.add_argument("--no-batch", action="store_true", help="--serve: round-robin instead of batched passes")
    ap.add_argument("--threads", type=int, default=0, help="--serve: torch threads (0: torch's default)")
    return serve(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
