"""What a model folder says about itself, read without loading the model (no torch here).

A model folder may hold ``fimble.json`` (written by whoever trained the model):

    {"languages": ["python"]}

``languages`` are the LSP language ids the model was trained on. The server serves exactly
those by default (lsp_server/PROTOCOL.md, "Languages"). A folder without the file is of
unknown training: ``None``, every language.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The same folder as engine.loader.DEFAULT_TARGET, named here so that reading it needs no torch.
EMBEDDED_TARGET = Path(__file__).resolve().parent.parent / "models" / "fimble-target"
# The FIM-trained SmolLM2 model (models/MODEL_CARD.md), built by the install step
# (``python -m training.assemble``, README's first command). Once built it is the default;
# until then, or with FIMBLE_DEFAULT_MODEL=embedded (the test suite sets it), the embedded model is.
BUILT_TARGET = EMBEDDED_TARGET.parent / "fimble-smollm2"
INFO_FILE = "fimble.json"
MAX_INFO_BYTES = 64 * 1024  # a metadata file, not a data set: refuse anything bigger


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the folder's last path part, for messages
    languages: tuple[str, ...] | None  # None: unknown, every language


def default_target() -> Path:
    """The model used when none is named: fimble-smollm2 once built, else the embedded model."""
    if os.environ.get("FIMBLE_DEFAULT_MODEL", "") == "embedded":
        return EMBEDDED_TARGET
    built = (BUILT_TARGET / "built_from.json").is_file() and (BUILT_TARGET / "model.safetensors").is_file()
    return BUILT_TARGET if built else EMBEDDED_TARGET


def model_folder(model: str | None) -> Path:
    """The folder the engine loads for the ``model`` setting (None: ``default_target()``)."""
    return Path(model).expanduser() if model else default_target()


def read_model_info(model: str | None) -> ModelInfo:
    """``model``'s fimble.json; a missing or bad file gives languages=None (bad ones are logged)."""
    folder = model_folder(model)
    info = ModelInfo(folder.name or str(folder), None)
    path = folder / INFO_FILE
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
        log.warning("ignoring %s: \"languages\" must be a list of language ids", path)
        return info
    return ModelInfo(info.name, tuple(dict.fromkeys(langs)))  # (order kept, duplicates dropped)
