"""FIM prompts: cut from Python files frozen under tests/data/lossless_corpus, and the decoding benchmarks' mix.

``fim_prompts`` is deterministic: the corpus files are copies of fimble's own modules at one commit, so every
interpreter and every machine draws the same prompts (an earlier version cut them from the running Python's
stdlib, which changes with the Python version).
"""

from __future__ import annotations

import gzip
import json
import random
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # bench/harness/ -> the repository
CORPUS = REPO / "tests" / "data" / "lossless_corpus"
HUMANEVAL = REPO.parent / "shared" / "data" / "humaneval-infilling" / "HumanEval-SingleLineInfilling.jsonl.gz"
REAL_FILES = ["json/encoder.py", "textwrap.py", "argparse.py", "csv.py", "dataclasses.py", "difflib.py"]


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
        out.append((text[max(0, cut - window) : cut], text[end : end + window // 3]))
    return out


def pinned_tie_prompt() -> tuple[str, str]:
    """The prompt of the divergence seen on a clean clone (../shared/notes/lossless-repro.md)."""
    case = json.loads((CORPUS / "argparse_tie.json").read_text())
    return case["prefix"], case["suffix"]


def mixed_prompts(n: int, seed: int) -> list[tuple[str, str, str]]:
    """(source, prefix, suffix): half HumanEval infilling (where ../shared/data has it), half cursors at line
    starts in real standard-library files (bench/vs_transformers.py, bench/runtimes.py)."""
    rng = random.Random(seed)
    out = []
    if HUMANEVAL.exists():
        rows = [json.loads(line) for line in gzip.open(HUMANEVAL, "rt")]
        for row in rng.sample(rows, n // 2):
            out.append(("humaneval", row["prompt"], row["suffix"]))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / f).read_text() for f in REAL_FILES if (stdlib / f).exists()]
    while len(out) < n:
        text = rng.choice(texts)
        cut = text.find("\n", rng.randrange(1000, len(text) - 1000)) + 1
        out.append(("file", text[max(0, cut - 1500) : cut], text[cut : cut + 500]))
    return out
