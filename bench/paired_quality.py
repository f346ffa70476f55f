"""Paired comparison of bench/quality.py --json runs on the same problems (e.g. --anchor-lines K against K=0).

    python -m bench.paired_quality BASE.json OTHER.json [OTHER.json ...] [--variant raw] [--first N]

Each run's records are matched per set by position (quality.py samples each set with random.Random(0), so two
runs with the same --set and --limit answer the same problems in the same order; for these set sizes a smaller
--limit samples a prefix of a larger one's, and --first N compares only the first N problems of every set).
Task ids are checked to match. Per set and pooled: identical shown answers, passing base -> other with the
problems lost and gained, and a two-sided exact sign test (McNemar) p on those discordant pairs; the same for
exact match; mean edit similarity and its paired mean difference. --tables: each run's per-set summary too.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

from bench.harness.stats import sign_test_p


def load(path: Path, variant: str, first: int | None) -> dict[str, list[dict]]:
    data = json.loads(path.read_text())
    out: dict[str, list[dict]] = defaultdict(list)
    for r in data["records"]:
        if r["variant"] == variant and r.get("group") is None:
            out[r["set"]].append(r)
    return {s: (rs[:first] if first else rs) for s, rs in out.items()}


def compare(base: list[dict], other: list[dict]) -> dict:
    if len(base) != len(other):
        raise SystemExit(f"paired_quality: {len(base)} against {len(other)} problems (use --first)")
    pairs = list(zip(base, other, strict=True))
    if any(a["task_id"] != b["task_id"] for a, b in pairs):
        raise SystemExit("paired_quality: the runs answer different problems")
    n = len(base)
    same = sum(a["shown"] == b["shown"] for a, b in pairs)
    tested = [(a, b) for a, b in pairs if a["pass"] is not None]
    p_lost = sum(1 for a, b in tested if a["pass"] and not b["pass"])
    p_gain = sum(1 for a, b in tested if b["pass"] and not a["pass"])
    e_lost = sum(1 for a, b in pairs if a["exact"] and not b["exact"])
    e_gain = sum(1 for a, b in pairs if b["exact"] and not a["exact"])
    d_edit = [b["edit_sim"] - a["edit_sim"] for a, b in pairs]
    mean = sum(d_edit) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in d_edit) / (n - 1)) if n > 1 else 0.0
    return {
        "n": n,
        "identical": same,
        "pass_base": sum(1 for a, _ in tested if a["pass"]),
        "pass_other": sum(1 for _, b in tested if b["pass"]),
        "pass_lost": p_lost,
        "pass_gained": p_gain,
        "pass_p": sign_test_p(p_lost, p_gain),
        "exact_base": sum(a["exact"] for a in base),
        "exact_other": sum(b["exact"] for b in other),
        "exact_lost": e_lost,
        "exact_gained": e_gain,
        "exact_p": sign_test_p(e_lost, e_gain),
        "edit_base": sum(a["edit_sim"] for a in base) / n,
        "edit_other": sum(b["edit_sim"] for b in other) / n,
        "edit_diff": mean,
        "edit_diff_se": sd / math.sqrt(n) if n > 1 else 0.0,
    }


def line(label: str, c: dict) -> str:
    return (
        f"{label}: n={c['n']} identical answers {c['identical']}, "
        f"passing {c['pass_base']} -> {c['pass_other']} (lost {c['pass_lost']}, gained {c['pass_gained']}, "
        f"sign p={c['pass_p']:.3f}); exact {c['exact_base']} -> {c['exact_other']} (lost {c['exact_lost']}, "
        f"gained {c['exact_gained']}, p={c['exact_p']:.3f}); edit {c['edit_base']:.3f} -> {c['edit_other']:.3f} "
        f"(paired diff {c['edit_diff']:+.3f} +- {c['edit_diff_se']:.3f} se)"
    )


def table(label: str, runs: dict[str, list[dict]]) -> None:
    """Per set and pooled: bench/quality.py's summary of these records (the --first subset)."""
    from bench.quality import summarize

    print(f"{label}\n{'':28}{'n':>4} pass@1  exact   edit  shown  noErr parses retype")
    rows = [*runs.items(), ("all", [r for rs in runs.values() for r in rs])]
    for s, rs in rows:
        m = summarize(rs)
        cols = ("pass@1", "exact_match", "edit_sim", "shown", "shown_parse_ok", "shown_program_parses")
        vals = " ".join(f"{m[c]:6.3f}" if m[c] is not None else "     -" for c in cols)
        print(f"{s:28}{m['problems']:>4} {vals} {m['shown_retypes_suffix'] or 0:6.3f}")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("others", type=Path, nargs="+")
    ap.add_argument("--variant", default="raw")
    ap.add_argument("--first", type=int, help="only the first N problems of each set")
    ap.add_argument("--json", type=Path, help="write the comparisons here")
    ap.add_argument("--tables", action="store_true", help="also each run's per-set table on these problems")
    args = ap.parse_args()
    base = load(args.base, args.variant, args.first)
    results = {}
    if args.tables:
        table(str(args.base.stem), base)
        for path in args.others:
            table(str(path.stem), load(path, args.variant, args.first))
    for path in args.others:
        other = load(path, args.variant, args.first)
        sets = [s for s in base if s in other]
        res = {s: compare(base[s], other[s]) for s in sets}
        res["pooled"] = compare([r for s in sets for r in base[s]], [r for s in sets for r in other[s]])
        results[str(path)] = res
        for s, c in res.items():
            print(line(f"{path.stem} {s}", c))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
