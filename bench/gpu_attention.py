"""The CUDA path's attention kernel (engine/runtimes/gpu_kernels.py ``attention``) per geometry, on the shapes the
engine runs: a 1-token step and an 8-token verify of one sequence, and fimble serve's batched rounds (32 sequences of
1-4 tokens over ~2,000 cached keys).

    python -m bench.gpu_attention [--variants bm16-s256-n64-w4,bm32-s256-n64-w4,...] [--quick] [--json PATH]

A variant is the kernel's geometry: query rows a program (``BLOCK_M``), keys a split (``SPLIT_KEYS``), keys a tile
(``BLOCK_N``), warps a program. Each variant runs every case eagerly, ordered (the batch-invariant sets' mode), each
layer's call on its own cache (28 layers, as a model's: one layer's keys are not in L2 when the next reads its own),
an L2 flush before each call; the kernels' own GPU time comes from torch.profiler, per call, the median of the rounds.
Variants interleave per round. Another geometry sums the keys in another order: a variant changes the bits the engine
computes (the same for every pass shape within a variant: the GPU suite checks a default before it is taken).
The table per case, then the headline (the best variant per case against the default), last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from engine.runtimes import gpu_kernels as gk
from engine.runtimes.cuda_graphs import key_bucket

DEFAULT_VARIANT = "bm16-s256-n64-w4"  # the engine's geometry (gpu_kernels' BLOCK_M, SPLIT_KEYS, BLOCK_N, warps)
VARIANTS = (
    DEFAULT_VARIANT,
    "bm32-s256-n64-w4",
    "bm16-s256-n128-w4",
    "bm32-s256-n128-w4",
    "bm16-s128-n64-w4",
    "bm32-s512-n64-w4",
    "bm32-s256-n64-w8",
    "bm64-s256-n64-w4",
)
# (name, query heads, kv heads, head dim, sequences, tokens a sequence, cached tokens)
CASES = (
    ("1.5B step", 12, 2, 128, 1, 1, 1024),
    ("1.5B verify8", 12, 2, 128, 1, 8, 1024),
    ("1.5B serve 32x1", 12, 2, 128, 32, 1, 1900),
    ("1.5B serve 32x2", 12, 2, 128, 32, 2, 1900),
    ("1.5B serve 32x4", 12, 2, 128, 32, 4, 1900),
    ("0.5B step", 14, 2, 64, 1, 1, 1024),
    ("0.5B serve 32x2", 14, 2, 64, 32, 2, 1900),
)
LAYERS = 28


def parse_variant(name: str) -> tuple[int, int, int, int]:
    """ "bm32-s256-n64-w4" -> (32, 256, 64, 4); a clear error on anything else."""
    try:
        bm, split, tile, warps = name.split("-")
        out = int(bm[2:]), int(split[1:]), int(tile[1:]), int(warps[1:])
        assert bm[:2] == "bm" and split[0] == "s" and tile[0] == "n" and warps[0] == "w"
    except (ValueError, AssertionError):
        raise SystemExit(f"bad variant {name!r}: want bm<rows>-s<split keys>-n<tile keys>-w<warps>") from None
    rows, split, tile, warps = out
    if rows not in (16, 32, 64) or tile not in (32, 64, 128) or split % tile or warps not in (2, 4, 8):
        raise SystemExit(f"bad variant {name!r}: rows 16/32/64, tile 32/64/128 dividing the split, warps 2/4/8")
    return out


def set_variant(name: str) -> None:
    gk.BLOCK_M, gk.SPLIT_KEYS, gk.BLOCK_N, gk.ATTENTION_WARPS = parse_variant(name)


def case_tensors(case: tuple, device: torch.device) -> dict:
    """A case's layers: each its own cache (keys, values), the query rows at the sequence's end."""
    _, heads, kv, hd, seqs, t, context = case
    max_len = 4096 + 128  # fimble serve's slots (4,096 and a scratch tail): the key buckets a graph pass attends over
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    layers = [(rnd(seqs, kv, max_len, hd), rnd(seqs, kv, max_len, hd)) for _ in range(LAYERS)]
    positions = torch.tensor([context + i for _ in range(seqs) for i in range(t)], device=device)
    keys_len = key_bucket(context + t, max_len)  # as a graph's pass: a power-of-two bucket past the last position
    return {"q": rnd(seqs * t, heads * hd), "layers": layers, "positions": positions, "keys_len": keys_len}


def kernel_ms(case: tuple, tensors: dict, flush: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The attention kernels' own GPU time per call (ms), every layer once, and the last layer's output."""
    _, _, kv, _, seqs, _, _ = case
    q, positions, keys_len = tensors["q"], tensors["positions"], tensors["keys_len"]
    scratch = gk.attention_scratch(q, keys_len, seqs, kv, tensors["layers"][0][0].shape[-1])
    out = gk.attention(q, *tensors["layers"][0], positions, keys_len, seqs, kv, scratch, ordered=True)  # (compiled)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for keys, values in tensors["layers"]:
            flush.zero_()  # the layer's keys are not in L2, as after a layer's projections
            out = gk.attention(q, keys, values, positions, keys_len, seqs, kv, scratch, ordered=True)
        torch.cuda.synchronize()
    total = sum(
        ev.time_range.elapsed_us()
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA and "attention" in ev.name
    )
    return total / 1e3 / LAYERS, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated geometries (see the docstring)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, variants interleaved in each")
    ap.add_argument("--quick", action="store_true", help="2 rounds, the default and one other variant")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not gk.available():
        raise SystemExit("gpu_attention needs a CUDA device and Triton")
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        parse_variant(v)
    if args.quick:
        variants, args.rounds = [DEFAULT_VARIANT, variants[1] if len(variants) > 1 else VARIANTS[1]], 2
    if DEFAULT_VARIANT not in variants:
        variants.insert(0, DEFAULT_VARIANT)
    if not 1 <= args.rounds <= 50:
        raise SystemExit("--rounds 1-50")
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    flush = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)  # more than any GPU's L2
    times: dict[tuple[str, str], list[float]] = {}
    exact: dict[tuple[str, str], bool] = {}  # a variant's output against a float32 reference, within bf16
    for case in CASES:
        tensors = case_tensors(case, device)
        ref = None
        for rnd in range(args.rounds):
            for v in variants:
                set_variant(v)
                ms, out = kernel_ms(case, tensors, flush)
                times.setdefault((case[0], v), []).append(ms)
                if rnd == 0:
                    if ref is None:
                        ref = reference(case, tensors)
                    exact[(case[0], v)] = bool(torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2))
        del tensors
        torch.cuda.empty_cache()
    set_variant(DEFAULT_VARIANT)
    load = os.getloadavg()[0]
    print(f"{gpu}, torch {torch.__version__}, {args.rounds} rounds, {LAYERS} layers a call, load {load:.2f}")
    print(f"{'case':<17} | {'variant':<18} | {'us a call':>9} | {'/default':>8} | close to fp32")
    best: dict[str, tuple[str, float]] = {}
    rows = []
    for case in CASES:
        base = statistics.median(times[(case[0], DEFAULT_VARIANT)])
        for v in variants:
            ms = statistics.median(times[(case[0], v)])
            rows.append(
                {"case": case[0], "variant": v, "us": ms * 1e3, "ratio": ms / base, "close": exact[(case[0], v)]}
            )
            print(f"{case[0]:<17} | {v:<18} | {ms * 1e3:>9.2f} | {ms / base:>8.3f} | {exact[(case[0], v)]}")
            if exact[(case[0], v)] and ms < best.get(case[0], ("", float("inf")))[1]:
                best[case[0]] = (v, ms)
    headline = (
        "gpu_attention: "
        + "; ".join(
            f"{c}: {best[c][0]} {best[c][1] / statistics.median(times[(c, DEFAULT_VARIANT)]):.2f}x" for c in best
        )
        + f" of the default ({gpu})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"bench": "gpu_attention", "date": time.strftime("%Y-%m-%d"), "gpu": gpu, "load_average": load,
                 "rounds": args.rounds, "rows": rows, "headline": headline},
                indent=2,
            )
            + "\n"
        )  # fmt: skip
    print(headline)
    return 0


def reference(case: tuple, tensors: dict) -> torch.Tensor:
    """The last layer's attention in float32 torch (masked by position): what every variant should be close to."""
    _, heads, kv, hd, seqs, t, _ = case
    keys, values = tensors["layers"][-1]
    keys_len = tensors["keys_len"]
    q = tensors["q"].float().view(seqs, t, heads, hd).transpose(1, 2)  # [S, H, T, hd]
    k = keys[:, :, :keys_len].float().repeat_interleave(heads // kv, dim=1)
    v = values[:, :, :keys_len].float().repeat_interleave(heads // kv, dim=1)
    scores = q @ k.transpose(-1, -2) * hd**-0.5
    pos = tensors["positions"].view(seqs, 1, t, 1)
    scores = scores.masked_fill(torch.arange(keys_len, device=q.device) > pos, float("-inf"))
    out = torch.softmax(scores, -1) @ v  # [S, H, T, hd]
    return out.transpose(1, 2).reshape(seqs * t, heads * hd)


if __name__ == "__main__":
    raise SystemExit(main())
