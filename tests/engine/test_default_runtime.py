"""The CPU default runtime: llama.cpp's kernels through the library the README's install step builds
(engine/runtimes/ggml_build.py), with 1-token steps that need no padding to stay lossless."""

from __future__ import annotations

import os

import pytest
from conftest import TARGET_DIR

from engine.loader import load_model
from engine.runtimes import ggml_build


def test_the_cpu_default_is_ggml_on_fimbles_own_build():
    if os.environ.get("FIMBLE_RUNTIME", "").strip():
        pytest.skip("FIMBLE_RUNTIME forces a runtime")
    assert ggml_build.is_built(), "llama.cpp's library is not built: run `python -m engine.runtimes.ggml_build`"
    from engine.runtimes.ggml_lib import get_lib

    model = load_model(TARGET_DIR)
    assert model.backend == "ggml"
    assert get_lib().source == str(ggml_build.lib_dir())
    # The patched line at work: a 1-row pass equals a block's row as it is, so no 2-row padding, and
    # flash attention can stay off (faster here; stock builds need it on).
    assert model.runtime.batch_invariant and not model.runtime.pad_single and not model.runtime.flash_attn


def test_the_patch_applies_once_and_refuses_other_sources(tmp_path):
    src = tmp_path / "src"
    originals: dict[str, str] = {}
    for rel, old, _ in ggml_build.PATCHES:
        originals[rel] = originals.get(rel, "// source\n") + old + "\n// more\n"
    for rel, text in originals.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    ggml_build.patch_source(src)
    for rel, _old, new in ggml_build.PATCHES:
        assert new in (src / rel).read_text()
    with pytest.raises(SystemExit, match="not the expected source"):
        ggml_build.patch_source(src)  # already patched: a second run must not patch blindly
    # one edit's text missing: nothing is written at all
    for rel, text in originals.items():
        (src / rel).write_text(text)
    rel, old, _ = ggml_build.PATCHES[-1]
    (src / rel).write_text(originals[rel].replace(old, "changed upstream"))
    with pytest.raises(SystemExit, match="not the expected source"):
        ggml_build.patch_source(src)
    first_rel = ggml_build.PATCHES[0][0]
    assert first_rel != rel and (src / first_rel).read_text() == originals[first_rel]


def test_more_threads_never_cost_losslessness(monkeypatch):
    """With flash attention on and 2 threads, llama.cpp's q8_0 blocks differed from its 1-token steps on
    this machine: whatever the thread count asked for, the runtime must load a setting whose blocks are
    equal (or drop to 1 thread), never decode lossy."""
    if not ggml_build.is_built():
        pytest.skip("llama.cpp's library is not built")
    monkeypatch.setenv("FIMBLE_GGML_THREADS", "2")
    model = load_model(TARGET_DIR, runtime="ggml")
    assert model.runtime.batch_invariant
    assert model.runtime.threads in (1, 2)
