"""FIM sentinels for SmolLM2's tokenizer, by renaming special tokens its pretraining never used.

SmolLM2's vocabulary has 17 special tokens and no FIM ones. Ten of them (ids 7-16:
``<gh_stars>``, ``<issue_*>``, ``<jupyter_*>``, ``<empty_output>``) have one and the same
embedding row in the released weights (norm 3.2937 each, pairwise cosine 1.000 after the
GGUF's Q8_0 rounding), so pretraining never trained them apart. Renaming four of those to
fimble's sentinels gives FIM tokens without growing the vocabulary: the base's config,
embedding shape and tied output head stay as they are, and only those four embedding rows
are trained (training/fim_lora.py) and shipped.
The names are fimble's own (engine/fim.py "fimble" template: SPM order, cache-friendly).
"""

from __future__ import annotations

import json
from pathlib import Path

RENAMES = {
    "<jupyter_start>": "<|fim_pre|>",
    "<jupyter_text>": "<|fim_suf|>",
    "<jupyter_code>": "<|fim_mid|>",
    "<jupyter_output>": "<|fim_pad|>",
}
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FIM_PAD = RENAMES.values()
EOT = "<|endoftext|>"  # ends every training sample, so it ends completions (engine/loader.py stop ids)


def rename_tokenizer_json(data: dict) -> dict:
    """tokenizer.json content with the four special tokens renamed (ids unchanged)."""
    out = json.loads(json.dumps(data))
    found = set()
    for tok in out.get("added_tokens", []):
        if tok["content"] in RENAMES:
            found.add(tok["content"])
            tok["content"] = RENAMES[tok["content"]]
    vocab = out["model"]["vocab"]
    for old, new in RENAMES.items():
        if old in vocab:
            vocab[new] = vocab.pop(old)
    if found != set(RENAMES):
        raise ValueError(f"tokenizer lacks special tokens {sorted(set(RENAMES) - found)}: not SmolLM2's")
    return out


def write_fim_tokenizer(base: Path, dest: Path) -> dict[str, int]:
    """Write tokenizer.json/tokenizer_config.json with FIM sentinels into ``dest``; their ids."""
    data = rename_tokenizer_json(json.loads((base / "tokenizer.json").read_text(encoding="utf-8")))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    cfg = json.loads((base / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only", "chat_template"):
        cfg.pop(key, None)
    # Completions end at <|endoftext|>, the token every FIM sample ends with.
    cfg.update(
        eos_token=EOT,
        pad_token=FIM_PAD,
        bos_token=None,
        add_bos_token=False,
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    return {
        t["content"]: t["id"] for t in data["added_tokens"] if t["content"] in RENAMES.values() or t["content"] == EOT
    }
