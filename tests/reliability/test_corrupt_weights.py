"""Corrupt weights are a load error with a one-line reason, never "ready" with empty completions.

Tiny random models (tests/conftest.py) are written in safetensors and then damaged the ways a
disk or a download does: all NaN, one Inf, random bytes over the tensor data, random bytes over
the header. The last case runs through a real ``fimble lsp`` and engine process, as a user meets it.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model
from safetensors.torch import load_file, save_file

from bench.harness.raw_lsp import SERVER_ENV, RawServer
from engine.errors import ModelLoadError
from engine.loader import load_model
from engine.runtimes.weights_check import bad_probe, bad_weight


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _weights(folder: Path) -> Path:
    return next(folder.glob("*.safetensors"))


def _data_span(path: Path, name: str) -> tuple[int, int]:
    """Byte span of tensor ``name``'s data in a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    start, end = header[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def _rewrite(folder: Path, name_part: str, fn) -> str:
    path = _weights(folder)
    state = load_file(str(path))
    name = next(k for k in state if name_part in k)
    state[name] = fn(state[name].clone())
    save_file(state, str(path), metadata={"format": "pt"})
    return name


def _load_error(folder: Path) -> str:
    with pytest.raises(ModelLoadError) as err:
        load_model(folder)
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_the_intact_model_loads(tiny):
    assert load_model(tiny).backend in ("ggml", "compact")  # the default runtime takes it
    model = load_model(tiny, runtime="compact")  # the checks below read the compact runtime's tensors
    assert bad_weight(model.runtime) is None and bad_probe(model.runtime) is None


def test_all_nan_weights_are_a_load_error(tiny, tmp_path):
    folder = _copy(tiny, tmp_path / "nan")
    name = _rewrite(folder, "mlp.down_proj", lambda t: torch.full_like(t, float("nan")))
    message = _load_error(folder)
    assert "corrupt" in message and "NaN" in message and "down" in message and name.startswith("model.")


def test_one_inf_is_a_load_error(tiny, tmp_path):
    folder = _copy(tiny, tmp_path / "inf")

    def one_inf(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[7] = float("inf")
        return t

    _rewrite(folder, "input_layernorm", one_inf)
    assert "Inf" in _load_error(folder)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_bytes_over_tensor_data_are_a_load_error(tiny, tmp_path, seed):
    folder = _copy(tiny, tmp_path / f"bytes{seed}")
    path = _weights(folder)
    name = next(k for k in load_file(str(path)) if "q_proj" in k)
    start, end = _data_span(path, name)
    rng = random.Random(seed)
    at = rng.randrange(start, end - 1024)
    raw = bytearray(path.read_bytes())
    raw[at : at + 1024] = rng.randbytes(1024)  # 256 floats of garbage in the middle of a tensor
    path.write_bytes(bytes(raw))
    assert "corrupt" in _load_error(folder)


def test_garbage_that_stays_finite_is_caught_by_the_probe(tiny):
    # Half precision: 6e4 fits (and passes the per-weight bound), but activations overflow to Inf.
    model = load_model(tiny, dtype=torch.float16, runtime="compact")  # edits the compact runtime's layers
    with torch.no_grad():
        for layer in model.runtime.layers:
            for p in layer.parameters():
                p.fill_(6e4)
    assert bad_weight(model.runtime) is None
    assert bad_probe(model.runtime) == "a probe forward pass gives NaN or Inf logits"


def _ask(server: RawServer) -> list:
    """One completion request (it waits for the engine's start, which fails): its items."""
    server.open("file:///w.py", "def f(x):\n    return \n")
    answer = server.call(
        "textDocument/inlineCompletion",
        {
            "textDocument": {"uri": "file:///w.py"},
            "position": {"line": 1, "character": 11},
            "context": {"triggerKind": 1},
        },
        timeout=180,
    )
    return (answer.get("result") or {}).get("items", [])


def test_random_bytes_over_the_header_through_the_server(tiny, tmp_path):
    folder = _copy(tiny, tmp_path / "header")
    path = _weights(folder)
    raw = bytearray(path.read_bytes())
    raw[8:72] = random.Random(7).randbytes(64)  # the start of the JSON header
    path.write_bytes(bytes(raw))
    server = RawServer(env=dict(SERVER_ENV, FIMBLE_MODEL=str(folder), FIMBLE_DRAFT=""))
    try:
        server.initialize({"noDraft": True})
        assert _ask(server) == []
        message = server.wait_message("window/showMessage", lambda p: p["type"] == 1, 10)
        assert "cannot read weights" in message["message"] and "Traceback" not in message["message"]
        assert server.stats()["engine"]["state"] == "error"
    finally:
        server.close()


def test_nan_weights_through_the_server_are_an_error_not_ready(tiny, tmp_path):
    folder = _copy(tiny, tmp_path / "nan-server")
    _rewrite(folder, "embed_tokens", lambda t: torch.full_like(t, float("nan")))
    server = RawServer(env=dict(SERVER_ENV, FIMBLE_MODEL=str(folder), FIMBLE_DRAFT=""))
    try:
        server.initialize({"noDraft": True})
        assert _ask(server) == []
        engine = server.stats()["engine"]
        assert engine["state"] == "error"
        shown = [m["message"] for m in server.messages("window/showMessage")]
        assert any("are corrupt" in m and "NaN" in m for m in shown), shown
    finally:
        server.close()
