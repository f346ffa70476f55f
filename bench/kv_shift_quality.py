"""What shift reuse of the KV cache costs in completion quality, against recomputing the prompt.

    python -m bench.kv_shift_quality [--quick] [--set single-line|random-span|both]
                                     [--scenario edit|jump|jump-middle|all] [--limit N] [--procs N]
                                     [--time-budget S] [--json PATH [--records]] [--rereport JSON]

Shift reuse (``reuse="shift"``, engine/caching/kv_shift.py) keeps cached prompt pieces (lines) that
moved after an edit and re-rotates their RoPE keys by the position delta instead of
recomputing them. Their keys and values were computed while they attended to the old text
before them, so the result is approximate. Exact reuse (``reuse="exact"``) only keeps the
common token prefix and must be token-identical to recomputing.

Method. HumanEval infilling problems (bench/quality.py's loaders and scoring: the single-line
and random-span sets of /work/shared/data/humaneval-infilling). Every problem is completed
with the options of quality.py's "raw" variant (greedy, 96 tokens, one line for single-line,
no line limit for random-span), healing on, the text used as it comes, three ways on one engine:

- recompute: ``reuse="none"`` on a fresh document: the reference.
- exact:     a warm-up request on a fresh document, then the problem with ``reuse="exact"``
             on that document. Must equal recompute; every difference is counted and listed.
- shift:     the same warm-up on another fresh document, then ``reuse="shift"``.

The warm-up puts the cache in the state where shift reuse matters (scenarios):

- edit: the same document with one line more before the hole (``# note`` after the prompt's
  first line), cursor at the hole. The measured request is the true problem, as if the user
  deleted that line: every cached prefix line after it moves by the edit's token delta, and
  was computed with the extra line in its context. The SPM prompt puts the suffix first, so
  the suffix and the prefix's lines before the edit are exact reuse either way.
- jump: the same document (the problem's, the hole empty) with the cursor at its end (prefix =
  prompt + suffix, suffix = ""), then the request at the hole: the suffix's lines move from
  the prefix side of the SPM prompt to the suffix side (they were computed with the whole
  prompt before them) and the prefix's lines move up by the suffix's length.
- jump-middle: as jump, but the warm-up's document also holds the canonical middle (prefix =
  prompt + middle + suffix): a jump plus the deletion of the middle. The cached suffix lines
  were computed after the canonical answer, so shift reuse can leak it into the completion:
  this scenario bounds that leak, it is not an unbiased quality estimate.

The warm-up is a completion at the warm cursor cut to one new token: the measured request
only reads the prompt's keys/values, which decoding does not touch. Each document is forgotten
after its measured request, so nothing is borrowed between documents (engine/caching/kv_store.py).
The n-gram drafter's memory is cleared before every request; greedy speculative decoding is
lossless, so drafting changes speed, not text.

Metrics per set and scenario: pass@1 (prompt + completion + suffix + tests run in quality.py's
sandboxed subprocess) of recompute, exact and shift; exact match against the canonical middle;
agreement: share of problems whose shift text equals the recompute text (sim: mean difflib
ratio of the two texts, for long spans where one token changes the rest); exact != recompute
(expected 0); paired pass changes: problems passing only with recompute (rec+) or only with
shift (sh+), and the two-sided exact McNemar p-value on those discordant pairs; mean prefilled
tokens per request (recompute prefills the whole prompt), mean shifted tokens (moved and
re-rotated) and first-token latency. The last line is the headline.

--quick: 20 single-line problems, every scenario. --limit N: a fixed random sample of N per set
(quality.py's). --time-budget S: the problems run in a random order with the sets interleaved
and whatever is done after S seconds is reported (a random sample of each set), for a shared
machine where the whole run does not fit. --json: the summary, exact mismatches and every
shift/recompute disagreement; --records adds every record, and --rereport JSON rebuilds the
tables and --json from such a file without the model. Report: bench/reports/kv-shift-quality-*.json.
"""

from __future__ import annotations

import argparse
import difflib
import json
import multiprocessing as mp
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import bench.quality as quality
from bench.harness.stats import sign_test_p
from bench.quality import DATA, Problem, _init_worker, load_problems, options_for, shape_and_score

SETS = ("single-line", "random-span")
SCENARIOS = ("edit", "jump", "jump-middle")
MODES = ("recompute", "exact", "shift")
EDIT_LINE = "# note"
RAW = quality.Variant("raw", False)


# -- scenarios -----------------------------------------------------------------------------------
def warm_prompt(p: Problem, scenario: str) -> tuple[str, str]:
    """(prefix, suffix) of the warm-up request that fills the cache before the measured one."""
    if scenario == "edit":
        head, nl, rest = p.prompt.partition("\n")
        return (head + nl + EDIT_LINE + "\n" + rest if nl else EDIT_LINE + "\n" + p.prompt), p.suffix
    if scenario == "jump":
        return p.program(""), ""
    if scenario == "jump-middle":
        return p.program(p.middle), ""
    raise ValueError(scenario)


# -- running (one job per problem, in a worker holding an engine) -------------------------------
def _complete(prefix: str, suffix: str, opts, doc: str, reuse: str):
    from engine.api import CompletionRequest

    eng = quality._ENGINE
    req = CompletionRequest(prefix, suffix, opts, document_id=doc, reuse=reuse, truncate=True, heal=True)
    eng.drafters(req)[1].recent.clear()  # the request's n-gram drafter (engine/scheduler.py Drafters)
    t0 = time.perf_counter()
    result = eng.complete(req)
    return result, (time.perf_counter() - t0) * 1e3


def _forget(doc: str) -> None:
    quality._ENGINE.forget(doc)
    quality._ENGINE.run_pending()


def _measure(p: Problem, prefix: str, suffix: str, opts, doc: str, reuse: str) -> dict:
    result, ms = _complete(prefix, suffix, opts, doc, reuse)
    _forget(doc)
    s = result.stats
    score = shape_and_score(p, result.text, shape=False)
    return {
        "text": result.text,
        "shown": score["shown"],
        "pass": score["pass"],
        "exact": score["exact"],
        "edit_sim": score["edit_sim"],
        "finish": result.finish_reason,
        "tokens": result.tokens,
        "ms": ms,
        "prompt_tokens": s["prompt_tokens"],
        "prefilled": s["prefilled_tokens"],
        "shifted": s["shifted_tokens"],
        "first_token_ms": s["first_token_ms"],
    }


def run_problem(job: tuple[int, Problem, tuple[str, ...]]) -> list[dict]:
    """The problem's recompute reference, then warm-up + exact and warm-up + shift per scenario."""
    idx, p, scenarios = job
    opts, _ = options_for(p, RAW)
    warm_opts = replace(opts, max_tokens=1)
    ref = _measure(p, p.prompt, p.suffix, opts, f"{idx}/recompute", "none")
    out = []
    for sc in scenarios:
        wp, ws = warm_prompt(p, sc)
        rec = {"set": p.set, "task_id": p.task_id, "scenario": sc, "recompute": ref}
        for mode in ("exact", "shift"):
            doc = f"{idx}/{sc}/{mode}"
            warm, _ = _complete(wp, ws, warm_opts, doc, "none")
            rec["warm_prompt_tokens"] = warm.stats["prompt_tokens"]
            rec[mode] = _measure(p, p.prompt, p.suffix, opts, doc, mode)
        out.append(rec)
    return out


def run_all(
    problems: list[Problem], scenarios: tuple[str, ...], procs: int, model: str | None, budget_s: float | None = None
) -> list[dict]:
    """Records of every problem, or with ``budget_s`` of those done by then (sets interleaved at random)."""
    jobs = [(i, p, scenarios) for i, p in enumerate(problems)]
    if budget_s is not None:  # what finishes in time is then a random sample of every set
        random.Random(1).shuffle(jobs)
    t0 = time.time()
    deadline = t0 + budget_s if budget_s is not None else None
    if procs <= 1:
        _init_worker(model, 1)
        results, pool = map(run_problem, jobs), None
    else:
        pool = mp.get_context("spawn").Pool(procs, _init_worker, (model, 1))
        results = pool.imap_unordered(run_problem, jobs)
    done: list[dict] = []
    for i in range(1, len(jobs) + 1):
        left = None if deadline is None else deadline - time.time()
        if left is not None and left <= 0:
            break
        try:
            recs = results.next(timeout=left) if pool is not None else next(results)
        except mp.TimeoutError:
            break
        done.extend(recs)
        if i % 25 == 0 or i == len(jobs):
            print(f"  {i}/{len(jobs)} problems ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    finished = len({(r["set"], r["task_id"]) for r in done})
    if finished < len(jobs):
        print(f"  time budget: {finished}/{len(jobs)} problems done ({time.time() - t0:.0f}s)", file=sys.stderr)
    if pool is not None:
        if finished < len(jobs):
            pool.terminate()
        else:
            pool.close()
        pool.join()
    order = {(p.set, p.task_id): i for i, p in enumerate(problems)}
    done.sort(key=lambda r: (order[(r["set"], r["task_id"])], SCENARIOS.index(r["scenario"])))
    return done


# -- aggregation ---------------------------------------------------------------------------------


def summarize(rs: list[dict]) -> dict:
    n = len(rs)
    if not n:
        return {"problems": 0}

    def mean(mode: str, key: str) -> float:
        return sum(r[mode][key] for r in rs) / n

    rec_only = sum(1 for r in rs if r["recompute"]["pass"] and not r["shift"]["pass"])
    shift_only = sum(1 for r in rs if r["shift"]["pass"] and not r["recompute"]["pass"])
    out: dict = {"problems": n}
    for mode in MODES:
        out[mode] = {
            "pass@1": mean(mode, "pass"),
            "exact_match": mean(mode, "exact"),
            "edit_sim": mean(mode, "edit_sim"),
            "prefilled": mean(mode, "prefilled"),
            "shifted": mean(mode, "shifted"),
            "first_token_ms": mean(mode, "first_token_ms"),
            "ms": mean(mode, "ms"),
        }
    out.update(
        {
            "prompt_tokens": mean("recompute", "prompt_tokens"),
            "warm_prompt_tokens": sum(r["warm_prompt_tokens"] for r in rs) / n,
            "agreement": sum(r["shift"]["text"] == r["recompute"]["text"] for r in rs) / n,
            "shown_agreement": sum(r["shift"]["shown"] == r["recompute"]["shown"] for r in rs) / n,
            "similarity": sum(
                difflib.SequenceMatcher(None, r["shift"]["text"], r["recompute"]["text"]).ratio() for r in rs
            )
            / n,
            "moved": sum(1 for r in rs if r["shift"]["shifted"]),  # the rest had nothing to shift
            "agreement_moved": (
                sum(r["shift"]["text"] == r["recompute"]["text"] for r in rs if r["shift"]["shifted"])
                / max(1, sum(1 for r in rs if r["shift"]["shifted"]))
            ),
            "shifted_share": sum(r["shift"]["shifted"] for r in rs)
            / max(1, sum(r["shift"]["prompt_tokens"] for r in rs)),
            "exact_mismatches": sum(r["exact"]["text"] != r["recompute"]["text"] for r in rs),
            "pass_delta": mean("shift", "pass") - mean("recompute", "pass"),
            "recompute_only_pass": rec_only,
            "shift_only_pass": shift_only,
            "mcnemar_p": sign_test_p(rec_only, shift_only),
        }
    )
    return out


def print_table(labels: list[tuple[str, str]], stats: list[dict]) -> None:
    print(
        f"\n{'set':12s} {'scenario':11s} {'n':>5s} | {'pass@1 rec':>10s} {'exact':>6s} {'shift':>6s} | "
        f"{'EM rec':>6s} {'shift':>6s} | {'agree':>6s} {'sim':>5s} {'ex!=rec':>7s} | "
        f"{'rec+':>4s} {'sh+':>4s} {'p':>5s} | {'prefill rec':>11s} {'exact':>6s} {'shift':>6s} {'shifted':>7s} | "
        f"{'1st ms rec':>10s} {'shift':>6s}"
    )
    for (s, sc), st in zip(labels, stats, strict=True):
        r, e, h = st["recompute"], st["exact"], st["shift"]
        print(
            f"{s:12s} {sc:11s} {st['problems']:5d} | {r['pass@1']:10.3f} {e['pass@1']:6.3f} {h['pass@1']:6.3f} | "
            f"{r['exact_match']:6.3f} {h['exact_match']:6.3f} | {100 * st['agreement']:5.1f}% "
            f"{st['similarity']:5.3f} {st['exact_mismatches']:7d} | "
            f"{st['recompute_only_pass']:4d} {st['shift_only_pass']:4d} {st['mcnemar_p']:5.2f} | "
            f"{r['prefilled']:11.1f} {e['prefilled']:6.1f} {h['prefilled']:6.1f} {h['shifted']:7.1f} | "
            f"{r['first_token_ms']:10.1f} {h['first_token_ms']:6.1f}"
        )
    print("rec+ / sh+: problems passing only with recompute / only with shift; p: exact McNemar on those.")


def report(records: list[dict], meta: dict, json_path: Path | None, with_records: bool) -> None:
    """Tables, JSON and headline from the per-problem records."""
    sets = [x for x in SETS if any(r["set"] == x for r in records)]
    scenarios = [x for x in SCENARIOS if any(r["scenario"] == x for r in records)]
    results: dict = {
        **meta,
        "scenarios": scenarios,
        "problems": {s: len({r["task_id"] for r in records if r["set"] == s}) for s in sets},
        "options": "bench/quality.py raw variant (greedy, max_tokens 96, max_lines 1 for single-line)",
        "sets": {},
    }
    labels, stats = [], []
    for s in sets:
        for sc in scenarios:
            rs = [r for r in records if r["set"] == s and r["scenario"] == sc]
            if rs:
                results["sets"].setdefault(s, {})[sc] = summarize(rs)
                labels.append((s, sc))
                stats.append(results["sets"][s][sc])
    mismatches = [
        {
            "set": r["set"],
            "task_id": r["task_id"],
            "scenario": r["scenario"],
            "recompute": r["recompute"]["text"],
            "exact": r["exact"]["text"],
            "exact_prefilled": r["exact"]["prefilled"],
            "prompt_tokens": r["recompute"]["prompt_tokens"],
        }
        for r in records
        if r["exact"]["text"] != r["recompute"]["text"]
    ]
    results["exact_mismatches"] = mismatches
    results["disagreements"] = [
        {
            "set": r["set"],
            "task_id": r["task_id"],
            "scenario": r["scenario"],
            "shifted": r["shift"]["shifted"],
            "recompute": r["recompute"]["text"],
            "shift": r["shift"]["text"],
            "pass": [r["recompute"]["pass"], r["shift"]["pass"]],
            "exact": [r["recompute"]["exact"], r["shift"]["exact"]],
        }
        for r in records
        if r["shift"]["text"] != r["recompute"]["text"]
    ]
    print_table(labels, stats)
    if mismatches:
        print(f"\nexact != recompute ({len(mismatches)}):")
        for m in mismatches[:20]:
            print(f"  {m['set']} {m['task_id']} {m['scenario']}: recompute {m['recompute']!r} exact {m['exact']!r}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        out = {**results, "records": records} if with_records else results
        json_path.write_text(json.dumps(out, indent=1))
    print(f"\n({meta['seconds']:.0f}s)")
    heads = []
    for s, got in results["sets"].items():
        first = got[next(iter(got))]
        shift = " ".join(f"{sc} {st['shift']['pass@1']:.3f}" for sc, st in got.items())
        agree = " ".join(f"{sc} {100 * st['agreement']:.1f}%" for sc, st in got.items())
        heads.append(
            f"{s} (n={first['problems']}) pass@1 recompute {first['recompute']['pass@1']:.3f}, "
            f"shift {shift} (agreement {agree})"
        )
    total = sum(st["problems"] for st in stats)
    print(f"kv_shift_quality: {'; '.join(heads)}; exact != recompute {len(mismatches)}/{total}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 single-line problems (unless --set/--limit say otherwise)")
    ap.add_argument("--set", choices=[*SETS, "both"], default=None, help="default: both (single-line with --quick)")
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    ap.add_argument("--limit", type=int, help="problems per set, a fixed random sample (default: all; 20 with --quick)")
    ap.add_argument("--model")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument(
        "--procs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="worker processes, one engine and one torch thread each (the tests run in the worker)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        metavar="S",
        help="stop after S seconds and report the problems done (a random sample: sets interleaved)",
    )
    ap.add_argument("--json", type=Path, help="summary, exact mismatches and shift/recompute disagreements")
    ap.add_argument("--records", action="store_true", help="--json also holds every per-problem record")
    ap.add_argument(
        "--rereport",
        type=Path,
        metavar="JSON",
        help="no model: tables, headline and --json again from an earlier --json --records file",
    )
    args = ap.parse_args()

    if args.rereport:
        old = json.loads(args.rereport.read_text())
        meta = {k: old[k] for k in ("seconds", "procs", "limit", "time_budget_s", "problems_asked") if k in old}
        report(old["records"], meta, args.json, args.records)
        return
    set_arg = args.set or ("single-line" if args.quick else "both")
    sets = list(SETS) if set_arg == "both" else [set_arg]
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    limit = args.limit or (20 if args.quick else None)
    t0 = time.time()
    problems = load_problems(sets, args.data, limit)
    print(
        f"kv_shift_quality: {len(problems)} problems, scenarios {', '.join(scenarios)}, {args.procs} procs",
        file=sys.stderr,
        flush=True,
    )
    records = run_all(problems, scenarios, args.procs, args.model, args.time_budget)
    meta = {
        "seconds": time.time() - t0,
        "procs": args.procs,
        "limit": limit,
        "time_budget_s": args.time_budget,
        "problems_asked": {s: sum(1 for p in problems if p.set == s) for s in sets},
    }
    report(records, meta, args.json, args.records)


if __name__ == "__main__":
    main()
