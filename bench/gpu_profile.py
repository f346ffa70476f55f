"""Where a graph decode step's GPU time goes: kernel durations of the static 1-token pass, per kind.

    python -m bench.gpu_profile [--shape 0.5B] [--attention sdpa|matmul|invariant-cublas|invariant] [--json PATH]
    python -m bench.gpu_profile --shape 1.5B --attention invariant-cublas --round 32x2 [--context 1024]

``--round SxT``: a batched serve round instead (engine/runtimes/slot_graphs.py ``SlotGraphs``: S sequences of T
tokens each, every cache at ``--context`` tokens), the graph replay timed and the same round run uncaptured under
the profiler: what a serve round's GPU time is made of, per kernel set.

Runs the pass that bench/gpu.py captures (engine/runtimes/cuda_graphs.py forward_batch, block 1, cache at 1,024
tokens) uncaptured under torch.profiler, and sums the kernels' own durations by name. Their total against
the graph's replay time says how much of a step is kernel execution and how much the gaps between
kernels; the table says which kernels a fused layer would have to absorb. Headline last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.harness.random_models import random_model, weight_bytes
from engine.runtimes.cuda_graphs import GraphRuntime, key_bucket


def kernel_rows(fn, steps: int) -> list[tuple[float, float, str]]:
    """``fn`` run ``steps`` times under the profiler: (ms per call, kernels per call, name) per GPU kernel name
    (memcpy/memset included), the largest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:  # a kernel (or memcpy/memset) on the GPU
            per_name[ev.name].append(ev.time_range.elapsed_us() / 1e3)  # ms
    return sorted(((sum(v) / steps, len(v) / steps, name) for name, v in per_name.items()), reverse=True)


def round_passes(model, args) -> tuple:
    """A SlotGraphs round of ``args.round`` (SxT) on ``model``: (slots with graphs, slots without, passes)."""
    from engine.runtimes.slot_graphs import SlotGraphs

    seqs, block = (int(v) for v in args.round.lower().split("x"))
    if not 1 <= seqs <= 128 or not 1 <= block <= 16:
        raise SystemExit("--round wants SxT with S in 1..128 and T in 1..16")
    max_len = args.context + 64
    vocab = model.cfg.vocab_size
    base = model.new_cache(max_len)
    model(torch.randint(0, vocab, (args.context,), device=model.device), base, 0, 1)
    toks = torch.randint(0, vocab, (block,), device=model.device)
    built = []
    for use_graphs in (True, False):
        slots = SlotGraphs(model, seqs, max_len, attention=args.attention)
        slots.use_graphs = slots.use_graphs and use_graphs
        views = []
        for _ in range(seqs):
            c = model.new_cache(max_len)
            c.keys.copy_(base.keys)
            c.values.copy_(base.values)
            c.length = base.length
            views.append(slots.take(c))
        built.append((slots, [(toks, v, args.context, block) for v in views]))
    return built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5B")
    ap.add_argument("--attention", default="matmul")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--round", help="SxT: profile a batched serve round of S sequences x T tokens")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens (64..8192)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not 64 <= args.context <= 8192:
        raise SystemExit("--context must be in 64..8192")
    model = random_model(args.shape)
    if args.attention in ("invariant-cublas", "invariant"):
        model.invariant = args.attention  # the eager passes' kernel set too
    if args.round:
        return profile_round(model, args)
    context = args.context
    cache = model.new_cache(context + 64)
    model(torch.randint(0, model.cfg.vocab_size, (context,), device="cuda"), cache, 0, 1)
    one = torch.randint(0, model.cfg.vocab_size, (1,), device="cuda")
    graphs = GraphRuntime(model, attention=args.attention)
    graphs(one, cache, context, 1)
    graph, _ = graphs._graph(cache, 1, key_bucket(context + 1, cache.max_len))
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - t0) * 10
    eager = GraphRuntime(model, attention=args.attention)
    eager.use_graphs = False  # the same pass, launched op by op, so the profiler sees each kernel
    for _ in range(3):
        eager(one, cache, context, 1)
    torch.cuda.synchronize()
    rows = kernel_rows(lambda: eager(one, cache, context, 1), args.steps)
    kernel_ms = sum(r[0] for r in rows)
    kernels = sum(r[1] for r in rows)
    floor = weight_bytes(model) / 4.2e12 * 1e3
    print(
        f"\n{args.shape}, attention {args.attention}, cache {context}: graph replay {replay_ms:.3f} ms per step, "
        f"{kernels:.0f} kernels, their own time {kernel_ms:.3f} ms; floor at 4.2 TB/s {floor:.3f} ms; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'ms/step':>8s} {'n/step':>6s} {'mean us':>8s}  kernel")
    for ms, n, name in rows[:25]:
        print(f"{ms:8.4f} {n:6.0f} {ms / n * 1e3:8.2f}  {name[:110]}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "shape": args.shape,
                    "attention": args.attention,
                    "replay_ms": replay_ms,
                    "kernels": kernels,
                    "kernel_ms": kernel_ms,
                    "floor_ms": floor,
                    "rows": [{"ms": r[0], "n": r[1], "name": r[2]} for r in rows],
                },
                indent=1,
            )
        )
    print(
        f"headline: {args.shape} graph step {replay_ms:.3f} ms = {kernels:.0f} kernels running {kernel_ms:.3f} ms "
        f"+ {replay_ms - kernel_ms:.3f} ms between them; floor {floor:.3f} ms; median kernel "
        f"{statistics.median(r[0] / r[1] for r in rows) * 1e3:.1f} us"
    )


def profile_round(model, args) -> None:
    (graphed, passes_g), (eager, passes_e) = round_passes(model, args)
    for _ in range(3):  # capture, then warm replays
        graphed.run(passes_g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        graphed.run(passes_g)
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - t0) * 1e3 / 50
    gpu_ms = graphed.pass_ms(graphed.shape(passes_g))
    for _ in range(3):
        eager.run(passes_e)
    torch.cuda.synchronize()
    rows = kernel_rows(lambda: eager.run(passes_e), args.steps)
    kernel_ms = sum(r[0] for r in rows)
    kernels = sum(r[1] for r in rows)
    floor = weight_bytes(model) / 4.2e12 * 1e3
    print(
        f"\n{args.shape}, kernels {args.attention}, round {args.round} at {args.context} cached: graph round "
        f"{replay_ms:.3f} ms host-timed ({gpu_ms if gpu_ms is None else round(gpu_ms, 3)} ms GPU), {kernels:.0f} "
        f"kernels running {kernel_ms:.3f} ms uncaptured; floor (4.2 TB/s) {floor:.3f} ms; load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'ms/round':>8s} {'n/round':>7s} {'mean us':>8s}  kernel")
    for ms, n, name in rows[:30]:
        print(f"{ms:8.4f} {n:7.0f} {ms / n * 1e3:8.2f}  {name[:110]}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"shape": args.shape, "kernels": args.attention, "round": args.round, "context": args.context,
                 "replay_ms": replay_ms, "gpu_ms": gpu_ms, "kernels_per_round": kernels, "kernel_ms": kernel_ms,
                 "floor_ms": floor, "rows": [{"ms": r[0], "n": r[1], "name": r[2]} for r in rows]},
                indent=1,
            )
        )  # fmt: skip
    print(
        f"headline: {args.shape} {args.attention} round {args.round}: graph {replay_ms:.3f} ms, {kernels:.0f} kernels "
        f"running {kernel_ms:.3f} ms; the largest {rows[0][2][:60]} {rows[0][0]:.3f} ms"
    )


if __name__ == "__main__":
    main()
