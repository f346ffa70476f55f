"""Supervision that recovers and tells busy from stuck, with real processes.

- a taken port is one line, exit status 2;
- SIGTERM and SIGINT end ``fimble lsp --tcp`` and its engine child at once, one still loading too:
  once the server has exited the child is gone, and no traceback was printed (SIGTERM over stdio
  with a ready engine: the end of the zombie test);
- an engine killed while it loads is restarted (the host used to stay in state "error" for good),
  and after kills of both kinds (SIGKILL while loading, SIGSTOP so the watchdog kills it) no zombie
  is left among the server's children (SIGKILL of a ready engine: test_engine_supervision.py);
- a full session with the embedded model on a machine loaded by two CPU hogs, with limits so tight
  that every prefill outlasts them: the engine computes, so it is waited for (``busy_holds``), and
  is never restarted. The same with the default model and the default limits is in the heavy suite (tests/heavy.sh).
Assertions are on counters, exit statuses and output; the time bounds are wide, for a loaded machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from rel_helpers import SERVER_CMD, Listener, TcpClient, server_env

from bench.harness.raw_lsp import SERVER_ENV, RawServer
from engine.liveness import read_proc

REPO = Path(__file__).resolve().parents[2]
QWEN = REPO / "models" / "qwen2.5-coder-0.5b" / "qwen2.5-coder-0.5b-instruct-q8_0.gguf"
READY_TIMEOUT_S = 240.0  # an engine start on a loaded 2-core machine


def children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return found


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise TimeoutError(what)


# -- a taken port ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--tcp", "--ws"])
def test_a_taken_port_is_one_line_and_exit_status_2(flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*SERVER_CMD, flag, f"127.0.0.1:{port}"], env=server_env(), capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"fimble: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_a_taken_port_is_one_line_and_exit_status_2_for_fimble_serve():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "lsp_server", "serve", "--port", str(port)],
            env=server_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fimble: cannot listen on 127.0.0.1:{port}: "), lines
    assert "in use" in lines[0]


def test_fimble_serve_reports_a_taken_port_before_it_loads_a_model(tmp_path):
    # The model named here does not exist: reaching the model load would end with that error instead.
    missing = tmp_path / "no-such-model.gguf"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "lsp_server", "serve", "--port", str(port), "--model", str(missing)]
        done = subprocess.run(cmd, env=server_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"fimble: cannot listen on 127.0.0.1:{port}: Address already in use"]


# -- stop signals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_the_server_and_its_loading_engine_at_once_without_a_traceback(sig, status):
    """While the engine loads: the case where it used to outlive the server by the rest of its load
    (a ready engine and SIGTERM over stdio: the zombie test below ends that way)."""
    when = "starting"
    srv = Listener("--tcp")
    try:

        async def session() -> list[int]:
            client = await TcpClient.connect(srv.port)
            await client.initialize({"preload": True})
            kids = await asyncio.to_thread(wait_for, lambda: children(srv.proc.pid), READY_TIMEOUT_S, "no engine")
            deadline = time.monotonic() + READY_TIMEOUT_S
            while (await client.call("fimble/stats", {}))["result"]["engine"]["state"] != when:
                assert time.monotonic() < deadline, f"the engine never was {when}"
                await asyncio.sleep(0.05)
            return kids

        kids = asyncio.run(session())
        srv.proc.send_signal(sig)
        assert srv.proc.wait(60) == status
        # The server reaps its engine before it exits: a child still there would be an orphan (loading on).
        assert [k for k in kids if read_proc(k) is not None] == []
        assert "Traceback" not in srv.stderr() and "Error" not in srv.stderr()
    finally:
        srv.close()


# -- kills while loading, zombies --------------------------------------------------------------------
URI = "file:///supervised/loading.py"
TEXT = (
    "".join(f"def helper_{i}(values):\n    return sorted(values)[:{i}]\n\n\n" for i in range(40))
    + "def main(paths):\n    for path in paths:\n        print(path, \n"
)
CURSOR = (TEXT.count("\n") - 1, len("        print(path, "))


def _engine(server: RawServer) -> dict:
    return server.stats()["engine"]


def _ready_pid(server: RawServer, not_pid: int | None = None) -> int:
    def ready() -> int | None:
        engine = _engine(server)
        return engine["pid"] if engine["state"] == "ready" and engine["pid"] not in (None, not_pid) else None

    return wait_for(ready, READY_TIMEOUT_S, "engine not ready")


def test_an_engine_killed_while_loading_is_restarted_and_no_killed_engine_is_left_a_zombie():
    server = RawServer(env=dict(SERVER_ENV, FIMBLE_ENGINE_STALL_S="1"))
    killed: list[int] = []
    try:
        server.initialize()  # preload: the engine starts loading now
        loading = wait_for(lambda: children(server.proc.pid), READY_TIMEOUT_S, "no engine process")[0]
        assert _engine(server)["state"] == "starting"
        os.kill(loading, signal.SIGKILL)
        killed.append(loading)
        pid = _ready_pid(server, loading)
        engine = _engine(server)
        assert engine["supervision"]["start_deaths"] == 1 and engine["restarts"] == 1 and engine["error"] is None
        notice = server.wait_message("window/showMessage", lambda p: "while starting" in p["message"], 30)
        assert "restarting it" in notice["message"] and "Traceback" not in notice["message"]
        server.open(URI, TEXT)
        answer = server.wait(server.inline(URI, *CURSOR), READY_TIMEOUT_S)
        assert "result" in answer  # served by the restarted engine

        os.kill(pid, signal.SIGSTOP)  # then one stalls: the server kills it
        killed.append(pid)
        pid = _ready_pid(server, pid)
        engine = _engine(server)
        assert engine["restarts"] == 2 and engine["supervision"]["stalls"] == 1
        assert engine["supervision"]["start_deaths"] == 1
        states = {k: (read_proc(k).state if read_proc(k) else None) for k in children(server.proc.pid)}
        assert [k for k, state in states.items() if state == "Z"] == [], states
        assert [k for k in killed if read_proc(k) is not None] == []  # each killed one gone: reaped
        assert list(states) == [pid]
        server.proc.send_signal(signal.SIGTERM)  # and a stop signal ends the server with its ready engine
        assert server.proc.wait(60) == 0 and read_proc(pid) is None
    finally:
        for k in killed:
            try:
                os.kill(k, signal.SIGKILL)
            except OSError:
                pass
        server.close()


# -- a busy engine on a loaded machine ---------------------------------------------------------------
@contextmanager
def cpu_hogs(n: int = 2) -> Iterator[list[subprocess.Popen]]:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


# About 45 K characters of this repository's Python, frozen in the lossless corpus (the test once read
# lsp_server/completer.py, which shrank when it was split): every spot's prefix fills a 6,000-character window.
LOADED_CODE = ("local.py.txt", "policy.py.txt", "postprocess.py.txt")


def _full_session(env: dict[str, str], options: dict, spots: int, timeout: float) -> tuple[dict, list[dict]]:
    """Open real code (LOADED_CODE), ask for completions at ``spots`` places far apart (each a cold prompt),
    under two CPU hogs; the engine's stats and the answers."""
    text = "\n".join((REPO / "tests" / "data" / "lossless_corpus" / name).read_text() for name in LOADED_CODE)
    lines = text.splitlines()
    uri = "file:///loaded/code.py"
    server = RawServer(env=env)
    try:
        server.initialize(options, timeout=timeout)
        first_pid = _ready_pid(server)
        with cpu_hogs():
            server.open(uri, text)
            answers = []
            for i in range(spots):
                line = (i + 1) * len(lines) // (spots + 1)
                while not lines[line].strip():
                    line += 1
                answers.append(server.wait(server.inline(uri, line, len(lines[line])), timeout))
            engine = _engine(server)
        assert engine["pid"] == first_pid
        return engine, answers
    finally:
        server.close()


def test_a_busy_engine_on_a_loaded_machine_is_never_restarted():
    """Limits far below what a prefill takes here (the old watchdog killed at each one): the engine's CPU
    time is what keeps it alive, so the waits are counted and the restarts are zero."""
    # The cold window off: each request waits on its whole prompt's prefill (thousands of tokens).
    env = dict(
        SERVER_ENV,
        FIMBLE_ENGINE_STALL_S="1",
        FIMBLE_ENGINE_STEP_S="0.05",
        FIMBLE_ENGINE_PREFILL_S_PER_TOKEN="0",
        FIMBLE_REQUEST_BUDGET_S="300",
        FIMBLE_COLD_WINDOW="off",
    )
    engine, answers = _full_session(env, {"prefixChars": 6000, "maxTokens": 16, "maxLines": 2}, 3, READY_TIMEOUT_S)
    assert all("result" in a for a in answers), answers
    sup = engine["supervision"]
    assert engine["restarts"] == 0 and sup["stalls"] == sup["stuck"] == sup["deaths"] == 0, engine
    assert sup["busy_holds"] >= 1, engine  # the prefills did outlast the limits: the CPU rule was what held


@pytest.mark.heavy  # minutes on a loaded 2-core machine: tests/heavy.sh
@pytest.mark.skipif(not QWEN.is_file(), reason="the default model is not installed (python -m training.fetch_qwen)")
def test_the_default_model_on_a_loaded_machine_is_never_restarted():
    """Cold ~1,250-token prompts of the default model under two CPU hogs, default limits. The cold
    window (engine/caching/cold_window.py) is off, so each request waits on its whole prompt's prefill (tens of
    seconds here), the case the old watchdog killed as 'no progress for 30 s'."""
    env = dict(SERVER_ENV, FIMBLE_DEFAULT_MODEL="qwen", FIMBLE_REQUEST_BUDGET_S="900", FIMBLE_COLD_WINDOW="off")
    for name in ("FIMBLE_MODEL", "FIMBLE_DRAFT", "FIMBLE_ENGINE_STALL_S", "FIMBLE_ENGINE_STEP_S"):
        env.pop(name, None)
    engine, answers = _full_session(env, {"maxTokens": 24, "maxLines": 2}, 3, 900.0)
    assert all("result" in a for a in answers), answers
    assert "qwen" in str(engine["info"]).lower(), engine["info"]
    sup = engine["supervision"]
    assert engine["restarts"] == 0 and sup["stalls"] == sup["stuck"] == sup["deaths"] == 0, engine


# -- a blocked event loop ------------------------------------------------------------------------------
def test_a_server_loop_frozen_past_the_stall_limit_keeps_its_idle_healthy_engine():
    """A loop block over the stall limit (6 s) once made the watchdog kill the shared, idle, healthy engine.
    Here the whole server is frozen (SIGSTOP) for four stall limits, twice: no ping goes out meanwhile, and the
    engine, idle, uses no CPU. The watchdog's late tick starts its clocks afresh: the same engine serves on."""
    server = RawServer(env=dict(SERVER_ENV, FIMBLE_ENGINE_STALL_S="1"))
    try:
        server.initialize()
        pid = _ready_pid(server)
        server.open(URI, TEXT)
        assert "result" in server.wait(server.inline(URI, *CURSOR), READY_TIMEOUT_S)
        for _ in range(2):
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(4.0)  # the block itself: four stall limits with no ping and no answer read
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert "result" in server.wait(server.inline(URI, *CURSOR), READY_TIMEOUT_S)
        time.sleep(2.0)  # two more stall limits after the last block, the engine idle
        engine = _engine(server)
        sup = engine["supervision"]
        assert engine["pid"] == pid and engine["restarts"] == 0, engine
        assert sup["stalls"] == sup["stuck"] == sup["deaths"] == 0, engine
        assert read_proc(pid) is not None and read_proc(pid).state != "Z"
    finally:
        server.close()
