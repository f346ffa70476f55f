"""Start in the time of a click: `fimble complete` wall time, its parts, and the cold wait of `fimble lsp`.

What a user feels before the first ghost text: the whole `fimble complete` process (Python start, imports, the
model's load, the engine, one completion), the median of ``--runs`` after one warm-up run that may build the
on-disk caches (engine/runtimes/probe_cache.py). The parts come from one more process that times each stage
in place (wrapping the loader's functions where the checkout has them; nested parts overlap their callers, and
llama.cpp's load runs on a thread beside the tokenizer's). ``--lsp`` adds the cold wait of `fimble lsp` (server
start to the first text of the first request), from bench/lsp_typing.py's cold phase (``--lsp`` runs of it,
typing a few characters after).

``--compare ROOT`` runs another checkout (e.g. main) the same way, interleaved run by run, so both see the same
load on a shared machine. Run from the repository root: ``python -m bench.start [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SPEC = "tests/data/demo.py:7:9"

# Run inside the measured checkout: times each stage of `fimble complete`'s path, prints one JSON line.
PARTS = r"""
import json, sys, time
t0 = time.perf_counter()
marks = {}
def timed(owner, name, label):
    fn = getattr(owner, name, None)
    if fn is None:
        return
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            marks[label] = marks.get(label, 0.0) + time.perf_counter() - t
    setattr(owner, name, wrapper)
from lsp_server import cli
t1 = time.perf_counter()
import engine.local
marks["import engine.local"] = time.perf_counter() - t1
from engine import loader
from engine.decoding import healing
from engine.runtimes import ggml_lib, ggml_runtime, gguf_loader
timed(gguf_loader, "open_meta", "  GGUF metadata")
timed(gguf_loader, "_tokenizer", "  tokenizer")
timed(ggml_lib.LlamaLib, "load_model", "  llama.cpp load (may overlap)")
timed(ggml_runtime, "_check_probe", "  weights probe")
import engine.scheduler
timed(engine.local, "load_model", "load_model")
timed(loader, "cached_token_texts", "  token texts")
timed(healing.TokenIndex, "__init__", "healing index")
timed(engine.scheduler, "verify_costs", "verify costs")
Engine = engine.local.LocalEngine
real_complete = Engine.complete
timed(engine.local, "LocalEngine", "engine (scheduler)")
def complete(self, request):
    t = time.perf_counter()
    result = real_complete(self, request)
    marks["completion"] = time.perf_counter() - t
    marks["  first token (engine's own)"] = result.stats.get("first_token_ms", 0.0) / 1000
    marks["tokens"] = result.tokens
    return result
Engine.complete = complete
sys.argv = ["fimble", "complete", SPEC]
code = cli.main()
marks["total in process"] = time.perf_counter() - t0
marks["torch imported"] = "torch" in sys.modules
print(json.dumps(marks), file=sys.stderr)
"""


def checkout_env(root: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1")


def complete_once(root: Path, spec: str) -> tuple[float, str]:
    """One whole `fimble complete` process: (wall seconds, what it printed)."""
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "lsp_server", "complete", spec],
        cwd=root,
        env=checkout_env(root),
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"bench.start: fimble complete failed in {root}: {out.stderr[-800:]}")
    return wall, out.stdout


def parts_once(root: Path, spec: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PARTS.replace("SPEC", repr(spec))],
        cwd=root,
        env=checkout_env(root),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise SystemExit(f"bench.start: the parts run failed in {root}: {out.stderr[-800:]}")
    return json.loads(out.stderr.strip().splitlines()[-1])


def lsp_cold_once(root: Path) -> dict:
    """bench/lsp_typing.py's cold phase with the default model: server start to the engine's ready message and to
    the first text of the first request (then it types a few characters and ends)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "typing.json"
        cmd = [sys.executable, "-m", "bench.lsp_typing", "--quick", "--chars", "8", "--cold-timeout", "300"]
        subprocess.run(
            [*cmd, "--json", str(path)], cwd=root, env=checkout_env(root), capture_output=True, text=True, timeout=900
        )
        run = json.loads(path.read_text()).get("run", {}) if path.is_file() else {}
        return {k: run.get(k) for k in ("engine_ready_s", "cold_wait_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 timed runs, no parts run")
    ap.add_argument("--json", metavar="PATH", help="write every figure here")
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="FILE:LINE:COL to complete (relative to each checkout)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs after the warm-up (median)")
    ap.add_argument("--compare", metavar="ROOT", help="another checkout (e.g. main), run interleaved with this one")
    ap.add_argument("--lsp", type=int, default=0, metavar="N", help="also N cold starts of fimble lsp")
    args = ap.parse_args()
    runs = 3 if args.quick else args.runs
    roots = {"this": REPO}
    if args.compare:
        roots["compare"] = Path(args.compare).resolve()
    load_start = os.getloadavg()
    results: dict = {name: {"root": str(root), "walls": [], "lsp_cold_s": []} for name, root in roots.items()}
    for name, root in roots.items():  # the warm-up: may build caches
        results[name]["warmup_s"], results[name]["text"] = complete_once(root, args.spec)
    for _ in range(runs):
        for name, root in roots.items():
            results[name]["walls"].append(complete_once(root, args.spec)[0])
    if not args.quick:
        for name, root in roots.items():
            results[name]["parts"] = parts_once(root, args.spec)
    for _ in range(args.lsp):
        for name, root in roots.items():
            results[name]["lsp_cold_s"].append(lsp_cold_once(root))
    load_end = os.getloadavg()
    threads = os.environ.get("FIMBLE_GGML_THREADS") or "engine default (1 on <= 2 cores)"

    print(f"fimble complete {args.spec}: {runs} runs after a warm-up; cores {os.cpu_count()}, ggml threads {threads}")
    print(f"load average at start {load_start[0]:.2f}, at end {load_end[0]:.2f}")
    names = list(roots)
    print(f"{'':34}" + "".join(f"{n:>14}" for n in names))
    print(f"{'warm-up run (s)':34}" + "".join(f"{results[n]['warmup_s']:14.2f}" for n in names))
    for i in range(runs):
        print(f"{f'run {i + 1} (s)':34}" + "".join(f"{results[n]['walls'][i]:14.2f}" for n in names))
    labels: list[str] = []
    for n in names:
        labels += [k for k in results[n].get("parts", {}) if k not in labels]
    for k in labels:
        cells = []
        for n in names:
            v = results[n].get("parts", {}).get(k)
            cells.append(f"{'-':>14}" if v is None else f"{v:14.2f}" if isinstance(v, float) else f"{v!s:>14}")
        print(f"{k[:34]:34}" + "".join(cells))
    for n in names:
        results[n]["median_s"] = statistics.median(results[n]["walls"])
        for key in ("engine_ready_s", "cold_wait_s"):
            got = [c[key] for c in results[n]["lsp_cold_s"] if c.get(key) is not None]
            results[n][f"lsp_{key}_median"] = statistics.median(got) if got else None
    for key, label in (("engine_ready_s", "fimble lsp: start to engine ready"), ("cold_wait_s", "  to first text (s)")):
        if args.lsp:
            cells = [results[n][f"lsp_{key}_median"] for n in names]
            print(f"{label:34}" + "".join(f"{c:14.2f}" if c is not None else f"{'none':>14}" for c in cells))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"results": results, "load_start": load_start, "load_end": load_end, "threads": threads})
        )
    heads = ", ".join(f"{n} {results[n]['median_s']:.2f} s" for n in names)
    print(f"headline: fimble complete median of {runs} after a warm-up: {heads} (load {load_end[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
