"""A bad model setting never replaces a working engine: the new one loads beside it and replaces it
only once it is loaded and checked; a failure is one clear message and the working engine serves on.

Before: a model folder with a corrupt or truncated weights file, NaN weights, or config/tokenizer files
that are links to system files (and ``device: "cuda:99"``, which surfaced an ``AssertionError``) sent no
message and replaced the running engine: every later completion was empty.

One real ``fimble lsp`` over stdio with the embedded model; each bad setting arrives as an editor sends it
(``workspace/didChangeConfiguration``). Asserted: one error message per bad setting, naming no path and
holding no file's text or traceback; the same engine process (pid, no restart) answering the same
completion as before; and at the end a good model folder does replace the engine.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model
from safetensors.torch import load_file, save_file
from test_busy_supervision import _Healthy, _Notices, _settle

import lsp_server.engine_host as engine_host
from bench.harness.raw_lsp import SERVER_ENV, RawServer
from engine.errors import ModelLoadError
from engine.loader import check_device
from lsp_server.settings import Settings

URI = "file:///bad-model/w.py"
TEXT = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.\n"
CURSOR = (5, len("        return f."))
SYSTEM_FILE = "/etc/passwd"
LOAD_TIMEOUT_S = 240.0  # an engine start on a loaded 2-core machine


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-models")
    good = build_tiny_model(root / "good")
    weights = next(good.glob("*.safetensors")).name

    def copy(name: str) -> Path:
        dst = root / name
        dst.mkdir()
        for f in good.iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
        return dst

    truncated = copy("truncated")
    raw = (truncated / weights).read_bytes()
    (truncated / weights).write_bytes(raw[: len(raw) // 2])  # a download cut off halfway

    nan = copy("nan")
    state = load_file(str(nan / weights))
    name = next(k for k in state if "embed_tokens" in k)
    state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, str(nan / weights), metadata={"format": "pt"})

    config_link = copy("config-link")
    (config_link / "config.json").unlink()
    (config_link / "config.json").symlink_to(SYSTEM_FILE)

    tokenizer_link = copy("tokenizer-link")
    (tokenizer_link / "tokenizer.json").unlink()
    (tokenizer_link / "tokenizer.json").symlink_to(SYSTEM_FILE)
    return {
        "good": good,
        "truncated": truncated,
        "nan": nan,
        "config-link": config_link,
        "tokenizer-link": tokenizer_link,
    }


def test_check_device_names_a_device_this_machine_lacks():
    check_device("cpu")
    for device in ("cuda:99", "tpu", "cuda:x"):
        if device == "cuda:x" or not torch.cuda.is_available() or torch.cuda.device_count() <= 99:
            with pytest.raises(ModelLoadError, match="device") as err:
                check_device(device)
            assert "\n" not in str(err.value)


def _errors(server: RawServer) -> list[str]:
    return [m["message"] for m in server.messages("window/showMessage") if m["type"] == 1]


def _answer(server: RawServer) -> list:
    reply = server.wait(server.inline(URI, *CURSOR), LOAD_TIMEOUT_S)
    assert "result" in reply, reply
    return [item["insertText"] for item in (reply["result"] or {}).get("items", [])]


def _configure(server: RawServer, settings: dict) -> None:
    server.notify("workspace/didChangeConfiguration", {"settings": {"fimble": settings}})


def test_bad_model_settings_are_one_message_and_the_working_engine_serves_on(folders):
    log = tempfile.NamedTemporaryFile(prefix="fimble-bad-model-", suffix=".log", delete=False)
    os.environ["RAW_SERVER_STDERR"] = log.name
    try:
        server = RawServer(env=dict(SERVER_ENV))
    finally:
        del os.environ["RAW_SERVER_STDERR"]
    try:
        server.initialize({"maxTokens": 8, "maxLines": 1})
        first = server.engine_ready(LOAD_TIMEOUT_S)
        server.open(URI, TEXT)
        before = _answer(server)

        cases = [
            ({"model": str(folders[name])}, name) for name in ("truncated", "nan", "config-link", "tokenizer-link")
        ]
        cases.append(({"model": None, "device": "cuda:99"}, "cuda:99"))
        for n, (settings, name) in enumerate(cases, 1):
            _configure(server, {"device": "cpu", **settings})
            server.wait_message("window/showMessage", lambda p, n=n: len(_errors(server)) >= n, LOAD_TIMEOUT_S)
            message = _errors(server)[n - 1]
            assert "did not load" in message and "keeping the model that was running" in message, (name, message)
            assert "\n" not in message and "Traceback" not in message, (name, message)
            assert "AssertionError" not in message, (name, message)
            assert str(folders["good"].parent) not in message and "root:" not in message, (name, message)
            if name == "cuda:99":
                assert "device cuda:99 is not available" in message, message
            else:
                assert "model not found or not usable" in message, (name, message)
            engine = server.stats()["engine"]
            assert engine["state"] == "ready" and engine["pid"] == first["pid"], (name, engine)
            assert engine["restarts"] == 0 and engine["error"] is None and not engine["replacing"], (name, engine)
            assert _answer(server) == before, name  # the same engine answers as it did
            assert len(_errors(server)) == n, (name, _errors(server))  # one message per bad setting

        # The same bad setting again (an editor re-sends its whole configuration) is not loaded again.
        _configure(server, {"device": "cuda:99", "maxLines": 2})
        assert _answer(server) is not None and len(_errors(server)) == len(cases)

        # A good model folder does replace the engine, once it is ready: no error, a new process.
        _configure(server, {"model": str(folders["good"]), "device": "cpu"})
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        engine = server.stats()["engine"]
        while not (engine["pid"] != first["pid"] and engine["state"] == "ready") and time.monotonic() < deadline:
            time.sleep(0.1)
            engine = server.stats()["engine"]
        assert engine["pid"] != first["pid"] and engine["state"] == "ready" and engine["error"] is None, engine
        assert len(_errors(server)) == len(cases)
        _answer(server)
    finally:
        server.close()
    text = Path(log.name).read_text(errors="replace")
    os.unlink(log.name)
    assert "root:x:" not in text  # a system file's content never reaches the log
    assert "Traceback" not in text


# -- the host's rule, on fake engines (no model): load beside, swap once ready, or keep the working one --------
def _starts(monkeypatch, outcomes: dict) -> list:
    """``_start`` by the settings' model: an engine, or the error it raises; the engines made, in order."""
    made: list = []

    def start(settings: Settings):
        outcome = outcomes[settings.model]
        if isinstance(outcome, Exception):
            raise outcome
        made.append(_Healthy())
        return made[-1]

    monkeypatch.setattr(engine_host, "_start", start)
    return made


async def test_the_host_keeps_the_working_engine_when_new_settings_fail(monkeypatch):
    made = _starts(
        monkeypatch, {None: "ok", "/bad": ModelLoadError("/bad/model.safetensors is corrupt"), "/good": "ok"}
    )
    host, notices = engine_host.EngineHost(), _Notices()
    host.add_notice_listener(notices.hear)
    working = await host.get(Settings())
    assert working is not None and len(made) == 1
    bad = Settings(model="/bad")
    assert await host.get(bad) is not None  # a request meanwhile: the working engine answers it
    await _settle(host, lambda: notices.items)
    assert notices.items == [("rejected", "/bad/model.safetensors is corrupt")]
    assert host.state == "ready" and host.running_settings == Settings() and not made[0].closed
    assert (await host.get(bad))._engine is made[0]  # the same settings are not tried again
    assert len(notices.items) == 1 and not host.info()["replacing"]
    good = Settings(model="/good")
    host.configure(good)
    await _settle(host, lambda: host.running_settings == good)
    assert host.running_settings == good and (await host.get(good))._engine is made[1]
    await _settle(host, lambda: made[0].closed)
    assert made[0].closed and host.restarts == 0 and len(notices.items) == 1
    await host.close()


async def test_an_engine_that_dies_while_its_replacement_loads_is_replaced_by_it(monkeypatch):
    made = _starts(monkeypatch, {None: "ok", "/slow": "ok"})
    gate = asyncio.Event()

    async def slow(fn):  # the new engine's start waits for the gate
        await gate.wait()
        return fn()

    host = engine_host.EngineHost()
    await host.get(Settings())
    monkeypatch.setattr(engine_host, "_in_daemon_thread", lambda fn: asyncio.ensure_future(slow(fn)))
    host.configure(Settings(model="/slow"))
    assert host.info()["replacing"] and host.state == "ready"
    made[0].error = "killed"  # the working engine dies
    waiting = asyncio.ensure_future(host.get(Settings(model="/slow")))
    for _ in range(20):
        await asyncio.sleep(0)
    assert host.state == "starting" and not waiting.done()  # the request waits for the replacement
    gate.set()
    got = await waiting
    assert got is not None and got._engine is made[1] and len(made) == 2
    assert host.running_settings == Settings(model="/slow") and host.state == "ready"
    await host.close()


async def test_a_replacement_no_longer_wanted_closes_itself(monkeypatch):
    made = _starts(monkeypatch, {None: "ok", "/slow": "ok"})
    gate = asyncio.Event()

    async def slow(fn):
        await gate.wait()
        return fn()

    host = engine_host.EngineHost()
    await host.get(Settings())
    monkeypatch.setattr(engine_host, "_in_daemon_thread", lambda fn: asyncio.ensure_future(slow(fn)))
    host.configure(Settings(model="/slow"))
    host.configure(Settings())  # the user went back before it was ready
    assert not host.info()["replacing"]
    gate.set()
    await _settle(host, lambda: len(made) == 2 and made[1].closed)
    assert made[1].closed and not made[0].closed and host.running_settings == Settings()
    await host.close()
