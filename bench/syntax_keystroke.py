"""Per-keystroke cost of the syntax layer: incremental reparse + cursor classification.

Builds a ~3,000-line Python file from real stdlib sources, then replays typing one character
at a time at many places in it, the way an auto-indenting, auto-pairing editor sends it. Each
keystroke is one `SyntaxDocument.apply_edit` (tree.edit + incremental parse; none when the key
types over an auto-inserted closer) followed by `classify` at the new cursor. The file is reset
(untimed) after each place.

    python -m bench.syntax_keystroke [--quick] [--json PATH] [--places N] [--seed S]

The last line printed is the headline: p95 ms per keystroke (target <= 2 ms).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sysconfig
import time
from pathlib import Path

from lsp_server.shaping.syntax.context import classify
from lsp_server.shaping.syntax.document import SyntaxDocument

TARGET_LINES = 3000
# What gets typed, key by key, by an editor that auto-indents and auto-pairs brackets and
# quotes (typing a closer over an auto-inserted one just moves the cursor). Newlines get the
# current line's indentation, plus one level after a trailing ":". Real editing shapes:
# statements, calls, f-strings, comments, a block opener, an argument added mid-line.
LINE_END_SNIPPETS = [
    "\nresult = self.compute(alpha, beta[0], gamma={'k': 1})",
    "\nif value is not None and len(items) > 2:\nreturn items",
    '\nmessage = f"{name}: {count(values)} items"  # summary',
    "\nfor key, val in sorted(mapping.items()):\nprint(key, val)",
    "\nwidth = max(len(line) for line in lines) + 2",
]
INLINE_SNIPPETS = [", extra=None", ", *args", " or default"]  # typed just before a `)`
PAIRS = {"(": ")", "[": "]", "{": "}", '"': '"', "'": "'"}
STDLIB_SOURCES = ["textwrap.py", "argparse.py", "configparser.py", "shlex.py", "dataclasses.py", "typing.py"]


class Editor:
    """Minimal auto-indenting, auto-pairing editor over a SyntaxDocument."""

    def __init__(self, doc: SyntaxDocument, cursor: int) -> None:
        self.doc, self.cursor = doc, cursor

    def type(self, ch: str) -> None:
        data, pos = self.doc.bytes, self.cursor
        nxt = data[pos : pos + 1].decode("latin-1")
        if ch in ")]}\"'" and nxt == ch:
            self.cursor += 1  # type over the auto-inserted closer: no edit
            return
        if ch == "\n":
            start = data.rfind(b"\n", 0, pos) + 1
            line = data[start:pos].decode("utf-8")
            indent = line[: len(line) - len(line.lstrip())]
            if line.rstrip().endswith(":"):
                indent += "    "
            self._insert("\n" + indent, len(("\n" + indent).encode()))
            return
        prev = data[pos - 1 : pos].decode("latin-1")
        if ch in PAIRS and not (ch in "\"'" and (prev.isalnum() and prev not in "fFrRbB")):
            self._insert(ch + PAIRS[ch], 1)
            return
        self._insert(ch, len(ch.encode()))

    def _insert(self, text: str, advance: int) -> None:
        self.doc.apply_edit(self.cursor, self.cursor, text)
        self.cursor += advance


def build_source(lines: int = TARGET_LINES) -> str:
    """Concatenate real stdlib modules until the file holds at least `lines` lines."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for name in STDLIB_SOURCES:
        path = stdlib / name
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        parts.append(text)
        total += text.count("\n")
        if total >= lines:
            break
    if total < lines:
        raise SystemExit(f"not enough stdlib source found under {stdlib}")
    kept = "".join(parts).split("\n")[:lines]
    return "\n".join(kept) + "\n"


def pick_places(doc: SyntaxDocument, count: int, rng: random.Random) -> list[tuple[int, str]]:
    """(byte offset, snippet): code line ends for statements, spots before `)` for arguments."""
    data = doc.bytes
    line_ends = []
    call_ends = []
    start = 0
    for line in data.split(b"\n"):
        end = start + len(line)
        code = line.strip()
        if code and not code.startswith((b"#", b"@")) and code[-1:] not in b"\\,([{\"'":
            line_ends.append(end)
            if code.endswith(b")") and b"#" not in line and b'"' not in line and b"'" not in line:
                call_ends.append(end - 1)
        start = end + 1
    places = []
    for _ in range(count):
        if rng.random() < 0.75:
            places.append((rng.choice(line_ends), rng.choice(LINE_END_SNIPPETS)))
        else:
            places.append((rng.choice(call_ends), rng.choice(INLINE_SNIPPETS)))
    return places


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run(places: int, seed: int) -> dict:
    source = build_source()
    t0 = time.perf_counter()
    doc = SyntaxDocument("python", source)
    full_parse_ms = (time.perf_counter() - t0) * 1000
    rng = random.Random(seed)
    reparse, classify_ms, total = [], [], []
    for place, snippet in pick_places(doc, places, rng):
        editor = Editor(doc, place)
        for ch in snippet:
            t0 = time.perf_counter()
            editor.type(ch)
            t1 = time.perf_counter()
            classify(doc, editor.cursor)
            t2 = time.perf_counter()
            reparse.append((t1 - t0) * 1000)
            classify_ms.append((t2 - t1) * 1000)
            total.append((t2 - t0) * 1000)
        doc.set_text(source)  # restore, untimed
    assert doc.bytes == source.encode("utf-8")

    def summary(values: list[float]) -> dict:
        return {
            "p50": percentile(values, 0.50),
            "p95": percentile(values, 0.95),
            "p99": percentile(values, 0.99),
            "max": max(values),
            "mean": statistics.fmean(values),
        }

    return {
        "lines": source.count("\n"),
        "bytes": len(source.encode("utf-8")),
        "places": places,
        "keystrokes": len(total),
        "full_parse_ms": full_parse_ms,
        "reparse_ms": summary(reparse),
        "classify_ms": summary(classify_ms),
        "keystroke_ms": summary(total),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer places (well under 60 s)")
    parser.add_argument("--places", type=int, default=None, help="typing places (default 800, quick 200)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    places = args.places or (200 if args.quick else 800)
    res = run(places, args.seed)

    print(f"file: {res['lines']} lines, {res['bytes']} bytes; full parse {res['full_parse_ms']:.2f} ms")
    print(f"{res['keystrokes']} keystrokes at {res['places']} places")
    print(f"{'stage':<22}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}  (ms)")
    for key, label in (
        ("reparse_ms", "incremental reparse"),
        ("classify_ms", "classify"),
        ("keystroke_ms", "keystroke total"),
    ):
        s = res[key]
        print(f"{label:<22}{s['p50']:>9.3f}{s['p95']:>9.3f}{s['p99']:>9.3f}{s['max']:>9.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    p95 = res["keystroke_ms"]["p95"]
    print(f"p95 keystroke (reparse + classify): {p95:.3f} ms (target <= 2 ms: {'PASS' if p95 <= 2 else 'FAIL'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
