"""Training corpus: Python source found on the machine, deduplicated, HumanEval-like files removed.

Sources are the Python installation that runs this script (its stdlib and
site-packages) plus the system Python folders. Files are split into chunks of a
few thousand characters at line boundaries so a fill-in-the-middle sample fits
the model's context.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import site
import sysconfig
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

MIN_CHARS, MAX_CHARS = 200, 1_000_000


def source_roots() -> list[Path]:
    roots = [Path(p) for p in site.getsitepackages()]
    roots.append(Path(sysconfig.get_paths()["stdlib"]))
    for pattern in ("/usr/lib/python3*", "/usr/local/lib/python3*", "/usr/share/python3*"):
        roots.extend(Path("/").glob(pattern.lstrip("/")))
    seen: set[Path] = set()
    unique = []
    for r in roots:
        r = r.resolve()
        if r.is_dir() and r not in seen:
            seen.add(r)
            unique.append(r)
    return unique


def iter_python_files(roots: list[Path]) -> Iterator[Path]:
    seen: set[Path] = set()
    for root in roots:
        for path in root.rglob("*.py"):
            try:
                real = path.resolve()
            except OSError:
                continue
            if real not in seen and real.is_file():
                seen.add(real)
                yield real


def read_source(path: Path, min_chars: int = MIN_CHARS, max_chars: int = MAX_CHARS) -> str | None:
    """The file's UTF-8 text, or None for an unreadable, binary, too small or too large one."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if not min_chars <= len(raw) <= max_chars or b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def normalized_hash(text: str) -> str:
    """Hash with whitespace runs collapsed: copies that differ only in spacing count as one."""
    return hashlib.sha1(re.sub(r"\s+", " ", text).strip().encode()).hexdigest()


@dataclass
class HumanEvalFilter:
    """Drops files that resemble HumanEval: they define a problem's function, or share its lines."""

    entry_points: set[str] = field(default_factory=set)
    fingerprint_lines: set[str] = field(default_factory=set)

    @classmethod
    def from_files(cls, paths: list[Path]) -> HumanEvalFilter:
        f = cls()
        for path in paths:
            for line in gzip.open(path, "rt"):
                row = json.loads(line)
                f.entry_points.add(row["entry_point"])
                body = row["prompt"] + row["canonical_solution"] + row["suffix"]
                for src_line in body.splitlines():
                    s = src_line.strip()
                    # Long lines are specific to a problem; short ones ("return x") are not.
                    if len(s) >= 30:
                        f.fingerprint_lines.add(s)
        return f

    def resembles(self, text: str) -> bool:
        for name in re.findall(r"^\s*def\s+(\w+)\s*\(", text, flags=re.M):
            if name in self.entry_points:
                return True
        hits = 0
        for line in text.splitlines():
            if line.strip() in self.fingerprint_lines:
                hits += 1
                if hits >= 2:
                    return True
        return False


def split_chunks(text: str, rng: random.Random, min_chars: int = 1500, max_chars: int = 12000) -> list[str]:
    """Cut a file into consecutive chunks of random size at line boundaries."""
    lines = text.splitlines(keepends=True)
    chunks, current, size = [], [], 0
    target = rng.randint(min_chars, max_chars)
    for line in lines:
        current.append(line)
        size += len(line)
        if size >= target:
            chunks.append("".join(current))
            current, size = [], 0
            target = rng.randint(min_chars, max_chars)
    if current:
        chunks.append("".join(current))
    return chunks


def _load(path: Path) -> tuple[str, str] | None:
    text = read_source(path)
    return None if text is None else (str(path), text)


def collect(roots: list[Path], he_filter: HumanEvalFilter, workers: int = 16) -> tuple[list[str], dict]:
    """All unique, HumanEval-free source files, in a stable (sorted-path) order."""
    paths = sorted(iter_python_files(roots))
    stats = {"files_seen": len(paths), "unreadable_or_size": 0, "duplicates": 0, "humaneval_like": 0}
    texts: list[str] = []
    hashes: set[str] = set()
    with ProcessPoolExecutor(workers) as pool:
        for item in pool.map(_load, paths, chunksize=64):
            if item is None:
                stats["unreadable_or_size"] += 1
                continue
            _, text = item
            h = normalized_hash(text)
            if h in hashes:
                stats["duplicates"] += 1
                continue
            hashes.add(h)
            if he_filter.resembles(text):
                stats["humaneval_like"] += 1
                continue
            texts.append(text)
    stats["files_kept"] = len(texts)
    stats["chars_kept"] = sum(map(len, texts))
    return texts, stats
