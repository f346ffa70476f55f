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


# Code in four languages, from files that change rarely, so runs of different days type the same text.
# Python: the lossless corpus's snapshots of engine modules; TypeScript, JavaScript and Lua: fimble's own editor
# clients and their tests. The issue asks for cold prompts in >= 3 languages; one language would hide what a
# drafter (or n-gram) does on code unlike its training mix.
LANGUAGE_SOURCES: dict[str, tuple[str, str]] = {
    "python": ("tests/data/lossless_corpus", "*.py.txt"),
    "typescript": ("editors/vscode/src", "*.ts"),
    "lua": ("editors/nvim/lua", "**/*.lua"),
    "javascript": ("editors/vscode/test", "**/*.js"),
}  # in this order the typing loop takes one file of each
MIN_SOURCE_BYTES = 3000  # room for a 600-char lead, a cut and a 400-char suffix


def language_files(min_bytes: int = MIN_SOURCE_BYTES) -> dict[str, list[Path]]:
    """Each language's source files of at least ``min_bytes``, sorted; languages with none are left out."""
    out = {}
    for lang, (folder, pattern) in LANGUAGE_SOURCES.items():
        files = sorted(f for f in (REPO / folder).glob(pattern) if f.is_file() and f.stat().st_size >= min_bytes)
        if files:
            out[lang] = files
    return out


def corpus_files() -> list[str]:
    """Every language's source texts (the tokenizer check reads them)."""
    return [f.read_text() for files in language_files().values() for f in files]


COLD_MIDDLE_CHARS = 400  # code removed at the cursor: about 100 tokens, a few lines the model must write


def cold_prompts(n: int, seed: int, middle: int = COLD_MIDDLE_CHARS) -> list[tuple[str, str, str]]:
    """``n`` (language, prefix, suffix) cuts, the languages in turn. The prefix is up to 1,500 characters ending at
    a line start; then whole lines of at least ``middle`` characters are removed (the code a user is about to
    write, as HumanEval-infilling removes lines); the suffix is the next 500 characters.

    ``middle`` 0 puts the suffix right at the cut: a cursor where nothing is missing, whose best completion is
    empty, so the 96 timed tokens are mostly text past the model's end token (the bench before 2026-12-06)."""
    rng, by_lang, out = random.Random(seed), language_files(), []
    langs = list(by_lang)
    while len(out) < n:
        lang = langs[len(out) % len(langs)]
        text = rng.choice(by_lang[lang]).read_text()
        cut = text.find("\n", rng.randrange(600, len(text) - 400 - middle)) + 1
        resume = cut if middle <= 0 else text.find("\n", cut + middle) + 1 or len(text)
        out.append((lang, text[max(0, cut - 1500) : cut], text[resume : resume + 500]))
    return out


def typing_files(n: int) -> list[Path]:
    """Files to type into: the largest file of each language, then the next largest, languages in turn.
    Fixed files (not the engine's own, which change every week) keep the trace the same from run to run."""
    ranked = {lang: sorted(files, key=lambda f: -f.stat().st_size) for lang, files in language_files(4000).items()}
    out: list[Path] = []
    depth = 0
    while len(out) < n and any(depth < len(v) for v in ranked.values()):
        out += [v[depth] for v in ranked.values() if depth < len(v)]
        depth += 1
    return out[:n]
