"""Cursor sets for bench/quality.py beyond HumanEval's single lines.

- block-body: multi-line cursors from the same HumanEval programs as the context-lines set: the
  cursor at the start of a compound statement's body (after ``header:`` and the line break,
  indentation typed), the whole body to fill; pass@1 runs the task's tests.
- held-out-<lang>: per trained language, cursors in files held out of training
  (training/corpus_langs.py's held-out rows; Python's come back from the GPU machine, see
  training/fim_lora.py): a statement start (cursor after a line's indentation, the line to
  fill), mid-line (the rest of a line), and a block body (after a line ending in ``{`` or ``:``,
  the lines up to the block's end). No tests exist for these: exact match and edit similarity.
"""

from __future__ import annotations

import json
import lzma
import random
import re
from pathlib import Path

HELD_OUT_KINDS = ("statement_start", "mid_line", "block_body")
WINDOW_BEFORE, WINDOW_AFTER = 4000, 1500  # characters of the file around the cursor
MAX_BODY_LINES = 8


def block_body_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """(cursor, body end) for Python compound statements whose header line ends in ':' within
    [start, end): the cursor after the body's first-line indentation, the body up to the last
    line indented deeper than the header (at most MAX_BODY_LINES lines)."""
    lines = text.split("\n")
    offsets, pos = [], 0
    for ln in lines:
        offsets.append(pos)
        pos += len(ln) + 1
    out = []
    for i, ln in enumerate(lines[:-1]):
        if not (start <= offsets[i] < end) or not ln.rstrip().endswith(":") or ln.lstrip().startswith("#"):
            continue
        indent = len(ln) - len(ln.lstrip())
        j = i + 1
        body_indent = len(lines[j]) - len(lines[j].lstrip())
        if not lines[j].strip() or body_indent <= indent:
            continue
        k = j
        while k + 1 < len(lines) and (
            not lines[k + 1].strip() or len(lines[k + 1]) - len(lines[k + 1].lstrip()) > indent
        ):
            k += 1
        while k > j and not lines[k].strip():
            k -= 1
        if k - j + 1 > MAX_BODY_LINES:
            continue
        out.append((offsets[j] + body_indent, offsets[k] + len(lines[k])))
    return out


def load_held_out(langs_dir: Path | None, python_file: Path | None) -> list[dict]:
    """Held-out rows {lang, path, text}, from the corpus_langs bundle and the Python file."""
    rows: list[dict] = []
    if langs_dir is not None and (langs_dir / "langs_manifest.json").is_file():
        from training.corpus_langs import read_parts

        rows += [r for r in read_parts(langs_dir) if r["held_out"]]
    if python_file is not None and python_file.is_file():
        with lzma.open(python_file, "rt", encoding="utf-8") as f:
            rows += [{**json.loads(line), "path": f"python/{i}"} for i, line in enumerate(f)]
    return rows


_WORD = re.compile(r"[A-Za-z_]\w*")


def _braced_block_end(text: str, open_pos: int) -> int | None:
    """End of the line before the brace that closes the block opened at ``open_pos``."""
    depth = 0
    for i in range(open_pos, min(len(text), open_pos + 4000)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text.rfind("\n", open_pos, i)
    return None


def held_out_cursors(row: dict, per_kind: int, rng: random.Random) -> list[dict]:
    """Up to ``per_kind`` cursors of each kind in one file: {kind, prefix, middle, suffix}."""
    text = row["text"]
    lines = text.split("\n")
    offsets, pos = [], 0
    for ln in lines:
        offsets.append(pos)
        pos += len(ln) + 1
    cands: dict[str, list[tuple[int, int]]] = {k: [] for k in HELD_OUT_KINDS}
    for i, ln in enumerate(lines):
        stripped = ln.strip()
        if len(stripped) < 8 or len(ln) > 160 or stripped.startswith(("//", "#", "*", "/*")):
            continue
        indent = len(ln) - len(ln.lstrip())
        start, end = offsets[i] + indent, offsets[i] + len(ln)
        cands["statement_start"].append((start, end))
        words = [m.start() for m in _WORD.finditer(ln, indent + 1) if m.start() > indent + 2]
        if words:
            cands["mid_line"].append((offsets[i] + rng.choice(words), end))
        if stripped.endswith(("{", ":")) and i + 1 < len(lines) and lines[i + 1].strip():
            nxt = lines[i + 1]
            body_start = offsets[i + 1] + len(nxt) - len(nxt.lstrip())
            if stripped.endswith("{"):
                close = _braced_block_end(text, offsets[i] + ln.rfind("{"))
                body_end = close if close is not None and close > body_start else None
            else:
                spans = [s for s in block_body_spans(text, offsets[i], offsets[i] + 1) if s[0] == body_start]
                body_end = spans[0][1] if spans else None
            if body_end is not None and text.count("\n", body_start, body_end) < MAX_BODY_LINES:
                cands["block_body"].append((body_start, body_end))
    out = []
    for kind, spans in cands.items():
        for a, b in rng.sample(spans, min(per_kind, len(spans))):
            out.append(
                {
                    "kind": kind,
                    "prefix": text[max(0, a - WINDOW_BEFORE) : a],
                    "middle": text[a:b],
                    "suffix": text[b : b + WINDOW_AFTER],
                }
            )
    return out


def held_out_sample(lp: list, limit: int | None) -> list:
    """One language's seeded sample of ``limit`` cursors (all of them, in order, without a limit; all of them
    in the sample's order when the language has no more). For limit >= 6 and len(lp) <= 85, random.sample
    draws from a pool, so a smaller limit's sample is the larger one's head: ``--held-out-from`` A with
    ``--limit`` B runs cursors A..B of the same order, and runs of [0, A) and [A, B) together are the sample
    of B (tests/training/test_held_out_set.py)."""
    return random.Random(0).sample(lp, min(limit, len(lp))) if limit else lp
