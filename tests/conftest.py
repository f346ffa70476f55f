"""Shared fixtures: the embedded models, and tiny random models built from a config (no download)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# The suite tests engine mechanics on the small embedded models, also where the install step has
# built fimble-smollm2 (engine/model_info.py default_target); servers started by tests inherit it.
os.environ.setdefault("FIMBLE_DEFAULT_MODEL", "embedded")
# The cold window (engine/caching/cold_window.py) chooses by the measured prefill rate, that is by the
# machine's load: tests that count prefilled tokens or documents must not depend on it. Its own tests
# turn it on for one engine, with a rate they set.
os.environ.setdefault("FIMBLE_COLD_WINDOW", "off")
# Background work stops this long after the host's last message (engine/local.py BACKGROUND_S): on a
# loaded machine a test's pre-warm could outlast the default. Its own test sets it for one engine.
os.environ.setdefault("FIMBLE_BACKGROUND_S", "600")
os.environ.setdefault("FIMBLE_FOLLOW_UP_WITHIN_S", "600")  # (Tab-Tab's follow-ups: the same reason)
# Listeners leave their tokens in a per-user folder (engine/auth.py runtime_dir): the suite's go to one of
# its own, never the user's, and a test's client never picks up a token of the user's own servers.
os.environ.setdefault("FIMBLE_RUNTIME_DIR", tempfile.mkdtemp(prefix="fimble-test-run-"))
REPO = Path(__file__).resolve().parent.parent
TARGET_DIR = REPO / "models" / "fimble-target"
DRAFT_DIR = REPO / "models" / "fimble-draft"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_tiny_model(
    folder: Path,
    model_type: str = "llama",
    vocab_size: int = 8192,
    seed: int = 0,
    with_tokenizer: bool = True,
    **overrides,
) -> Path:
    """A random Llama/Qwen2/Mistral folder in HF format. initializer_range ~1 keeps outputs varied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=1.0,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
    )
    cfg.update(overrides)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # make norms and biases non-trivial too, so every weight is checked
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if with_tokenizer:
        for f in TOKENIZER_FILES:
            shutil.copy(TARGET_DIR / f, folder / f)
    return folder


@pytest.fixture(scope="session")
def embedded_target():
    from engine.loader import load_model

    return load_model(TARGET_DIR)


@pytest.fixture(scope="session")
def embedded_draft():
    from engine.loader import load_model

    return load_model(DRAFT_DIR)


# The embedded models on fimble's torch runtime, for tests of its own mechanics (CUDA-graph static path,
# key re-rotation for shift reuse, fbgemm int8, ties pinned on its kernels). The fixtures above take the
# default runtime: ggml on the CPU where llama.cpp's library is built (engine/runtimes/ggml_build.py).
@pytest.fixture(scope="session")
def compact_target():
    from engine.loader import load_model

    return load_model(TARGET_DIR, runtime="compact")


@pytest.fixture(scope="session")
def compact_draft():
    from engine.loader import load_model

    return load_model(DRAFT_DIR, runtime="compact")


@pytest.fixture(scope="session")
def compact_unbatched(compact_target, compact_draft):
    """What `fimble lsp`'s engine (a fresh LocalEngine on the compact pair, one torch thread) answers to a list of
    requests, computed once per list for the session: tests/serve's batched schedulers are compared with it (three
    tests asked it the same five prompts, 3 s each time)."""
    from engine.local import LocalEngine

    texts: dict[str, list[str]] = {}

    def answer(requests) -> list[str]:
        key = repr(requests)
        if key not in texts:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                plain = LocalEngine(compact_target, compact_draft, start_thread=False)
                texts[key] = [plain.complete(r).text for r in requests]
            finally:
                torch.set_num_threads(threads)
        return list(texts[key])

    return answer


@pytest.fixture
def one_thread():
    """One intra-op thread, as `fimble serve` runs by default (engine/serve/batched.py says why)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def embedded_engine(embedded_target, embedded_draft):
    """The embedded pair in a LocalEngine without a worker thread: complete() decodes in the test's own thread. One
    torch thread: small matmuls on a busy 2-core machine run several times faster than with two spinning threads."""
    from engine.local import LocalEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = LocalEngine(embedded_target, embedded_draft, start_thread=False)
    yield eng
    eng.close()
    torch.set_num_threads(threads)
