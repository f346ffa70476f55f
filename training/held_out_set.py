"""The held-out cursor set of the FIM-tuned default, in every enabled language this machine has sources for.

    python -m training.held_out_set --out DIR --device-held heldout.jsonl.xz --train-files train_files.tsv.xz \
        [--debian-root DIR] [--registry-root DIR] [--per-lang 12] [--seed 0]

Writes a bundle in training/corpus_langs.py's format (``langs.jsonl.xz.partNN`` and ``langs_manifest.json``,
every row ``held_out``) for ``bench/quality.py --set held-out --held-out-langs DIR``.

Why these files were not trained on (models/qwen2.5-coder-0.5b-fim, training/qwen_fim_train.py):
- Python, C and C++ come from the adapter's own held-out split. Its corpus (training/qwen_fim_corpus.py
  ``gather``: the GPU machine's site-packages and standard library, sorted, seeded shuffle, seed 0) is
  deterministic; re-run on the GPU machine it gave the training report's every count (files seen, kept,
  dropped, held out, training files and characters per language, to the character), so its held-out part
  (``--device-held``, the 2% never trained on) is the one training left out. ``--train-files`` lists the
  training files with their whitespace-collapsed sha1 (training/corpus.py ``normalized_hash``).
- Every other file comes from this machine and is checked against those hashes (a copy of a training file
  is dropped and counted). The adapter was trained on Python, C, C++ and 6 JavaScript files (training report
  ``train_files``); for every other language it saw no file at all.
HumanEval-like files (a fingerprint line of the infilling sets) are dropped as the corpora do.

``--registry-root`` adds the enabled languages this machine has no source for, from registry packages fetched
by name (REGISTRY below; the adapter saw none of these languages). Under DIR, as the commands lay them out:
- ``deb/``: ``apt-get download libruby3.1 ocaml`` then ``dpkg -x PKG.deb deb`` (Ruby, OCaml);
- ``npm/NAME/``: ``npm pack expo-modules-core element-ui @react-navigation/stack @docusaurus/theme-classic``,
  each ``tar xzf NAME-VERSION.tgz -C npm/NAME-VERSION`` (Swift, Kotlin, Vue, TypeScript React);
- ``pypi/``: ``pip download --no-deps ziglang`` (its ``ziglang/lib/std`` unzipped into ``pypi/ziglang``) and
  ``pip download --no-deps --no-binary=:all: pythonnet`` (``tar xzf`` into ``pypi/pythonnet``) (Zig, C#);
- ``debsrc/SRC/``: Debian source packages (a deb-src entry in a private apt list, ``apt-get source -d
  elixir-lang xmonad-contrib r-cran-ggplot2 scala``), each orig tarball unpacked into ``debsrc/SRC`` (Elixir,
  Haskell, R, Scala).
HTML, JSON, Makefiles, Dockerfiles and PowerShell come from this machine (LOCAL).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import lzma
import random
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

from training.corpus import normalized_hash
from training.corpus_langs import write_bundle

REPO = Path(__file__).resolve().parent.parent
MIN_CHARS, MAX_CHARS = 300, 150_000
DEVICE_LANGS = ("python", "c", "cpp")  # from the adapter's own held-out split
DEVICE_SOURCE = "the adapter's held-out split (the GPU machine's site-packages and standard library)"
_NODE_SKIP = r"(\.min\.|/dist/|/umd/|/bundle|/vendor/|\.d\.ts$|/test/fixtures/)"
_SHEBANG = re.compile(rb"^#!\s*(/usr)?/bin/(env\s+)?(ba|da)?sh\b")

# language -> [(root, file suffixes or "shebang", exclude regex, licence)]; roots under {debian} are where
# `apt-get download golang-1.19-src rust-src openjdk-17-source` were `dpkg -x`ed (as training/corpus_langs.py).
# A suffix entry starting with "=" is a file-name pattern instead (fnmatch: "=Makefile", "=Dockerfile*").
LOCAL: dict[str, list[tuple[str, tuple[str, ...] | str, str | None, str]]] = {
    "cpp": [
        ("/usr/include/c++", ("", ".h", ".tcc"), None, "libstdc++ 12 headers: GPL-3.0 with the GCC runtime exception")
    ],
    "javascript": [
        (
            "/usr/lib/node_modules/npm",
            (".js", ".mjs", ".cjs"),
            _NODE_SKIP,
            "npm 11 and its dependencies: Artistic-2.0, ISC, MIT, BSD",
        )
    ],
    "typescript": [
        (
            "{vscode_modules}",
            (".ts", ".tsx"),
            _NODE_SKIP,
            "the VS Code extension's npm dependencies: MIT, BSD, Apache-2.0",
        )
    ],
    "go": [("{debian}/usr/share/go-1.19/src", (".go",), r"/testdata/", "Debian golang-1.19-src: BSD-3-Clause")],
    "rust": [("{debian}/usr/src", (".rs",), r"/(tests|benches)/", "Debian rust-src 1.63: MIT or Apache-2.0")],
    "java": [
        (
            "{debian}/usr/lib/jvm/openjdk-17/lib/src.zip",
            (".java",),
            None,
            "Debian openjdk-17-source: GPL-2.0 with the Classpath exception",
        )
    ],
    "lua": [
        ("/usr/share/nvim/runtime/lua", (".lua",), None, "Neovim 0.7.2 runtime (Debian): Apache-2.0 and Vim licence")
    ],
    "shellscript": [
        ("/usr/bin", "shebang", None, "Debian packages' shell scripts (various free licences)"),
        ("/usr/sbin", "shebang", None, "Debian packages' shell scripts (various free licences)"),
        ("/usr/lib/git-core", "shebang", None, "git: GPL-2.0"),
        ("/usr/share/doc/git/contrib", (".sh",), None, "git contrib: GPL-2.0"),
    ],
    "php": [
        (
            "/usr/lib/google-cloud-sdk/platform/google_appengine/php",
            (".php",),
            r"/tests?/",
            "Google App Engine PHP SDK: Apache-2.0",
        )
    ],
    "sql": [("/usr/share/postgresql/15", (".sql",), None, "PostgreSQL 15 extensions: PostgreSQL licence")],
    "cmake": [("/usr/share/cmake-3.25/Modules", (".cmake",), None, "CMake 3.25 modules: BSD-3-Clause")],
    "css": [
        ("/usr/lib/google-cloud-sdk", (".css",), None, "Google Cloud SDK: Apache-2.0"),
        ("/usr/share/source-highlight", (".css",), None, "source-highlight: GPL-3.0"),
    ],
    "yaml": [
        (
            "/usr/lib/google-cloud-sdk/lib/googlecloudsdk/command_lib",
            (".yaml", ".yml"),
            None,
            "Google Cloud SDK: Apache-2.0",
        )
    ],
    "html": [
        ("/usr/lib/google-cloud-sdk", (".html",), None, "Google Cloud SDK: Apache-2.0"),
        ("/usr/lib/node_modules/npm/docs", (".html",), None, "npm 11 documentation: Artistic-2.0"),
        ("/usr/share/doc/git", (".html",), None, "git documentation: GPL-2.0"),
    ],
    "json": [
        ("/usr/lib/google-cloud-sdk/lib", (".json",), None, "Google Cloud SDK: Apache-2.0"),
        (
            "/usr/lib/node_modules/npm",
            (".json",),
            _NODE_SKIP,
            "npm 11 and its dependencies: Artistic-2.0, ISC, MIT, BSD",
        ),
    ],
    "makefile": [
        ("/usr/share/doc", ("=Makefile", "=*.mk"), None, "Debian packages' examples (git GPL-2.0, xz, xmlsec, ...)"),
        (
            "/usr/lib/google-cloud-sdk/platform",
            ("=Makefile", "=*.mk"),
            None,
            "Google Cloud SDK's third party (MIT, BSD)",
        ),
        ("/usr/share/postgresql-common", ("=Makefile",), None, "postgresql-common: GPL-2.0"),
        ("/usr/lib/python3.11/config-3.11-x86_64-linux-gnu", ("=Makefile",), None, "CPython 3.11: PSF-2.0"),
    ],
    "dockerfile": [
        ("/usr/lib/google-cloud-sdk/platform/ext-runtime", ("=Dockerfile*",), None, "Google Cloud SDK: Apache-2.0"),
    ],
    "powershell": [
        ("/usr/lib/node_modules", (".ps1", ".psm1"), None, "npm 11 and corepack: Artistic-2.0, MIT"),
        ("/usr/lib/python3.11/venv", (".ps1",), None, "CPython 3.11 venv: PSF-2.0"),
    ],
}

# Languages with no source on this machine, from registry packages (the module's docstring says how
# --registry-root is filled): language -> [(root under {registry}, suffixes, exclude regex, licence)].
REGISTRY: dict[str, list[tuple[str, tuple[str, ...] | str, str | None, str]]] = {
    "ruby": [
        ("{registry}/deb/usr/lib/ruby", (".rb",), None, "Debian libruby3.1 (Ruby 3.1 stdlib): BSD-2-Clause or Ruby")
    ],
    "ocaml": [
        ("{registry}/deb/usr/lib/ocaml", (".ml",), None, "Debian ocaml 4.13 stdlib: LGPL-2.1 with the OCaml exception")
    ],
    "swift": [("{registry}/npm", (".swift",), r"/Tests?/", "npm expo-modules-core 58: MIT")],
    "kotlin": [("{registry}/npm", (".kt", ".kts"), r"/(test|androidTest)/", "npm expo-modules-core 58: MIT")],
    "vue": [("{registry}/npm", (".vue",), None, "npm element-ui 2.15: MIT")],
    "typescriptreact": [
        (
            "{registry}/npm",
            (".tsx",),
            r"/(__tests__|__fixtures__)/",
            "npm @react-navigation/stack 7, @docusaurus/theme-classic 3, expo-modules-core: MIT",
        )
    ],
    "zig": [("{registry}/pypi/ziglang", (".zig",), None, "PyPI ziglang 0.17 (Zig standard library): MIT")],
    "csharp": [("{registry}/pypi/pythonnet", (".cs",), r"(?i)/[^/]*test", "PyPI pythonnet 3.2 sdist: MIT")],
    "elixir": [
        ("{registry}/debsrc/elixir-lang", (".ex", ".exs"), r"/test/", "Debian source elixir-lang 1.14: Apache-2.0")
    ],
    "haskell": [
        ("{registry}/debsrc/xmonad-contrib", (".hs",), r"/tests/", "Debian source xmonad-contrib 0.17: BSD-3-Clause")
    ],
    "r": [("{registry}/debsrc/r-cran-ggplot2", (".R", ".r"), r"/tests/", "Debian source r-cran-ggplot2 3.4: MIT")],
    "scala": [("{registry}/debsrc/scala", (".scala",), r"/(test|tests)/", "Debian source scala 2.11: BSD-3-Clause")],
}


def _looks_generated(text: str) -> bool:
    lines = text.split("\n")
    if max(map(len, lines)) > 400 or len(text) / max(1, len(lines)) > 100:
        return True
    head = text[:2000].lower()
    return ("do not edit" in head and "generated" in head) or "autogenerated" in head


def _decode(raw: bytes) -> str | None:
    if not MIN_CHARS <= len(raw) <= MAX_CHARS or b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def local_files(root: Path, kind: tuple[str, ...] | str, exclude: str | None) -> list[tuple[str, Callable]]:
    """(path, read) for the files under ``root`` (a folder or a .zip), sorted by path; ``read()`` gives the
    text or None (binary, not UTF-8, out of the size range, or not a shell script). Only listed here: a file
    is read when the sample reaches it."""
    skip = re.compile(exclude) if exclude else None
    out: list[tuple[str, Callable]] = []
    if root.suffix == ".zip":
        if root.is_file():
            with zipfile.ZipFile(root) as z:
                names = [n for n in sorted(z.namelist()) if n.endswith(kind) and not (skip and skip.search(n))]

            def member(name: str) -> Callable:
                def read() -> str | None:
                    with zipfile.ZipFile(root) as z:
                        return _decode(z.read(name))

                return read

            out = [(f"{root}!{n}", member(n)) for n in names]
        return out
    if not root.is_dir():
        return out
    for path in sorted(root.rglob("*")):
        rel = str(path)
        if skip and skip.search(rel):
            continue
        if kind != "shebang" and not _kind_matches(path, kind):
            continue
        if not path.is_file() or path.is_symlink():
            continue
        out.append((rel, _reader(path, kind == "shebang")))
    return out


def _kind_matches(path: Path, kind: tuple[str, ...]) -> bool:
    names = [k[1:] for k in kind if k.startswith("=")]
    return path.suffix in kind or any(fnmatch.fnmatchcase(path.name, n) for n in names)


def _reader(path: Path, shebang: bool) -> Callable:
    def read() -> str | None:
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        if shebang and not _SHEBANG.match(raw[:64]):
            return None
        return _decode(raw)

    return read


def build(
    out: Path,
    device_rows: list[dict],
    train_hashes: set[str],
    fingerprint_lines: set[str],
    per_lang: int,
    seed: int,
    debian_root: Path | None,
    part_mib: float = 4.0,
    vscode_modules: Path = REPO / "editors/vscode/node_modules",
    registry_root: Path | None = None,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    stats: dict[str, dict] = {}
    by_lang: dict[str, list[tuple[str, Callable, str]]] = {}
    for r in device_rows:
        if r["lang"] in DEVICE_LANGS:
            by_lang.setdefault(r["lang"], []).append((r["path"], (lambda t=r["text"]: t), DEVICE_SOURCE))
    sources = [(lang, src) for lang, srcs in LOCAL.items() for src in srcs]
    sources += [(lang, src) for lang, srcs in REGISTRY.items() for src in srcs] if registry_root else []
    for lang, (root, kind, exclude, licence) in sources:
        if "{debian}" in root:
            if debian_root is None:
                continue
            root = root.replace("{debian}", str(debian_root))
        root = root.replace("{registry}", str(registry_root))
        root = root.replace("{vscode_modules}", str(vscode_modules))
        path = Path(root) if Path(root).is_absolute() else REPO / root
        for p, read in local_files(path, kind, exclude):
            by_lang.setdefault(lang, []).append((p, read, licence))
    for lang in sorted(by_lang):
        st = {"candidates": len(by_lang[lang]), "read": 0, "unusable": 0, "in_training": 0, "duplicates": 0}
        st.update(generated=0, humaneval_like=0)
        rng = random.Random(f"{seed}/{lang}")
        cands = list(by_lang[lang])
        rng.shuffle(cands)
        if lang == "cpp":  # the split's own C++ files first, then this machine's
            cands.sort(key=lambda c: c[2] != DEVICE_SOURCE)
        seen: set[str] = set()
        chosen = []
        for path, read, src in cands:  # in the seeded order, until the language has its files
            if len(chosen) >= per_lang:
                break
            st["read"] += 1
            text = read()
            if text is None:
                st["unusable"] += 1
                continue
            h = normalized_hash(text)
            if h in train_hashes:
                st["in_training"] += 1
                continue
            if h in seen:
                st["duplicates"] += 1
                continue
            seen.add(h)
            if _looks_generated(text):
                st["generated"] += 1
                continue
            if any(ln.strip() in fingerprint_lines for ln in text.splitlines()):
                st["humaneval_like"] += 1
                continue
            chosen.append((path, text, src))
        for path, text, src in chosen:
            rows.append({"lang": lang, "path": path, "text": text, "held_out": True, "source": src})
        st["files"] = len(chosen)
        st["sources"] = sorted({src for _p, _t, src in chosen})
        stats[lang] = st
        print(f"held_out_set: {lang}: {st}", flush=True)
    fields = {"what": "held-out files only (training/held_out_set.py)", "seed": seed, "per_lang": per_lang}
    return write_bundle(out, rows, part_mib, {**fields, "stats": stats}, preset=6)


def read_train_hashes(path: Path) -> set[str]:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return {line.split("\t", 1)[0] for line in f if line.strip()}


def main() -> None:
    from training.corpus import HumanEvalFilter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device-held", type=Path, required=True, help="the split's heldout.jsonl.xz")
    ap.add_argument("--train-files", type=Path, required=True, help="the split's train_files.tsv.xz (sha1 first)")
    ap.add_argument("--debian-root", type=Path)
    ap.add_argument("--registry-root", type=Path, help="registry packages for the languages with no source here")
    ap.add_argument(
        "--vscode-modules",
        type=Path,
        default=REPO / "editors/vscode/node_modules",
        help="the VS Code extension's node_modules (npm install in editors/vscode): TypeScript sources",
    )
    ap.add_argument("--humaneval", type=Path, default=REPO.parent / "shared/data/humaneval-infilling")
    ap.add_argument("--per-lang", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with lzma.open(args.device_held, "rt", encoding="utf-8") as f:
        device_rows = [json.loads(line) for line in f]
    he = HumanEvalFilter.from_files(sorted(args.humaneval.glob("HumanEval-*.jsonl.gz")))
    m = build(
        args.out,
        device_rows,
        read_train_hashes(args.train_files),
        he.fingerprint_lines,
        args.per_lang,
        args.seed,
        args.debian_root,
        vscode_modules=args.vscode_modules,
        registry_root=args.registry_root,
    )
    print(json.dumps({k: m[k] for k in ("parts", "bytes")}))


if __name__ == "__main__":
    main()
