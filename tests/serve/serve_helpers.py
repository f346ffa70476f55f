"""A real ``fimble serve`` daemon in a subprocess (port 0, token required), and small clients for it."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVE_CMD = [sys.executable, "-m", "lsp_server", "serve"]
START_TIMEOUT_S = 120.0  # a loaded 2-core machine: wide, the tests assert outcomes, never speed


class ServeProcess:
    """``fimble serve --port 0 --require-token --token-file F``; the port read from the line it prints.

    ``token="default"``: no token flag, so the daemon makes its own token (read back from its stderr);
    ``token="none"``: ``--no-token``. Its token files go to ``runtime_dir`` (a folder of its own unless given)."""

    def __init__(
        self,
        *extra: str,
        port: int = 0,
        token_file: str | None = None,
        token: str = "file",
        runtime_dir: str | None = None,
    ):
        self.dir = tempfile.mkdtemp(prefix="fimble-serve-test-")
        self.runtime_dir = runtime_dir or os.path.join(self.dir, "run")
        self.token_file = token_file or os.path.join(self.dir, "token")
        if token == "file":
            if token_file is None:
                Path(self.token_file).write_text("test-token-" + os.urandom(12).hex() + "\n")
            self.token: str | None = Path(self.token_file).read_text().strip()
            token_args = ["--require-token", "--token-file", self.token_file]  # --require-token: old scripts' flag
        else:
            self.token = None
            token_args = ["--no-token"] if token == "none" else []
        self.log_path = os.path.join(self.dir, "stderr.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(
            os.environ,
            FIMBLE_DEFAULT_MODEL=os.environ.get("FIMBLE_DEFAULT_MODEL", "embedded"),
            FIMBLE_RUNTIME_DIR=self.runtime_dir,
        )
        self.proc = subprocess.Popen(
            [
                *SERVE_CMD,
                "--port",
                str(port),
                "--threads",
                "1",
                *token_args,
                *extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            env=env,
        )
        self.port = self._wait_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        if token == "default":
            self.token = re.search(r"^fimble: token: (\S+)$", self.stderr(), re.M).group(1)  # type: ignore[union-attr]

    def stderr(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def _wait_port(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = re.search(r"on ws://127\.0\.0\.1:(\d+)", self.stderr())
            if found:
                return int(found.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"fimble serve exited: {self.stderr()[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError("fimble serve did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def post(port: int, body: dict | bytes, token: str | None, path: str = "/v1/completions") -> tuple[int, dict, str]:
    """POST JSON; (status, headers, body text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn.request("POST", path, body if isinstance(body, bytes) else json.dumps(body), headers)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, dict(resp.getheaders()), text


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


def wait_for(pred, timeout: float = 60.0, every: float = 0.05):
    """Poll ``pred()`` until it returns a truthy value (returned); AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(every)


def running_daemon(*extra: str):
    """A ServeProcess for a test module's fixture to yield, stopped after (a model load is the slow
    part, so one per module). Not a conftest.py fixture: a conftest.py here would shadow
    tests/conftest.py for the directories collected after this one."""
    proc = ServeProcess(*extra)
    try:
        yield proc
    finally:
        proc.stop()
