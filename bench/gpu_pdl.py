"""Programmatic dependent launch on the CUDA path's Triton kernels (issue 27): the graph step with FIMBLE_CUDA_PDL off
and on, in one process, interleaved, and whether the two give the same bits.

    python -m bench.gpu_pdl [--shapes 0.5B,1.5B] [--sets invariant,invariant-cublas] [--context 1024] [--quick]
                            [--json PATH]

Per shape and kernel set, two ``GraphRuntime``s of one random-weight model: one captured with PDL off, one with it on
(engine/runtimes/gpu_linear.py ``use_pdl``, read as each graph is captured), and one with PDL and 2 weight slabs
prefetched into L2 while a projection waits (``FIMBLE_CUDA_PREFETCH``). In rounds, alternately: the host-timed
graph step (call and argmax read back), the 8-token verify, and back-to-back replays of the step's graph (GPU time).
The step's and the verify's logits of the two are compared bit for bit (PDL changes when a kernel starts, never what
it computes). Floor = weight bytes / measured copy bandwidth. The table, then the headline, last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench import gpu as gb
from bench.harness.random_models import random_model, weight_bytes
from engine.runtimes import gpu_kernels as gk
from engine.runtimes import gpu_linear as gl
from engine.runtimes.cuda_graphs import GraphRuntime, key_bucket
from engine.runtimes.graph_forward import _min_block, block_bucket

# compared variants: name -> (PDL on, weight slabs prefetched into L2 while a projection waits, attention's keys a
# split, attention's keys a tile). Only variants of one attention geometry can share bits (another split or tile sums
# the keys in another order: lossless within a process either way, as every pass uses the same geometry).
VARIANTS = {
    "off": (False, 0, 256, 64),
    # PDL as the engine's default (auto: layers 1,536 wide and up), attention at another split / tile (2026-12-07)
    "auto": (None, 2, 256, 64),
    "auto-s128": (None, 2, 128, 64),
    "auto-s64": (None, 2, 64, 64),
    "auto-s64-t32": (None, 2, 64, 32),
    "auto-s32-t32": (None, 2, 32, 32),
    "on": (True, 0, 256, 64),
    "pf2": (True, 2, 256, 64),
    "pf2-s128": (True, 2, 128, 64),
    "pf2-s64": (True, 2, 64, 64),
    "pf2-t128": (True, 2, 256, 128),
}


def set_variant(name: str) -> None:
    on, slabs, split, tile = VARIANTS[name]
    os.environ[gl.PDL_ENV] = "auto" if on is None else "1" if on else "0"
    os.environ[gl.PREFETCH_ENV] = str(slabs)
    gl.use_pdl.cache_clear()
    gl.prefetch_slabs.cache_clear()
    gk.SPLIT_KEYS, gk.BLOCK_N = split, tile


def same_geometry(a: str, b: str) -> bool:
    return VARIANTS[a][2:] == VARIANTS[b][2:]


def _host_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _replay_ms(graph, reps: int = 20) -> float:
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


@torch.inference_mode()
def compare(shape: str, kernels: str, context: int, rounds: int, n: int, bandwidth: float) -> dict:
    model = random_model(shape)
    model.invariant = kernels
    vocab = model.cfg.vocab_size
    cache = model.new_cache(context + 64)
    gen = torch.Generator().manual_seed(1)
    set_variant("off")
    model(torch.randint(0, vocab, (context,), generator=gen).to(gb.DEV), cache, 0, 1)
    one = torch.randint(0, vocab, (1,), generator=gen).to(gb.DEV)
    eight = torch.randint(0, vocab, (8,), generator=gen).to(gb.DEV)
    runtimes, graphs, logits, failed = {}, {}, {}, {}
    for on in VARIANTS:  # each runtime's graphs captured under its own setting
        set_variant(on)
        try:
            rt = GraphRuntime(model, attention=kernels)
            step = rt(one, cache, context, 1).clone()
            verify = rt(eight, cache, context, 8).clone()
            block = _min_block(block_bucket(1), kernels)  # the graph a 1-token step replays (16 rows: cuBLAS set)
            graphs[on], _ = rt._graph(cache, block, key_bucket(context + 1, cache.max_len))
        except Exception as exc:  # noqa: BLE001 - a geometry this GPU cannot compile (shared memory): noted
            failed[on] = f"{type(exc).__name__}: {str(exc)[:120]}"
            continue
        runtimes[on], logits[on] = rt, (step, verify)
    names = list(runtimes)
    same = [v for v in names if same_geometry("off", v)]
    same_step = all(torch.equal(logits["off"][0], logits[v][0]) for v in same)
    same_verify = all(torch.equal(logits["off"][1], logits[v][1]) for v in same)
    samples: dict[str, list[float]] = {f"{k}_{v}": [] for k in ("step", "verify8", "gpu") for v in names}
    for _ in range(rounds):
        for on in names:
            rt, tag = runtimes[on], on
            set_variant(on)
            samples[f"step_{tag}"] += [_host_ms(lambda rt=rt: rt(one, cache, context, 1).argmax(-1).tolist())
                                       for _ in range(n)]  # fmt: skip
            samples[f"verify8_{tag}"] += [_host_ms(lambda rt=rt: rt(eight, cache, context, 8).argmax(-1).tolist())
                                          for _ in range(n)]  # fmt: skip
            samples[f"gpu_{tag}"] += [_replay_ms(graphs[on]) for _ in range(max(2, n // 10))]
    floor = weight_bytes(model) / bandwidth * 1e3
    row = {"shape": shape, "kernels": kernels, "context": context, "floor_ms": floor, "variants": names}
    row.update({k: statistics.median(v) for k, v in samples.items()})
    row["same_step_bits"], row["same_verify_bits"], row["failed"] = same_step, same_verify, failed
    for tag in names:
        row[f"step_over_floor_{tag}"] = row[f"step_{tag}"] / floor
    set_variant("off")
    del runtimes, graphs, model
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0.5B,1.5B")
    ap.add_argument("--sets", default="invariant,invariant-cublas", help="kernel sets (cuda_graphs attention names)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="0.5B, the Triton set, 2 rounds: under a minute")
    ap.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)} (default all; off always runs)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.variants:
        unknown = set(args.variants.split(",")) - set(VARIANTS)
        if unknown:
            raise SystemExit(f"unknown variants: {', '.join(sorted(unknown))}")
        for name in list(VARIANTS):
            if name != "off" and name not in args.variants.split(","):
                del VARIANTS[name]
    if not torch.cuda.is_available():
        raise SystemExit("gpu_pdl needs a CUDA device")
    if not 64 <= args.context <= 8192:
        raise SystemExit("--context must be in 64..8192")
    shapes = ["0.5B"] if args.quick else args.shapes.split(",")
    sets = ["invariant"] if args.quick else args.sets.split(",")
    rounds = 2 if args.quick else max(1, args.rounds)
    device = torch.cuda.get_device_name()
    bandwidth = gb.copy_bandwidth()
    rows = []
    print(f"{device}, copy {bandwidth / 1e12:.2f} TB/s, load {os.getloadavg()[0]:.2f}, cache {args.context} tokens")
    print("shape | kernels          | variant  | step ms | /off  | verify8 ms | /off  | GPU step ms | step/floor")
    for shape in shapes:
        for kernels in sets:
            r = compare(shape, kernels, args.context, rounds, 20, bandwidth)
            rows.append(r)
            for v in r["variants"]:
                print(f"{shape:5s} | {kernels:16s} | {v:8s} | {r[f'step_{v}']:7.3f} | "
                      f"{r[f'step_{v}'] / r['step_off']:5.3f} | {r[f'verify8_{v}']:10.3f} | "
                      f"{r[f'verify8_{v}'] / r['verify8_off']:5.3f} | {r[f'gpu_{v}']:11.3f} | "
                      f"{r[f'step_over_floor_{v}']:10.2f}", flush=True)  # fmt: skip
            for v, why in r["failed"].items():
                print(f"{shape:5s} | {kernels:16s} | {v:8s} | failed: {why}")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "load": os.getloadavg(), "rows": rows}, indent=1))
    same = all(r["same_step_bits"] and r["same_verify_bits"] for r in rows)
    best = ", ".join(
        f"{r['shape']} {r['kernels']} {r['step_off']:.3f} -> {min(r[f'step_{v}'] for v in r['variants']):.3f} ms "
        f"({min(r['variants'], key=lambda v: r[f'step_{v}'])})"
        for r in rows
    )
    print(f"gpu_pdl: graph step, PDL off -> the fastest variant: {best}; same bits within a geometry {same} ({device})")


if __name__ == "__main__":
    main()
