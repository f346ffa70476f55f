"""bench/compare_typing.py: two settings of bench/lsp_typing.py, compared run by run and pause by pause.

    python -m bench.compare_typing --a on1.json on2.json --b off1.json off2.json [--json out.json]

Each file is one ``python -m bench.lsp_typing --json PATH`` run; ``--a`` and ``--b`` are the two settings (for
issue 26: cross-file context on, and ``--no-context``), run interleaved (a, b, a, b) on an idle machine so that
drift hits both. It reads the runs only: it starts nothing, so it has no ``--quick``.

- Per run: the pauses' time to text (all, and new lines), the cold wait, and the engine's own figures (requests
  that carried context, keystrokes whose context waited for the cache, prefill p95, cold-window prompts,
  pre-warms preempted).
- Paired: the same pause (file, line, kind, its order) in an ``a`` run and a ``b`` run of the same index, the
  session's first pause left out (it is the cold start). The median and mean difference ``a - b``, and how
  many pauses are over ``--margin`` ms slower each way: a difference in the tail shows there even when the
  medians agree. Headline last.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.harness.stats import sign_test_p
from bench.lsp_latency import percentile


def _pauses(run: dict) -> dict[tuple, float | None]:
    """(file, line, kind, order) -> time to text in ms (None: no text), the session's first pause left out."""
    out: dict[tuple, float | None] = {}
    seen: dict[tuple, int] = {}
    for p in run["run"]["pauses"][1:]:
        if p["kind"] not in ("line", "word"):
            continue
        base = (p["file"], p["line"], p["kind"])
        seen[base] = seen.get(base, 0) + 1
        out[(*base, seen[base])] = p["text_ms"]
    return out


def _engine_counters(run: dict) -> dict:
    return ((run["run"].get("server_stats") or {}).get("engine") or {}).get("counters") or {}


def _prefill_p95(run: dict) -> float | None:
    lat = (run["run"].get("server_stats") or {}).get("latency_ms") or {}
    row = lat.get("prefill") or lat.get("prefill_ms")
    return row.get("p95") if isinstance(row, dict) else None


def run_row(label: str, run: dict) -> dict:
    s, c = run["summary"], _engine_counters(run)
    return {
        "run": label,
        "context": "off" if run["args"].get("no_context") else "on",
        "n": s["all_pauses"]["n"],
        "p50_ms": s["all_pauses"]["p50"],
        "within_300ms": s["all_pauses"]["within_300ms"],
        "within_1s": s["all_pauses"]["within_1000ms"],
        "newline_p50_ms": s["line_pauses"]["p50"],
        "newline_p90_ms": s["line_pauses"]["p90"],
        "cold_s": s["cold_wait_s"],
        "requests": c.get("submitted", 0),
        "context_prompts": c.get("context_prompts", 0),
        "context_deferred": c.get("context_deferred", 0),
        "tokens_prefilled": c.get("tokens_prefilled", 0),
        "prefill_p95_ms": _prefill_p95(run),
        "cold_prompts": c.get("cold_prompts", 0),
        "prewarms_preempted": c.get("prewarms_preempted", 0),
        "load": run["run"].get("load_avg_start"),
    }


def paired(a_runs: list[dict], b_runs: list[dict], margin: float, tie_ms: float = 20.0) -> dict:
    diffs: list[float] = []
    a_slower = b_slower = only_a = only_b = 0
    for a, b in zip(a_runs, b_runs, strict=False):
        pa, pb = _pauses(a), _pauses(b)
        for key in pa.keys() & pb.keys():
            ta, tb = pa[key], pb[key]
            if ta is None or tb is None:
                only_a += ta is not None and tb is None
                only_b += tb is not None and ta is None
                continue
            d = ta - tb
            diffs.append(d)
            a_slower += d > margin
            b_slower += -d > margin
    slower, faster = sum(d > tie_ms for d in diffs), sum(-d > tie_ms for d in diffs)
    return {
        "pairs_with_text": len(diffs),
        "a_slower_any": slower,  # by more than tie_ms: a pause's own jitter
        "b_slower_any": faster,
        "sign_test_p": sign_test_p(slower, faster),
        "median_diff_ms": statistics.median(diffs) if diffs else None,
        "mean_diff_ms": statistics.fmean(diffs) if diffs else None,
        "a_slower": a_slower,
        "b_slower": b_slower,
        "text_only_a": only_a,
        "text_only_b": only_b,
        "margin_ms": margin,
    }


def _fmt(v, digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if v == float("inf") else f"{v:.{digits}f}"
    return str(v)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", nargs="+", required=True, type=Path, help="lsp_typing JSON runs of the first setting")
    ap.add_argument("--b", nargs="+", required=True, type=Path, help="... of the second, in the same order")
    ap.add_argument("--margin", type=float, default=200.0, help="ms: a paired pause this much slower counts")
    ap.add_argument("--json", type=Path, help="write the tables here")
    args = ap.parse_args(argv)
    if not 0 <= args.margin <= 60_000:
        ap.error("--margin must be 0-60000 ms")
    a_runs = [json.loads(p.read_text()) for p in args.a]
    b_runs = [json.loads(p.read_text()) for p in args.b]
    rows = [run_row(p.name, r) for p, r in zip(args.a + args.b, a_runs + b_runs, strict=True)]
    cols = [
        ("run", "run", 0),
        ("ctx", "context", 0),
        ("n", "n", 0),
        ("p50 ms", "p50_ms", 0),
        ("<=300", "within_300ms", 2),
        ("<=1s", "within_1s", 2),
        ("nl p50", "newline_p50_ms", 0),
        ("nl p90", "newline_p90_ms", 0),
        ("start s", "cold_s", 1),
        ("ctx req", "context_prompts", 0),
        ("deferred", "context_deferred", 0),
        ("prefilled", "tokens_prefilled", 0),
        ("pf p95", "prefill_p95_ms", 0),
        ("cold", "cold_prompts", 0),
        ("preempted", "prewarms_preempted", 0),
    ]
    width = max(len(r["run"]) for r in rows)
    print(f"{'run':<{width}}  " + "  ".join(f"{h:>8}" for h, _, _ in cols[1:]))
    for row in rows:
        print(f"{row['run']:<{width}}  " + "  ".join(f"{_fmt(row[k], d):>8}" for _, k, d in cols[1:]))
    pairs = paired(a_runs, b_runs, args.margin)
    a_all, b_all = rows[: len(a_runs)], rows[len(a_runs) :]
    within = {
        "a_within_1s": [round(r["within_1s"], 2) for r in a_all],
        "b_within_1s": [round(r["within_1s"], 2) for r in b_all],
        "a_p50_ms": percentile([r["p50_ms"] for r in a_all], 0.5),
        "b_p50_ms": percentile([r["p50_ms"] for r in b_all], 0.5),
    }
    print(
        f"\npaired pauses with text in both: {pairs['pairs_with_text']}; a - b median "
        f"{_fmt(pairs['median_diff_ms'])} ms, mean {_fmt(pairs['mean_diff_ms'])} ms; over {args.margin:.0f} ms "
        f"slower: a {pairs['a_slower']}, b {pairs['b_slower']}; text only in a {pairs['text_only_a']}, only in b "
        f"{pairs['text_only_b']}\nby more than 20 ms: a slower {pairs['a_slower_any']}, "
        f"b slower {pairs['b_slower_any']}, sign test p = {pairs['sign_test_p']:.2f} (small: a real difference)"
    )
    out = {"runs": rows, "paired": pairs, **within}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(
        f"headline: a vs b, pauses with text within 1 s {within['a_within_1s']} vs {within['b_within_1s']}; "
        f"paired median {_fmt(pairs['median_diff_ms'])} ms, slower by >{args.margin:.0f} ms: "
        f"a {pairs['a_slower']} / b {pairs['b_slower']}, sign test p {pairs['sign_test_p']:.2f}"
    )
    return out


if __name__ == "__main__":
    main()
