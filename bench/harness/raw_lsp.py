"""A raw JSON-RPC client for a real ``fimble lsp`` over stdio, and a ping that measures event-loop stalls.

Used by the reliability tests (tests/reliability) and bench/stall_figures.py. Why not pytest-lsp: they time how
long the server's event loop is unavailable, kill the engine under it, and read ``window/showMessage``; a blocking
client on threads, with every frame timestamped, keeps that measurement independent of the client's own event loop.

``Pinger``: while work runs, a request for a method the server does not have (answered by the
event loop itself, MethodNotFound) goes out every ``interval`` seconds, one at a time; its
round trip is how long the loop was busy when it arrived. ``max_block`` is the worst seen.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # bench/harness/ -> the repository
SERVER_CMD = [sys.executable, "-m", "lsp_server", "lsp"]


def model_env() -> dict[str, str]:
    """The environment a test's server runs in: $FIMBLE_MODEL if set, else the embedded model in models/, else
    the small stand-ins in /tmp/ftrain (same format) that exist while the embedded model trains."""
    env = dict(os.environ)
    if env.get("FIMBLE_MODEL"):
        return env
    if not (REPO / "models" / "fimble-target" / "config.json").is_file() and Path("/tmp/ftrain/fimble-target").is_dir():
        env["FIMBLE_MODEL"] = "/tmp/ftrain/fimble-target"
        env["FIMBLE_DRAFT"] = "/tmp/ftrain/fimble-draft"
    return env


SERVER_ENV = model_env()

PING_METHOD = "fimble/noSuchMethod"


class RawServer:
    """``fimble lsp`` over stdio, driven by blocking calls; every frame from it is timestamped."""

    def __init__(self, env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
        self._stderr = open(os.environ.get("RAW_SERVER_STDERR", os.devnull), "ab")  # noqa: SIM115 (closed in close)
        self.proc = subprocess.Popen(
            SERVER_CMD + list(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env or SERVER_ENV,
            cwd=REPO,
        )
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self.responses: dict[Any, tuple[float, dict]] = {}
        self.notifications: list[tuple[float, dict]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    # -- wire ------------------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        body = json.dumps(msg).encode("utf-8")
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            self.proc.stdin.flush()

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while True:
            length = None
            while True:
                line = out.readline()
                if not line:
                    return
                if line in (b"\r\n", b"\n"):
                    break
                name, _, value = line.decode("ascii", "replace").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if length is None:
                continue
            msg = json.loads(out.read(length))
            now = time.perf_counter()
            if "method" in msg and "id" in msg:  # a request from the server: answer it plainly
                self.send({"jsonrpc": "2.0", "id": msg["id"], "result": None})
                continue
            with self._cond:
                if "id" in msg and "method" not in msg:
                    self.responses[msg["id"]] = (now, msg)
                else:
                    self.notifications.append((now, msg))
                self._cond.notify_all()

    def request(self, method: str, params: Any) -> int:
        rid = next(self._ids)
        self.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
        return rid

    def notify(self, method: str, params: Any) -> None:
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    def wait(self, rid: int, timeout: float) -> dict:
        """The response to ``rid``; TimeoutError after ``timeout`` seconds."""
        deadline = time.perf_counter() + timeout
        with self._cond:
            while rid not in self.responses:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"no response to request {rid} within {timeout:.1f} s")
                self._cond.wait(left)
            return self.responses.pop(rid)[1]

    def call(self, method: str, params: Any, timeout: float = 60.0) -> dict:
        return self.wait(self.request(method, params), timeout)

    def messages(self, method: str) -> list[dict]:
        with self._cond:
            return [m["params"] for _, m in self.notifications if m.get("method") == method]

    def wait_message(self, method: str, pred, timeout: float) -> dict:
        deadline = time.perf_counter() + timeout
        with self._cond:
            while True:
                for _, m in self.notifications:
                    if m.get("method") == method and pred(m.get("params")):
                        return m["params"]
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"no {method} matching within {timeout:.1f} s")
                self._cond.wait(left)

    # -- LSP -------------------------------------------------------------------------------
    def initialize(self, options: dict | None = None, timeout: float = 60.0) -> None:
        opts = {"maxTokens": 16, "maxLines": 2}
        opts.update(options or {})
        caps = {"textDocument": {"inlineCompletion": {}}, "window": {"showMessage": {}}}
        self.call(
            "initialize",
            {"processId": os.getpid(), "rootUri": None, "capabilities": caps, "initializationOptions": opts},
            timeout,
        )
        self.notify("initialized", {})

    def open(self, uri: str, text: str, language: str = "python") -> None:
        self.notify(
            "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": language, "version": 1, "text": text}}
        )

    def change(self, uri: str, version: int, start: tuple[int, int], end: tuple[int, int], text: str) -> None:
        rng = {"start": {"line": start[0], "character": start[1]}, "end": {"line": end[0], "character": end[1]}}
        self.notify(
            "textDocument/didChange",
            {"textDocument": {"uri": uri, "version": version}, "contentChanges": [{"range": rng, "text": text}]},
        )

    def inline(self, uri: str, line: int, character: int) -> int:
        return self.request(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": uri},
                "position": {"line": line, "character": character},
                "context": {"triggerKind": 1},
            },
        )

    def stats(self, timeout: float = 30.0) -> dict:
        return self.call("fimble/stats", {}, timeout)["result"]

    def engine_ready(self, timeout: float = 120.0) -> dict:
        """Wait until the engine reports ready; its info (pid, ...)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            engine = self.stats()["engine"]
            if engine["state"] == "ready" and engine.get("pid"):
                return engine
            time.sleep(0.1)
        raise TimeoutError("engine not ready")

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                rid = self.request("shutdown", None)
                try:
                    self.wait(rid, 10)
                except TimeoutError:
                    pass
                self.notify("exit", None)
                self.proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


class Pinger:
    """Pings the server's event loop every ``interval`` s from a thread; ``max_block`` is the worst round trip."""

    def __init__(self, server: RawServer, interval: float = 0.02, timeout: float = 60.0):
        self.server, self.interval, self.timeout = server, interval, timeout
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.server.wait(self.server.request(PING_METHOD, {}), self.timeout)
            self.latencies.append(time.perf_counter() - t0)
            self._stop.wait(self.interval)

    def __enter__(self) -> Pinger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 5)

    @property
    def max_block(self) -> float:
        return max(self.latencies, default=0.0)


# -- pathological documents --------------------------------------------------------------------
BODY = "def f{i}(x):\n    return x + {i}\n"


def big_line_document() -> tuple[str, tuple[int, int]]:
    """Over 1M characters, with a 1 MB line right above the cursor (the cursor ends a call's first argument)."""
    head = "".join(BODY.format(i=i) for i in range(50))
    text = head + "DATA = [" + "1, " * 340_000 + "]\n" + "def g(y):\n    return max(y, \n"
    lines = text.split("\n")
    return text, (len(lines) - 2, len(lines[-2]))


def lone_cr_document(n_funcs: int = 25_000) -> tuple[str, tuple[int, int]]:
    """About 900 KB of Python with one lone \\r near the top; the cursor ends a line near the bottom."""
    text = "".join(BODY.format(i=i) for i in range(n_funcs))
    text = text.replace("x + 3\n", "x + 3\r", 1) + "def g(y):\n    return max(y, \n"
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return text, (len(lines) - 2, len(lines[-2]))


def type_and_ask(
    server: RawServer, uri: str, cursor: tuple[int, int], keys: str, timeout: float, version: int = 1
) -> tuple[int, list[dict]]:
    """Type ``keys`` at ``cursor`` one per keystroke, each followed by an inline completion request.

    Returns the last version and the responses (each must come within ``timeout`` seconds).
    """
    line, col = cursor
    answers = []
    for ch in keys:
        version += 1
        server.change(uri, version, (line, col), (line, col), ch)
        col += 1
        answers.append(server.wait(server.inline(uri, line, col), timeout))
    return version, answers


def engine_pid(server: RawServer) -> int:
    return int(server.engine_ready()["pid"])


def kill_engine(server: RawServer, sig: int = signal.SIGKILL) -> int:
    pid = engine_pid(server)
    os.kill(pid, sig)
    return pid
