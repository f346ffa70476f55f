"""Per-language paired comparison of bench/quality.py held-out runs: one model (and variant) against others.

    python -m bench.held_out_compare --json OUT 'FIM raw=RUNS/fim-*.json' 'Instruct raw=RUNS/instruct-*.json' ...

Each argument is ``LABEL=GLOB`` (the label's last word is the variant to read: raw or lsp); the records of the
matching ``bench/quality.py --json`` files are pooled (a long run in pieces, ``--held-out-from``). The first label
is the reference: for each other label, per language and pooled, only the cursors both ran (the same task ids):
n, exact match each, edit similarity each, the share of shown answers that run past the middle or re-type the
suffix each (bench/quality.py's past|r), the cursors only one of the two matched exactly (wins/losses of the
reference) and a two-sided sign test on them. Then the pooled figures per cursor kind. The last line is the
headline (the reference against the second label, pooled).
"""

from __future__ import annotations

import argparse
import glob
import json
from collections import defaultdict
from pathlib import Path

from bench.harness.stats import sign_test_p


def past_or_repeat(r: dict) -> bool:
    return bool(r["is_shown"] and (r.get("runs_past") or r.get("retypes_suffix") or r.get("repeats_suffix_line")))


def load(pattern: str, variant: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for path in sorted(glob.glob(pattern)):
        for r in json.loads(Path(path).read_text())["records"]:
            if r["variant"] == variant and r["set"].startswith("held-out-") and r.get("group") is None:
                out[r["task_id"]] = r
    return out


def figures(recs: list[dict]) -> dict:
    n = len(recs)
    shown = [r for r in recs if r["is_shown"]]
    return {
        "n": n,
        "exact": sum(bool(r["exact"]) for r in recs) / n,
        "edit_sim": sum(r["edit_sim"] for r in recs) / n,
        "shown": len(shown) / n,
        "past_or_repeat": sum(map(past_or_repeat, shown)) / len(shown) if shown else 0.0,
    }


def compare(ref: dict[str, dict], other: dict[str, dict]) -> dict:
    ids = sorted(set(ref) & set(other))
    groups: dict[str, list[str]] = defaultdict(list)
    for t in ids:
        groups[ref[t]["set"].removeprefix("held-out-")].append(t)
    kinds: dict[str, list[str]] = defaultdict(list)
    for t in ids:
        kinds[ref[t]["context"]].append(t)
    rows = {}
    for name, tids in [*sorted(groups.items()), ("all", ids), *((f"  {k}", v) for k, v in sorted(kinds.items()))]:
        if not tids:
            continue
        a, b = figures([ref[t] for t in tids]), figures([other[t] for t in tids])
        wins = sum(bool(ref[t]["exact"]) and not other[t]["exact"] for t in tids)
        losses = sum(bool(other[t]["exact"]) and not ref[t]["exact"] for t in tids)
        rows[name] = {"ref": a, "other": b, "wins": wins, "losses": losses, "sign_p": sign_test_p(wins, losses)}
    return rows


def table(ref_label: str, label: str, rows: dict) -> list[str]:
    lines = [
        f"{ref_label} (A) against {label} (B)",
        f"{'language':18} {'n':>4}  {'exact A':>7} {'B':>6}  {'edit A':>6} {'B':>6}  {'past|rep A':>10} {'B':>6}"
        f"  {'A-only/B-only exact':>19} {'sign p':>6}",
    ]
    for name, r in rows.items():
        a, b = r["ref"], r["other"]
        wl = f"{r['wins']:>9}/{r['losses']:<9}"
        lines.append(
            f"{name:18} {a['n']:>4}  {a['exact']:>7.3f} {b['exact']:>6.3f}  {a['edit_sim']:>6.3f} {b['edit_sim']:>6.3f}"
            f"  {a['past_or_repeat']:>10.3f} {b['past_or_repeat']:>6.3f}  {wl} {r['sign_p']:>6.3f}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=GLOB; the label's last word is the variant (raw or lsp)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = []
    for arg in args.runs:
        label, pattern = arg.split("=", 1)
        runs.append((label, load(pattern, label.split()[-1])))
    (ref_label, ref), out, head = runs[0], {}, ""
    for label, recs in runs[1:]:
        rows = compare(ref, recs)
        out[label] = rows
        print("\n".join(table(ref_label, label, rows)) + "\n")
        if not head and "all" in rows:
            r = rows["all"]
            head = (
                f"headline: {ref_label} against {label}, {r['ref']['n']} held-out cursors: exact "
                f"{r['ref']['exact']:.3f} vs {r['other']['exact']:.3f} ({r['wins']}/{r['losses']} only one matched, "
                f"sign p {r['sign_p']:.3g}), edit similarity {r['ref']['edit_sim']:.3f} vs {r['other']['edit_sim']:.3f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"reference": ref_label, "comparisons": out}, indent=1))
    print(head or "headline: no shared cursors")


if __name__ == "__main__":
    main()
