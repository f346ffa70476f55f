"""A drafter whose vocabulary is a subset of its target's: its token map and the tokenizer files its GGUF needs.

A sub-vocabulary drafter folder (HF format) holds ``config.json``, ``model.safetensors`` and ``token_map.json``:
a JSON list of length ``vocab_size`` whose entry ``d`` is the target's token id of drafter index ``d``; entry 0
is -1, "any other token" (the target's tokens outside the map are fed to the drafter as index 0, and it is
never proposed). A small output layer is most of what makes such a drafter cheap next to Qwen's 151,936 tokens.

engine/runtimes/gguf_export.py needs a byte-level BPE ``tokenizer.json`` in the folder to write a GGUF that
llama.cpp loads: ``write_draft_tokenizer`` writes one for the sub-vocabulary from the target GGUF's own tables.
fimble never tokenizes with it (the drafter runs on the target's ids, engine/runtimes/mapped_runtime.py): it
only has to describe the drafter's rows to llama.cpp, as a valid BPE.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from engine.errors import ModelLoadError

TOKEN_MAP = "token_map.json"
OTHER_TOKEN = "<|fimble_other|>"  # drafter index 0: every target token outside the map
CONTROL_TYPES = (3, 4, 5)  # GGUF token types control, user-defined, unused: whole tokens, never merged text


def is_mapped_draft(path: str | Path) -> bool:
    """Whether ``path`` is a sub-vocabulary drafter folder (it has a token map)."""
    return (Path(path) / TOKEN_MAP).is_file()


def check_weights(folder: Path, sha256: str) -> None:
    """ModelLoadError unless the folder's model.safetensors has ``sha256`` (the shipped drafter's pinned digest)."""
    h = hashlib.sha256()
    try:
        with open(folder / "model.safetensors", "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    except OSError as exc:
        raise ModelLoadError(f"{folder.name}: cannot read model.safetensors: {exc.strerror or exc}") from None
    if h.hexdigest() != sha256:
        raise ModelLoadError(f"{folder.name}: model.safetensors is not the shipped file (its sha256 differs)")


def read_token_map(folder: Path, target_vocab: int) -> np.ndarray:
    """The folder's token map as int64 (entry 0 is -1), checked against its config and the target's vocabulary:
    a map that does not fit would scatter logits onto the wrong tokens, so every entry is checked once here."""
    path = folder / TOKEN_MAP
    try:
        raw = json.loads(path.read_text())
        size = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{folder}: cannot read its token map or config: {exc}") from None
    if not isinstance(raw, list) or not all(type(v) is int for v in raw):
        raise ModelLoadError(f"{path}: not a list of token ids")
    if len(raw) != size:
        raise ModelLoadError(f"{path}: {len(raw)} entries, but config.json's vocab_size is {size}")
    ids = np.asarray(raw, dtype=np.int64)
    if len(ids) < 2 or ids[0] != -1:
        raise ModelLoadError(f"{path}: entry 0 must be -1 (any other token), followed by target ids")
    rest = ids[1:]
    if rest.min() < 0 or rest.max() >= target_vocab:
        raise ModelLoadError(f"{path}: ids outside the target's vocabulary of {target_vocab}")
    if len(np.unique(rest)) != len(rest):
        raise ModelLoadError(f"{path}: a target id appears twice")
    return ids


def sub_vocab_files(
    token_map: list[int], tokens: list[str], types: list[int], merges: list[str], eos: int | None
) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) of the sub-vocabulary: drafter index ``d`` is ``tokens[map[d]]``;
    index 0 and the target's control tokens are added special tokens at their drafter index; the merges are
    the target's (in its order) whose two parts and result are all normal tokens here, so the BPE stays valid."""
    # Every token sits in the BPE vocabulary at its drafter index, the special ones also as added tokens: tokenizers
    # gives an added token absent from the vocabulary an id of its own, after the vocabulary's.
    vocab: dict[str, int] = {OTHER_TOKEN: 0}
    normal: set[str] = set()
    added = [_added(0, OTHER_TOKEN)]
    for d, tid in enumerate(token_map[1:], start=1):
        vocab[tokens[tid]] = d
        if types[tid] in CONTROL_TYPES:
            added.append(_added(d, tokens[tid]))
        else:
            normal.add(tokens[tid])
    kept = []
    for m in merges:
        a, _, b = m.partition(" ")
        if a in normal and b in normal and a + b in normal:
            kept.append([a, b])
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        # The GPT-2 split (what gguf_export maps to GGUF "gpt-2"): never used to split text, see the module doc.
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": kept,
        },
    }
    eos_text = tokens[eos] if eos is not None and eos in set(token_map[1:]) else None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_text, "bos_token": None}
    return tokenizer, config


def _added(i: int, content: str) -> dict:
    return {
        "id": i,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def target_tables(target_gguf: Path) -> tuple[list[str], list[int], list[str], int | None]:
    """(tokens, token types, merges, eos id) from a GGUF's metadata (engine/runtimes/gguf_meta.py: no tensors)."""
    from engine.runtimes.gguf_loader import open_meta

    meta = open_meta(target_gguf)

    def field(key: str, default: object = None) -> object:
        f = meta.fields.get(key)
        return default if f is None else f.contents()

    tokens = field("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or field("tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError(f"{target_gguf.name}: no byte-level BPE vocabulary to take a drafter's tokens from")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    eos = field("tokenizer.ggml.eos_token_id")
    return tokens, list(types), list(field("tokenizer.ggml.merges", [])), None if eos is None else int(eos)


def write_draft_tokenizer(folder: str | Path, target_gguf: str | Path) -> bool:
    """Write ``folder``'s tokenizer.json and tokenizer_config.json for its token map over ``target_gguf``'s
    vocabulary. Files already holding the same text are left alone (a rewrite would change their times, and
    ggml_runtime.cached_gguf would export the GGUF again). Whether anything was written."""
    folder, target_gguf = Path(folder), Path(target_gguf)
    tokens, types, merges, eos = target_tables(target_gguf)
    token_map = read_token_map(folder, len(tokens)).tolist()
    tokenizer, config = sub_vocab_files(token_map, tokens, types, merges, eos)
    wrote = False
    for name, data in (("tokenizer.json", tokenizer), ("tokenizer_config.json", config)):
        path, text = folder / name, json.dumps(data, ensure_ascii=False, indent=1) + "\n"
        try:
            if path.is_file() and path.read_text(encoding="utf-8") == text:
                continue
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        except OSError as exc:
            raise ModelLoadError(f"cannot write the drafter's {name} in {folder}: {exc.strerror or exc}") from None
        wrote = True
    return wrote


def tokenizer_matches(folder: Path, token_map: np.ndarray, target_tokenizer: object) -> bool:
    """Whether ``folder``'s tokenizer.json names, at every drafter index, the target's token of that index: the
    check at each load, without reading the target GGUF's 151k merges again."""
    lookup = getattr(getattr(target_tokenizer, "backend_tokenizer", None), "id_to_token", None)
    try:
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        names = {i: t for t, i in data["model"]["vocab"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    if lookup is None or len(names) != len(token_map) or names.get(0) != OTHER_TOKEN:
        return False
    return all(names.get(d) == lookup(int(t)) for d, t in enumerate(token_map) if d > 0)


__all__ = [
    "OTHER_TOKEN",
    "TOKEN_MAP",
    "check_weights",
    "is_mapped_draft",
    "read_token_map",
    "sub_vocab_files",
    "target_tables",
    "tokenizer_matches",
    "write_draft_tokenizer",
]
