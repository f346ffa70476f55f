"""Deterministic FIM prompts cut from Python files frozen under tests/data/lossless_corpus.

The files are copies of fimble's own modules at one commit, so every interpreter and every
machine draws the same prompts (an earlier version cut them from the running Python's stdlib,
which changes with the Python version).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "data" / "lossless_corpus"


def fim_prompts(n: int, seed: int = 0, window: int = 1200) -> list[tuple[str, str]]:
    """(prefix, suffix) pairs with the cursor at random places, some mid-line, some at line ends."""
    texts = [f.read_text() for f in sorted(CORPUS.glob("*.py.txt"))]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        text = rng.choice(texts)
        cut = rng.randrange(200, len(text) - 200)
        if rng.random() < 0.5:  # cursor at the start of a line's content
            line_start = text.rfind("\n", 0, cut) + 1
            cut = line_start + len(text[line_start:cut]) - len(text[line_start:cut].lstrip())
        end = text.find("\n", cut)
        end = len(text) if end == -1 else end
        out.append((text[max(0, cut - window): cut], text[end: end + window // 3]))
    return out


def pinned_tie_prompt() -> tuple[str, str]:
    """The prompt of the divergence seen on a clean clone (../shared/notes/lossless-repro.md)."""
    case = json.loads((CORPUS / "argparse_tie.json").read_text())
    return case["prefix"], case["suffix"]
