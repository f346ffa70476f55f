"""q8_0 weights packed in the lane order at load (engine/runtimes/ggml_patch_packed.py): the packed kernel must give
the unpacked lane kernel's bits for every row count and row length, and a model loaded packed must give the same
logits as one loaded unpacked (FIMBLE_Q8_0_PACK=0), steps and verify blocks alike, with its weights really packed.
Skipped where the library is not built (the README's install step) or the CPU has no AVX2.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.runtimes.ggml_lib import unavailable_reason
from tests.engine.test_q8_rows import ROWS_MAX, _blocks, _ggml_cpu, _has_avx2

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"no llama.cpp library: {REASON}"),
    pytest.mark.skipif(not _has_avx2(), reason="the packed layout is the lane kernels'"),
]


def test_packed_kernel_gives_the_lane_kernels_bits():
    cpu = _ggml_cpu()
    vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    lanes_fn, packed_fn, pack = (
        cpu.fimble_vec_dot_q8_0_q8_0_lanes,
        cpu.fimble_vec_dot_q8_0_q8_0_packed,
        cpu.fimble_q8_0_pack,
    )
    lanes_fn.argtypes = packed_fn.argtypes = [i, i, i, vp, sz, vp, sz, vp, sz]
    pack.argtypes = [vp, vp, ctypes.c_int64, i]
    cpu.fimble_q8_0_packed_rows.restype = ctypes.c_int64
    before = cpu.fimble_q8_0_packed_rows()
    rng = np.random.default_rng(3)
    # groups past the last 8 blocks: 4 (896: packed as 4), 0 (4864), 1, 7, 1, 3, 5 (left as blocks)
    for n, nx in ((896, 16), (4864, 5), (32, 3), (224, 4), (288, 2), (96, 3), (160, 2)):
        nb = n // 32
        x, y = _blocks(rng, nx, nb), _blocks(rng, ROWS_MAX, nb)
        y["qs"] = np.maximum(y["qs"], -127)  # activations as ggml quantises them; weights keep their -128s
        packed = np.zeros_like(x)
        pack(x.ctypes.data, packed.ctypes.data, nx, n)
        if nb >= 8 or nb == 4:  # a packed group is not its blocks: the layout really changed
            assert packed.tobytes() != x.tobytes()
        for nr in range(1, ROWS_MAX + 1):
            want = np.full((ROWS_MAX, 16), np.nan, np.float32)
            got = np.full((ROWS_MAX, 16), np.nan, np.float32)
            cpu.fimble_q8_0_lanes_forget()
            lanes_fn(n, nx, nr, want.ctypes.data, 16, x.ctypes.data, x.strides[0], y.ctypes.data, y.strides[0])
            cpu.fimble_q8_0_lanes_forget()
            packed_fn(n, nx, nr, got.ctypes.data, 16, packed.ctypes.data, x.strides[0], y.ctypes.data, y.strides[0])
            assert np.abs(want[:nr, :nx]).max() > 0
            assert np.array_equal(got[:nr, :nx].view(np.uint32), want[:nr, :nx].view(np.uint32)), (n, nr)
            assert np.isnan(got[nr:]).all() and np.isnan(got[:nr, nx:]).all()  # nothing written past its rows
    assert cpu.fimble_q8_0_packed_rows() - before == 16 + 5 + 3 + 4 + 2 + 3 + 2


_LOGITS = """
import ctypes, hashlib, sys
from pathlib import Path
import torch
from engine.loader import load_model
from engine.runtimes.ggml_lib import get_lib
rt = load_model(Path(sys.argv[1]), runtime="ggml").runtime
ids = [(i * 7919 + 11) % rt.vocab for i in range(120)]
cache = rt.new_cache(130)
out = [rt(torch.tensor(ids[:100]), cache, 0, 1)]  # a prefill (its own kernels' passes)
out += [rt(torch.tensor([ids[100 + k]]), cache, 100 + k, 1) for k in range(6)]  # 1-token steps
for k in (2, 3, 6, 17):  # verify blocks; 17: two calls of the kernel
    cache.rollback(100)
    out.append(rt(torch.tensor(ids[100 : 100 + k]), cache, 100, k))
cpu = ctypes.CDLL(str(Path(get_lib().source) / "libggml-cpu.so"))
cpu.fimble_q8_0_packed_rows.restype = ctypes.c_int64
print(cpu.fimble_q8_0_packed_rows(), len({int(t) for t in torch.cat(out).argmax(-1)}))
print(hashlib.sha256(b"".join(t.numpy().tobytes() for t in out)).hexdigest())
print(bool(torch.equal(out[-1][:6], torch.cat(out[1:7]))))  # a block equals the steps
"""


def _logits(path: Path, pack: str) -> list[str]:
    env = dict(os.environ, FIMBLE_Q8_0_PACK=pack, FIMBLE_GGML_THREADS="2")
    done = subprocess.run(
        [sys.executable, "-c", _LOGITS, str(path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_a_packed_model_gives_the_unpacked_models_logits(tmp_path):
    """The embedded target as q8_0 (the default model where it is installed, too): packed and unpacked loads give the
    same logits bit for bit, and the packed load packed its weights (the unpacked one none)."""
    from engine.model_info import qwen_fim_target
    from engine.runtimes.gguf_export import export_gguf
    from tests.conftest import TARGET_DIR

    paths = [export_gguf(TARGET_DIR, tmp_path / "target-q8_0.gguf", "q8_0")]
    if qwen_fim_target().is_file():
        paths.append(qwen_fim_target())
    for path in paths:
        packed, unpacked = _logits(path, "1"), _logits(path, "0")
        assert int(packed[0]) > 0, path  # either lane kernel (AVX2's, VNNI's) reads packed weights
        assert int(unpacked[0]) == 0 and int(packed[1]) > 1  # (several distinct argmaxes: not a degenerate model)
        assert packed[2] == unpacked[2], path  # every logit, bit for bit
        assert packed[3] == unpacked[3] == "True"
