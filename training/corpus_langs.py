"""The non-Python part of the FIM corpus: source files from npm packages and Debian source packages.

    python -m training.corpus_langs --out DIR [--seed 0] [--scale 1.0] [--part-mib 4]

Built on a machine with the registries (the GPU machine reaches none): JavaScript and
TypeScript from installed npm packages (node_modules folders), Go from Debian's
``golang-1.19-src``, Rust from ``rust-src``, Java from ``openjdk-17-source`` (its src.zip),
C and C++ from the system headers (``/usr/include``, libc6-dev, linux-libc-dev, libstdc++).
Fetch the Debian ones first with ``apt-get download golang-1.19-src rust-src openjdk-17-source``
and ``dpkg -x`` each into ``--debian-root``.

Per language: files in sorted-path order, minified/generated files and exact duplicates
(whitespace-collapsed SHA-1) dropped, lines that look like HumanEval's dropped at file level,
then a seeded sample up to the language's character budget. A seeded 3% of each
language's files is held out (never trained on; bench/quality.py builds its per-language
cursor sets from them). Output: ``langs.jsonl.xz`` (one JSON object per file: lang, path,
text, held_out), cut into parts of at most ``--part-mib`` MiB for the device tool's
per-call transfer limit, and ``langs_manifest.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import random
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

from training.corpus import normalized_hash

REPO = Path(__file__).resolve().parent.parent
# LSP language ids (engine/model_info.py) -> budget in characters at --scale 1.
BUDGETS = {
    "javascript": 8_000_000,
    "typescript": 8_000_000,
    "go": 7_000_000,
    "rust": 5_000_000,
    "java": 5_000_000,
    "c": 3_500_000,
    "cpp": 3_500_000,
}
HELD_OUT_SHARE = 0.03
MIN_CHARS, MAX_CHARS = 300, 150_000


def _looks_generated(text: str) -> bool:
    """Minified bundles, source maps in text form, generated tables: long lines or few newlines."""
    lines = text.split("\n")
    if max(map(len, lines)) > 400 or len(text) / max(1, len(lines)) > 100:
        return True
    head = text[:2000].lower()
    return "do not edit" in head and "generated" in head


def _files(root: Path, suffixes: tuple[str, ...], exclude: re.Pattern | None = None) -> Iterator[tuple[str, str]]:
    if not root.is_dir():
        return
    for path in sorted(root.rglob("*")):
        name = path.name
        if not name.endswith(suffixes) or not path.is_file() or path.is_symlink():
            continue
        rel = str(path)
        if exclude and exclude.search(rel):
            continue
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if MIN_CHARS <= len(raw) <= MAX_CHARS and b"\0" not in raw:
            try:
                yield rel, raw.decode("utf-8")
            except UnicodeDecodeError:
                continue


def _cpp_headers(root: Path) -> Iterator[tuple[str, str]]:
    """libstdc++ headers: extensionless (<vector>) and .h/.tcc under include/c++."""
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and (path.suffix in ("", ".h", ".tcc", ".hpp")):
            try:
                raw = path.read_bytes()
                if MIN_CHARS <= len(raw) <= MAX_CHARS and b"\0" not in raw:
                    yield str(path), raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue


def _zip_files(zip_path: Path, suffix: str, include: re.Pattern) -> Iterator[tuple[str, str]]:
    if not zip_path.is_file():
        return
    with zipfile.ZipFile(zip_path) as z:
        for name in sorted(z.namelist()):
            if name.endswith(suffix) and include.search(name):
                raw = z.read(name)
                if MIN_CHARS <= len(raw) <= MAX_CHARS:
                    try:
                        yield f"{zip_path}!{name}", raw.decode("utf-8")
                    except UnicodeDecodeError:
                        continue


def sources(node_roots: list[Path], debian_root: Path) -> dict[str, Iterator[tuple[str, str]]]:
    node_skip = re.compile(r"(\.min\.|/dist/|/umd/|/bundle|/vendor/|\.d\.ts$|/test/fixtures/)")

    def node(suffixes: tuple[str, ...], skip: re.Pattern) -> Iterator[tuple[str, str]]:
        for root in node_roots:
            yield from _files(root, suffixes, skip)

    return {
        "javascript": node((".js", ".mjs", ".cjs", ".jsx"), node_skip),
        # .d.ts declarations are most of what npm ships as TypeScript; sources (.ts/.tsx) first.
        "typescript": _chain(
            node((".ts", ".tsx"), re.compile(r"(\.d\.ts$|/vendor/)")), node((".d.ts",), re.compile(r"/vendor/"))
        ),
        "go": _files(debian_root / "usr/share/go-1.19/src", (".go",), re.compile(r"/testdata/")),
        "rust": _files(debian_root / "usr/src", (".rs",), re.compile(r"/(tests|benches)/")),
        "java": _zip_files(
            debian_root / "usr/lib/jvm/openjdk-17/lib/src.zip",
            ".java",
            re.compile(r"^(java\.base|java\.net\.http|java\.sql|java\.logging)/"),
        ),
        "c": _files(Path("/usr/include"), (".h",), re.compile(r"/usr/include/(c\+\+|x86_64-linux-gnu/c\+\+)/")),
        "cpp": _cpp_headers(Path("/usr/include/c++")),
    }


def _chain(*its: Iterator) -> Iterator:
    for it in its:
        yield from it


def build(
    out: Path,
    node_roots: list[Path],
    debian_root: Path,
    seed: int,
    scale: float,
    part_mib: float,
    fingerprint_lines: set[str],
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    stats: dict = {}
    for lang, files in sources(node_roots, debian_root).items():
        seen: set[str] = set()
        kept: list[tuple[str, str]] = []
        st = {"seen": 0, "duplicates": 0, "generated": 0, "humaneval_like": 0}
        for path, text in files:
            st["seen"] += 1
            h = normalized_hash(text)
            if h in seen:
                st["duplicates"] += 1
                continue
            seen.add(h)
            if _looks_generated(text):
                st["generated"] += 1
                continue
            if sum(1 for ln in text.splitlines() if ln.strip() in fingerprint_lines) >= 2:
                st["humaneval_like"] += 1
                continue
            kept.append((path, text))
        rng = random.Random(f"{seed}/{lang}")
        rng.shuffle(kept)
        budget, total, chosen = BUDGETS[lang] * scale, 0, []
        for path, text in kept:
            if total >= budget:
                break
            chosen.append((path, text))
            total += len(text)
        n_held = max(2, round(len(chosen) * HELD_OUT_SHARE))
        for i, (path, text) in enumerate(chosen):
            rows.append({"lang": lang, "path": path, "text": text, "held_out": i < n_held})
        st.update(candidates=len(kept), files=len(chosen), chars=total, held_out=n_held)
        stats[lang] = st
        print(f"{lang}: {st}", flush=True)
    fields = {"seed": seed, "scale": scale, "budgets": BUDGETS, "stats": stats}
    return write_bundle(out, rows, part_mib, fields, preset=9 | lzma.PRESET_EXTREME)


def write_bundle(out: Path, rows: list[dict], part_mib: float, fields: dict, preset: int) -> dict:
    """``rows`` as xz-compressed JSON lines in parts of ``part_mib`` MiB, with the manifest ``read_parts`` checks
    (``fields`` first, then the parts and the whole blob's sha256). Returns the manifest."""
    blob = lzma.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), preset=preset)
    part = int(part_mib * 2**20)
    names = []
    for i in range(0, len(blob), part):
        name = f"langs.jsonl.xz.part{i // part:02d}"
        (out / name).write_bytes(blob[i : i + part])
        names.append(name)
    manifest = {**fields, "parts": names, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    (out / "langs_manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def split_bundles(folders: list[Path]) -> tuple[list[tuple[str, str]], dict[str, list[tuple[str, str]]], dict]:
    """The bundles' rows as (training files, held-out files by language, training files a language): the trainers'
    shared reading of ``--langs`` (training/qwen_fim_train.py, training/draft_distill.py)."""
    rows = [r for folder in folders for r in read_parts(folder)]
    train = [(r["path"], r["text"]) for r in rows if not r["held_out"]]
    held: dict[str, list[tuple[str, str]]] = {}
    for r in rows:
        if r["held_out"]:
            held.setdefault(r["lang"], []).append((r["path"], r["text"]))
    counts = {
        lang: sum(1 for r in rows if r["lang"] == lang and not r["held_out"]) for lang in {r["lang"] for r in rows}
    }
    return train, held, counts


def read_parts(folder: Path) -> list[dict]:
    """The rows of a bundle from its parts (checked against the manifest's sha256)."""
    manifest = json.loads((folder / "langs_manifest.json").read_text())
    blob = b"".join((folder / n).read_bytes() for n in manifest["parts"])
    if hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
        raise SystemExit(f"corpus_langs: parts in {folder} do not match the manifest")
    return [json.loads(line) for line in io.TextIOWrapper(io.BytesIO(lzma.decompress(blob)), encoding="utf-8")]


def main() -> None:
    from training.corpus import HumanEvalFilter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--node-root",
        type=Path,
        action="append",
        default=[REPO / "editors/vscode/node_modules", Path("/usr/lib/node_modules")],
    )
    ap.add_argument("--debian-root", type=Path, required=True, help="where the .deb packages were dpkg -x'ed")
    ap.add_argument("--humaneval", type=Path, default=REPO.parent / "shared/data/humaneval-infilling")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--part-mib", type=float, default=4.0)
    args = ap.parse_args()
    he = HumanEvalFilter.from_files(sorted(args.humaneval.glob("HumanEval-*.jsonl.gz")))
    m = build(args.out, args.node_root, args.debian_root, args.seed, args.scale, args.part_mib, he.fingerprint_lines)
    print(json.dumps({k: m[k] for k in ("parts", "bytes")}))


if __name__ == "__main__":
    main()
