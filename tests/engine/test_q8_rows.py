"""q8_0 verify rows that share their weight reads (engine/runtimes/ggml_patch.py item 3): every row of a block
must equal a 1-token step bit for bit, in the kernels alone and on the default model.

The kernel tests call the built library's C functions directly on random q8_0 blocks (extremes included), so a
change that alters one row's summation order fails here before any model runs. Every AVX2 CPU runs fimble's
lane-order kernel for every q8_0 product (1-token steps and prefills included): the AVX-512 VNNI one where the
CPU has it, else the AVX2 one; stock's order survives behind FIMBLE_Q8_0_AVX2=1 (the rows kernel, still tested).
On a VNNI CPU the AVX2 kernels run too, when told to, and the two lane kernels must agree bit for bit. The model
test decodes the default GGUF (Qwen2.5-Coder-0.5B q8_0) as 1-token steps and as blocks of every size the kernel
splits differently (2 rows, 3-8, 9-16; past 16 in several of llama.cpp's 16-row tiles), and compares logits
exactly. Skipped where the library or the default model is not there (the README's install steps).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import model_info
from engine.runtimes.ggml_lib import unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no llama.cpp library: {REASON}")
BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", 32)])  # ggml's block_q8_0: 34 bytes, packed
ROWS_MAX = 16  # FIMBLE_Q8_0_ROWS in the patch


def _has_avx2(flag: str = "avx2") -> bool:
    try:
        return f" {flag}" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _has_vnni() -> bool:
    """What the library's run-time check (fimble_q8_0_lanes) looks for."""
    return all(_has_avx2(f) for f in ("avx512_vnni", "avx512vl", "avx512bw", "avx512f"))


def _ggml_cpu() -> ctypes.CDLL:
    from engine.runtimes.ggml_lib import get_lib

    lib = get_lib()
    return ctypes.CDLL(str(Path(lib.source) / "libggml-cpu.so"))


def _blocks(rng: np.random.Generator, rows: int, nb: int) -> np.ndarray:
    out = np.zeros((rows, nb), BLOCK)
    out["d"] = rng.uniform(1e-4, 2e-2, (rows, nb)).astype(np.float16)
    out["qs"] = rng.integers(-127, 128, (rows, nb, 32), dtype=np.int8)
    out["qs"][0, 0, :4] = (-128, -128, 127, -127)  # the extremes the sign trick and int16 pairs must survive
    out["qs"][1, 0, :4] = (-128, 127, -128, -128)
    return out


@pytest.mark.skipif(not _has_avx2(), reason="the multi-row q8_0 kernel is AVX2's")
def test_kernel_rows_equal_one_row_dots_bit_for_bit():
    cpu = _ggml_cpu()
    rows_fn = cpu.fimble_vec_dot_q8_0_q8_0_rows  # absent: the build did not take the patch
    one_fn = cpu.ggml_vec_dot_q8_0_q8_0
    vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    rows_fn.argtypes = [i, i, i, vp, sz, vp, sz, vp, sz]
    one_fn.argtypes = [i, vp, sz, vp, sz, vp, sz, i]
    rng = np.random.default_rng(0)
    for n, nx in ((896, 16), (4864, 5), (32, 3), (9728, 2)):  # 9728: past the kernels' scale tables (256 blocks)
        nb = n // 32
        x, y = _blocks(rng, nx, nb), _blocks(rng, ROWS_MAX, nb)
        one = np.zeros((ROWS_MAX, nx), np.float32)
        for r in range(ROWS_MAX):
            for k in range(nx):
                one_fn(n, one[r, k:].ctypes.data, 0, x[k].ctypes.data, 0, y[r].ctypes.data, 0, 1)
        assert np.abs(one).max() > 0  # the dots are not all zero (else equality proves nothing)
        for nr in range(1, ROWS_MAX + 1):  # 1: a step's weight rows four at a time (nx 16, 5, 3, 2: every remainder)
            got = np.full((ROWS_MAX, 16), np.nan, np.float32)
            rows_fn(n, nx, nr, got.ctypes.data, 16, x.ctypes.data, x.strides[0], y.ctypes.data, y.strides[0])
            assert np.array_equal(got[:nr, :nx].view(np.uint32), one[:nr].view(np.uint32)), (n, nr)
            assert np.isnan(got[nr:]).all() and np.isnan(got[:nr, nx:]).all()  # nothing written past its rows


def _lanes_reference(x: np.ndarray, y: np.ndarray) -> float:
    """The lane order in float64: lane j adds blocks j, j+8, ... (an exact integer sum times dx*dy), then
    hsum_float_8's pairs. Not bit-exact (float64 rounds the FMAs differently), but close."""
    isum = (x["qs"].astype(np.int64) * y["qs"].astype(np.int64)).sum(-1)
    terms = x["d"].astype(np.float64) * y["d"].astype(np.float64) * isum
    lanes = [terms[j::8].sum() for j in range(8)]
    return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))


@pytest.mark.skipif(not _has_avx2(), reason="the lane-order kernels need AVX2")
def test_lane_kernel_rows_equal_its_one_row_products_bit_for_bit():
    """On AVX2 (and with VNNI) every q8_0 product of 1-16 rows takes a lane-order kernel, 1-token steps included:
    each row of a pass of 2-16 equals that row alone, bit for bit, for every tail length of the last group of 8
    blocks (the AVX2 kernel packs tails of 1-4 blocks), and the sums are the products' (within float rounding of
    the documented order)."""
    cpu = _ggml_cpu()
    lanes_fn, forget = cpu.fimble_vec_dot_q8_0_q8_0_lanes, cpu.fimble_q8_0_lanes_forget
    vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    lanes_fn.argtypes = [i, i, i, vp, sz, vp, sz, vp, sz]
    assert cpu.fimble_q8_0_lanes() == (1 if os.environ.get("FIMBLE_Q8_0_LANES") == "avx2" or not _has_vnni() else 2)
    rng = np.random.default_rng(1)
    # tails past the last 8 blocks: 4 (896), 0, 1, 7, 1, 0, 3, 5. With VNNI, 5-16 rows over 4,864 and 9,728 columns
    # take the group spans (fimble_lanes_vnni_rows); 70 weight rows: past the spans' 64-row pieces.
    for n, nx in ((896, 16), (4864, 5), (32, 3), (224, 4), (288, 2), (9728, 2), (96, 3), (160, 2), (4864, 70)):
        nb = n // 32
        x, y = _blocks(rng, nx, nb), _blocks(rng, ROWS_MAX, nb)
        # The activations as ggml quantises them (|y| <= 127; the AVX2 kernel's sign trick needs it, as ggml's own
        # AVX2 loop does); the weights keep their -128s (any int8, from any quantiser).
        y["qs"] = np.maximum(y["qs"], -127)
        y["qs"][1, 0, :4] = (-127, 127, -127, -127)
        one = np.zeros((ROWS_MAX, nx), np.float32)
        for r in range(ROWS_MAX):
            forget()  # a new product (the rows are prepared once per product and thread)
            lanes_fn(n, nx, 1, one[r].ctypes.data, 1, x.ctypes.data, x.strides[0], y[r].ctypes.data, y.strides[0])
        ref = np.array([[_lanes_reference(x[k], y[r]) for k in range(nx)] for r in range(ROWS_MAX)])
        assert np.abs(one).max() > 0 and np.allclose(one, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max()), n
        width = max(16, nx + 2)  # the output rows' stride: room past nx to see nothing written there
        for nr in range(1, ROWS_MAX + 1):
            forget()
            got = np.full((ROWS_MAX, width), np.nan, np.float32)
            lanes_fn(n, nx, nr, got.ctypes.data, width, x.ctypes.data, x.strides[0], y.ctypes.data, y.strides[0])
            assert np.array_equal(got[:nr, :nx].view(np.uint32), one[:nr].view(np.uint32)), (n, nr)
            assert np.isnan(got[nr:]).all() and np.isnan(got[:nr, nx:]).all()  # nothing written past its rows
            # a second call of the same product (ggml's next chunk) reuses the prepared rows: same values
            again = np.full((ROWS_MAX, width), np.nan, np.float32)
            lanes_fn(n, nx, nr, again.ctypes.data, width, x.ctypes.data, x.strides[0], y.ctypes.data, y.strides[0])
            assert np.array_equal(again[:nr, :nx].view(np.uint32), got[:nr, :nx].view(np.uint32))


@pytest.mark.skipif(not _has_vnni(), reason="no VNNI: the tests above ran the AVX2 kernels")
def test_kernel_avx2_path_rows_equal_one_row_dots_bit_for_bit():
    """The same checks on the AVX2 kernels, which this CPU (with VNNI) takes only when told to: stock's order
    (FIMBLE_Q8_0_AVX2=1) and the AVX2 lane kernel (FIMBLE_Q8_0_LANES=avx2)."""
    for var, value, name in (
        ("FIMBLE_Q8_0_AVX2", "1", "test_kernel_rows_equal_one_row_dots_bit_for_bit"),
        ("FIMBLE_Q8_0_LANES", "avx2", "test_lane_kernel_rows_equal_its_one_row_products_bit_for_bit"),
    ):
        env = dict(os.environ, **{var: value})
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{name}"], env=env
        )
        assert done.returncode == 0, var


_LANE_PRODUCTS = """
import ctypes, sys
from pathlib import Path
import numpy as np
from engine.runtimes.ggml_lib import get_lib
cpu = ctypes.CDLL(str(Path(get_lib().source) / "libggml-cpu.so"))
fn = cpu.fimble_vec_dot_q8_0_q8_0_lanes
vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
fn.argtypes = [i, i, i, vp, sz, vp, sz, vp, sz]
block = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
rng = np.random.default_rng(2)
for n in (896, 4864, 96, 160):
    x, y = np.zeros((8, n // 32), block), np.zeros((16, n // 32), block)
    for b in (x, y):
        b["d"] = rng.uniform(1e-4, 2e-2, b.shape).astype(np.float16)
        b["qs"] = rng.integers(-127, 128, b.shape + (32,), dtype=np.int8)
    x["qs"][0, 0, :2] = -128
    for nr in (1, 4, 16):
        cpu.fimble_q8_0_lanes_forget()
        s = np.zeros((16, 8), np.float32)
        fn(n, 8, nr, s.ctypes.data, 8, x.ctypes.data, x.strides[0], y.ctypes.data, y.strides[0])
        sys.stdout.write(s.tobytes().hex() + "\\n")
"""


@pytest.mark.skipif(not _has_vnni(), reason="one lane kernel on this CPU: nothing to compare it with")
def test_vnni_and_avx2_lane_kernels_agree_bit_for_bit():
    """The two lane kernels form the same exact integer sums and the same float operations, so a model gives the
    same logits on a CPU with VNNI and on one with AVX2 alone: here both run on one CPU and must agree."""
    runs = [
        subprocess.run(
            [sys.executable, "-c", _LANE_PRODUCTS],
            env=dict(os.environ, **extra),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for extra in ({}, {"FIMBLE_Q8_0_LANES": "avx2"})
    ]
    assert runs[0].count("\n") == 12 and runs[0] == runs[1]


@pytest.mark.heavy  # 11 s on 2 cores (a second pytest, the default model loaded again): tests/heavy.sh
@pytest.mark.skipif(not _has_avx2(), reason="stock's order runs the AVX2 kernels")
def test_stock_order_model_blocks_equal_steps_bit_for_bit():
    """In stock's order (FIMBLE_Q8_0_AVX2=1: 1-token steps four weight rows at a time, blocks in the rows kernel,
    each sum ggml_vec_dot_q8_0_q8_0's) the default model's blocks equal its steps too. An opt-in order: the default
    suite checks its kernels alone (test_kernel_rows_equal_one_row_dots_bit_for_bit), this the heavy suite."""
    if not model_info.qwen_fim_target().is_file():
        pytest.skip("the default model is not installed (python -m training.fetch_qwen)")
    name = "test_default_model_blocks_equal_steps_bit_for_bit"
    env = dict(os.environ, FIMBLE_Q8_0_AVX2="1")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{name}"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:]


def test_default_model_blocks_equal_steps_bit_for_bit():
    """The default model's verify blocks (every split the kernel makes) equal its 1-token steps exactly."""
    path = model_info.qwen_fim_target()
    if not path.is_file():
        pytest.skip("the default model is not installed (python -m training.fetch_qwen)")
    from engine.loader import load_model

    rt = load_model(path, runtime="ggml").runtime
    assert rt.batch_invariant and not rt.pad_single  # the load-time probe passed without padding 1-row passes
    depth, longest = 200, 33
    ids = [(i * 7919 + 11) % rt.vocab for i in range(depth + longest)]
    cache = rt.new_cache(depth + longest + 1)
    rt(torch.tensor(ids[:depth]), cache, 0, 1)
    steps = torch.cat([rt(torch.tensor([ids[depth + i]]), cache, depth + i, 1) for i in range(longest)])
    assert len({int(t) for t in steps.argmax(-1)}) > 1  # a model that says one thing proves nothing
    for k in (2, 3, 4, 5, 8, 9, 16, 17, 32, 33):  # 33: past the runtime's 32-row passes
        cache.rollback(depth)
        block = rt(torch.tensor(ids[depth : depth + k]), cache, depth, k)
        assert torch.equal(block, steps[:k]), k
