"""A prefill's projections in the Triton kernel set: what they cost against cuBLAS, and whether a wider swap tile
(more activation rows a program) keeps every row's bits, so that a long pass could take it without breaking batch
invariance.

    python -m bench.gpu_prefill_tiles [--quick] [--rows 512] [--json PATH]

Per weight of the 0.5B and 1.5B shapes (the fused variants a pass runs, as bench/gpu_linear.py's ``Weight``), a pass
of ``--rows`` rows (512: one eager invariant chunk, engine/runtimes/graph_forward.py INVARIANT_CHUNK):

- cuBLAS's plain product on those rows (what the "invariant-cublas" set's prefill runs, within its row limits);
- ``linear`` at the engine's config (``linear_config``; the qkv at ``rope_config``'s tile, without the RoPE epilogue,
  which is elementwise and changes no reduction);
- for a swap config, the same tile with 32, 64 and 128 activation rows a program: its time, and whether every row
  equals the 16-row tile's bit for bit (a tensor-core dot's per-element sum over K may or may not depend on the
  tile's other side: measured, not assumed).

Times on a CUDA GPU only (CUDA events, median of 15 after warm-up; the weight stays in L2 only where it fits, as in a
real prefill). The headline (last line): the Triton set's prefill projections against cuBLAS's, summed over one
layer's weights (the LM head left out: a prefill takes one row's logits), per shape: on the decode tiles, on the
engine's wide tiles (``gpu_linear.wide_config``) and on the fastest bit-equal tile found. For swap weights also
32 and 64 rows (a batched serve round's sizes), the 16-row tile against the wide one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.gpu_linear import DEV, DTYPE, fused_linear, weights_of
from bench.gpu_row_limits import _event_ms
from engine.runtimes import gpu_kernels as gk
from engine.runtimes import gpu_linear as gl


def timed_us(fn, reps: int = 15) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_event_ms(fn, reps)) * 1e3


class Pass:
    """One weight and a pass of ``m`` rows of its fused variant's inputs."""

    def __init__(self, n: int, k: int, kind: str, m: int) -> None:
        gen = torch.Generator(device=DEV).manual_seed(5)
        self.w = torch.randn(n, k, device=DEV, dtype=DTYPE, generator=gen) * 0.02
        self.x = torch.randn(m, 2 * k if "gated" in kind else k, device=DEV, dtype=DTYPE, generator=gen)
        self.res = torch.randn(m, n, device=DEV, dtype=DTYPE, generator=gen)
        self.bias = torch.randn(n, device=DEV, dtype=DTYPE, generator=gen) * 0.1
        self.norm = torch.rand(k, device=DEV, dtype=DTYPE, generator=gen) + 0.5
        self.kind, self.k = kind, k
        self.plain_x = torch.randn(m, k, device=DEV, dtype=DTYPE, generator=gen)

    def triton(self, cfg, m: int | None = None) -> torch.Tensor:
        return fused_linear(self.kind, self.x[:m], self.w, cfg, norm=self.norm, bias=self.bias, residual=self.res[:m])

    def cublas(self) -> torch.Tensor:
        return F.linear(self.plain_x, self.w)


def engine_config(name: str, n: int, k: int, shape: str) -> gl.LinearConfig:
    if name == "qkv":
        from bench.harness.random_models import SHAPES

        s = SHAPES[shape]
        return gl.rope_config(n, k, s["hidden_size"] // s["num_attention_heads"])
    return gl.linear_config(n, k)


@torch.inference_mode()
def probe(shapes: list[str], m: int, widths: tuple[int, ...]) -> list[dict]:
    rows = []
    for shape in shapes:
        for name, (n, k, kind) in weights_of(shape).items():
            p = Pass(n, k, kind, m)
            cfg = engine_config(name, n, k, shape)
            row = {"shape": shape, "weight": name, "n": n, "k": k, "rows": m, "config": list(cfg)}
            row["cublas_us"] = timed_us(p.cublas)
            row["engine_us"] = timed_us(lambda cfg=cfg, p=p: p.triton(cfg))
            base = p.triton(cfg)
            row["wide"] = {}
            if cfg.swap:
                for bm in widths:
                    wide = cfg._replace(bm=bm)
                    try:
                        equal = torch.equal(p.triton(wide), base)
                        row["wide"][bm] = {"us": timed_us(lambda wide=wide, p=p: p.triton(wide)), "bits_equal": equal}
                    except Exception as exc:  # noqa: BLE001 - a tile that does not compile (shared memory): noted
                        row["wide"][bm] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
                variants = {"wide": gl.wide_config(cfg, name == "qkv")}  # the engine's wide tile
                if name != "qkv":  # (a RoPE tile is one head wide)
                    variants["bn128-bm128"] = cfg._replace(bn=128, bm=128, warps=8, stages=2)
                    variants["bn256-bm64"] = cfg._replace(bn=256, bm=64, warps=8, stages=2)
                for label, wide in variants.items():
                    if wide is None:
                        continue
                    try:
                        equal = torch.equal(p.triton(wide), base)
                        us = timed_us(lambda wide=wide, p=p: p.triton(wide))
                        row["wide"][label] = {"config": list(wide), "us": us, "bits_equal": equal}
                    except Exception as exc:  # noqa: BLE001
                        row["wide"][label] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
                wide = variants["wide"]
                if wide is not None and row["wide"]["wide"].get("bits_equal"):  # a batched round's row counts
                    row["batched_us"] = {
                        m2: {"decode": timed_us(lambda p=p, m2=m2, cfg=cfg: p.triton(cfg, m2)),
                             "wide": timed_us(lambda p=p, m2=m2, wide=wide: p.triton(wide, m2))}
                        for m2 in (32, 64) if m2 <= m
                    }  # fmt: skip
            equal_times = [v["us"] for v in row["wide"].values() if v.get("bits_equal")]
            pre = row["wide"].get("wide", {})
            row["prefill_us"] = pre["us"] if pre.get("bits_equal") else row["engine_us"]  # as the engine decides
            row["best_equal_us"] = min([row["engine_us"], *equal_times])
            rows.append(row)
            cells = []
            for label, v in row["wide"].items():
                tag = label if isinstance(label, str) else f"BM{label}"
                cells.append(f"{tag} " + (f"{v['us']:8.1f} equal {v['bits_equal']}" if "us" in v else v["error"][:40]))
            wide = "  ".join(cells)
            batched = "  ".join(
                f"{m2} rows {v['decode']:.1f} -> {v['wide']:.1f}" for m2, v in row.get("batched_us", {}).items()
            )
            print(
                f"  {shape:5s} {name:8s} {n:6d}x{k:<5d} cuBLAS {row['cublas_us']:8.1f} us  engine "
                f"{row['engine_us']:8.1f} {tuple(cfg)}  {wide}  {batched}",
                flush=True,
            )
            del p
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="0.5B only, BM 64 only: under a minute")
    ap.add_argument("--rows", type=int, default=512, help="rows of the pass (1..4096)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not 1 <= args.rows <= 4096:
        sys.exit("--rows must be in 1..4096")
    if not torch.cuda.is_available() or not gk.available():
        sys.exit("bench/gpu_prefill_tiles.py needs CUDA and Triton")
    shapes = ["0.5B"] if args.quick else ["0.5B", "1.5B"]
    widths = (64,) if args.quick else (32, 64, 128)
    print(f"device {torch.cuda.get_device_name()}, {args.rows} rows a pass", flush=True)
    rows = probe(shapes, args.rows, widths)
    result = {"device": torch.cuda.get_device_name(), "rows": args.rows, "probe": rows, "loadavg": os.getloadavg()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    heads = []
    for shape in shapes:  # the LM head left out: a prefill takes the last rows' logits only
        mine = [r for r in rows if r["shape"] == shape and r["weight"] != "lm_head"]
        cub = sum(r["cublas_us"] for r in mine)
        eng = sum(r["engine_us"] for r in mine)
        pre = sum(r["prefill_us"] for r in mine)
        best = sum(r["best_equal_us"] for r in mine)
        heads.append(
            f"{shape} Triton/cuBLAS {eng / cub:.2f}x decode tiles, {pre / cub:.2f}x wide tiles, "
            f"{best / cub:.2f}x best bit-equal"
        )
    print(f"headline ({args.rows}-row pass, one layer's projections): " + "; ".join(heads))


if __name__ == "__main__":
    main()
