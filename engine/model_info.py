"""What a model folder says about itself, read without loading the model (no torch here).

A model folder, or the folder of a GGUF file, may hold ``fimble.json`` (written by whoever trained
the model, or shipped with the install step that fetches it):

    {"languages": ["python"]}

``languages`` are the LSP language ids the model was trained on. The server serves exactly
those by default (the LSP protocol notes, "Languages"). A folder without the file is of
unknown training: ``None``, every language.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from engine import env_settings

log = logging.getLogger(__name__)

# The same folder as engine.loader.DEFAULT_TARGET, named here so that reading it needs no torch.
EMBEDDED_TARGET = Path(__file__).resolve().parent.parent / "models" / "fimble-target"
# The FIM-trained SmolLM2 model (models/MODEL_CARD.md), built by ``python -m training.assemble``.
BUILT_TARGET = EMBEDDED_TARGET.parent / "fimble-smollm2"
# Qwen2.5-Coder-0.5B-Instruct as q8_0 GGUF, fetched by ``python -m training.fetch_qwen`` (README's
# first command). Pass@1 0.64 on HumanEval single-line against 0.36 for fimble-smollm2, which prefills
# 2.6x and steps 1.25x faster on a 2-core CPU (models/MODEL_CARD.md): quality decides the default.
QWEN_TARGET = EMBEDDED_TARGET.parent / "qwen2.5-coder-0.5b" / "qwen2.5-coder-0.5b-instruct-q8_0.gguf"
# The same model FIM-tuned on fimble's own prompts (training/qwen_fim.py), written beside it by the same install
# step: same architecture and q8_0, so the same speed per token; through fimble lsp on HumanEval it beat the
# Instruct file on every set (bench/reports/quality-qwen-fim-lsp-h200-2026-12-03.txt), so it is the default.
QWEN_FIM_NAME = "qwen2.5-coder-0.5b-fim-q8_0.gguf"  # in QWEN_TARGET's folder
# A sub-vocabulary drafter of these files (engine/runtimes/draft_vocab.py), a folder beside their folder: the
# default draft once it holds a token map (engine/loader.py default_models).
QWEN_DRAFT_NAME = "qwen2.5-coder-0.5b-draft"
# Its weights' sha256 (training/draft_distill.py, run 2 of 2026-12-06 on an H100): a changed or truncated file is not
# used as the default draft (engine/local.py), and decoding goes on without it, as exact as with it.
QWEN_DRAFT_SHA256 = "baad9a8a0c6276dc6c575b373141d6eada8a61681b3c84365e9bb326ffd48d92"
# The larger option, not installed by default (``python -m training.fetch_qwen --size 1.5b``):
# Qwen2.5-Coder-1.5B-Instruct as q8_0, used only when pinned (FIMBLE_DEFAULT_MODEL=qwen-1.5b) or named by the
# model setting.
QWEN_15B_TARGET = EMBEDDED_TARGET.parent / "qwen2.5-coder-1.5b" / "qwen2.5-coder-1.5b-instruct-q8_0.gguf"
# FIMBLE_DEFAULT_MODEL pins one: "embedded" (the test suite sets it), "smollm2", "qwen" (the FIM-tuned file),
# "qwen-instruct" (the Instruct file, the default before the FIM-tuned one) or "qwen-1.5b" (the larger option).
DEFAULT_CHOICES = env_settings.setting("FIMBLE_DEFAULT_MODEL").choices  # the table holds the names
INFO_FILE = "fimble.json"
MAX_INFO_BYTES = 64 * 1024  # a metadata file, not a data set: refuse anything bigger


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the folder's last path part, for messages
    languages: tuple[str, ...] | None  # None: unknown, every language


def _smollm2_built() -> bool:
    return (BUILT_TARGET / "built_from.json").is_file() and (BUILT_TARGET / "model.safetensors").is_file()


def _qwen_fetched() -> bool:
    # The GGUF appears only when complete (renamed from .part); SOURCE.txt is written after it.
    return QWEN_TARGET.is_file() and (QWEN_TARGET.parent / "SOURCE.txt").is_file()


def _qwen_15b_fetched() -> bool:
    return QWEN_15B_TARGET.is_file() and (QWEN_15B_TARGET.parent / "SOURCE.txt").is_file()


def qwen_fim_target() -> Path:
    return QWEN_TARGET.parent / QWEN_FIM_NAME


def qwen_draft() -> Path:
    return QWEN_TARGET.parent.parent / QWEN_DRAFT_NAME


def _qwen_fim_built() -> bool:
    return qwen_fim_target().is_file() and (QWEN_TARGET.parent / "SOURCE.txt").is_file()


def default_target() -> Path:
    """The model used when none is named: the FIM-tuned Qwen2.5-Coder-0.5B once built, else the Instruct
    file, else fimble-smollm2 once built, else the embedded model. ``FIMBLE_DEFAULT_MODEL`` pins one (a
    pinned model not installed falls back the same way, with a log line); "qwen-1.5b" is used only when pinned."""
    pinned = env_settings.read("FIMBLE_DEFAULT_MODEL")  # "" or one of DEFAULT_CHOICES (engine/env_settings.py)
    if pinned == "embedded":
        return EMBEDDED_TARGET
    order = [(qwen_fim_target(), _qwen_fim_built), (QWEN_TARGET, _qwen_fetched), (BUILT_TARGET, _smollm2_built)]
    if pinned == "smollm2":
        order.insert(0, order.pop(2))
    elif pinned == "qwen-instruct":
        order.insert(0, order.pop(1))
    elif pinned == "qwen-1.5b":
        order.insert(0, (QWEN_15B_TARGET, _qwen_15b_fetched))
    if pinned in DEFAULT_CHOICES[1:] and not order[0][1]():
        log.warning("FIMBLE_DEFAULT_MODEL=%s is not installed (README's first command); using the next one", pinned)
    for target, installed in order:
        if installed():
            return target
    return EMBEDDED_TARGET


def model_folder(model: str | None) -> Path:
    """The folder the engine loads for the ``model`` setting (None: ``default_target()``)."""
    return Path(model).expanduser() if model else default_target()


def read_model_info(model: str | None) -> ModelInfo:
    """``model``'s fimble.json; a missing or bad file gives languages=None (bad ones are logged)."""
    folder = model_folder(model)
    info = ModelInfo(folder.name or str(folder), None)
    path = (folder.parent if folder.suffix.lower() == ".gguf" else folder) / INFO_FILE
    try:
        if not path.is_file():
            return info
        if path.stat().st_size > MAX_INFO_BYTES:
            raise ValueError(f"over {MAX_INFO_BYTES} bytes")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        log.warning("ignoring %s: %s", path, exc)
        return info
    langs = data.get("languages") if isinstance(data, dict) else None
    if langs is None:
        return info
    if not isinstance(langs, list) or not all(isinstance(x, str) and x for x in langs):
        log.warning('ignoring %s: "languages" must be a list of language ids', path)
        return info
    return ModelInfo(info.name, tuple(dict.fromkeys(langs)))  # (order kept, duplicates dropped)
