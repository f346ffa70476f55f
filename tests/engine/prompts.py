"""Deterministic FIM prompts cut from real Python files of the running interpreter's stdlib."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

STDLIB_FILES = ["json/encoder.py", "textwrap.py", "argparse.py", "csv.py", "dataclasses.py", "shlex.py",
                "difflib.py", "fractions.py", "heapq.py", "bisect.py", "string.py", "fnmatch.py"]


def fim_prompts(n: int, seed: int = 0, window: int = 1200) -> list[tuple[str, str]]:
    """(prefix, suffix) pairs with the cursor at random places, some mid-line, some at line ends."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / f).read_text() for f in STDLIB_FILES if (stdlib / f).exists()]
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
