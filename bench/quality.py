"""Completion quality on HumanEval infilling: execution-based pass@1, exact match, parse errors.

    python bench/quality.py [--quick] [--set single-line|random-span|both] [--json PATH]

Each problem's prompt/suffix goes to the engine (greedy, embedded model by default);
the program prompt + completion + suffix + tests runs in a sandboxed subprocess
(isolated mode, temp dir, memory and CPU limits, timeout). The last line is the
headline: pass@1 per set.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DATA = REPO.parent / "shared" / "data" / "humaneval-infilling"
SETS = {"single-line": "HumanEval-SingleLineInfilling.jsonl.gz",
        "random-span": "HumanEval-RandomSpanInfillingLight.jsonl.gz"}


def load_set(name: str, data_dir: Path) -> list[dict]:
    path = data_dir / SETS[name]
    if not path.exists():
        sys.exit(f"quality: {path} not found (pass --data DIR)")
    return [json.loads(line) for line in gzip.open(path, "rt")]


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (10, 10))


def passes(program: str, timeout: float = 10.0) -> bool:
    """Run a program in a throwaway directory; True when it exits 0 in time."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", program], cwd=tmp, capture_output=True,
                                  timeout=timeout, preexec_fn=_limits, env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0


def parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError):
        return False


def program_for(row: dict, middle: str) -> str:
    return row["prompt"] + middle + row["suffix"] + "\n" + row["test"] + f"\ncheck({row['entry_point']})\n"


def complete_all(rows: list[dict], set_name: str, engine, max_tokens: int) -> list[tuple[str, dict]]:
    from engine.api import CompletionRequest, DecodeOptions

    out = []
    for i, row in enumerate(rows):
        # Single-line infilling asks for one line; random spans may cross lines.
        opts = DecodeOptions(max_tokens=max_tokens, max_lines=1 if set_name == "single-line" else 0)
        result = engine.complete(CompletionRequest(row["prompt"], row["suffix"], opts))
        text = result.text + ("\n" if set_name == "single-line" else "")
        out.append((text, result.stats))
        if (i + 1) % 50 == 0:
            print(f"  {set_name}: {i + 1}/{len(rows)} completed", file=sys.stderr, flush=True)
    return out


def evaluate(rows: list[dict], completions: list[str], workers: int) -> dict:
    with ThreadPoolExecutor(workers) as pool:
        passed = list(pool.map(lambda rc: passes(program_for(rc[0], rc[1])), zip(rows, completions, strict=True)))
    exact = [c.strip() == r["canonical_solution"].strip() for r, c in zip(rows, completions, strict=True)]
    broken = [not parses(r["prompt"] + c + r["suffix"]) for r, c in zip(rows, completions, strict=True)]
    n = len(rows)
    return {"problems": n, "pass@1": sum(passed) / n, "exact_match": sum(exact) / n,
            "adds_parse_error": sum(broken) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a random sample of 60 problems per set")
    ap.add_argument("--set", choices=["single-line", "random-span", "both"], default="both")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--model")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from engine.local import open_engine

    engine = open_engine(args.model, use_draft=True, start_thread=False)
    names = list(SETS) if args.set == "both" else [args.set]
    results = {}
    for name in names:
        rows = load_set(name, args.data)
        limit = args.limit or (60 if args.quick else None)
        if limit and limit < len(rows):
            rows = random.Random(0).sample(rows, limit)
        t0 = time.time()
        done = complete_all(rows, name, engine, args.max_tokens)
        texts = [t for t, _ in done]
        res = evaluate(rows, texts, args.workers)
        res["seconds"] = time.time() - t0
        res["mean_first_token_ms"] = sum(s["first_token_ms"] for _, s in done) / len(done)
        results[name] = {"raw": res}
    print(f"\n{'set':12s} {'variant':8s} {'problems':>8s} {'pass@1':>7s} {'exact':>7s} {'parse err':>9s}")
    for name, variants in results.items():
        for variant, r in variants.items():
            print(f"{name:12s} {variant:8s} {r['problems']:8d} {r['pass@1']:7.3f} {r['exact_match']:7.3f} "
                  f"{r['adds_parse_error']:9.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    print("headline: " + ", ".join(f"{n} pass@1 {v['raw']['pass@1']:.3f}" for n, v in results.items()))


if __name__ == "__main__":
    main()
