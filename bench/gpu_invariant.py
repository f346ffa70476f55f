"""Batch-invariant CUDA kernels: the proof (a row's logits are the same bits in any pass) and the cost, in one run
on one GPU.

    python -m bench.gpu_invariant [--quick] [--parts 1,2,3,4] [--modes ...] [--json PATH]

Kernel sets compared in the same process, interleaved (--modes): "invariant-cublas" (the CUDA default since this
change: cuBLAS projections on passes of a fixed 16 rows, Triton attention with the splits combined in order, the eager
path on the same kernels), "invariant" (FIMBLE_CUDA_INVARIANT=triton: every projection in
engine/runtimes/gpu_kernels.py ``linear``, invariant for any row count) and "fused" (before, FIMBLE_CUDA_INVARIANT=0:
cuBLAS projections at the pass's own row count, Triton attention; the eager path torch's own ops and sdpa).

1. Rows (a): per model (the embedded target and draft, random-weight Qwen2.5 0.5B and 1.5B shapes), cache holding
   C tokens, k = 1..16: the logits of a k-token verify pass against k 1-token steps, row by row, bit for bit
   (torch.equal), eager (the model's own forward) and graph (``GraphRuntime`` replays); eager against graph; and a
   batched round (``SlotGraphs``: five sequences at other depths, blocks of 1-16, one graph replay;
   ``engine.serve.batched.batched_forward``: the same, eagerly) against each sequence's verify pass alone.
2. The embedded pair (b): the FIM prompts of bench/gpu.py part 2 (seed 11), greedy bf16: plain and speculative
   (auto, draft model, n-gram), eager and graph, each compared with the same mode's plain output and with eager
   plain; decode tok/s.
3. Cost (c): bench/gpu.py's step figures for each kernel set, measured alternately in rounds: the graph 1-token
   step (call + argmax read back), 8- and 16-token verify, back-to-back replays of the step's graph (GPU time),
   the eager step; cache at --context tokens; floor = weight bytes / measured copy bandwidth. Then batched rounds
   of the 1.5B shape, 32 streams (bench/gpu.py's ``batched``: aggregate tok/s, first delta), and the GPU time of
   one captured round of 1 or 32 streams x 1, 4 and 16 tokens.
4. ``linear`` tile configs per 0.5B weight shape at 1 and 16 rows against cuBLAS (graph-replayed, so launch costs
   are out), and cuBLAS's own row invariance (row 0 alone against row 0 of an M-row product, M = 2..512) with
   torch's default settings and with cuBLASLt, split-K off (``allow_bf16_reduced_precision_reduction = (False,
   False)``), with each setting's time at 1 and 16 rows; F.rms_norm's row invariance.

Running it on the device tool: the tree is over the 64 MiB transfer limit; bench/gpu.py's docstring says what to
move out for the call. The last lines are a short table and the headline.
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

from bench import gpu as gb  # copy bandwidth, batched streams, decode
from bench.harness.prompts import fim_prompts
from bench.harness.random_models import SHAPES, random_model, weight_bytes
from engine.api import CompletionRequest
from engine.decoding.drafters import NgramDrafter
from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from engine.local import LocalEngine
from engine.runtimes import gpu_kernels as gk
from engine.runtimes.compact import CompactTransformer
from engine.runtimes.cuda_graphs import (
    BatchedCache,
    GraphRuntime,
    SlotGraphs,
    capture,
    eager_runtime,
    forward_batch,
    key_bucket,
)
from engine.serve.batched import Forward, batched_forward

DEV, DTYPE = gb.DEV, gb.DTYPE
# cuBLAS projections on 16-row passes (the default); Triton projections; before (cuBLAS's own choices per shape)
ALL_MODES = ("invariant-cublas", "invariant", "fused")
MODES = ALL_MODES
CUBLAS_DEFAULTS = (
    torch.backends.cuda.preferred_blas_library(),
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
)
ROWS = gk.CUBLAS_ROWS


def cublas_without_split_k() -> None:
    """cuBLASLt with split-K and reduced-precision reductions off (process-wide; part 4's probe only)."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)


def restore_cublas() -> None:
    library, bf16, fp16 = CUBLAS_DEFAULTS
    torch.backends.cuda.preferred_blas_library(library)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = bf16
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = fp16


def sync() -> None:
    torch.cuda.synchronize()


def kset(mode: str) -> str:
    """The kernel set of a compared mode ("invariant-cublas1": "invariant-cublas" without the 16-row padding)."""
    return "invariant-cublas" if mode.startswith("invariant-cublas") else mode


def set_mode(model: CompactTransformer, mode: str) -> None:
    """The model's eager kernels (and the padding of the cuBLAS set, a module setting read at each pass)."""
    model.invariant = kset(mode) if kset(mode) in gk.INVARIANT_SETS else False
    gk.CUBLAS_ROWS = 1 if mode == "invariant-cublas1" else ROWS


def copy_cache(dst, src) -> None:
    dst.keys.copy_(src.keys)
    dst.values.copy_(src.values)
    dst.length = src.length


# -- 1. rows ---------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def rows_check(model: CompactTransformer, mode: str, contexts: tuple[int, ...], ks: range) -> dict:
    set_mode(model, mode)
    graph = GraphRuntime(model, attention=kset(mode))
    vocab = model.cfg.vocab_size
    max_len = max(contexts) + 64
    base, cv, cs = (model.new_cache(max_len) for _ in range(3))
    gen = torch.Generator().manual_seed(11)
    out = {f"{w}_{c}": 0 for w in ("eager", "graph", "eager_vs_graph") for c in ("differ", "rows")}
    out["max_abs_diff"] = 0.0
    per_k: dict[int, int] = {}
    for ctx in contexts:
        base.rollback(0)
        model(torch.randint(0, vocab, (ctx,), generator=gen).to(DEV), base, 0, 1)
        for k in ks:
            block = torch.randint(0, vocab, (k,), generator=gen).to(DEV)
            verify = {}
            for name, rt in (("eager", model), ("graph", graph)):
                copy_cache(cv, base)
                v = rt(block, cv, ctx, k).clone()
                copy_cache(cs, base)
                s = torch.cat([rt(block[i : i + 1], cs, ctx + i, 1).clone() for i in range(k)])
                differ = int((v != s).any(-1).sum())
                out[f"{name}_differ"] += differ
                out[f"{name}_rows"] += k
                per_k[k] = per_k.get(k, 0) + differ
                out["max_abs_diff"] = max(out["max_abs_diff"], float((v - s).abs().max()))
                verify[name] = v
            out["eager_vs_graph_differ"] += int((verify["eager"] != verify["graph"]).any(-1).sum())
            out["eager_vs_graph_rows"] += k
    out["differ_by_k"] = per_k
    out.update(batched_check(model, mode, max_len, gen))
    del graph
    return out


@torch.inference_mode()
def batched_check(model: CompactTransformer, mode: str, max_len: int, gen: torch.Generator) -> dict:
    """Five sequences at other depths with blocks of 1-16 in one slotted round (and one eager batched pass),
    against each one's verify pass alone (eager)."""
    vocab = model.cfg.vocab_size
    depths = tuple(min(d, max_len - 80) for d in (37, 300, max_len - 80, 500, 120))
    blocks = (1, 3, 16, 7, 2)
    bases = []
    for d in depths:
        c = model.new_cache(max_len)
        model(torch.randint(0, vocab, (d,), generator=gen).to(DEV), c, 0, 1)
        bases.append(c)
    toks = [torch.randint(0, vocab, (k,), generator=gen).to(DEV) for k in blocks]
    alone = []
    for c, d, t in zip(bases, depths, toks, strict=True):
        tmp = model.new_cache(max_len)
        copy_cache(tmp, c)
        alone.append(model(t, tmp, d, len(t)).clone())
    slots = SlotGraphs(model, 8, max_len, attention=kset(mode))
    views = []
    for c in bases:
        tmp = model.new_cache(max_len)
        copy_cache(tmp, c)
        views.append(slots.take(tmp))
    passes = [(t, v, d, len(t)) for t, v, d in zip(toks, views, depths, strict=True)]
    for _ in range(2):  # the first run captures, the second replays
        for v, d in zip(views, depths, strict=True):
            v.length = d
        got = [g.clone() for g in slots.run(passes)]
    slot_differ = sum(int((a != b).any(-1).sum()) for a, b in zip(alone, got, strict=True))
    calls = []
    for c, d, t in zip(bases, depths, toks, strict=True):
        tmp = model.new_cache(max_len)
        copy_cache(tmp, c)
        calls.append(Forward(t, tmp, d, len(t)))
    eager = batched_forward(model, calls)
    eager_differ = sum(int((a != b).any(-1).sum()) for a, b in zip(alone, eager, strict=True))
    return {"batched_rows": sum(blocks), "slot_round_differ": slot_differ, "batched_eager_differ": eager_differ}


# -- 2. the embedded pair --------------------------------------------------------------------------------------------
def pair_check(n_prompts: int, n_tokens: int, before_eager: bool, modes: tuple[str, ...] = MODES) -> dict:
    target = load_model(DEFAULT_TARGET, device=DEV, dtype=DTYPE)
    draft = load_model(DEFAULT_DRAFT, device=DEV, dtype=DTYPE)
    builder = LocalEngine(target, None, start_thread=False)
    tm, dm = eager_runtime(target.runtime), eager_runtime(draft.runtime)
    prompts = []
    for prefix, suffix in fim_prompts(n_prompts + 1, seed=11, window=1200):
        prompts.append(builder.build_prompt(CompletionRequest(prefix, suffix, heal=False))[0])
    max_len = max(len(p) for p in prompts) + n_tokens + 32
    ngram = NgramDrafter(history=0)
    runs = {}
    for mode in modes:
        gt, gd = GraphRuntime(tm, attention=kset(mode)), GraphRuntime(dm, attention=kset(mode))
        caches = {"eager": tm.new_cache(max_len), "graph": tm.new_cache(max_len)}
        e_md, g_md = gb.CountingDrafter(dm, max_len), gb.CountingDrafter(gd, max_len)
        methods = {
            "eager plain": ("eager", tm, "none", None),
            "eager spec: auto": ("eager", tm, "auto", e_md),
            "eager spec: draft model": ("eager", tm, "model", e_md),
            "eager spec: n-gram": ("eager", tm, "ngram", None),
            "graph plain": ("graph", gt, "none", None),
            "graph spec: auto": ("graph", gt, "auto", g_md),
            "graph spec: draft model": ("graph", gt, "model", g_md),
            "graph spec: n-gram": ("graph", gt, "ngram", None),
        }
        if mode == "fused" and not before_eager:  # torch's eager ops: ~100 tok/s, a minute or two per method
            methods = {m: v for m, v in methods.items() if m.startswith("graph")}
        runs[mode] = (methods, caches)
    rows = {(mode, m): {"decode_s": 0.0, "tokens": 0, "same_as_own_plain": 0, "same_as_eager_plain": 0}
            for mode, (methods, _) in runs.items() for m in methods}  # fmt: skip
    for i, prompt in enumerate(prompts):
        for mode, (methods, caches) in runs.items():  # interleaved: each prompt through both kernel sets
            set_mode(tm, mode)
            set_mode(dm, mode)
            outs = {}
            for name, (kind, runtime, drafter, md) in methods.items():
                out, _, dec = gb.decode(runtime, caches[kind], prompt, n_tokens, drafter, md, ngram)
                outs[name] = out
                if i == 0:
                    continue  # warm-up prompt: captures and compiles are not timed or counted
                r = rows[(mode, name)]
                r["decode_s"] += dec
                r["tokens"] += len(out)
                own = outs["eager plain" if kind == "eager" else "graph plain"] if f"{kind} plain" in outs else out
                r["same_as_own_plain"] += int(out == own)
                ref = outs.get("eager plain")
                r["same_as_eager_plain"] += int(ref is not None and out == ref)
    table = []
    for (mode, name), r in rows.items():
        has_eager = "eager plain" in runs[mode][0]
        table.append({
            "kernels": mode, "method": name, "decode_tok_s": r["tokens"] / max(r["decode_s"], 1e-9),
            "same_as_own_plain": f"{r['same_as_own_plain']}/{n_prompts}",
            "same_as_eager_plain": f"{r['same_as_eager_plain']}/{n_prompts}" if has_eager else "-",
        })  # fmt: skip
    return {"prompts": n_prompts, "tokens": n_tokens, "mean_prompt_tokens": statistics.mean(map(len, prompts[1:])),
            "table": table}  # fmt: skip


# -- 3. cost ---------------------------------------------------------------------------------------------------------
def _times(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


@torch.inference_mode()
def cost_table(name: str, model: CompactTransformer, context: int, bandwidth: float, n: int, rounds: int) -> dict:
    cache = model.new_cache(context + 64)
    gen = torch.Generator().manual_seed(1)
    vocab = model.cfg.vocab_size
    set_mode(model, "fused")
    prompt = torch.randint(0, vocab, (context,), generator=gen).to(DEV)
    model(prompt, cache, 0, 1)
    one = torch.randint(0, vocab, (1,), generator=gen).to(DEV)
    eight = torch.randint(0, vocab, (8,), generator=gen).to(DEV)
    sixteen = torch.randint(0, vocab, (16,), generator=gen).to(DEV)
    chunk = torch.randint(0, vocab, (128,), generator=gen).to(DEV)  # a prefill pass (fimble serve's chunk)
    runtimes = {}
    for mode in MODES:
        set_mode(model, mode)
        runtimes[mode] = GraphRuntime(model, attention=kset(mode))

    def gpu_fn(rt):
        rt(one, cache, context, 1)
        graph, _ = rt._graph(cache, 1, key_bucket(context + 1, cache.max_len))
        reps = 20

        def replays():
            for _ in range(reps):
                graph.replay()

        return replays, reps

    metrics = {}
    for mode, rt in runtimes.items():
        set_mode(model, mode)
        replays, reps = gpu_fn(rt)
        metrics[mode] = {
            "graph_step_ms": lambda rt=rt: rt(one, cache, context, 1).argmax(-1).tolist(),
            "graph_verify8_ms": lambda rt=rt: rt(eight, cache, context, 8).argmax(-1).tolist(),
            "graph_verify16_ms": lambda rt=rt: rt(sixteen, cache, context, 16).argmax(-1).tolist(),
            "graph_gpu_step_ms": (replays, reps),
            "eager_step_ms": lambda: model(one, cache, context, 1).argmax(-1).tolist(),
            "eager_verify8_ms": lambda: model(eight, cache, context, 8).argmax(-1).tolist(),
            # a cold prompt's cost: 128 prompt tokens in one eager pass (the last one's logits), at the context's depth
            "eager_prefill128_ms": lambda: model(chunk, cache, context - 128, 1).argmax(-1).tolist(),
            # a whole cold prompt of the context's length from position 0 (the same tokens: the cache stays as it was)
            f"eager_prefill{context}_ms": lambda: model(prompt, cache, 0, 1).argmax(-1).tolist(),
        }
        for fn in metrics[mode].values():  # warm-up: compiles, captures
            f = fn[0] if isinstance(fn, tuple) else fn
            for _ in range(3):
                set_mode(model, mode)
                f()
        sync()
    samples = {mode: {key: [] for key in metrics[mode]} for mode in MODES}
    for _ in range(rounds):
        for key in metrics[MODES[0]]:
            for mode in MODES:
                set_mode(model, mode)
                fn = metrics[mode][key]
                if isinstance(fn, tuple):
                    f, reps = fn
                    samples[mode][key] += [t / reps for t in _times(f, max(2, n // 10))]
                else:
                    samples[mode][key] += _times(fn, n)
    floor = weight_bytes(model) / bandwidth * 1e3
    row = {"shape": name, "weight_GB": weight_bytes(model) / 1e9, "floor_ms": floor}
    for mode in MODES:
        for key, vals in samples[mode].items():
            row[f"{key}_{mode}"] = statistics.median(vals)
        row[f"step_over_floor_{mode}"] = row[f"graph_step_ms_{mode}"] / floor
    del runtimes
    return row


@torch.inference_mode()
def round_gpu_ms(model: CompactTransformer, streams: int, block: int, context: int, mode: str) -> float:
    """GPU time of one captured round: ``streams`` sequences x ``block`` tokens at depth ``context``."""
    set_mode(model, mode)
    keys_len = key_bucket(context + block, 1 << 20)
    cache = BatchedCache(model, streams, keys_len)
    tokens = torch.randint(0, model.cfg.vocab_size, (streams, block), device=DEV)
    starts = torch.full((streams,), context, dtype=torch.long, device=DEV)
    graph, _ = capture(lambda: forward_batch(model, cache.keys, cache.values, tokens, starts, keys_len,
                                             attention=kset(mode)), torch.cuda.graph_pool_handle())  # fmt: skip
    for _ in range(3):
        graph.replay()
    sync()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        sync()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# -- 4. sweep --------------------------------------------------------------------------------------------------------
SWEEP_CONFIGS = [(16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 4),
                 (64, 128, 4, 4), (64, 256, 4, 3), (16, 256, 2, 4)]  # fmt: skip


def _graph_ms(fn, reps: int = 20) -> float:
    fn()
    sync()
    graph, _ = capture(lambda: [fn() for _ in range(reps)][-1], torch.cuda.graph_pool_handle())
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        sync()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


@torch.inference_mode()
def sweep(shapes: list[str]) -> dict:
    weights = {}
    for name in shapes:
        s = SHAPES[name]
        d, f, h, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"]
        hd = d // h
        for label, (n, k) in {"qkv": ((h + 2 * kv) * hd, d), "o": (d, d), "gate_up": (2 * f, d), "down": (d, f),
                              "lm_head": (s["vocab_size"], d)}.items():  # fmt: skip
            weights[f"{name} {label}"] = (n, k)
    rows = []
    for label, (n, k) in weights.items():
        w = torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.02
        x = torch.randn(16, k, device=DEV, dtype=DTYPE)
        row = {"weight": label, "n": n, "k": k, "default": gk.linear_config(n, k)}
        for m in (1, 16):
            row[f"cublas_m{m}"] = _graph_ms(lambda m=m, x=x, w=w: F.linear(x[:m], w))
            for cfg in SWEEP_CONFIGS:
                try:
                    row[f"{cfg}_m{m}"] = _graph_ms(lambda m=m, cfg=cfg, x=x, w=w: gk.linear(x[:m], w, config=cfg))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile: noted, skipped
                    row[f"{cfg}_m{m}"] = None
                    row.setdefault("errors", []).append(f"{cfg}: {type(exc).__name__}")
            row[f"default_m{m}"] = _graph_ms(lambda m=m, x=x, w=w: gk.linear(x[:m], w))
        ok = [c for c in SWEEP_CONFIGS if row.get(f"{c}_m1") is not None]
        row["best"] = min(ok, key=lambda c: row[f"{c}_m1"] + row[f"{c}_m16"])
        row["bytes_floor_us"] = n * k * 2 / 4.2e12 * 1e6
        rows.append(row)
    return {"configs": [list(c) for c in SWEEP_CONFIGS], "rows": rows}


@torch.inference_mode()
def cublas_probe(shapes: list[str]) -> dict:
    """Row 0 of x[:M] @ W.T against x[:1] @ W.T, M = 2..512: how many M give other bits (cuBLAS, torch flags)."""
    ms = (*range(2, 17), 24, 32, 48, 64, 100, 128, 256, 512)
    out = {"torch": torch.__version__, "defaults": [str(v) for v in CUBLAS_DEFAULTS],
           "matmul_attrs": sorted(a for a in dir(torch.backends.cuda.matmul) if not a.startswith("_"))}  # fmt: skip
    for flag_name in ("default", "cuBLASLt, no split-K"):
        if flag_name == "default":
            restore_cublas()
        else:
            cublas_without_split_k()
        res, timing = {}, {}
        for name in shapes:
            s = SHAPES[name]
            d, f, h, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"]
            for label, (n, k) in {
                "qkv": ((h + 2 * kv) * (d // h), d),
                "o": (d, d),
                "gate_up": (2 * f, d),
                "down": (d, f),
                "lm_head": (s["vocab_size"], d),
            }.items():
                w = torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.02
                x = torch.randn(512, k, device=DEV, dtype=DTYPE)
                ref = F.linear(x[:1], w)[0]
                res[f"{name} {label}"] = [m for m in ms if not torch.equal(F.linear(x[:m], w)[0], ref)]
                ref16 = F.linear(x[:16], w)[:16]
                res[f"{name} {label} (16-row multiples)"] = [
                    m for m in ms if m % 16 == 0 and not torch.equal(F.linear(x[:m], w)[:16], ref16)
                ]
                timing[f"{name} {label}"] = [_graph_ms(lambda m=m, x=x, w=w: F.linear(x[:m], w)) for m in (1, 16)]
            x = torch.randn(512, d, device=DEV, dtype=DTYPE)
            g = torch.rand(d, device=DEV, dtype=DTYPE) + 0.5
            ref = F.rms_norm(x[:1], (d,), g, 1e-6)[0]
            res[f"{name} rms_norm"] = [m for m in ms if not torch.equal(F.rms_norm(x[:m], (d,), g, 1e-6)[0], ref)]
        out[flag_name] = res
        out[f"{flag_name} ms (1 row, 16 rows)"] = timing
    restore_cublas()
    return out


# -- main ------------------------------------------------------------------------------------------------------------
def part_rows(args, result: dict) -> None:
    models = {
        "embedded target": eager_runtime(load_model(DEFAULT_TARGET, device=DEV, dtype=DTYPE).runtime),
        "embedded draft": eager_runtime(load_model(DEFAULT_DRAFT, device=DEV, dtype=DTYPE).runtime),
    }
    for name in ("0.5B",) if args.quick else ("0.5B", "1.5B"):
        models[name] = random_model(name)
    result["rows"] = {}
    for name, model in models.items():
        for mode in MODES:
            r = rows_check(model, mode, (37, 300, 1000), range(1, 17))
            result["rows"][f"{name} | {mode}"] = r
            print(f"  rows {name} {mode}: {r}", flush=True)


def part_pair(args, result: dict) -> None:
    modes = tuple(args.pair_modes.split(","))
    result["pair"] = pair_check(args.prompts or (6 if args.quick else 24), args.tokens, args.before_eager, modes)


def part_cost(args, result: dict) -> None:
    bw = gb.copy_bandwidth()
    result["copy_bandwidth_TBps"] = bw / 1e12
    shapes = (args.shapes or ("0.5B" if args.quick else "0.5B,1.5B,7B")).split(",")
    reps, rounds = (10, 2) if args.quick else (20, 3)
    result["cost"] = cost = []
    target = eager_runtime(load_model(DEFAULT_TARGET, device=DEV, dtype=DTYPE).runtime)
    draft = eager_runtime(load_model(DEFAULT_DRAFT, device=DEV, dtype=DTYPE).runtime)
    cost.append(cost_table("embedded target", target, args.context, bw, reps, rounds))
    cost.append(cost_table("embedded draft", draft, args.context, bw, reps, rounds))
    del target, draft
    for name in shapes:
        model = random_model(name)
        cost.append(cost_table(name, model, args.context, bw, reps, rounds))
        print(f"  cost {name}: {cost[-1]}", flush=True)
        if name == "1.5B":
            result["rounds_1.5B"] = {
                f"{mode} {streams}x{block}": round_gpu_ms(model, streams, block, 512, mode)
                for block in (1, 4, 16) for streams in (1, 32) for mode in MODES
            }  # fmt: skip
            result["batched_1.5B"] = {}
            for mode in MODES:
                set_mode(model, mode)
                result["batched_1.5B"][mode] = gb.batched(model, 32, 512, 16, 128, [0.0] * 32, True, kset(mode))
        del model
        torch.cuda.empty_cache()


def part_sweep(args, result: dict) -> None:
    result["cublas_probe"] = cublas_probe(["0.5B", "1.5B", "7B"])
    print("  cuBLAS probe done", flush=True)
    result["sweep"] = sweep(["0.5B"])


def main() -> None:
    global MODES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer models, prompts and repeats")
    ap.add_argument("--parts", default="1,2,3", help="comma list of 1,2,3,4 (4: the sweep), run in that order")
    ap.add_argument("--shapes", default=None, help="cost shapes (comma list of 0.5B,1.5B,7B)")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--before-eager", action="store_true", help="part 2: also the old kernels' eager methods (slow)")
    ap.add_argument("--pair-modes", default=",".join(MODES), help="part 2's kernel sets (comma list)")
    ap.add_argument("--modes", default=",".join(MODES), help="parts 1 and 3: kernel sets compared (comma list)")
    ap.add_argument("--budget", type=float, default=0, help="seconds: start no part after this (0: no limit)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    MODES = tuple(args.modes.split(","))
    if not torch.cuda.is_available() or not gk.available():
        sys.exit("bench/gpu_invariant.py needs CUDA and Triton")
    import traceback

    import triton

    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    print(f"device {result['device']}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    t_start = time.perf_counter()
    parts = {"1": part_rows, "2": part_pair, "3": part_cost, "4": part_sweep}
    for key in args.parts.split(","):
        if args.budget and time.perf_counter() - t_start > args.budget:
            print(f"  part {key} skipped: past the budget", flush=True)
            continue
        try:
            parts[key](args, result)
        except Exception:  # noqa: BLE001 - report it, keep the other parts
            result.setdefault("errors", []).append(f"part {key}: {traceback.format_exc()}")
            traceback.print_exc()
        torch.cuda.empty_cache()
        result["seconds"] = time.perf_counter() - t_start
        print(f"  part {key} done ({result['seconds']:.0f} s)", flush=True)
        if args.json:  # after every part: a run cut short still leaves what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1, default=str))
    result["loadavg"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    try:
        report(result)
    except Exception:  # noqa: BLE001 - a part that failed half way: the JSON has what there is
        traceback.print_exc()


def report(result: dict) -> None:
    print(f"\nbench/gpu_invariant.py: {result['device']}, torch {result['torch']}, triton {result['triton']}, "
          f"bf16, {result['seconds']:.0f} s")  # fmt: skip
    if "cublas_probe" in result:
        p = result["cublas_probe"]
        print(f"cuBLAS row invariance, torch {p['torch']}: the row counts M whose row 0 differs from M = 1 (for a "
              "'16-row multiples' entry: whose first 16 rows differ from M = 16); M = 2..16, 24, 32, 48, 64, 100, "
              "128, 256, 512")  # fmt: skip
        for flag in ("default", "cuBLASLt, no split-K"):
            if flag not in p:
                continue
            print(f"  {flag}:")
            for w, ms in p[flag].items():
                if ms:
                    print(f"    {w:34s} {ms}")
            print(
                "    (every other weight and M: the same bits); us per product at 1 / 16 rows: "
                + "; ".join(
                    f"{w} {a * 1e3:.1f}/{b * 1e3:.1f}" for w, (a, b) in p[f"{flag} ms (1 row, 16 rows)"].items()
                )
            )
    if "sweep" in result:
        print("linear tile configs (BN, BK, warps, stages), us per call (graph-replayed), 1 / 16 rows:")
        for r in result["sweep"]["rows"]:
            best = tuple(r["best"])
            print(f"  {r['weight']:16s} N={r['n']:6d} K={r['k']:5d} cuBLAS {r['cublas_m1'] * 1e3:6.1f} / "
                  f"{r['cublas_m16'] * 1e3:6.1f}  default {tuple(r['default'])} {r['default_m1'] * 1e3:6.1f} / "
                  f"{r['default_m16'] * 1e3:6.1f}  best {best} {r[f'{best}_m1'] * 1e3:6.1f} / "
                  f"{r[f'{best}_m16'] * 1e3:6.1f}  floor {r['bytes_floor_us']:5.1f}")  # fmt: skip
    if "rows" in result:
        print(
            "(a) rows differing, verify pass vs 1-token steps (k = 1..16, caches of 37/300/1000 tokens); "
            "eager vs graph; a batched round vs alone"
        )
        print(f"  {'model | kernels':28s} {'eager':>11s} {'graph':>11s} {'eager/graph':>11s} {'slot round':>10s} "
              f"{'batched':>8s} {'max |diff|':>10s}")  # fmt: skip
        for key, r in result["rows"].items():
            n = r["batched_rows"]
            print(f"  {key:28s} {r['eager_differ']:4d}/{r['eager_rows']:<6d} "
                  f"{r['graph_differ']:4d}/{r['graph_rows']:<6d}"
                  f" {r['eager_vs_graph_differ']:4d}/{r['eager_vs_graph_rows']:<6d} "
                  f"{r['slot_round_differ']:3d}/{n:<6d} {r['batched_eager_differ']:3d}/{n:<4d}"
                  f" {r['max_abs_diff']:10.4g}")  # fmt: skip
    if "pair" in result:
        p = result["pair"]
        print(f"(b) embedded pair, {p['prompts']} FIM prompts (~{p['mean_prompt_tokens']:.0f} tokens), {p['tokens']} "
              "new tokens, greedy bf16: identical to the same mode's plain output / to eager plain")  # fmt: skip
        for r in p["table"]:
            print(f"  {r['kernels']:9s} {r['method']:24s} {r['decode_tok_s']:8.0f} tok/s  "
                  f"{r['same_as_own_plain']:>6s}  {r['same_as_eager_plain']:>6s}")  # fmt: skip
    if "cost" in result:
        modes = [m for m in ALL_MODES if f"graph_step_ms_{m}" in result["cost"][0]]
        print(
            f"(c) cost, cache at 1024 tokens, copy bandwidth {result['copy_bandwidth_TBps']:.2f} TB/s; ms, "
            + " / ".join(modes)
            + " (fused = before), medians of interleaved rounds"
        )
        keys = ("graph_step_ms", "graph_verify8_ms", "graph_verify16_ms", "graph_gpu_step_ms", "eager_step_ms")
        for r in result["cost"]:
            print(f"  {r['shape']} (floor {r['floor_ms']:.3f} ms):")
            for k in keys:
                print(f"    {k.replace('_ms', ''):18s} " + " / ".join(f"{r[f'{k}_{m}']:7.3f}" for m in modes))
            print(f"    {'step / floor':18s} " + " / ".join(f"{r[f'step_over_floor_{m}']:7.2f}" for m in modes))
        rounds = result.get("rounds_1.5B", {})
        if rounds:
            shapes = sorted({k.split(" ")[1] for k in rounds}, key=lambda x: [int(v) for v in x.split("x")])
            print("  1.5B, one captured round at depth 512, GPU ms (" + " / ".join(modes) + "): " + "; ".join(
                f"{sh} " + " / ".join(f"{rounds.get(f'{m} {sh}', float('nan')):.3f}" for m in modes) for sh in shapes
            ))  # fmt: skip
        for mode, r in result.get("batched_1.5B", {}).items():
            print(
                f"  1.5B x 32 streams, warm, all at once ({mode}): aggregate {r['aggregate_tok_s']:.0f} tok/s, "
                f"full-batch step {r['full_batch_step_ms'] or 0:.2f} ms, "
                f"p95 first delta {r['first_delta_p95_ms']:.1f} ms"
            )
    head = []
    if "rows" in result:
        for mode in ALL_MODES:
            rs = [r for k, r in result["rows"].items() if k.endswith(f"| {mode}")]
            if rs:
                differ = sum(r["eager_differ"] + r["graph_differ"] + r["eager_vs_graph_differ"]
                             + r["slot_round_differ"] + r["batched_eager_differ"] for r in rs)  # fmt: skip
                total = sum(r["eager_rows"] + r["graph_rows"] + r["eager_vs_graph_rows"] + 2 * r["batched_rows"]
                            for r in rs)  # fmt: skip
                head.append(f"{mode} rows differing {differ}/{total}")
    if "pair" in result:
        for mode in ALL_MODES:
            rs = [r for r in result["pair"]["table"] if r["kernels"] == mode and "spec" in r["method"]]
            if rs:
                head.append(f"{mode} spec==plain " + ", ".join(f"{r['method']} {r['same_as_own_plain']}" for r in rs))
    if "cost" in result:
        for r in result["cost"]:
            head.append(f"{r['shape']} graph step " + "/".join(f"{r[f'graph_step_ms_{m}']:.3f}" for m in modes) + " ms")
    print("headline: " + "; ".join(head))


if __name__ == "__main__":
    main()
