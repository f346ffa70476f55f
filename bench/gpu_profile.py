"""Where a graph decode step's GPU time goes: kernel durations of the static 1-token pass, per kind.

    python -m bench.gpu_profile [--shape 0.5B] [--attention sdpa|matmul] [--json PATH]

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5B")
    ap.add_argument("--attention", default="matmul")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = random_model(args.shape)
    context = 1024
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
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eager(one, cache, context, 1)
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:  # a kernel (or memcpy/memset) on the GPU
            per_name[ev.name].append(ev.time_range.elapsed_us() / 1e3)  # ms
    rows = sorted(((sum(v) / args.steps, len(v) / args.steps, name) for name, v in per_name.items()), reverse=True)
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


if __name__ == "__main__":
    main()
