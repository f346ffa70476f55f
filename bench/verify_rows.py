"""What a verify pass of N rows costs on the default model, against a 1-token step, and whether its rows equal
1-token steps bit for bit (what keeps speculative decoding lossless).

    python -m bench.verify_rows [--model GGUF] [--threads 1,2] [--runs N] [--repeats N] [--quick] [--json PATH]

The cost is the engine's own probe (engine/decoding/spec_policy.py ``measure``: passes of 1, 2, 3, 4, 8 and 16
rows over 256 cached positions, interleaved, the fastest of ``--repeats`` each; what the cost-aware policy
drafts by), run ``--runs`` times per thread count with the thread counts interleaved, so the spread between
runs shows the machine's noise. The bit check decodes 16 one-token steps after a 256-token prompt, then runs
the same tokens as blocks of 2, 3, 4, 8 and 16 rows and compares their logits exactly. The library is the one
the ggml runtime loads (``$LLAMA_CPP_LIB_PATH`` or the install step's build); the table names it.

At 1 thread the probe's passes are also timed in CPU time (a row of the table): on a loaded machine it shows
the kernels' cost without the time other processes held the core.

The bar: 4 rows <= 1.4x a step, 8 rows <= 1.8x, rows bit-identical, at 1 and 2 threads. The last
line is the headline: the 4- and 8-row costs of the run with the fastest step (the least
disturbed), per thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from engine.decoding import spec_policy

DEFAULT_MODEL = Path("models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-fim-q8_0.gguf")
BIT_BLOCKS = (2, 3, 4, 8, 16)
DEPTH = 256


def load(model: Path, threads: int):
    """The ggml runtime at ``threads`` (the load-time probe may settle on fewer: reported)."""
    from engine.loader import load_model

    os.environ["FIMBLE_GGML_THREADS"] = str(threads)
    return load_model(model, runtime="ggml").runtime


def cpu_costs(rt, repeats: int) -> dict[int, float]:
    """The probe's passes timed in this thread's CPU time, fastest of ``repeats`` (1 thread only: ggml then
    computes in the calling thread). Time spent descheduled by other processes does not count, so on a
    loaded machine this shows the kernels' own cost where the wall-clock probe shows the load too."""
    rows = spec_policy.PROBE_ROWS
    ids = [(i * 7919 + 11) % rt.vocab for i in range(DEPTH + max(rows))]
    cache = rt.new_cache(DEPTH + max(rows) + 1)
    rt(torch.tensor(ids[:DEPTH]), cache, 0, 1)
    best: dict[int, float] = {}
    for _ in range(repeats):
        for r in rows:
            cache.rollback(DEPTH)
            t0 = time.thread_time()
            rt(torch.tensor(ids[DEPTH : DEPTH + r]), cache, DEPTH, r)
            best[r] = min(best.get(r, 1e9), time.thread_time() - t0)
    return {r: best[r] / best[1] for r in rows} | {0: best[1]}


def bit_check(rt) -> dict[int, bool]:
    """Whether blocks of each size equal the 1-token steps over the same tokens, logits bit for bit."""
    vocab = rt.vocab
    ids = [(i * 7919 + 11) % vocab for i in range(DEPTH + max(BIT_BLOCKS))]
    cache = rt.new_cache(DEPTH + max(BIT_BLOCKS) + 1)
    rt(torch.tensor(ids[:DEPTH]), cache, 0, 1)
    steps = torch.cat([rt(torch.tensor([ids[DEPTH + i]]), cache, DEPTH + i, 1) for i in range(max(BIT_BLOCKS))])
    out = {}
    for k in BIT_BLOCKS:
        cache.rollback(DEPTH)
        block = rt(torch.tensor(ids[DEPTH : DEPTH + k]), cache, DEPTH, k)
        out[k] = bool(torch.equal(block, steps[:k]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--runs", type=int, default=3, help="probe runs per thread count (interleaved)")
    ap.add_argument("--repeats", type=int, default=5, help="passes per row count in a run; the fastest counts")
    ap.add_argument("--quick", action="store_true", help="one run of best of 3, bit check included")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.runs, args.repeats = 1, 3
    if not args.model.is_file():
        sys.exit(f"verify_rows: no model at {args.model} (python -m training.fetch_qwen builds it)")
    spec_policy.PROBE_REPEATS = args.repeats
    threads = [int(t) for t in args.threads.split(",")]
    runtimes = {t: load(args.model, t) for t in threads}
    load_start = os.getloadavg()
    runs: dict[int, list] = {t: [] for t in threads}
    for _ in range(args.runs):
        for t in threads:  # thread counts interleaved: a burst of load hits both alike
            runs[t].append(spec_policy.measure(runtimes[t]))
    cpu = {t: cpu_costs(runtimes[t], args.repeats) for t in threads if runtimes[t].threads == 1}
    bits = {t: bit_check(rt) for t, rt in runtimes.items()}
    load_end = os.getloadavg()
    lib = runtimes[threads[0]].lib.source
    rows = spec_policy.PROBE_ROWS
    print(f"verify rows on {args.model.name}, library {lib}")
    print(f"{DEPTH} cached positions, best of {args.repeats} per run, {args.runs} run(s) per thread count")
    print(f"load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end ({os.cpu_count()} CPUs)")
    print()
    print(f"| threads (asked/used) | run | step ms | {' | '.join(f'{r} rows' for r in rows)} |")
    print(f"| --- | --- | --- | {' | '.join('---' for _ in rows)} |")
    for t in threads:
        for i, c in enumerate(runs[t]):
            cells = " | ".join(f"{x:.2f}" for x in c.relative)
            print(f"| {t}/{runtimes[t].threads} | {i + 1} | {c.step_s * 1e3:.1f} | {cells} |")
    for t, c in cpu.items():
        cells = " | ".join(f"{c[r]:.2f}" for r in rows)
        print(f"| {t}/1, CPU time | - | {c[0] * 1e3:.1f} | {cells} |")
    print()
    for t in threads:
        same = ", ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in bits[t].items())
        print(f"{t} thread(s): blocks equal to 1-token steps bit for bit: {same}")
    best = {t: min(runs[t], key=lambda c: c.step_s) for t in threads}  # the least disturbed run
    out = {
        "model": str(args.model),
        "library": lib,
        "load_avg_start": load_start,
        "load_avg_end": load_end,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": list(rows),
        "runs": {str(t): [{"step_ms": c.step_s * 1e3, "rel": list(c.relative)} for c in runs[t]] for t in threads},
        "threads_used": {str(t): runtimes[t].threads for t in threads},
        "cpu_time_rel": {str(t): {"step_ms": c[0] * 1e3, "rel": [c[r] for r in rows]} for t, c in cpu.items()},
        "bit_identical": {str(t): {str(k): ok for k, ok in bits[t].items()} for t in threads},
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    head = "; ".join(
        f"{t} thread(s): 4 rows {best[t].cost(4):.2f}x, 8 rows {best[t].cost(8):.2f}x a step"
        f" ({best[t].step_s * 1e3:.1f} ms), bit-identical {'yes' if all(bits[t].values()) else 'NO'}"
        for t in threads
    )
    print(f"headline: {head} (bar 1.4x / 1.8x; load average {load_end[0]:.2f})")


if __name__ == "__main__":
    main()
