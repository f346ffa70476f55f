"""The batch-invariant projection kernel (engine/runtimes/gpu_kernels.py ``linear``) against cuBLAS, weight by weight,
and the graph step it gives: which tile shape and K split each Qwen2.5 weight wants on this GPU.

    python -m bench.gpu_linear [--quick] [--shapes 0.5B,1.5B] [--step] [--json PATH]

1. Per weight of each shape (qkv with its RMSNorm and bias, o with the residual, gate_up with its RMSNorm, down with
   the silu gate and the residual, the LM head with the final norm and float32 logits; exactly the fused variants a
   step runs), 1 and 16 rows: cuBLAS's plain product on 16 rows (what the default kernel set runs, its norms and
   adds not counted), ``linear`` at ``linear_config``'s choice, and a sweep of (BN, BK, warps, stages, splits).
   Each figure is the time of one product inside a CUDA graph of many, each on another copy of the weight, so the
   weights come from HBM as in a step (the copies together exceed the 50 MB L2 several times).
2. Rows: the best config's row i equals, bit for bit, the same row computed in a pass of 1..16 and of 48 rows.
3. ``--step``: the graph 1-token step, 8- and 16-token verify of the random-weight shape, cache at 1,024 tokens, with
   the default kernels ("invariant-cublas") against the Triton set ("invariant") at the sweep's best configs,
   measured alternately (bench/gpu_invariant.py ``cost_table``); step / floor for both.

Times on a CUDA GPU only; the headline (last line) is the step / floor of the Triton set per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness.random_models import SHAPES
from engine.runtimes import gpu_kernels as gk
from engine.runtimes import gpu_linear as gl

DEV, DTYPE = "cuda", torch.bfloat16
L2_BUST_BYTES = 400e6  # weight copies per timed graph: several times the H200's 50 MB L2


def weights_of(shape: str) -> dict[str, tuple[int, int, str]]:
    s = SHAPES[shape]
    d, f, h, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"]
    hd = d // h
    return {
        "qkv": ((h + 2 * kv) * hd, d, "norm+bias"),
        "o": (d, d, "residual"),
        "gate_up": (2 * f, d, "norm"),
        "down": (d, f, "gated+residual"),
        "lm_head": (s["vocab_size"], d, "norm, float32"),
    }


def narrow_candidates(n: int, k: int) -> list[tuple]:
    """Swap-AB tiles only 16-32 weight rows wide, K split at most twice: for the small products (qkv, o) whose time is
    latency, not bytes (2026-12-07: their wide split-K swap tiles take 6-8 us for 1.5-2 us of weights)."""
    out = []
    for bn in (16, 32):
        for bk in (128, 256, 512):
            for splits in (1, 2):
                for stages in (3, 4):
                    out.append(gl.LinearConfig(bn, bk, 4, stages, splits, gk.LINEAR_ROWS, True))
    return out


def candidates(n: int, k: int, quick: bool) -> list[tuple]:
    """Configs (``LinearConfig``: BN, BK, warps, stages, splits, BM, swap) worth timing beside ``linear_config``'s:
    16-row tensor-core tiles with the weight as the wide side (swap: the weight read once for every row of a
    verify block), K split until the tiles fill the GPU; a few rows a program (BM 4 or 8: the weight slab read once
    for them, each row's tree as alone), narrow tiles, K split 8 ways only where K is long (as the one-row sweep
    found best: bench/reports/gpu-linear-h200-2026-12-05-run2.json)."""
    out: list[tuple] = []
    for bn in (64,) if quick else (64, 128):
        for bk in (128,) if quick else (64, 128, 256):
            splits = gl._splits(-(-n // bn), -(-k // bk))
            out.append(gl.LinearConfig(bn, bk, 4, 3, splits, gk.LINEAR_ROWS, True))
    for bm in (4, 8):
        for bn in (8, 16) if not quick else (8,):
            for bk in (64, 128):
                splits = 8 if k >= 4096 else 1
                if -(-n // bn) * splits >= gk.SM_TARGET // 2:
                    out.append(gl.LinearConfig(bn, bk, 4, 4, splits, bm))
    return out


def sync() -> None:
    torch.cuda.synchronize()


def graph_us(fns: list) -> float:
    """Median time of one call of ``fns`` (each on its own weight copy), replayed from one CUDA graph, in us."""
    for fn in fns[:2]:
        fn()
    sync()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns[:2]:
            fn()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        sync()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    del graph
    return statistics.median(times)


def fused_linear(kind: str, x, w, cfg, *, norm, bias, residual) -> torch.Tensor:
    """``gk.linear`` as the fused variant ``kind`` (``weights_of``'s third field) runs it in a pass."""
    kw: dict = {"config": cfg}
    if "norm" in kind:
        kw.update(norm=norm, eps=1e-6)
    if "bias" in kind:
        kw["bias"] = bias
    if "residual" in kind:
        kw["residual"] = residual
    if "float32" in kind:
        kw["out_dtype"] = torch.float32
    return gk.linear(x, w, gated="gated" in kind, **kw)


class Weight:
    """One weight's copies and the inputs of its fused variant."""

    def __init__(self, n: int, k: int, kind: str) -> None:
        copies = max(2, min(48, int(L2_BUST_BYTES // (n * k * 2)) + 1))
        self.ws = [torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.02 for _ in range(copies)]
        self.n, self.k, self.kind = n, k, kind
        gen = torch.Generator(device=DEV).manual_seed(3)
        self.x = torch.randn(48, 2 * k if "gated" in kind else k, device=DEV, dtype=DTYPE, generator=gen)
        self.res = torch.randn(48, n, device=DEV, dtype=DTYPE, generator=gen)
        self.bias = torch.randn(n, device=DEV, dtype=DTYPE, generator=gen) * 0.1
        self.norm = torch.rand(k, device=DEV, dtype=DTYPE, generator=gen) + 0.5

    def call(self, w: torch.Tensor, m: int, cfg=None) -> torch.Tensor:
        return fused_linear(self.kind, self.x[:m], w, cfg, norm=self.norm, bias=self.bias, residual=self.res[:m])

    def triton_us(self, m: int, cfg=None) -> float:
        return graph_us([lambda w=w: self.call(w, m, cfg) for w in self.ws])

    def cublas_us(self) -> float:
        x = torch.randn(16, self.k, device=DEV, dtype=DTYPE)
        return graph_us([lambda w=w: F.linear(x, w) for w in self.ws])

    def rows_equal(self, cfg) -> bool:
        w = self.ws[0]
        full = self.call(w, 48, cfg)
        ok = all(torch.equal(self.call(w, m, cfg), full[:m]) for m in range(1, 17))
        return ok and torch.equal(self.call(w, 16, cfg), full[:16])


def measure(wt: Weight, row: dict, tried: dict, cfg: tuple) -> None:
    """``tried[cfg]`` = (1-row, 8-row) us of ``cfg`` on ``wt`` (a config that does not compile: noted in ``row``)."""
    if cfg in tried:
        return
    try:
        tried[cfg] = (wt.triton_us(1, cfg), wt.triton_us(8, cfg))
    except Exception as exc:  # noqa: BLE001 - noted, skipped
        row.setdefault("errors", []).append(f"{cfg}: {type(exc).__name__}")


@torch.inference_mode()
def sweep(shapes: list[str], quick: bool, weights: list[str] | None = None, narrow: bool = False) -> list[dict]:
    rows = []
    for shape in shapes:
        for label, (n, k, kind) in weights_of(shape).items():
            if weights and label not in weights:
                continue
            t0 = time.perf_counter()
            wt = Weight(n, k, kind)
            row = {"shape": shape, "weight": label, "n": n, "k": k, "fused": kind, "copies": len(wt.ws)}
            row["floor_us"] = n * k * 2 / 4.2e12 * 1e6
            row["cublas16_us"] = wt.cublas_us()
            row["config_default"] = list(gk.linear_config(n, k))
            row["default_m1_us"] = wt.triton_us(1)
            old = (*gk.linear_config(n, k)[:4], 1, gk.LINEAR_ROWS)  # 16-row tiles, rows as M, no split
            row["unsplit_m1_us"] = wt.triton_us(1, old)
            tried: dict = {}  # config -> (1 row, 8 rows) us; the sweep's score is their sum (a step and a verify)
            measure(wt, row, tried, tuple(row["config_default"]))
            for cfg in candidates(n, k, quick) + (narrow_candidates(n, k) if narrow else []):
                measure(wt, row, tried, cfg)
            best = min(tried, key=lambda c: sum(tried[c]))
            for warps, stages in ((8, best[3]), (best[2], 2), (best[2], 4)):
                if not quick:
                    measure(wt, row, tried, gl.LinearConfig.of(best)._replace(warps=warps, stages=stages))
            best = min(tried, key=lambda c: sum(tried[c]))
            fastest_step = min(tried, key=lambda c: tried[c][0])
            row["best"] = list(best)
            row["best_m1_us"], row["best_m8_us"] = tried[best]
            row["best_m16_us"] = wt.triton_us(16, best)
            row["fastest_1row"] = list(fastest_step)
            row["fastest_1row_us"] = tried[fastest_step]
            row["best_rows_equal"] = wt.rows_equal(best)
            row["tried"] = {
                str(list(c)): [round(t, 2) for t in ts] for c, ts in sorted(tried.items(), key=lambda kv: sum(kv[1]))
            }
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(
                f"  {shape:5s} {label:8s} {n:6d}x{k:<5d} floor {row['floor_us']:6.1f} us  cuBLAS16 "
                f"{row['cublas16_us']:6.1f}  unsplit {row['unsplit_m1_us']:6.1f}  default {row['default_m1_us']:6.1f}"
                f"  best {row['best_m1_us']:6.1f} (m8 {row['best_m8_us']:6.1f}, m16 {row['best_m16_us']:6.1f}) {best}"
                f" fastest 1-row {fastest_step} {row['fastest_1row_us'][0]:.1f} rows-equal "
                f"{row['best_rows_equal']}  [{len(tried)} configs, {row['seconds']:.0f} s]",
                flush=True,
            )
            del wt
            torch.cuda.empty_cache()
    return rows


def step_costs(shapes: list[str], table: dict, context: int) -> list[dict]:
    """bench/gpu_invariant.py's graph step table, default kernels against the Triton set on ``table``'s configs."""
    from bench import gpu as gb
    from bench import gpu_invariant as gi
    from bench.harness.random_models import random_model

    plain = gl.linear_config
    gl.linear_config = lambda n, k: gl.LinearConfig.of(table[(n, k)]) if (n, k) in table else plain(n, k)
    gi.MODES = ("invariant-cublas", "invariant")
    bw = gb.copy_bandwidth()
    out = []
    try:
        for shape in shapes:
            model = random_model(shape)
            row = gi.cost_table(shape, model, context, bw, 20, 3)
            row["copy_bandwidth_TBps"] = bw / 1e12
            out.append(row)
            print(f"  step {shape}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)))
            del model
            torch.cuda.empty_cache()
    finally:
        gl.linear_config = plain
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="0.5B, fewer configs: under a minute")
    ap.add_argument("--shapes", default=None, help="comma list of 0.5B,1.5B,7B (default 0.5B,1.5B)")
    ap.add_argument("--step", action="store_true", help="also the graph step at the best configs (3.)")
    ap.add_argument("--step-only", action="store_true", help="only the graph step, at linear_config's configs")
    ap.add_argument("--configs-from", type=Path, help="with --step-only: an earlier sweep's configs (its json)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--weights", help="comma list of qkv,o,gate_up,down,lm_head to sweep (default all)")
    ap.add_argument("--narrow", action="store_true", help="also 16-32-row swap tiles, K split at most twice")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not gk.available():
        sys.exit("bench/gpu_linear.py needs CUDA and Triton")
    import triton

    shapes = (args.shapes or ("0.5B" if args.quick else "0.5B,1.5B")).split(",")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    result["attention_fixed_trips"] = gk.FIXED_TRIPS
    print(f"device {result['device']}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    weights = args.weights.split(",") if args.weights else None
    if weights and set(weights) - {"qkv", "o", "gate_up", "down", "lm_head"}:
        sys.exit(f"--weights: unknown {', '.join(sorted(set(weights) - {'qkv', 'o', 'gate_up', 'down', 'lm_head'}))}")
    result["sweep"] = [] if args.step_only else sweep(shapes, args.quick, weights, args.narrow)
    swept = json.loads(args.configs_from.read_text())["sweep"] if args.configs_from else result["sweep"]
    table = {(r["n"], r["k"]): tuple(r["best"]) for r in swept}
    if args.step or args.step_only:
        result["step"] = step_costs(shapes, table, args.context)
    result["loadavg"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    print(
        f"\n{'weight':16s} {'floor us':>8s} {'cuBLAS16':>8s} {'best m1':>8s} {'m8':>7s} {'m16':>7s}  "
        "best (step + 8-row verify)"
    )
    for r in result["sweep"]:
        print(
            f"{r['shape'] + ' ' + r['weight']:16s} {r['floor_us']:8.1f} {r['cublas16_us']:8.1f} "
            f"{r['best_m1_us']:8.1f} {r['best_m8_us']:7.1f} {r['best_m16_us']:7.1f}  {r['best']} "
            f"rows-equal {r['best_rows_equal']}"
        )
    heads = []
    for r in result.get("step", []):
        heads.append(
            f"{r['shape']} step/floor cuBLAS {r['step_over_floor_invariant-cublas']:.2f}x, "
            f"Triton {r['step_over_floor_invariant']:.2f}x ({r['graph_step_ms_invariant']:.3f} ms)"
        )
    print("headline: " + ("; ".join(heads) if heads else "projection sweep only (--step for the graph step)"))


if __name__ == "__main__":
    main()
