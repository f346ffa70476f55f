"""fimble serve's host side under load, without a GPU: the real daemon, scheduler and clients; the graphs simulated.

At 32 editors on the H200 the slotted rounds are host-bound (bench/reports/serve-load-h200-1.5B-*): the Python
around a ~3 ms graph sets the round. This reproduces that on a CPU machine, so the host work can be measured and cut
without device time. The daemon serves the embedded model's tokenizer and FIM template with a ServeEngine whose
``SlotGraphs`` is replaced by ``SimulatedSlots``: the same slots, staging and hand-out code (cuda_graphs.py
``SlotGraphs`` with ``device=False``) around a simulated device step (``replay_round``, ``wait_round``): a pass
"runs" for a modelled time (``--graph-ms`` + ``--row-ms`` x rows, the H200's 1.5B-shape figures by default) during
which the decode loop sleeps (the GIL free, as while it waits on a CUDA event), and each row's argmax is a random
token (as with random weights). Editors type as in bench/serve_load.py (its ``level``).

Compared, interleaved per level: the decode loop in a child process (``fimble serve``'s CUDA default) and in the
daemon's process. Per row: tok/s while typing, p50/p95 first delta, and the round's host time: advancing (after the
wait: verify, draft, next pass) and overlapped (streaming, admitting: while the "GPU" runs).

    python -m bench.serve_host --quick              # 8 editors, under a minute
    python -m bench.serve_host --levels 8,32 --json out.json

Absolute figures depend on this machine's CPU (and the client shares it); the ratio between the two layouts and the
host times per round are what carry over. The last line printed is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

CHILD_ENV = "SERVE_HOST_CHILD"  # set in the engine process this file starts for itself


def simulated_engine(graph_ms: float, row_ms: float, prefill_ms: float):
    """A ServeEngine on the embedded model (CPU) whose slotted rounds are timed sleeps."""
    import numpy as np
    import torch

    from engine.loader import DEFAULT_TARGET, load_model
    from engine.runtimes.cuda_graphs import BLOCKS, SlotGraphs
    from engine.serve.scheduler import ServeEngine

    class SimulatedSlots(SlotGraphs):
        """SlotGraphs' host side (``device=False``: a slot view shares its document's cache, no copies) with the
        device step replaced by a clock: a pass takes ``graph_ms + row_ms * rows``, every row's argmax is a random
        token."""

        def __init__(self, model, streams: int, slot_len: int):
            super().__init__(model, streams, slot_len, attention="simulated", device=False)
            self.use_graphs = True  # the scheduler overlaps rounds, as on CUDA
            # Random rows, as random weights give: a healed first token read from them is any allowed token, not
            # always the lowest id (all-zero rows re-typed the healed text one character a step, 2026-12-07).
            gen = torch.Generator().manual_seed(0)
            self._logits = torch.randn(streams * max(BLOCKS), model.cfg.vocab_size, generator=gen)
            self._rng = np.random.default_rng(0)
            self._busy_until = 0.0

        def pass_ms(self, key):
            return graph_ms + row_ms * key[0] * key[1]

        def _random_rows(self, n: int) -> torch.Tensor:
            return torch.from_numpy(self._rng.integers(3, self.model.cfg.vocab_size, n))

        def _run_for(self, ms: float) -> None:
            self._busy_until = max(time.perf_counter(), self._busy_until) + ms / 1e3

        def prefill(self, passes, best=None):
            self._run_for(prefill_ms)
            time.sleep(max(0.0, self._busy_until - time.perf_counter()))  # eager: synchronous, as on the GPU
            out = []
            for t, cache, start, _ in passes:
                cache.length = start + len(t)
                out.append(self._logits[0:1])
                if best is not None:
                    best.append(self._random_rows(1).tolist())
            return out

        def replay_round(self, rnd, feeds, kept, after) -> None:
            rows = rnd.key[0] * rnd.key[1]
            self._hosts[rnd.turn][:rows] = self._random_rows(rows)  # (a fed row's token: whatever its source chose)
            self._run_for(self.pass_ms(rnd.key))
            rnd.ready_at = self._busy_until  # rounds queue on the simulated device, as on a CUDA stream
            self.replays += 1
            rnd.logits, rnd.kept = self._logits, {}  # (the simulated logits never change: nothing to keep aside)

        def wait_round(self, rnd) -> None:
            time.sleep(max(0.0, rnd.ready_at - time.perf_counter()))  # the GIL is free, as in a CUDA sync

    torch.set_num_threads(1)
    target = load_model(DEFAULT_TARGET, device="cpu", runtime="compact")
    engine = ServeEngine(target, None, slots=True, threads=1, slot_len=4096)
    engine.slots = SimulatedSlots(target.runtime, engine.max_active, 4096)
    engine.overlap = True  # as on CUDA (ServeEngine turns it on for graph rounds)
    return engine


def serve(args: argparse.Namespace) -> int:
    """Be the daemon (and, with --engine-process on, start this file again as its engine process)."""
    from engine.process import serve_built
    from engine.serve.daemon import ServeOptions, run_daemon
    from engine.serve.engine_process import SWITCH_INTERVAL_S, ServeEngineProcess

    build = lambda: simulated_engine(args.graph_ms, args.row_ms, args.prefill_ms)  # noqa: E731
    announce = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if os.environ.get(CHILD_ENV):
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # as engine/process.py --serve
        return serve_built(build)
    if args.engine_process == "off":
        return run_daemon(build(), ServeOptions(port=0), announce=announce)
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as fimble serve with its engine in a child
    os.environ[CHILD_ENV] = "1"
    engine = ServeEngineProcess.start(command=[sys.executable, "-m", "bench.serve_host", *sys.argv[1:]])
    del os.environ[CHILD_ENV]
    return run_daemon(engine, ServeOptions(port=0), announce=announce)


def simulated_daemon(serve_load, args: argparse.Namespace, layout: str):
    """This file as a daemon in a subprocess (serve_load's launcher: the port read from the line it prints)."""
    cmd = [sys.executable, "-m", "bench.serve_host", "--serve", "--engine-process", layout]
    cmd += ["--graph-ms", str(args.graph_ms), "--row-ms", str(args.row_ms), "--prefill-ms", str(args.prefill_ms)]
    return serve_load.Daemon(command=cmd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="8,32", help="concurrent editors per level, comma-separated")
    ap.add_argument("--chars", type=int, default=12, help="characters each editor types (one request each)")
    ap.add_argument("--think-ms", type=int, default=100, help="pause between a first delta and the next keystroke")
    ap.add_argument("--graph-ms", type=float, default=2.15, help="a simulated graph's fixed time (H200, 1.5B)")
    ap.add_argument("--row-ms", type=float, default=0.012, help="its time per row (H200, 1.5B: 32 x 2 rows 2.9 ms)")
    ap.add_argument("--prefill-ms", type=float, default=14.0, help="an eager prefill chunk's time (H200, 1.5B)")
    ap.add_argument("--quick", action="store_true", help="8 editors, 6 characters: under a minute")
    ap.add_argument(
        "--layout",
        choices=("both", "on", "off"),
        default="both",
        help="the engine in a child process "
        "(on: fimble serve's CUDA default), in the daemon's (off), or both, interleaved",
    )
    ap.add_argument("--rounds", type=int, default=1, help="run the levels this many times, interleaved")
    ap.add_argument("--fresh-traces", action="store_true", help="a new trace every round (as bench/serve_load.py)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # internal: be the daemon
    ap.add_argument("--engine-process", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not (0 < args.graph_ms <= 1000 and 0 <= args.row_ms <= 100 and 0 <= args.prefill_ms <= 10_000):
        raise SystemExit("--graph-ms 0-1000, --row-ms 0-100, --prefill-ms 0-10000")
    if args.serve:
        return serve(args)
    if args.quick:
        args.levels, args.chars = "8", 6
    levels = [int(x) for x in args.levels.split(",")]
    if any(not 1 <= n <= 256 for n in levels) or not 1 <= args.chars <= 200 or not 0 <= args.think_ms <= 10_000:
        raise SystemExit("levels 1-256 editors, --chars 1-200, --think-ms 0-10000")
    from bench import serve_load

    serve_load.MAX_LINES = 0  # completions run until the next keystroke cancels them (serve_load's GPU runs)
    load_start = os.getloadavg()
    print(
        f"serve_host: simulated graphs {args.graph_ms} ms + {args.row_ms} ms/row, levels {levels}, {args.chars} "
        f"keystrokes, think {args.think_ms} ms, max_tokens 128, 1 torch thread, {os.cpu_count()} CPUs, load average "
        f"{load_start[0]:.2f}",
        flush=True,
    )
    layouts = ("on", "off") if args.layout == "both" else (args.layout,)
    daemons = {layout: simulated_daemon(serve_load, args, layout) for layout in layouts}
    rows: list[dict] = []
    try:
        for rnd, n in ((r, n) for r in range(args.rounds) for n in levels):  # interleaved: every layout at a level
            seed = n + 1000 * rnd if args.fresh_traces else n
            for layout, daemon in daemons.items():
                r = asyncio.run(serve_load.level(daemon.url, n, args.chars, args.think_ms / 1e3, 128, seed=seed))
                r.update(layout="engine process" if layout == "on" else "one process", load=os.getloadavg()[0])
                r["round"] = rnd
                rows.append(r)
    finally:
        for d in daemons.values():
            d.stop()
    print(
        f"{'editors':>7} | {'layout':<14} | {'tok/s':>7} | {'p50 ms':>6} | {'p95 ms':>6} | {'round ms':>8} | "
        f"{'advancing':>9} | {'overlapped':>10} | errors"
    )
    for r in rows:
        print(
            f"{r['editors']:>7} | {r['layout']:<14} | {r['tok_per_s']:>7.0f} | {r['p50_first_delta_ms']:>6.1f} | "
            f"{r['p95_first_delta_ms']:>6.1f} | {r['mean_round_ms']:>8.2f} | {r['mean_advance_ms']:>9.2f} | "
            f"{r['mean_overlap_ms']:>10.2f} | {r['errors']}"
        )
    top = levels[-1]
    if args.layout != "both":
        last = [r for r in rows if r["editors"] == top]
        rates = "/".join(str(round(r["tok_per_s"])) for r in last)
        p95s = "/".join(str(round(r["p95_first_delta_ms"])) for r in last)
        headline = (
            f"serve_host: {top} editors, simulated graphs, {last[0]['layout']}: {rates} tok/s, p95 {p95s} ms; "
            f"load average {os.getloadavg()[0]:.2f}"
        )
    else:
        child = next(r for r in rows if r["editors"] == top and r["layout"] == "engine process")
        alone = next(r for r in rows if r["editors"] == top and r["layout"] == "one process")
        headline = (
            f"serve_host: {top} editors, simulated graphs: engine process {child['tok_per_s']:.0f} tok/s, p95 "
            f"{child['p95_first_delta_ms']:.0f} ms vs one process {alone['tok_per_s']:.0f} tok/s, p95 "
            f"{alone['p95_first_delta_ms']:.0f} ms ({child['tok_per_s'] / max(alone['tok_per_s'], 1e-9):.2f}x); "
            f"round host time advancing {child['mean_advance_ms']:.2f} ms; load average {os.getloadavg()[0]:.2f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "bench": "serve_host",
                    "date": time.strftime("%Y-%m-%d"),
                    "threads": 1,
                    "cpu_count": os.cpu_count(),
                    "graph_ms": args.graph_ms,
                    "row_ms": args.row_ms,
                    "levels": levels,
                    "rounds": args.rounds,
                    "fresh_traces": args.fresh_traces,
                    "layout": args.layout,
                    "load_average_start": load_start,
                    "load_average_end": os.getloadavg(),
                    "rows": rows,
                    "headline": headline,
                },
                indent=2,
            )
            + "\n"
        )
    print(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
