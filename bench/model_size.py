"""How big may the embedded target be? Decode and prefill speed of candidate shapes on this CPU.

The rule (what keeps the embedded model usable while typing): the largest model that decodes >= 150 tokens/s
and prefills 512 tokens in <= 150 ms on the 2-core CPU machine, measured with fimble's own runtime
(engine/runtimes/compact.py) on random weights of each shape, vocabulary 8,192.

    python -m bench.model_size [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.runtimes.compact import CompactConfig, CompactTransformer, param_count

# (hidden, layers, ffn, heads, kv heads)
SHAPES = [
    (192, 3, 512, 3, 1),
    (384, 6, 1024, 6, 2),
    (448, 8, 1216, 7, 7),
    (512, 8, 1408, 8, 2),
    (512, 10, 1408, 8, 2),
    (640, 10, 1728, 10, 2),
]
DECODE_MIN_TOK_S, PREFILL_MAX_MS = 150.0, 150.0


def measure(shape, repeats: int) -> dict:
    d, layers, ffn, heads, kv = shape
    cfg = CompactConfig(8192, d, ffn, layers, heads, kv, d // heads, 10000.0, 1e-5, 4096, True, False)
    model = CompactTransformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    cache = model.new_cache(1024)
    prompt = torch.randint(0, 8192, (512,))
    prefill = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model(prompt, cache, 0, 1)
        prefill.append(time.perf_counter() - t0)
    token = torch.tensor([7])
    for _ in range(10):
        model(token, cache)
    cache.rollback(512)
    steps = 40 * repeats
    t0 = time.perf_counter()
    for _ in range(steps):
        model(token, cache)
    decode_s = (time.perf_counter() - t0) / steps
    return {
        "shape": {"hidden": d, "layers": layers, "ffn": ffn, "heads": heads, "kv_heads": kv},
        "params_m": param_count(cfg) / 1e6,
        "prefill_512_ms": statistics.median(prefill[1:]) * 1e3,
        "decode_tok_s": 1 / decode_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = [measure(s, 3 if args.quick else 8) for s in SHAPES]
    print(f"{'hidden':>6s} {'layers':>6s} {'params':>8s} {'decode tok/s':>12s} {'prefill 512':>11s}  fits")
    for r in rows:
        r["fits"] = r["decode_tok_s"] >= DECODE_MIN_TOK_S and r["prefill_512_ms"] <= PREFILL_MAX_MS
        s = r["shape"]
        print(
            f"{s['hidden']:6d} {s['layers']:6d} {r['params_m']:7.1f}M {r['decode_tok_s']:12.0f} "
            f"{r['prefill_512_ms']:9.0f}ms  {'yes' if r['fits'] else 'no'}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    best = max((r for r in rows if r["fits"]), key=lambda r: r["params_m"], default=None)
    print(f"largest shape that fits: {best['params_m']:.1f}M params" if best else "no shape fits")


if __name__ == "__main__":
    main()
