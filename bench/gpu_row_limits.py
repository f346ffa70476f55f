"""Row limits for the default CUDA kernels ("invariant-cublas", engine/runtimes/row_limits.py): what the probe finds,
what it proves and what it costs, on random-weight Qwen2.5 shapes in bf16, in one run on one GPU.

    python -m bench.gpu_row_limits [--quick] [--shapes 0.5B,1.5B,7B] [--json PATH]

Per shape: the probed (base, limit) per stage (every product runs on at least base and at most limit rows a
call, so each row gets the bits of a base-row pass; engine/runtimes/row_limits.py) and the probe's time; rows of a
batched round (a slotted graph round and the eager batched pass, 32 streams x 1, 4 and 16 tokens) that differ from
each sequence's own pass, limits on and off (bench/harness/slot_rounds.py); the GPU time of one captured round of
1 (a single sequence's step or verify graph: 16 rows), 8, 16 or 32 streams x 1, 4 and 16 tokens at depth 512, and
an eager 512-token prefill pass, limits on and off, measured alternately (medians). A single pass changes only
where a stage's base is over 16. The last lines are the table and the headline.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness.random_models import random_model
from bench.harness.slot_rounds import rows_differing
from engine.runtimes import gpu_kernels as gk
from engine.runtimes import row_limits as rl
from engine.runtimes.cuda_graphs import BatchedCache, capture, forward_batch, key_bucket

ROUNDS = ((1, 16), (8, 16), (16, 16), (32, 1), (32, 4), (32, 16))  # (streams, block); 1 x 16: a single step
OFF = dict.fromkeys(rl.STAGES, rl.OFF)


def _event_ms(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


@torch.inference_mode()
def round_costs(model, limits: dict, depth: int, reps: int) -> dict:
    """GPU ms of one captured round per (streams, block), and of an eager 512-token prefill, limits on / off."""
    out = {}
    for streams, block in ROUNDS:
        keys_len = key_bucket(depth + block, 1 << 20)
        cache = BatchedCache(model, streams, keys_len)
        tokens = torch.randint(0, model.cfg.vocab_size, (streams, block), device=model.device)
        starts = torch.full((streams,), depth, dtype=torch.long, device=model.device)
        graphs = {}
        fwd = functools.partial(
            forward_batch, model, cache.keys, cache.values, tokens, starts, keys_len, attention="invariant-cublas"
        )
        for name, lim in (("on", limits), ("off", OFF)):
            model.row_limits = lim
            graphs[name] = capture(fwd, torch.cuda.graph_pool_handle())[0]
        samples = {"on": [], "off": []}
        for _ in range(reps):  # alternately, so drift hits both alike
            for name, graph in graphs.items():
                samples[name] += _event_ms(graph.replay, 3)
        out[f"{streams}x{block}"] = {k: statistics.median(v) for k, v in samples.items()}
        del graphs, fwd
    prompt = torch.randint(0, model.cfg.vocab_size, (512,), device=model.device)
    kv = model.new_cache(600)
    samples = {"on": [], "off": []}
    for i in range(reps + 1):
        for name, lim in (("on", limits), ("off", OFF)):
            model.row_limits = lim
            ms = _event_ms(lambda: model(prompt, kv, 0, 1), 1)
            if i:  # the first of each: warm-up
                samples[name] += ms
    out["prefill512"] = {k: statistics.median(v) for k, v in samples.items()}
    model.row_limits = limits
    return out


def run_shape(shape: str, reps: int) -> dict:
    model = random_model(shape)
    model.invariant = "invariant-cublas"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    limits = rl.limits(model, gk.CUBLAS_ROWS)
    torch.cuda.synchronize()
    row: dict = {"shape": shape, "limits": dict(limits), "probe_s": time.perf_counter() - t0, "rows": {}}
    for block in (1, 4, 16):
        on = rows_differing(model, 32, block)
        model.row_limits = OFF
        off = rows_differing(model, 32, block)
        model.row_limits = limits
        row["rows"][f"32x{block}"] = {"on": on, "off": off}
    row["cost"] = round_costs(model, limits, 512, reps)
    del model
    torch.cuda.empty_cache()
    return row


def report(result: dict) -> None:
    print(f"\nbench/gpu_row_limits.py: {result['device']}, torch {result['torch']}, bf16, threads {result['threads']}, "
          f"load average {result['loadavg']}, {result['seconds']:.0f} s")  # fmt: skip
    print("(base, limit) per stage: rows a call runs on at least / at most (512: no change found up to 512):")
    for r in result["shapes"]:
        print(f"  {r['shape']:5s} {r['limits']}  (probe {r['probe_s']:.2f} s)")
    print("rows differing from each sequence alone (slot round + eager batched pass), limits on / off:")
    for r in result["shapes"]:
        cells = []
        for key, v in r["rows"].items():
            on = v["on"]["slot_round"] + v["on"]["batched_pass"]
            off = v["off"]["slot_round"] + v["off"]["batched_pass"]
            cells.append(f"{key} {on}/{off} of {2 * v['on']['rows']}")
        print(f"  {r['shape']:5s} " + ", ".join(cells))
    print("GPU ms, limits on / off (one captured round at depth 512; eager 512-token prefill):")
    for r in result["shapes"]:
        cells = [f"{k} {v['on']:.3f}/{v['off']:.3f}" for k, v in r["cost"].items()]
        print(f"  {r['shape']:5s} " + ", ".join(cells))
    on = sum(v["on"]["slot_round"] + v["on"]["batched_pass"] for r in result["shapes"] for v in r["rows"].values())
    off = sum(v["off"]["slot_round"] + v["off"]["batched_pass"] for r in result["shapes"] for v in r["rows"].values())
    total = sum(2 * v["on"]["rows"] for r in result["shapes"] for v in r["rows"].values())
    worst = max((v["on"] / v["off"] - 1, f"{r['shape']} {k}") for r in result["shapes"] for k, v in r["cost"].items())
    steps = ", ".join(f"{r['shape']} {r['cost']['1x16']['on'] / r['cost']['1x16']['off'] - 1:+.1%}"
                      for r in result["shapes"])  # fmt: skip
    print(f"headline: batched rows differing from alone {on}/{total} with row limits, {off}/{total} without; "
          f"single-pass graph cost {steps}; largest cost {worst[0]:+.1%} ({worst[1]})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="0.5B and 1.5B only, fewer repeats")
    ap.add_argument("--shapes", default=None, help="comma list of 0.5B,1.5B,7B")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not gk.available():
        sys.exit("bench/gpu_row_limits.py needs CUDA and Triton")
    shapes = (args.shapes or ("0.5B,1.5B" if args.quick else "0.5B,1.5B,7B")).split(",")
    reps = 5 if args.quick else 15
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": []}
    result["threads"] = torch.get_num_threads()
    t0 = time.perf_counter()
    for shape in shapes:
        result["shapes"].append(run_shape(shape, reps))
        print(f"  {shape} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    result["seconds"] = time.perf_counter() - t0
    result["loadavg"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    report(result)


if __name__ == "__main__":
    main()
