"""Completion quality on HumanEval infilling: execution-based pass@1, exact match, parse errors.

    python -m bench.quality [--quick] [--set single-line|random-span|context-lines|block-body|held-out,...|both|all]
                            [--variants raw,policy] [--sweep] [--procs N] [--json PATH]

Sets (from /work/shared/data/humaneval-infilling, or --data DIR):
- single-line:   HumanEval single-line infilling (the cursor on an empty line, one line asked).
- random-span:   HumanEval random-span infilling (light): a span anywhere, possibly many lines.
- context-lines: derived from the same programs and tests, because the two sets above put the
  cursor almost only at statement starts: per task, one cursor in each of comment, docstring
  (string), import, attribute chain, call arguments, parameters and mid-statement (where the
  program has one), the rest of the line to fill. Pass@1 in comments and docstrings only says
  the program still runs; exact match and edit similarity carry the quality there.
- block-body:    multi-line cursors from the same programs: a compound statement's whole body
  (cursor after the header's line break and the body's indentation), tests run (bench/cursor_sets.py).
- held-out:      only when named (--set held-out --held-out-langs DIR [--held-out-python FILE]):
  per trained language, statement-start, mid-line and block-body cursors in files held out of
  training (training/corpus_langs.py, training/fim_lora.py); raw and lsp variants (lsp: the file opened
  with its language id), no tests: exact match and edit similarity. --limit applies per language
  (--held-out-from A runs a language's sample from its A-th cursor: a long run in pieces).
- multi-line, random-span-x2: only when named; derived from the same 164 programs with the published
  HumanEval infilling rules (seeded), since those files are not in the data folder: up to 4 spans of 2-6
  whole lines per solution (the cursor on the emptied line, as single-line; 468 problems), and 2 random
  character spans per solution (328).
--no-newline-heal measures the older healing rule; --template forces a template (or prefix-only).

Variants:
- raw:    the engine alone: greedy, 96 tokens, one line for single-line/context-lines (the task
          asks for one line), no line limit for random-span; the text is used as it comes.
- policy: lsp_server.shaping.policy.decide() on the cursor's syntax context picks the DecodeOptions; the
          streamed text goes through lsp_server.shaping.shaper.CompletionShaper (bracket guard, then
          validate_completion + fit_to_line_rest) and what it shows is what is scored. Sets
          that ask for one line cap every decision at one line (as an editor's maxLines would).
- lsp:    through a real `fimble lsp` per worker (default settings, or --lsp-settings), as an editor drives
          it: the document opened, one invoked inlineCompletion, the stream's final shown text applied
          over [position, replaceEnd); the resulting document runs the tests (Python sets only). A request
          right after opening is the cold window's (engine/caching/cold_window.py: ~16 lines around the
          cursor) wherever the full prompt would prefill over its budget; --lsp-full-prompt runs every
          request on its full prompt instead, as once the pre-warm has filled the document's cache. Each
          record says whether the cold window served it (cold) and what the engine prefilled.
past|r: the share of shown answers that run past the middle (the whole middle, then more non-blank
text) or re-type the suffix (retype or repLn below).
--sweep adds every candidate in CANDIDATES: the policy with one group of contexts changed
(temperature, gamma, confidence gate, line rules), run only on that group's problems; its JSON
has the per-candidate, per-context table the defaults in lsp_server/shaping/policy.py were chosen from.

Cursor documents: single-line problems are classified as an editor sees them, on the empty line
auto-indented like the previous line (one level more after a `:`); the model gets exactly the
dataset's prompt and suffix in every variant, so raw and policy answer the same question.

Metrics, per set, variant and cursor context: pass@1 (prompt + completion + suffix + tests run in
a sandboxed subprocess: isolated mode, temp dir, memory and CPU limits, timeout), exact match,
edit similarity (difflib ratio against the canonical middle), shown (non-empty); noErr: the share
of shown completions that add no parse error by CPython's own parser (the program parses, or
its first error is the one the program without the completion has; random spans also accept a
first error after the inserted text, a fill that stops early); parses: the stricter share whose
whole program parses (a fill that leaves a pre-existing break in place fails it); mean accepted
tokens per verify step and decode ms per token after the first (the prompt's prefill is left
out: variants of one problem share its KV cache). The shaper's Python stage enforces a rule
like noErr's, so for Python that share is high by construction (other languages rely on the
tree-sitter checks of validate_completion alone).
Suffix re-typing (shown completions, any language): retype: the share that re-types the text after
the cursor by lsp_server.shaping.syntax.suffix_overlap's rules (the rule the shaper cuts by, so 0 for policy by
construction; raw shows what the model does); repLn: the looser share with any line of 10+
non-space characters equal to one of the next 10 non-blank lines (an upper bound: it also counts a
line that legitimately recurs, e.g. `return None` in two branches).
Exact match keeps leading whitespace (indentation is syntax in Python). The last line is the headline.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import gzip
import json
import multiprocessing as mp
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

DATA = REPO.parent / "shared" / "data" / "humaneval-infilling"
SETS = {
    "single-line": "HumanEval-SingleLineInfilling.jsonl.gz",
    "random-span": "HumanEval-RandomSpanInfillingLight.jsonl.gz",
}
ALL_SETS = ("single-line", "random-span", "context-lines", "block-body")
EXTRA_SETS = ("held-out", "multi-line", "random-span-x2")  # only when asked for
# multi-line and random-span-x2: the published HumanEval multi-line and full random-span sets are not in
# the data folder (only single-line and random-span light are), so both are derived from the same 164
# programs with the published rules, seeded: 2 spans of 2-6 whole lines inside each canonical solution
# (up to 4, the cursor on an emptied line, as single-line), and 2 random character spans inside each solution.
DERIVED_PER_TASK = 2
MULTI_LINE_PER_TASK = 4  # at most: many solutions have few lines
RAW_MAX_TOKENS = 96
LINE_KINDS = ("comment", "string", "import", "attribute_chain", "call_args", "parameters", "mid_statement")

# Context groups the sweep varies together, and the candidates tried for each. A candidate row
# is an override row (lsp_server.shaping.policy field -> value) applied to every context of its group.
GROUPS = {
    "prose": ("comment", "string"),
    "code-line": ("import", "attribute_chain", "call_args", "parameters", "mid_statement"),
    "block": ("block_start", "block_body", "top_level"),
}
_SAMPLED = {
    "t0.2": {"temperature": 0.2, "top_p": 0.95},
    "t0.3": {"temperature": 0.3, "top_p": 0.95},
    "t0.7": {"temperature": 0.7, "top_p": 0.95},
}
CANDIDATES: dict[str, dict[str, dict]] = {
    "prose": {
        "greedy-g2": {"gamma": 2},
        "greedy-g4": {"gamma": 4},
        "greedy-g8": {"gamma": 8},
        "gate0.3": {"confidence_gate": 0.3},
        **_SAMPLED,
    },
    "code-line": {"greedy-g2": {"gamma": 2}, "greedy-g4": {"gamma": 4}, "greedy-g8": {"gamma": 8}, **_SAMPLED},
    "block": {
        "greedy-g4": {"gamma": 4},
        "greedy-g8": {"gamma": 8},
        "t0.2": _SAMPLED["t0.2"],
        "t0.7": _SAMPLED["t0.7"],
        "one-line": {"multiline": False},
        "multi-nostop": {"stop": ()},
        "multi-3": {"max_lines": 3},
    },
}


# -- problems ------------------------------------------------------------------------------------
@dataclass
class Problem:
    set: str
    task_id: str
    prompt: str  # what the model gets before the cursor
    suffix: str  # ... and after it
    middle: str  # the canonical fill
    join: str  # put between the completion and the suffix in the program ("\n" for single-line)
    test: str
    entry_point: str
    doc_text: str  # the editor's document (validation): completion goes in at `cursor`
    cursor: int  # UTF-8 byte offset
    ctx_text: str  # the document the cursor context is classified in (auto-indent for single-line)
    ctx_cursor: int
    one_line: bool  # the task asks for one line
    viable_prefix: bool  # parse-ok rule: a partial fill is legitimate (random spans)
    context: str = ""  # filled by classify_problems
    mid_line: bool = False
    lang: str = "python"
    max_lines: int = 0  # raw variant's line cap where the task is not one line (0: none)

    @property
    def has_tests(self) -> bool:
        return bool(self.test)

    def program(self, middle: str) -> str:
        return self.prompt + middle + self.join + self.suffix

    def runnable(self, middle: str) -> str:
        return self.program(middle) + "\n" + self.test + f"\ncheck({self.entry_point})\n"


def load_rows(name: str, data_dir: Path) -> list[dict]:
    path = data_dir / SETS[name]
    if not path.exists():
        sys.exit(f"quality: {path} not found (pass --data DIR)")
    return [json.loads(line) for line in gzip.open(path, "rt")]


def _nbytes(s: str) -> int:
    return len(s.encode("utf-8"))


def single_line_problems(rows: list[dict]) -> list[Problem]:
    out = []
    for r in rows:
        p, s = r["prompt"], r["suffix"]
        lines = [ln for ln in p.split("\n") if ln.strip()]
        prev = lines[-1] if lines else ""
        indent = prev[: len(prev) - len(prev.lstrip())] + ("    " if prev.rstrip().endswith(":") else "")
        out.append(
            Problem(
                "single-line",
                r["task_id"],
                p,
                s,
                r["canonical_solution"].rstrip("\n"),
                "\n",
                r["test"],
                r["entry_point"],
                p + "\n" + s,
                _nbytes(p),
                p + indent + "\n" + s,
                _nbytes(p + indent),
                one_line=True,
                viable_prefix=False,
            )
        )
    return out


def random_span_problems(rows: list[dict]) -> list[Problem]:
    return [
        Problem(
            "random-span",
            r["task_id"],
            r["prompt"],
            r["suffix"],
            r["canonical_solution"],
            "",
            r["test"],
            r["entry_point"],
            r["prompt"] + r["suffix"],
            _nbytes(r["prompt"]),
            r["prompt"] + r["suffix"],
            _nbytes(r["prompt"]),
            one_line=False,
            viable_prefix=True,
        )
        for r in rows
    ]


_CURSOR_SPOTS = re.compile(r"(?<=\w\.)(?=\w)|\((?=[^)\s])|#\s*\w+ |(?:import|from) |(?:=|return|\+|-|\*|if|in) |\w+ ")


def context_line_problems(rows: list[dict]) -> list[Problem]:
    """One rest-of-line problem per (task, context kind), from the single-line set's programs."""
    from lsp_server.shaping.syntax import SyntaxDocument, classify

    programs: dict[str, dict] = {}
    for r in rows:
        base = r["task_id"].split("/")[2]
        programs.setdefault(base, r)
    out = []
    for base, r in sorted(programs.items(), key=lambda kv: int(kv[0])):
        text = r["prompt"] + r["canonical_solution"] + r["suffix"]
        doc = SyntaxDocument("python", text)
        spots: dict[str, list[int]] = defaultdict(list)
        for m in _CURSOR_SPOTS.finditer(text):
            pos = m.end()
            eol = text.find("\n", pos)
            rest = text[pos : eol if eol >= 0 else len(text)]
            if not rest.strip() or len(rest) > 80:
                continue
            kind = classify(doc, _nbytes(text[:pos])).kind.value
            if kind in LINE_KINDS:
                spots[kind].append(pos)
        rng = random.Random(f"context-lines/{base}")
        for kind in LINE_KINDS:
            if not spots[kind]:
                continue
            pos = rng.choice(spots[kind])
            eol = text.find("\n", pos)
            eol = len(text) if eol < 0 else eol
            prompt, middle, suffix = text[:pos], text[pos:eol], text[eol:]
            out.append(
                Problem(
                    "context-lines",
                    f"ContextLines/HumanEval/{base}/{kind}",
                    prompt,
                    suffix,
                    middle,
                    "",
                    r["test"],
                    r["entry_point"],
                    prompt + suffix,
                    _nbytes(prompt),
                    prompt + suffix,
                    _nbytes(prompt),
                    one_line=True,
                    viable_prefix=False,
                )
            )
    return out


def block_body_problems(rows: list[dict]) -> list[Problem]:
    """One multi-line problem per program: a compound statement's whole body inside the solution."""
    from bench.harness.cursor_sets import block_body_spans

    programs: dict[str, dict] = {}
    for r in rows:
        programs.setdefault(r["task_id"].split("/")[2], r)
    out = []
    for base, r in sorted(programs.items(), key=lambda kv: int(kv[0])):
        text = r["prompt"] + r["canonical_solution"] + r["suffix"]
        sol_start = len(r["prompt"]) - len(r["prompt"].split("\n")[-1])
        spans = block_body_spans(text, sol_start, len(r["prompt"]) + len(r["canonical_solution"]))
        if not spans:
            continue
        a, b = random.Random(f"block-body/{base}").choice(spans)
        prompt, middle, suffix = text[:a], text[a:b], text[b:]
        out.append(
            Problem(
                "block-body",
                f"BlockBody/HumanEval/{base}",
                prompt,
                suffix,
                middle,
                "",
                r["test"],
                r["entry_point"],
                prompt + suffix,
                _nbytes(prompt),
                prompt + suffix,
                _nbytes(prompt),
                one_line=False,
                viable_prefix=True,
                max_lines=middle.count("\n") + 1,
            )
        )
    return out


def _programs(rows: list[dict]) -> list[tuple[str, dict, int, int]]:
    """(task number, row, solution start, solution end) per HumanEval program (its first single-line row)."""
    programs: dict[str, dict] = {}
    for r in rows:
        programs.setdefault(r["task_id"].split("/")[2], r)
    out = []
    for base, r in sorted(programs.items(), key=lambda kv: int(kv[0])):
        out.append((base, r, len(r["prompt"]), len(r["prompt"]) + len(r["canonical_solution"])))
    return out


def multi_line_problems(rows: list[dict]) -> list[Problem]:
    """Whole-line spans of 2-6 lines inside each canonical solution, the cursor on an emptied line."""
    out = []
    for base, r, _a, _b in _programs(rows):
        text = r["prompt"] + r["canonical_solution"] + r["suffix"]
        # The solution's lines: from the line that holds the first single-line hole of this program.
        sol_start = len(r["prompt"]) - len(r["prompt"].split("\n")[-1])
        sol_end = len(text.rstrip())  # the L0 row's prompt is the header and docstring; the rest is the solution
        starts = [i for i in range(sol_start, sol_end) if (i == 0 or text[i - 1] == "\n")]
        starts = [i for i in starts if text[i : text.find("\n", i)].strip()]
        rng = random.Random(f"multi-line/{base}")
        seen = set()
        for _ in range(MULTI_LINE_PER_TASK * 8):
            if len(seen) >= MULTI_LINE_PER_TASK or len(starts) < 2:
                break
            k = rng.randrange(len(starts) - 1)
            n = rng.randint(2, 6)
            last = min(len(starts) - 1, k + n - 1)
            if last == k or (k, last) in seen:
                continue
            seen.add((k, last))
            a = starts[k]
            b = text.find("\n", starts[last])
            b = len(text) if b < 0 else b
            prompt, middle, suffix = text[:a], text[a:b], text[b + 1 :]
            first = middle.split("\n")[0]
            indent = first[: len(first) - len(first.lstrip())]
            tid = f"MultiLine/HumanEval/{base}/{k}-{last}"
            out.append(
                Problem(
                    "multi-line",
                    tid,
                    prompt,
                    suffix,
                    middle,
                    "\n",
                    r["test"],
                    r["entry_point"],
                    prompt + "\n" + suffix,
                    _nbytes(prompt),
                    prompt + indent + "\n" + suffix,
                    _nbytes(prompt + indent),
                    one_line=False,
                    viable_prefix=True,
                    max_lines=middle.count("\n") + 1,
                )
            )
    return out


def random_span_x2_problems(rows: list[dict]) -> list[Problem]:
    """Random character spans inside each canonical solution (the published random-span rule)."""
    out = []
    for base, r, _a, _b in _programs(rows):
        text = r["prompt"] + r["canonical_solution"] + r["suffix"]
        sol_start = len(r["prompt"]) - len(r["prompt"].split("\n")[-1])
        sol_end = len(text.rstrip())  # everything after the L0 row's prompt is the solution
        rng = random.Random(f"random-span-x2/{base}")
        for i in range(DERIVED_PER_TASK):
            a = rng.randrange(sol_start, sol_end - 1)
            b = rng.randrange(a + 1, sol_end)
            prompt, middle, suffix = text[:a], text[a:b], text[b:]
            out.append(
                Problem(
                    "random-span-x2",
                    f"RandomSpanX2/HumanEval/{base}/{i}",
                    prompt,
                    suffix,
                    middle,
                    "",
                    r["test"],
                    r["entry_point"],
                    prompt + suffix,
                    _nbytes(prompt),
                    prompt + suffix,
                    _nbytes(prompt),
                    one_line=False,
                    viable_prefix=True,
                )
            )
    return out


def held_out_problems(langs_dir: Path | None, python_file: Path | None, per_kind: int = 1) -> list[Problem]:
    """Cursors in files held out of training, per language (no tests: exact match, edit similarity)."""
    from bench.harness.cursor_sets import held_out_cursors, load_held_out

    out = []
    for row in load_held_out(langs_dir, python_file):
        rng = random.Random(f"held-out/{row['lang']}/{row['path']}")
        for i, c in enumerate(held_out_cursors(row, per_kind, rng)):
            pre, mid, suf = c["prefix"], c["middle"], c["suffix"]
            one = c["kind"] != "block_body"
            p = Problem(
                f"held-out-{row['lang']}",
                f"HeldOut/{row['lang']}/{row['path']}/{c['kind']}/{i}",
                pre,
                suf,
                mid,
                "",
                "",
                "",
                pre + suf,
                _nbytes(pre),
                pre + suf,
                _nbytes(pre),
                one_line=one,
                viable_prefix=not one,
                context=c["kind"],
                mid_line=c["kind"] == "mid_line",
                lang=row["lang"],
                max_lines=0 if one else mid.count("\n") + 1,
            )
            out.append(p)
    return out


def classify_problems(problems: list[Problem]) -> None:
    from lsp_server.shaping.syntax import SyntaxDocument, classify

    for p in problems:
        if p.set.startswith("held-out-"):
            continue  # context is the cursor kind; other languages' grammars are not needed here
        ctx = classify(SyntaxDocument("python", p.ctx_text), p.ctx_cursor)
        p.context, p.mid_line = ctx.kind.value, not ctx.at_line_end


def load_problems(
    sets: list[str],
    data_dir: Path,
    limit: int | None,
    held_langs: Path | None = None,
    held_python: Path | None = None,
    held_from: int = 0,
) -> list[Problem]:
    single = load_rows("single-line", data_dir)
    out: list[Problem] = []
    for name in sets:
        if name == "single-line":
            probs = single_line_problems(single)
        elif name == "random-span":
            probs = random_span_problems(load_rows("random-span", data_dir))
        elif name == "block-body":
            probs = block_body_problems(single)
        elif name == "multi-line":
            probs = multi_line_problems(single)
        elif name == "random-span-x2":
            probs = random_span_x2_problems(single)
        elif name == "held-out":
            from bench.harness.cursor_sets import held_out_sample

            probs = held_out_problems(held_langs, held_python)
            if limit or held_from:  # the limit applies per language
                by_lang = defaultdict(list)
                for p in probs:
                    by_lang[p.set].append(p)
                probs = [p for lp in by_lang.values() for p in held_out_sample(lp, limit)[held_from:]]
            out.extend(probs)
            continue
        else:
            probs = context_line_problems(single)
        if limit and limit < len(probs):
            probs = random.Random(0).sample(probs, limit)
        out.extend(probs)
    classify_problems(out)
    return out


# -- variants ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    name: str
    policy: bool  # False: raw
    group: str | None = None  # sweep candidates: only problems in this context group
    row: tuple = ()  # sweep candidates: the override row, as sorted items


def variants_for(names: list[str], sweep: bool) -> list[Variant]:
    out = [Variant(n, n == "policy") for n in names]
    if sweep:
        for group, cands in CANDIDATES.items():
            for cname, row in cands.items():
                out.append(Variant(f"{group}:{cname}", True, group, tuple(sorted(row.items()))))
    return out


def options_for(p: Problem, v: Variant):
    """(DecodeOptions, decision dict or None) for a problem under a variant; None if not run."""
    from engine.decoding.speculative import DecodeOptions
    from lsp_server.shaping.policy import DEFAULTS, MID_LINE_ONE_LINE, ONE_LINE_CONTEXTS, decide_for_context

    seed = zlib.crc32(f"{p.task_id}/{v.name}".encode())
    if not v.policy:
        return DecodeOptions(max_tokens=RAW_MAX_TOKENS, max_lines=1 if p.one_line else p.max_lines, seed=seed), None
    if p.set.startswith("held-out-"):
        return None  # raw only: the policy's contexts need each language's grammar
    overrides = None
    if v.group is not None:
        if p.context not in GROUPS[v.group]:
            return None
        row = dict(v.row)
        overrides = {ctx: row for ctx in GROUPS[v.group]}
        # A group row never lifts the mid-line rule (the one-line row in comments, strings, imports).
        overrides["mid_line"] = dict(MID_LINE_ONE_LINE if p.context in ONE_LINE_CONTEXTS else DEFAULTS["mid_line"])
    decision = decide_for_context(p.context, mid_line=p.mid_line, overrides=overrides)
    if p.one_line:
        decision = replace(decision, multiline=False)
    return decision.to_options(seed=seed), decision.to_dict()


# -- running -------------------------------------------------------------------------------------
_ENGINE = None
_PASS_CACHE: dict[int, bool] = {}


def _init_worker(
    model: str | None,
    threads: int,
    newline_heal: bool = True,
    template: str | None = None,
    line_in_middle: bool = True,
    anchor_lines: int = 0,
) -> None:
    global _ENGINE
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    from engine.local import open_engine

    # --device (FIMBLE_QUALITY_DEVICE): cuda runs the compact runtime there (a GGUF's weights dequantised to
    # float32), not the CPU default's llama.cpp kernels: a few greedy answers may differ from the CPU's.
    device = os.environ.get("FIMBLE_QUALITY_DEVICE", "cpu")
    _ENGINE = open_engine(model, use_draft=True, start_thread=False, template=template, device=device)
    _ENGINE.prompts.newline_healing = newline_heal  # engine/decoding/healing.py; off only to measure the older rule
    _ENGINE.prompts.line_in_middle = line_in_middle  # engine/caching/prompt_plan.py; off only to measure it
    _ENGINE.prompts.anchor_lines = anchor_lines  # the anchored layout, as after typing that many lines


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (10, 10))


def passes(program: str, timeout: float = 10.0) -> bool:
    """Run a program in a throwaway directory; True when it exits 0 in time."""
    key = zlib.crc32(program.encode()) ^ (len(program) << 32)
    if key in _PASS_CACHE:
        return _PASS_CACHE[key]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", program],
                cwd=tmp,
                capture_output=True,
                timeout=timeout,
                preexec_fn=_limits,
                env={"PATH": os.environ.get("PATH", "")},
            )
            ok = proc.returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
    _PASS_CACHE[key] = ok
    return ok


def parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError):
        return False


_LINE_REF = re.compile(r"on line (\d+)")


def _first_error(source: str) -> tuple[int, str, int | None] | None:
    """CPython's first syntax error: (char offset, message without line refs, line it blames)."""
    try:
        ast.parse(source)
        return None
    except (SyntaxError, ValueError) as exc:
        if not isinstance(exc, SyntaxError) or exc.lineno is None:
            return 0, str(exc), None
        lines = source.split("\n")
        at = sum(len(ln) + 1 for ln in lines[: exc.lineno - 1]) + max(0, (exc.offset or 1) - 1)
        m = _LINE_REF.search(exc.msg or "")
        return at, _LINE_REF.sub("on line N", exc.msg or ""), int(m.group(1)) if m else None


def adds_no_parse_error(p: Problem, shown: str) -> bool:
    """Does inserting `shown` leave CPython's first syntax error where it was without it?

    True when the program parses, or its first error is the one the program without the
    completion has (same place and message, mapped past the inserted text, and not blamed on
    an inserted line). Random spans also accept a first error after the inserted text: a fill
    that stops early leaves the rest of the span missing (a viable prefix). Independent of
    tree-sitter; the shaper's own Python stage (lsp_server/shaping/shaper.py) applies a similar rule.
    """
    new = _first_error(p.program(shown))
    if new is None:
        return True
    pos, msg, blamed = new
    lo, hi = len(p.prompt), len(p.prompt) + len(shown)
    first = p.prompt.count("\n") + 1
    inserted = shown.count("\n")
    if blamed is not None and first <= blamed <= first + inserted and shown.strip():
        return False
    if lo < pos < hi:
        return False
    if p.viable_prefix and pos >= hi:
        return True
    base = _first_error(p.program(""))
    if base is None:
        return False
    mapped = pos - len(shown) if pos >= hi else pos
    mblamed = blamed - inserted if blamed is not None and blamed > first + inserted else blamed
    return (mapped, msg, mblamed) == base


def shape_and_score(p: Problem, text: str, shape: bool, known: dict | None = None) -> dict:
    """What the editor would show for engine output `text`, and its scores.

    `known`: an earlier record of the same output; its pass result is reused when the shown
    text has not changed (running the tests is most of the cost of a rescore)."""
    shown, cut = text, None
    if shape:
        from lsp_server.shaping.shaper import CompletionShaper
        from lsp_server.shaping.syntax import SyntaxDocument

        shaped = CompletionShaper(SyntaxDocument("python", p.doc_text), p.cursor, snapshot=False).finish(text)
        shown, cut = shaped.text, shaped.cut_reason
    elif p.one_line:
        shown = shown.split("\n")[0]
    same = known is not None and known.get("shown") == shown and "pass" in known
    python = p.lang == "python" and p.has_tests
    if same:
        passed = known["pass"]
    else:
        passed = passes(p.runnable(shown)) if p.has_tests else None
    retype = rep_line = None
    if shown.strip():
        from lsp_server.shaping.syntax.suffix_overlap import repeats_a_suffix_line, suffix_overlap_cut, text_after

        data = p.doc_text.encode("utf-8")
        line_prefix = data[data.rfind(b"\n", 0, p.cursor) + 1 : p.cursor].decode("utf-8", errors="replace")
        after = text_after(data, p.cursor)
        retype = suffix_overlap_cut(shown, line_prefix, after) is not None
        rep_line = repeats_a_suffix_line(shown, line_prefix, after)
    return {
        "shown": shown,
        "cut": cut,
        "pass": passed,
        "retypes_suffix": retype,
        "repeats_suffix_line": rep_line,
        "runs_past": runs_past(p, shown),
        "exact": shown.rstrip() == p.middle.rstrip(),  # indentation counts in Python
        "edit_sim": difflib.SequenceMatcher(None, shown.strip(), p.middle.strip()).ratio(),
        "is_shown": bool(shown.strip()),
        "parse_ok": adds_no_parse_error(p, shown) if shown.strip() and python else None,
        "parses": parses(p.program(shown)) if python else None,
    }


def run_one(job: tuple[int, Problem, str, object, bool]) -> dict:
    from engine.api import CompletionRequest

    job_id, p, variant, opts, shape = job
    # Completions remembered by the n-gram drafter would let a variant draft from another
    # variant's answer to the same problem: every job starts with none.
    # Held-out files are dense: a window can exceed a small model's context, so it is trimmed to fit.
    request = CompletionRequest(p.prompt, p.suffix, opts, truncate=p.set.startswith("held-out-"))
    _ENGINE.drafters(request)[1].recent.clear()  # the request's n-gram drafter (engine/scheduler.py Drafters)
    t0 = time.perf_counter()
    result = _ENGINE.complete(request)
    ms = (time.perf_counter() - t0) * 1e3
    s = result.stats
    return {
        "job": job_id,
        "set": p.set,
        "task_id": p.task_id,
        "variant": variant,
        "context": p.context,
        "mid_line": p.mid_line,
        "raw_text": result.text,
        "ms": ms,
        "tokens": result.tokens,
        "decode_ms": s["total_ms"] - s["first_token_ms"],
        "steps": s["steps"],
        "accepted": s["accepted"],
        "drafted": s["drafted"],
        **shape_and_score(p, result.text, shape),
    }


# -- through fimble lsp --------------------------------------------------------------------------
# The "lsp" variant: each worker runs one `fimble lsp` over stdio with the default settings, as an editor
# launches it (the VS Code and Neovim clients advertise completionDelta streaming, so this client does too).
# Per problem: the editor's document opened (a single-line or multi-line hole is an emptied line with the
# cursor after its auto-indentation), one invoked textDocument/inlineCompletion, and the final shown text
# (the stream's `done` text over [position, replaceEnd), else the answer's item) applied to the document as
# the editor applies it; that document runs the tests.
_LSP: dict = {}
# Held-out documents: the file's name as an editor would have it (the server reads the languageId; the name is
# for what the logs show).
_LSP_FILE_NAMES = {
    "python": "x.py",
    "c": "x.c",
    "cpp": "x.cpp",
    "cmake": "x.cmake",
    "css": "x.css",
    "go": "x.go",
    "java": "X.java",
    "javascript": "x.js",
    "javascriptreact": "x.jsx",
    "typescript": "x.ts",
    "typescriptreact": "x.tsx",
    "lua": "x.lua",
    "php": "x.php",
    "rust": "x.rs",
    "shellscript": "x.sh",
    "sql": "x.sql",
    "yaml": "x.yaml",
    "csharp": "X.cs",
    "ruby": "x.rb",
    "kotlin": "X.kt",
    "swift": "x.swift",
    "scala": "X.scala",
    "r": "x.R",
    "haskell": "X.hs",
    "dart": "x.dart",
    "elixir": "x.ex",
    "julia": "x.jl",
    "ocaml": "x.ml",
    "html": "x.html",
    "vue": "x.vue",
    "json": "x.json",
    "dockerfile": "Dockerfile",
    "makefile": "Makefile",
    "powershell": "x.ps1",
    "zig": "x.zig",
}


def _utf16_pos(text: str, offset: int) -> dict:
    before = text[:offset]
    line = before.count("\n")
    col = before[before.rfind("\n") + 1 :]
    return {"line": line, "character": len(col.encode("utf-16-le")) // 2}


def _offset(text: str, pos: dict) -> int:
    lines = text.split("\n")
    start = sum(len(ln) + 1 for ln in lines[: pos["line"]])
    line = lines[pos["line"]] if pos["line"] < len(lines) else ""
    units, i = 0, 0
    while i < len(line) and units < pos["character"]:
        units += 2 if ord(line[i]) > 0xFFFF else 1
        i += 1
    return start + i


def _lsp_init(model: str | None, settings: dict, full_prompt: bool = False) -> None:
    import asyncio

    from bench import lsp_latency as lat

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    cmd = [sys.executable, "-m", "lsp_server", "lsp"] + (["--model", model] if model else [])
    log = open(os.devnull, "wb")
    env = dict(os.environ)
    if full_prompt:  # the cold window never serves: every request runs its full prompt
        env["FIMBLE_COLD_BUDGET_S"] = "3600"

    async def start():
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            cwd=str(REPO),
            env=env,
            limit=1 << 26,
        )
        rpc = lat.RpcClient(proc)
        deltas: dict[int, dict] = {}
        rpc.on_notification = lambda m, p, _t: (
            deltas.__setitem__(p["requestId"], p) if m == "fimble/completionDelta" and p.get("done") else None
        )
        await rpc.call(
            "initialize",
            {
                "processId": os.getpid(),
                "rootUri": None,
                "capabilities": {
                    "general": {"positionEncodings": ["utf-16"]},
                    "textDocument": {"inlineCompletion": {"dynamicRegistration": True}},
                    "experimental": {"fimble": {"completionDelta": True, "status": True, "replaceStart": True}},
                },
                "initializationOptions": settings,
            },
            timeout=300,
        )
        rpc.notify("initialized", {})
        t0 = time.time()
        while (await rpc.call("fimble/stats", None, timeout=300))["engine"].get("state") != "ready":
            if time.time() - t0 > 600:
                raise RuntimeError("quality: the fimble lsp engine did not start")
            await asyncio.sleep(0.2)
        return proc, rpc, deltas

    proc, rpc, deltas = loop.run_until_complete(start())
    _LSP.update(loop=loop, proc=proc, rpc=rpc, deltas=deltas, n=0, full_prompt=full_prompt)


async def _engine_counters() -> dict:
    got = await _LSP["rpc"].call("fimble/stats", None, timeout=300)
    return (got.get("engine") or {}).get("counters") or {}


async def _lsp_complete(p: Problem) -> tuple[str, int, int, str | None]:
    """(shown text, start offset, end offset in the document, finish reason) for one problem."""
    import asyncio

    rpc, deltas = _LSP["rpc"], _LSP["deltas"]
    _LSP["n"] += 1
    doc = p.ctx_text
    cursor = len(p.ctx_text.encode("utf-8")[: p.ctx_cursor].decode("utf-8"))
    name = _LSP_FILE_NAMES.get(p.lang, f"x.{p.lang}")
    uri = f"file:///tmp/fimble-quality/{_LSP['n']}/{re.sub(r'[^A-Za-z0-9_.-]', '_', p.task_id)}/{name}"
    before = await _engine_counters()
    rpc.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": p.lang, "version": 1, "text": doc}})
    pos = _utf16_pos(doc, cursor)
    req_id, fut = rpc.request(
        "textDocument/inlineCompletion", {"textDocument": {"uri": uri}, "position": pos, "context": {"triggerKind": 1}}
    )
    msg = await asyncio.wait_for(fut, 600)
    items = ((msg.get("result") or {}).get("items")) or []
    text, start, end, reason = "", None, None, None
    if items:
        rng = items[0].get("range", {})
        text, start, end = items[0]["insertText"], rng.get("start"), rng.get("end")
    # The stream's end carries the final shaped text. Every request gets one done (lsp_server/PROTOCOL.md), and
    # one answered without a decode (a language the model does not complete: finishReason "disabled", nothing to
    # complete, no model) gets it before its response, so it is here already. An empty or error response with no
    # done yet ends the wait too: a server from before that rule sent none (120 s a cursor made a 32-language run
    # look hung), and this one sends it later only for a decode past its request budget with no text. A non-empty
    # answer waits for its decode's end, 120 s at most (a safety net).
    t0 = time.time()
    while req_id not in deltas and items and time.time() - t0 < 120:
        await asyncio.sleep(0.01)
    done = deltas.pop(req_id, None)
    if done is not None:  # as the VS Code extension applies it: [replaceStart or position, replaceEnd)
        text, end, reason = done["text"], done.get("replaceEnd"), done.get("finishReason")
        start = done.get("replaceStart")
    # Whether the cold window (engine/caching/cold_window.py) served it, and what the engine prefilled meanwhile.
    after = await _engine_counters()
    _LSP["cold"], _LSP["prefilled"] = (after.get(k, 0) - before.get(k, 0) for k in ("cold_prompts", "tokens_prefilled"))
    rpc.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
    end_off = _offset(doc, end) if end else cursor
    # A range may start before the cursor on its line (a dedent over the auto-indentation: lsp_server/line_start.py)
    start_off = min(cursor, _offset(doc, start)) if start else cursor
    return text, start_off, max(cursor, end_off), reason


def run_one_lsp(job: tuple[int, Problem, str, object, bool]) -> dict:
    job_id, p, variant, _opts, _shape = job
    t0 = time.perf_counter()
    text, a, b, reason = _LSP["loop"].run_until_complete(_lsp_complete(p))
    cursor = len(p.ctx_text.encode("utf-8")[: p.ctx_cursor].decode("utf-8"))
    ms = (time.perf_counter() - t0) * 1e3
    doc = p.ctx_text[:a] + text + p.ctx_text[b:]
    rec = {
        "job": job_id,
        "set": p.set,
        "task_id": p.task_id,
        "variant": variant,
        "context": p.context,
        "mid_line": p.mid_line,
        "raw_text": text,
        "ms": ms,
        "tokens": 0,
        "decode_ms": 0.0,
        "steps": 0,
        "accepted": 0,
        "drafted": 0,
        "finish": reason,
        "replaced": p.ctx_text[a:b],
    }
    rec.update(cold=_LSP["cold"], prefilled=_LSP["prefilled"])
    # Held-out cursors have no tests: the answer is exact where it rewrites [a, b) as the file has it (the
    # indentation it replaced, the middle, the suffix text it re-typed over).
    want = p.ctx_text[a:cursor] + p.middle + p.ctx_text[cursor:b] if p.set.startswith("held-out-") else None
    rec.update(score_document(p, text, doc, line_start=a < cursor, want=want))
    return rec


def score_document(p: Problem, shown: str, doc: str, line_start: bool = False, want: str | None = None) -> dict:
    """Scores of an answer applied to the editor's document (the lsp variant). ``line_start``: the answer
    replaced the cursor line's auto-indentation (its text holds the line's own indentation). ``want``: the
    text the answer's range holds in the original file, where given (exact match against it)."""
    if want is not None:
        exact = shown.rstrip() == want.rstrip()
    else:
        exact = shown.rstrip() == p.middle.rstrip() if line_start else _norm_exact(p, shown)
    passed = passes(doc + "\n" + p.test + f"\ncheck({p.entry_point})\n") if p.has_tests else None
    retype = rep_line = None
    if shown.strip():
        from lsp_server.shaping.syntax.suffix_overlap import repeats_a_suffix_line, suffix_overlap_cut, text_after

        data = p.ctx_text.encode("utf-8")
        line_prefix = data[data.rfind(b"\n", 0, p.ctx_cursor) + 1 : p.ctx_cursor].decode("utf-8", errors="replace")
        after = text_after(data, p.ctx_cursor)
        retype = suffix_overlap_cut(shown, line_prefix, after) is not None
        rep_line = repeats_a_suffix_line(shown, line_prefix, after)
    return {
        "shown": shown,
        "cut": None,
        "pass": passed,
        "retypes_suffix": retype,
        "repeats_suffix_line": rep_line,
        "runs_past": runs_past(p, shown),
        "exact": exact,
        "is_shown": bool(shown.strip()),
        "edit_sim": difflib.SequenceMatcher(None, shown.strip(), p.middle.strip()).ratio(),
        "parse_ok": None,
        "parses": parses(doc) if p.lang == "python" and p.has_tests else None,
    }


def _norm_exact(p: Problem, shown: str) -> bool:
    # The cursor sits after the emptied line's auto-indentation: the answer starts after it.
    want = p.middle.lstrip(" \t") if p.ctx_text != p.doc_text else p.middle
    return shown.rstrip() == want.rstrip()


def runs_past(p: Problem, shown: str) -> bool:
    """The answer holds the whole middle and then writes on (more non-blank text after it)."""
    got, want = "".join(shown.split()), "".join(p.middle.split())
    return bool(want) and got.startswith(want) and len(got) > len(want)


def rescore(records: list[dict], problems: list[Problem]) -> list[dict]:
    """Re-shape and re-score stored engine outputs with the current shaper and metrics."""
    by_id = {p.task_id: p for p in problems}
    out = []
    for i, r in enumerate(records, 1):
        out.append({**r, **shape_and_score(by_id[r["task_id"]], r["raw_text"], r["variant"] != "raw", r)})
        if i % 2000 == 0:
            print(f"  {i}/{len(records)} rescored", file=sys.stderr, flush=True)
    return out


def run_jobs(
    jobs: list,
    procs: int,
    model: str | None,
    newline_heal: bool = True,
    template: str | None = None,
    line_in_middle: bool = True,
    anchor_lines: int = 0,
    lsp_settings: dict | None = None,
    lsp_full_prompt: bool = False,
) -> list[dict]:
    done: list[dict] = []
    t0 = time.time()
    if lsp_settings is not None:
        if procs <= 1:
            _lsp_init(model, lsp_settings, lsp_full_prompt)
            results = map(run_one_lsp, jobs)
            pool = None
        else:
            pool = mp.get_context("spawn").Pool(procs, _lsp_init, (model, lsp_settings, lsp_full_prompt))
            results = pool.imap_unordered(run_one_lsp, jobs, chunksize=1)
    elif procs <= 1:
        _init_worker(model, 1, newline_heal, template, line_in_middle, anchor_lines)
        results = map(run_one, jobs)
        pool = None
    else:
        pool = mp.get_context("spawn").Pool(
            procs, _init_worker, (model, 1, newline_heal, template, line_in_middle, anchor_lines)
        )
        results = pool.imap_unordered(run_one, jobs, chunksize=2)
    for i, r in enumerate(results, 1):
        done.append(r)
        if i % 100 == 0 or i == len(jobs):
            print(f"  {i}/{len(jobs)} completions ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    if pool is not None:
        pool.close()
        pool.join()
    return done


# -- aggregation ---------------------------------------------------------------------------------
def summarize(rs: list[dict]) -> dict:
    n = len(rs)
    if not n:
        return {"problems": 0}
    shown = [r for r in rs if r["is_shown"]]
    steps = sum(r["steps"] for r in rs)
    tested = [r for r in rs if r["pass"] is not None]
    checked = [r for r in shown if r["parse_ok"] is not None]  # Python programs only
    return {
        "problems": n,
        "pass@1": sum(r["pass"] for r in tested) / len(tested) if tested else None,
        "exact_match": sum(r["exact"] for r in rs) / n,
        "edit_sim": sum(r["edit_sim"] for r in rs) / n,
        "shown": len(shown) / n,
        "shown_n": len(shown),
        "shown_parse_ok_n": sum(1 for r in checked if r["parse_ok"]),
        "shown_parse_ok": (sum(1 for r in checked if r["parse_ok"]) / len(checked)) if checked else None,
        "shown_program_parses": (sum(1 for r in checked if r["parses"]) / len(checked)) if checked else None,
        "shown_retypes_suffix_n": sum(1 for r in shown if r.get("retypes_suffix")),
        "shown_retypes_suffix": sum(1 for r in shown if r.get("retypes_suffix")) / len(shown) if shown else None,
        "shown_repeats_suffix_line": (
            sum(1 for r in shown if r.get("repeats_suffix_line")) / len(shown) if shown else None
        ),
        "runs_past_or_repeats": (
            sum(1 for r in shown if r.get("runs_past") or r.get("retypes_suffix") or r.get("repeats_suffix_line"))
            / len(shown)
        )
        if shown
        else None,
        "runs_past": (sum(1 for r in shown if r.get("runs_past")) / len(shown)) if shown else None,
        "mean_accepted": (sum(r["accepted"] for r in rs) + steps) / steps if steps else 0.0,
        "ms_per_token": sum(r["decode_ms"] for r in rs) / max(1, sum(r["tokens"] - 1 for r in rs if r["tokens"])),
        "mean_ms": sum(r["ms"] for r in rs) / n,
    }


def by(rs: list[dict], *keys: str) -> dict:
    out: dict = defaultdict(list)
    for r in rs:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def _fmt(v) -> str:
    return "    -" if v is None else f"{v:5.3f}"


def print_table(title: str, rows: list[tuple[str, ...]], stats: list[dict]) -> None:
    print(f"\n{title}")
    print(
        f"{'':44s} {'n':>5s} {'pass@1':>6s} {'exact':>6s} {'edit':>6s} {'shown':>6s} {'noErr':>6s} "
        f"{'parses':>6s} {'retype':>6s} {'repLn':>6s} {'past|r':>6s} {'acc/st':>6s} {'ms/tok':>6s}"
    )
    for label, s in zip(rows, stats, strict=True):
        print(
            f"{' '.join(label):44s} {s['problems']:5d} {_fmt(s['pass@1']):>6s} {_fmt(s['exact_match']):>6s} "
            f"{_fmt(s['edit_sim']):>6s} {_fmt(s['shown']):>6s} {_fmt(s['shown_parse_ok']):>6s} "
            f"{_fmt(s.get('shown_program_parses')):>6s} {_fmt(s.get('shown_retypes_suffix')):>6s} "
            f"{_fmt(s.get('shown_repeats_suffix_line')):>6s} {_fmt(s.get('runs_past_or_repeats')):>6s} "
            f"{s['mean_accepted']:6.2f} {s['ms_per_token']:6.1f}"
        )


def choose(candidates: dict[str, dict], rows: dict[str, dict]) -> str:
    """The candidate a group's defaults should take, by the rule lsp_server/shaping/policy.py states.

    Eligible: pass@1 not below the current defaults' ('policy') and shown parse-ok >= 99%.
    Greedy candidates differ only in speed (lossless decoding: same text), so the greedy pick is
    the fastest (decode ms per token; ties keep the current defaults). A sampled candidate (one seed per
    problem) replaces it only when it is at least a point better on pass@1 or exact match and
    no worse on the other: a gain of a problem or two is within sampling noise, and greedy is
    deterministic (the same context gives the same suggestion, so type-through stays valid).
    """
    base = candidates["policy"]["pass@1"]

    def eligible(name: str) -> bool:
        s = candidates[name]
        return bool(s.get("problems")) and s["pass@1"] >= base and (s["shown_parse_ok"] or 1.0) >= 0.99

    def sampled(name: str) -> bool:
        return rows.get(name, {}).get("temperature", 0) > 0

    names = [n for n in candidates if eligible(n)] or ["policy"]
    greedy = [n for n in names if not sampled(n)] or ["policy"]
    # Ties (same decode ms per token to 0.1 ms) keep the current defaults.
    pick = min(
        greedy, key=lambda n: (round(candidates[n]["ms_per_token"], 1), n != "policy", -candidates[n]["mean_accepted"])
    )
    for n in names:
        s, g = candidates[n], candidates[pick]
        gain = max(s["pass@1"] - g["pass@1"], s["exact_match"] - g["exact_match"])
        if sampled(n) and gain >= 0.01 and s["pass@1"] >= g["pass@1"] and s["exact_match"] >= g["exact_match"]:
            pick = n
    return pick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a random sample of 20 problems per set")
    ap.add_argument(
        "--set", default="all", help=f"comma-separated sets ({', '.join([*ALL_SETS, *EXTRA_SETS])}), 'both' or 'all'"
    )
    ap.add_argument("--held-out-langs", type=Path, help="training/corpus_langs.py output folder (held-out rows)")
    ap.add_argument("--held-out-python", type=Path, help="heldout_python.jsonl.xz from training/fim_lora.py")
    ap.add_argument(
        "--held-out-from",
        type=int,
        default=0,
        metavar="A",
        help="held-out: skip the first A cursors of each language's seeded sample (run --limit B in pieces)",
    )
    ap.add_argument(
        "--variants",
        default="raw,policy",
        help="comma-separated: raw, policy, lsp (through `fimble lsp`, as an editor drives it)",
    )
    ap.add_argument("--sweep", action="store_true", help="also run every policy candidate (CANDIDATES)")
    ap.add_argument("--limit", type=int, help="problems per set (default: all; 20 with --quick)")
    ap.add_argument("--model")
    ap.add_argument("--template", help="FIM template name, or prefix-only (default: detected)")
    ap.add_argument(
        "--no-newline-heal",
        action="store_true",
        help="the older healing rule: a prefix ending in a line break is not healed (to measure it)",
    )
    ap.add_argument(
        "--no-line-in-middle",
        action="store_true",
        help="PSM models: keep the cursor's line in the prefix, as before (to measure the layout)",
    )
    ap.add_argument(
        "--anchor-lines",
        type=int,
        default=0,
        metavar="K",
        help="PSM models: the anchored layout, K lines above the cursor's line after the middle "
        "sentinel, as after typing them (engine/caching/prompt_plan.py; to measure its cost)",
    )
    ap.add_argument(
        "--lsp-settings",
        default="{}",
        help="the lsp variant's initializationOptions as JSON (default: none, the server's defaults)",
    )
    ap.add_argument(
        "--lsp-full-prompt",
        action="store_true",
        help="lsp variant: every request runs its full prompt (the server's FIMBLE_COLD_BUDGET_S set past any "
        "prompt), as a request does once the pre-warm has filled the document's cache; by default the first "
        "request after opening is the cold window's (engine/caching/cold_window.py), which sees ~16 lines",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="raw/policy variants' engine device (cuda: the compact runtime on the GPU, float32; lsp: always CPU)",
    )
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument(
        "--procs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="worker processes, one engine and one torch thread each",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--reuse",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="raw records of earlier --json runs OF THE SAME MODEL are taken for the same problems instead of "
        "running them again (greedy: the same text); marked reused in this run's JSON",
    )
    ap.add_argument(
        "--rescore",
        type=Path,
        metavar="JSON",
        help="no model: re-shape and re-score the engine outputs stored in an earlier --json",
    )
    args = ap.parse_args()

    sets = list(ALL_SETS) if args.set == "all" else list(SETS) if args.set == "both" else args.set.split(",")
    unknown = [x for x in sets if x not in (*ALL_SETS, *EXTRA_SETS)]
    if unknown:
        sys.exit(f"quality: unknown set(s) {unknown}")
    limit = args.limit or (20 if args.quick else None)
    os.environ["FIMBLE_QUALITY_DEVICE"] = args.device  # read by each worker's _init_worker
    t0 = time.time()
    if args.rescore:
        old = json.loads(args.rescore.read_text())
        records = old["records"]
        sets = [s for s in ALL_SETS if s in {r["set"] for r in records}]
        problems = load_problems(sets, args.data, None)
        records = rescore(records, problems)
        report(records, problems, sets, old.get("decisions", {}), bool(old.get("candidates")), t0, args.json)
        return
    problems = load_problems(sets, args.data, limit, args.held_out_langs, args.held_out_python, args.held_out_from)
    variants = variants_for([v for v in args.variants.split(",") if v], args.sweep)
    # One job per distinct (problem, options, shaping): candidates that leave a problem's options
    # as the policy has them reuse the policy's result.
    jobs, wanted = [], []  # wanted: (problem index, variant, job key)
    index: dict[tuple, int] = {}
    decisions: dict[str, dict] = {}
    for i, p in enumerate(problems):
        for v in variants:
            got = options_for(p, v)
            if got is None:
                continue
            opts, decision = got
            if decision is not None:
                decisions.setdefault(f"{v.name}/{p.context}{'/mid_line' if p.mid_line else ''}", decision)
            key = (i, repr(replace(opts, seed=None) if opts.temperature == 0 else opts), v.policy, v.name == "lsp")
            if key not in index:
                index[key] = len(jobs)
                jobs.append((len(jobs), p, v.name, opts, v.policy))
            wanted.append((i, v, index[key]))
    print(
        f"quality: {len(problems)} problems, {len(variants)} variants, {len(jobs)} completions, {args.procs} procs",
        file=sys.stderr,
        flush=True,
    )
    done, reused = [], []
    if args.reuse:  # greedy raw answers of the same model: an earlier run's record stands for the job
        old = {}
        for path in args.reuse:
            for r in json.loads(path.read_text())["records"]:
                if r["variant"] == "raw" and r.get("group") is None:
                    old[r["task_id"]] = r
        for j in jobs:
            if j[2] == "raw" and j[1].task_id in old:
                done.append({**old[j[1].task_id], "job": j[0], "reused": True})
                reused.append(j[1].task_id)
        print(f"quality: {len(reused)} raw completions reused from {len(args.reuse)} earlier runs", file=sys.stderr)
    taken = {r["job"] for r in done}
    engine_jobs = [j for j in jobs if j[2] != "lsp" and j[0] not in taken]
    lsp_jobs = [j for j in jobs if j[2] == "lsp"]
    if lsp_jobs:  # before the engine's jobs: each worker's server has the CPUs alone
        done += run_jobs(
            lsp_jobs,
            args.procs,
            args.model,
            lsp_settings=json.loads(args.lsp_settings),
            lsp_full_prompt=args.lsp_full_prompt,
        )
    if engine_jobs:
        done += run_jobs(
            engine_jobs,
            args.procs,
            args.model,
            not args.no_newline_heal,
            args.template,
            not args.no_line_in_middle,
            args.anchor_lines,
        )
    by_job = {r["job"]: r for r in done}
    records = [{**by_job[j], "variant": v.name, "group": v.group} for _, v, j in wanted]
    report(records, problems, sets, decisions, args.sweep, t0, args.json)


def report(
    records: list[dict],
    problems: list[Problem],
    sets: list[str],
    decisions: dict,
    sweep: bool,
    t0: float,
    json_path: Path | None,
) -> None:
    elapsed = time.time() - t0
    main_recs = [r for r in records if r["group"] is None]
    results: dict = {
        "seconds": elapsed,
        "problems": {s: sum(1 for p in problems if p.set == s) for s in sets},
        "sets": {},
        "contexts": {},
        "candidates": {},
        "decisions": decisions,
    }
    labels, stats = [], []
    for (s, v), rs in sorted(by(main_recs, "set", "variant").items()):
        results["sets"].setdefault(s, {})[v] = summarize(rs)
        labels.append((s, v))
        stats.append(results["sets"][s][v])
    for (v,), rs in sorted(by(main_recs, "variant").items()):
        results["sets"].setdefault("all", {})[v] = summarize(rs)
        labels.append(("all", v))
        stats.append(results["sets"]["all"][v])
    print_table("per set", labels, stats)
    clabels, cstats = [], []
    for (s, c, v), rs in sorted(by(main_recs, "set", "context", "variant").items()):
        results["contexts"].setdefault(s, {}).setdefault(c, {})[v] = summarize(rs)
        clabels.append((s, c, v))
        cstats.append(results["contexts"][s][c][v])
    print_table("per cursor context", clabels, cstats)

    if sweep:
        base = [r for r in records if r["variant"] == "policy"]
        slabels, sstats = [], []
        for group, cands in CANDIDATES.items():
            in_group = [r for r in base if r["context"] in GROUPS[group]]
            if not in_group:
                continue
            table = {"policy": summarize(in_group)}
            per_ctx = {"policy": {c: summarize(rs) for (c,), rs in by(in_group, "context").items()}}
            per_set = {"policy": {s: summarize(rs) for (s,), rs in by(in_group, "set").items()}}
            for cname in cands:
                rs = [r for r in records if r["variant"] == f"{group}:{cname}"]
                table[cname] = summarize(rs)
                per_ctx[cname] = {c: summarize(x) for (c,), x in by(rs, "context").items()}
                per_set[cname] = {s: summarize(x) for (s,), x in by(rs, "set").items()}
            for cname, s in table.items():
                slabels.append((group, cname))
                sstats.append(s)
            results["candidates"][group] = {
                "contexts": GROUPS[group],
                "rows": CANDIDATES[group],
                "all": table,
                "per_context": per_ctx,
                "per_set": per_set,
                "best": choose(table, cands),
            }
        print_table(
            "sweep: candidates per context group (pooled over sets; 'policy' = current defaults)", slabels, sstats
        )
        print("best per group: " + ", ".join(f"{g} {c['best']}" for g, c in results["candidates"].items()))

    from lsp_server.shaping.policy import policy_table

    results["policy_table"] = policy_table()
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({**results, "records": records}, indent=1, default=str))
    print(f"\n({elapsed:.0f}s)")
    heads = []
    for s in sets:
        got = results["sets"].get(s, {})
        if "raw" in got and "policy" in got:
            heads.append(f"{s} pass@1 raw {got['raw']['pass@1']:.3f} -> policy {got['policy']['pass@1']:.3f}")
        if "lsp" in got and got["lsp"].get("pass@1") is not None:
            rp = got["lsp"].get("runs_past_or_repeats")
            heads.append(
                f"{s} lsp pass@1 {got['lsp']['pass@1']:.3f} (shown {got['lsp']['shown']:.2f}, run past or "
                f"repeat {'-' if rp is None else f'{rp:.3f}'})"
            )
    for s in sorted(results["sets"]):
        for v in ("raw", "lsp"):
            if s.startswith("held-out-") and v in results["sets"][s]:
                got = results["sets"][s][v]
                heads.append(f"{s} {v} exact {got['exact_match']:.3f} edit {got['edit_sim']:.3f}")
    tot = results["sets"].get("all", {})
    parse = [
        f"{v} {100 * s['shown_parse_ok']:.1f}% of {s['shown_n']}"
        for v, s in tot.items()
        if s.get("shown_parse_ok") is not None
    ]
    print("headline: " + "; ".join(heads) + "; shown completions adding no parse error: " + ", ".join(parse))


if __name__ == "__main__":
    main()
