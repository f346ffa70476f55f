"""GPU decode speed: eager steps against CUDA-graph steps (engine/runtimes/cuda_graphs.py), on one GPU, in one run.

    python -m bench.gpu [--quick] [--json PATH]

1. Per shape (Qwen2.5 0.5B / 1.5B / 7B with random bf16 weights built from their configs, no download;
   the embedded target and draft from models/), cache filled to --context tokens: the eager 1-token step,
   the eager 8-token verify, the same two replayed as graphs, and the floor. Step = call + reading the
   argmax back to the host (what a decode step costs the loop). "graph GPU" = back-to-back replays with
   no host sync (device time alone). Floor = bytes of weights one step reads (every weight but the
   embedding table, from which a step reads one row) / device-to-device copy bandwidth measured at the
   start of this run (bytes read + written).
2. The embedded pair on real FIM prompts (tests/data/lossless_corpus), bf16: eager and graph, plain and
   speculative, interleaved per prompt, outputs compared with eager plain greedy; tok/s per stream.
3. Replay: random weights make acceptance meaningless, so the verify steps recorded from the embedded
   pair (graph auto) are replayed on the 1.5B / 7B shapes with the 0.5B shape as draft model: the same
   block sizes, draft lengths and accepted counts, real graph passes, random tokens. Labelled "replay".
4. Batched: --streams streams of the 1.5B shape decode one token each per step in one captured graph
   (prompts of --batch-prompt tokens prefilled by a captured graph as they arrive, one per step);
   aggregate tok/s, and first delta = arrival to first token on the host, p50/p95, for arrivals spread
   at random over one second and for all streams arriving at once.

5. The peer (``--llama-server BIN --gguf PATH``, issue 27 item 4): llama.cpp's llama-server built with CUDA
   (bench/peer_h200.sh) on the random 1.5B shape written as a GGUF (bench/harness/llama_server_cuda.py): its
   single-stream step against fimble's graph step on the same prompt, greedy outputs compared token for token.

The last line is the headline.

Graph kernels: each shape is timed with torch's sdpa, plain matmuls and, where Triton runs, the fused Triton
attention with cuBLAS projections at the pass's row count ("fused", the default before the batch-invariant passes),
the same on fixed 16-row passes ("invariant-cublas", the CUDA default: batch-invariant) and Triton projections
("invariant"; engine/runtimes/ gpu_kernels.py); the default is used for the rest of the run where it runs, else the
fastest. The eager figures are the model's own forward, on the default kernels too (FIMBLE_CUDA_INVARIANT=0: torch's
ops). bench/gpu_invariant.py compares the kernel sets alternately.

Running it on the device tool: the tracked tree is ~92 MB, over the tool's 64 MiB per-call transfer;
models/fimble-smollm2/adapter.safetensors (19.6 MB) and bench/reports (8 MB), neither needed there, are the
excess. Move them out of the tree for the call and back right after (2026-12-01's runs did so); never
commit their removal, the install step needs the adapter. The GPU image lacks msgpack and websockets:
carry their cp312 wheels (the device tool's README says how).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness.prompts import fim_prompts
from bench.harness.random_models import SHAPES, random_model, weight_bytes
from engine.api import CompletionRequest
from engine.decoding.drafters import ModelDrafter, NgramDrafter
from engine.decoding.speculative import DecodeOptions, SpeculativeDecoder
from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from engine.local import LocalEngine
from engine.runtimes import gpu_kernels
from engine.runtimes.compact import CompactTransformer
from engine.runtimes.cuda_graphs import (
    BatchedCache,
    GraphRuntime,
    batched_forward,
    capture,
    default_attention,
    eager_runtime,
    key_bucket,
)

DEV = "cuda"
DTYPE = torch.bfloat16
# graph attentions compared per shape (cuda_graphs.forward_batch); "fused" = the Triton kernels, where Triton runs
ATTENTIONS = ("sdpa", "matmul") + (("fused", "invariant-cublas", "invariant") if gpu_kernels.available() else ())


def sync() -> None:
    torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20 copies of 2 GiB)."""
    src = torch.randn(1 << 30, dtype=DTYPE, device=DEV)
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        sync()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * (1 << 31) / statistics.median(times[3:])


def median_ms(fn, n: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def step_table(
    name: str, model: CompactTransformer, context: int, bandwidth: float, n: int, compile_only: bool = False
) -> dict:
    """Eager and graph 1-token step and 8-token verify at a cache of ``context`` tokens."""
    cache = model.new_cache(context + 64)
    gen = torch.Generator().manual_seed(1)
    vocab = model.cfg.vocab_size
    model(torch.randint(0, vocab, (context,), generator=gen).to(DEV), cache, 0, 1)
    one = torch.randint(0, vocab, (1,), generator=gen).to(DEV)
    eight = torch.randint(0, vocab, (8,), generator=gen).to(DEV)
    row = {
        "shape": name,
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "weight_GB": weight_bytes(model) / 1e9,
        "floor_ms": weight_bytes(model) / bandwidth * 1e3,
    }

    def gpu_ms(runtime) -> float:  # back-to-back replays of the 1-token graph, no host sync between
        runtime(one, cache, context, 1)
        graph, _ = runtime._graph(cache, 1, key_bucket(context + 1, cache.max_len))
        reps = max(20, n)

        def replays():
            for _ in range(reps):
                graph.replay()

        return median_ms(replays, 5, warm=1) / reps

    if compile_only:
        t0 = time.perf_counter()
        runtime = GraphRuntime(model, compile=True)
        runtime(one, cache, context, 1)  # compiles and captures
        row["compile_s"] = time.perf_counter() - t0
        row["compiled_graph_step_ms"] = median_ms(lambda: runtime(one, cache, context, 1).argmax(-1).tolist(), n)
        row["compiled_graph_gpu_step_ms"] = gpu_ms(runtime)
        row["compiled_step_over_floor"] = row["compiled_graph_step_ms"] / row["floor_ms"]
        row["compiled_gpu_over_floor"] = row["compiled_graph_gpu_step_ms"] / row["floor_ms"]
        return row
    row["eager_step_ms"] = median_ms(lambda: model(one, cache, context, 1).argmax(-1).tolist(), n)
    row["eager_verify8_ms"] = median_ms(lambda: model(eight, cache, context, 8).argmax(-1).tolist(), n)
    for attention in ATTENTIONS:
        runtime = GraphRuntime(model, attention=attention)
        row[f"graph_step_ms_{attention}"] = median_ms(
            lambda runtime=runtime: runtime(one, cache, context, 1).argmax(-1).tolist(), n
        )
        row[f"graph_verify8_ms_{attention}"] = median_ms(
            lambda runtime=runtime: runtime(eight, cache, context, 8).argmax(-1).tolist(), n
        )
        row[f"graph_gpu_step_ms_{attention}"] = gpu_ms(runtime)
    best = min(ATTENTIONS, key=lambda a: row[f"graph_step_ms_{a}"] + row[f"graph_verify8_ms_{a}"])
    if default_attention() in ATTENTIONS:  # what ships, not the fastest
        best = default_attention()
    row["attention"] = best
    for key in ("graph_step_ms", "graph_verify8_ms", "graph_gpu_step_ms"):
        row[key] = row[f"{key}_{best}"]
    row["graph_step_over_floor"] = row["graph_step_ms"] / row["floor_ms"]
    row["graph_gpu_over_floor"] = row["graph_gpu_step_ms"] / row["floor_ms"]
    row["graph_plain_tok_s"] = 1e3 / row["graph_step_ms"]
    row["eager_plain_tok_s"] = 1e3 / row["eager_step_ms"]
    return row


class CountingDrafter(ModelDrafter):
    """A ModelDrafter that notes each call's requested draft length (what the draft model computes)."""

    def __init__(self, runtime, max_len: int):
        super().__init__(runtime, max_len)
        self.requests: list[int] = []

    def propose(self, context, k, temperature, top_p, gate, gen):
        self.requests.append(k)
        return super().propose(context, k, temperature, top_p, gate, gen)


def decode(runtime, cache, prompt, n, drafter_name, model_drafter, ngram, trace=None) -> tuple[list[int], float, float]:
    """Decode exactly ``n`` tokens; return (output, prefill seconds, decode seconds)."""
    opts = DecodeOptions(max_tokens=n, drafter=drafter_name)
    cache.rollback(0)
    sync()
    t0 = time.perf_counter()
    dec = SpeculativeDecoder(runtime, cache, set(), opts, model_drafter, ngram)
    dec.prefill(prompt)
    sync()
    t1 = time.perf_counter()
    while not dec.done:
        before = (dec.stats.drafted, dec.stats.accepted, len(model_drafter.requests) if model_drafter else 0)
        dec.step()
        if trace is not None:
            asked = model_drafter.requests[-1] if model_drafter and len(model_drafter.requests) > before[2] else 0
            trace.append((dec.stats.drafted - before[0], dec.stats.accepted - before[1], asked))
    sync()
    return dec.output, t1 - t0, time.perf_counter() - t1


def pair_table(n_prompts: int, n_tokens: int, attention: tuple[str, str]) -> tuple[list[dict], list, dict]:
    target = load_model(DEFAULT_TARGET, device=DEV, dtype=DTYPE)
    draft = load_model(DEFAULT_DRAFT, device=DEV, dtype=DTYPE)
    builder = LocalEngine(target, None, start_thread=False)
    target.runtime, draft.runtime = eager_runtime(target.runtime), eager_runtime(draft.runtime)  # wrapped below
    prompts = []
    for prefix, suffix in fim_prompts(n_prompts + 1, seed=11, window=1200):
        ids, _, _ = builder.build_prompt(CompletionRequest(prefix, suffix, heal=False))
        prompts.append(ids)
    g_target = GraphRuntime(target.runtime, attention=attention[0])
    g_draft = GraphRuntime(draft.runtime, attention=attention[1])
    max_len = max(len(p) for p in prompts) + n_tokens + 32
    caches = {"eager": target.runtime.new_cache(max_len), "graph": target.runtime.new_cache(max_len)}
    e_md = CountingDrafter(draft.runtime, max_len)
    g_md = CountingDrafter(g_draft, max_len)
    ngram = NgramDrafter(history=0)
    methods = {
        "eager plain": ("eager", target.runtime, "none", None),
        "eager spec: auto": ("eager", target.runtime, "auto", e_md),
        "graph plain": ("graph", g_target, "none", None),
        "graph spec: draft model": ("graph", g_target, "model", g_md),
        "graph spec: n-gram": ("graph", g_target, "ngram", None),
        "graph spec: auto": ("graph", g_target, "auto", g_md),
    }
    rows = {m: {"prefill_s": 0.0, "decode_s": 0.0, "tokens": 0, "identical": 0} for m in methods}
    traces: list[list[tuple[int, int, int]]] = []
    for i, prompt in enumerate(prompts):
        reference = None
        for name, (kind, runtime, drafter, md) in methods.items():
            trace = [] if name == "graph spec: auto" else None
            out, pre, dec = decode(runtime, caches[kind], prompt, n_tokens, drafter, md, ngram, trace)
            reference = out if reference is None else reference
            if i == 0:
                continue  # warm-up prompt: captures and first calls are not timed
            r = rows[name]
            r["prefill_s"] += pre
            r["decode_s"] += dec
            r["tokens"] += len(out)
            r["identical"] += int(out == reference)
            if trace is not None:
                traces.append(trace)
    table = []
    for name, r in rows.items():
        table.append(
            {
                "method": name,
                "decode_tok_s": r["tokens"] / r["decode_s"],
                "with_prefill_tok_s": r["tokens"] / (r["decode_s"] + r["prefill_s"]),
                "prefill_ms": r["prefill_s"] / n_prompts * 1e3,
                "identical_to_eager_plain": f"{r['identical']}/{n_prompts}",
            }
        )
    steps = [s for t in traces for s in t]
    info = {
        "prompt_tokens_mean": statistics.mean(len(p) for p in prompts[1:]),
        "tokens_per_verify": sum(a + 1 for _, a, _ in steps) / len(steps),
        "model_draft_share": sum(1 for *_, m in steps if m) / len(steps),
        "graph_captures": g_target.captures + g_draft.captures,
    }
    return table, traces, info


def replay(
    target: CompactTransformer, drafter: CompactTransformer, traces, prompt_len: int, attention: tuple[str, str]
) -> dict:
    """Run the recorded verify steps on other shapes: real graph passes, random tokens."""
    rt, dt = GraphRuntime(target, attention=attention[0]), GraphRuntime(drafter, attention=attention[1])
    total = sum(1 + a for t in traces for _, a, _ in t)
    max_len = prompt_len + max(sum(1 + k for k, _, _ in t) for t in traces) + 64
    cache, dcache = target.new_cache(max_len), drafter.new_cache(max_len)
    rng = random.Random(0)
    vocab = min(target.cfg.vocab_size, drafter.cfg.vocab_size)
    seconds = plain_seconds = 0.0
    plain_tokens = 0
    for run, trace in enumerate([traces[0]] + traces):  # run 0 warms up (captures), untimed
        ids = [rng.randrange(vocab) for _ in range(prompt_len)]
        cache.rollback(0)
        target(torch.tensor(ids[:-1], device=DEV), cache, 0, 1)
        dcache.rollback(0)
        drafter(torch.tensor(ids[:-1], device=DEV), dcache, 0, 1)
        dids = ids[:-1]
        sync()
        t0 = time.perf_counter()
        for k, a, asked in trace:
            if asked:
                _, dids = dt.propose_greedy(dcache, dids, ids, asked, 0.0)
            start = len(ids) - 1
            block = torch.tensor(ids[-1:] + [rng.randrange(vocab) for _ in range(k)], device=DEV)
            rt(block, cache, start, k + 1).argmax(-1).tolist()
            cache.rollback(start + 1 + a)
            ids += [rng.randrange(vocab) for _ in range(a + 1)]
        sync()
        elapsed = time.perf_counter() - t0
        # Plain decoding of as many tokens on the same shape and cache, for the ratio.
        n = sum(1 + a for _, a, _ in trace)
        start = len(ids) - n - 1
        cache.rollback(start)
        t1 = time.perf_counter()
        for j in range(n):
            rt(torch.tensor(ids[start + j : start + j + 1], device=DEV), cache, start + j, 1).argmax(-1).tolist()
        sync()
        if run:
            seconds += elapsed
            plain_seconds += time.perf_counter() - t1
            plain_tokens += n
    return {
        "replay_tok_s": total / seconds,
        "graph_plain_tok_s": plain_tokens / plain_seconds,
        "speedup": (total / seconds) / (plain_tokens / plain_seconds),
    }


def batched(
    model: CompactTransformer,
    streams: int,
    doc_len: int,
    keystroke: int,
    new_tokens: int,
    arrivals: list[float],
    prewarmed: bool,
    attention: str,
) -> dict:
    """``streams`` requests on one batched cache, continuous batching at step granularity.

    Each stream's slot holds a document of ``doc_len`` tokens when ``prewarmed`` (what the engine's
    prewarm leaves: a keystroke then appends ``keystroke`` tokens), else nothing (the whole prompt of
    ``keystroke`` tokens is new). Requests that have arrived are admitted together in one captured pass
    (every slot's ``keystroke`` rows; rows of other slots write past their ends, harmlessly); then one
    captured step decodes a token for every admitted stream. First delta = arrival to first token on
    the host. Two graphs in all, whatever the arrivals.
    """
    vocab = model.cfg.vocab_size
    keys_len = key_bucket((doc_len if prewarmed else 0) + keystroke + new_tokens + 1, 1 << 20)
    cache = BatchedCache(model, streams, keys_len)
    gen = torch.Generator().manual_seed(2)
    lengths = torch.zeros(streams, dtype=torch.long, device=DEV)
    if prewarmed:
        for i in range(streams):
            model(torch.randint(0, vocab, (doc_len,), generator=gen).to(DEV), cache.slot(i), 0, 1)
        lengths.fill_(doc_len)
    keystrokes = torch.randint(0, vocab, (streams, keystroke), generator=gen)
    adm_tokens = torch.zeros(streams, keystroke, dtype=torch.long, device=DEV)
    adm_last = torch.full((streams,), keystroke - 1, dtype=torch.long, device=DEV)
    step_tokens = torch.zeros(streams, dtype=torch.long, device=DEV)
    active = torch.zeros(streams, dtype=torch.long, device=DEV)

    def admit():
        return batched_forward(model, cache, adm_tokens, lengths, keys_len, adm_last, attention).argmax(-1)

    def step():
        nxt = batched_forward(model, cache, step_tokens, lengths, keys_len, None, attention).argmax(-1)
        step_tokens.copy_(nxt)
        lengths.add_(active)  # idle slots stay put
        return nxt

    pool = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        admit_graph, admitted = capture(admit, pool)
        step_graph, _ = capture(step, pool)
    waiting = sorted(range(streams), key=lambda i: arrivals[i])
    counts = [0] * streams
    first_delta = [0.0] * streams
    step_times: list[tuple[float, int]] = []
    done = 0
    t_start = time.perf_counter()
    with torch.inference_mode():
        while done < streams:
            now = time.perf_counter() - t_start
            arrived = [i for i in waiting if arrivals[i] <= now]
            if arrived:
                waiting = [i for i in waiting if i not in arrived]
                rows = torch.zeros(streams, keystroke, dtype=torch.long)
                rows[arrived] = keystrokes[arrived]
                adm_tokens.copy_(rows)
                admit_graph.replay()
                idx = torch.tensor(arrived, device=DEV)
                lengths.index_add_(0, idx, torch.full((len(arrived),), keystroke, dtype=torch.long, device=DEV))
                step_tokens.index_copy_(0, idx, admitted.index_select(0, idx))
                active.index_fill_(0, idx, 1)
                admitted.tolist()  # the first tokens reach the host
                t = time.perf_counter() - t_start
                for i in arrived:
                    first_delta[i] = t - arrivals[i]
                    counts[i] = 1
            live = [i for i, c in enumerate(counts) if 0 < c < new_tokens]
            if not live:
                continue  # nothing to decode yet: wait for the next arrival
            t0 = time.perf_counter()
            step_graph.replay()
            step_tokens.tolist()  # the step's one sync: every stream's new token on the host
            step_times.append((time.perf_counter() - t0, len(live)))
            finished = []
            for i in live:
                counts[i] += 1
                if counts[i] == new_tokens:
                    finished.append(i)
            if finished:
                active.index_fill_(0, torch.tensor(finished, device=DEV), 0)
                done += len(finished)
    wall = time.perf_counter() - t_start
    full = [t for t, n in step_times if n == streams]
    deltas = sorted(first_delta)
    return {
        "streams": streams,
        "doc_tokens": doc_len if prewarmed else 0,
        "new_prompt_tokens": keystroke,
        "new_tokens": new_tokens,
        "aggregate_tok_s": streams * new_tokens / (wall - min(arrivals)),
        "full_batch_step_ms": statistics.median(full) * 1e3 if full else None,
        "full_batch_tok_s": streams / statistics.median(full) if full else None,
        "first_delta_p50_ms": statistics.median(deltas) * 1e3,
        "first_delta_p95_ms": deltas[min(len(deltas) - 1, round(0.95 * (len(deltas) - 1)))] * 1e3,
    }


def compile_table(shapes: list[str], context: int, bw: float, reps: int) -> list[dict]:
    """The 1-token step with torch.compile'd elementwise fusion inside the graph (one compile per shape)."""
    rows = []
    for name in ["embedded target"] + shapes:
        model = (
            eager_runtime(load_model(DEFAULT_TARGET, device=DEV, dtype=DTYPE).runtime)
            if name == "embedded target"
            else random_model(name)
        )
        try:
            rows.append(step_table(name, model, context, bw, reps, compile_only=True))
        except Exception as exc:  # report, keep the other shapes
            rows.append({"shape": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
        print(f"  compiled: {rows[-1]}", flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="0.5B only, few prompts, 8 streams: under a minute")
    ap.add_argument("--shapes", default=None, help="comma list of 0.5B,1.5B,7B")
    ap.add_argument("--context", type=int, default=1024, help="tokens in the cache when steps are timed")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--streams", type=int)
    ap.add_argument("--doc", type=int, default=512, help="batched: tokens of each stream's document")
    ap.add_argument("--keystroke", type=int, default=16, help="batched: new prompt tokens per request, warm")
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="only the 1-token graph step with torch.compile fusion, per shape (compiles take minutes)",
    )
    ap.add_argument(
        "--llama-server",
        metavar="BIN",
        help="the peer's row: llama.cpp's llama-server (CUDA build, bench/peer_h200.sh) on --gguf, its single-stream "
        "step against fimble's graph step on the same prompt, outputs compared (bench/harness/llama_server_cuda.py)",
    )
    ap.add_argument("--gguf", type=Path, help="--llama-server's model: the random 1.5B shape as a GGUF")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU")
    shapes = (args.shapes or ("0.5B" if args.quick else "0.5B,1.5B,7B")).split(",")
    n_prompts = args.prompts or (4 if args.quick else 24)
    n_tokens = args.tokens or (64 if args.quick else 96)
    streams = args.streams or (8 if args.quick else 32)
    reps = 20 if args.quick else 50
    torch.manual_seed(0)
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "threads": torch.get_num_threads(),
        "context": args.context,
    }
    bw = copy_bandwidth()
    result["copy_bandwidth_TBps"] = bw / 1e12
    print(f"device {result['device']}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if args.compile_only:
        result["compiled"] = rows = compile_table(shapes, args.context, bw, reps)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        print(
            f"\n{'shape':16s} {'compile':>8s} {'step':>9s} {'GPU':>9s} {'floor':>7s} "
            f"{'step/floor':>10s} {'GPU/floor':>9s}"
        )
        for r in rows:
            if "error" in r:
                print(f"{r['shape']:16s} {r['error']}")
                continue
            print(
                f"{r['shape']:16s} {r['compile_s']:7.1f}s {r['compiled_graph_step_ms']:7.3f}ms "
                f"{r['compiled_graph_gpu_step_ms']:7.3f}ms {r['floor_ms']:5.3f}ms "
                f"{r['compiled_step_over_floor']:10.2f} "
                f"{r['compiled_gpu_over_floor']:9.2f}"
            )
        ok = [r for r in rows if "error" not in r and r["shape"] in SHAPES]
        print(
            "headline: compiled graph step / floor "
            + ", ".join(f"{r['shape']} {r['compiled_step_over_floor']:.2f}x" for r in ok)
        )
        return

    steps = []
    target = eager_runtime(load_model(DEFAULT_TARGET, device=DEV, dtype=DTYPE).runtime)
    draft = eager_runtime(load_model(DEFAULT_DRAFT, device=DEV, dtype=DTYPE).runtime)
    steps.append(step_table("embedded target", target, args.context, bw, reps))
    steps.append(step_table("embedded draft", draft, args.context, bw, reps))
    del target, draft
    models = {}
    for name in shapes:
        models[name] = random_model(name)
        steps.append(step_table(name, models[name], args.context, bw, reps))
        print(f"  steps timed: {name}", flush=True)
    result["steps"] = steps
    att = {r["shape"]: r["attention"] for r in steps}  # each shape's faster graph attention, used below

    pair, traces, info = pair_table(n_prompts, n_tokens, (att["embedded target"], att["embedded draft"]))
    result["pair"], result["pair_info"] = pair, info
    result["trace"] = traces
    print("  embedded pair timed", flush=True)

    replays = {}
    if "0.5B" in models:
        prompt_len = round(info["prompt_tokens_mean"])
        for name in [s for s in ("1.5B", "7B") if s in models]:
            replays[name] = replay(models[name], models["0.5B"], traces, prompt_len, (att[name], att["0.5B"]))
            print(f"  replay on {name}", flush=True)
    result["replay"] = replays

    bshape = "1.5B" if "1.5B" in models else shapes[0]
    new_tokens = 32 if args.quick else 128
    rng = random.Random(3)
    spread = sorted(rng.uniform(0, 1.0) for _ in range(streams))
    bm, ba = models[bshape], att[bshape]
    result["batched"] = {
        "warm, all at once": batched(bm, streams, args.doc, args.keystroke, new_tokens, [0.0] * streams, True, ba),
        "warm, spread over 1 s": batched(bm, streams, args.doc, args.keystroke, new_tokens, spread, True, ba),
        "cold prompts, all at once": batched(bm, streams, 0, args.doc, new_tokens, [0.0] * streams, False, ba),
    }
    print("  batched timed", flush=True)
    load = os.getloadavg()
    result["loadavg"] = load

    print(
        f"\nbench/gpu.py: {result['device']}, bf16, cache at {args.context} tokens, copy bandwidth "
        f"{bw / 1e12:.2f} TB/s, threads={result['threads']}, load average {load[0]:.2f}"
    )
    print(
        "floor = weight bytes read per step / measured copy bandwidth; step = call + argmax read back; "
        "graph GPU = back-to-back replays; att = the graph kernels used below (the default where it runs, else the "
        "fastest)"
    )
    print(
        f"{'shape':16s} {'weights GB':>10s} {'eager step':>10s} {'eager ver8':>10s} {'graph step':>10s} "
        f"{'graph ver8':>10s} {'graph GPU':>9s} {'floor':>7s} {'step/floor':>10s} {'GPU/floor':>9s} att   "
        f"{'sdpa step':>9s} {'mm step':>9s} {'fused step':>10s} {'inv16 step':>10s} {'triton step':>11s}"
    )
    for r in steps:
        print(
            f"{r['shape']:16s} {r['weight_GB']:10.3f} {r['eager_step_ms']:8.3f}ms {r['eager_verify8_ms']:8.3f}ms "
            f"{r['graph_step_ms']:8.3f}ms {r['graph_verify8_ms']:8.3f}ms {r['graph_gpu_step_ms']:7.3f}ms "
            f"{r['floor_ms']:5.3f}ms {r['graph_step_over_floor']:10.2f} {r['graph_gpu_over_floor']:9.2f} "
            f"{r['attention']:6s}{r['graph_step_ms_sdpa']:7.3f}ms {r['graph_step_ms_matmul']:7.3f}ms "
            f"{r.get('graph_step_ms_fused', float('nan')):8.3f}ms "
            f"{r.get('graph_step_ms_invariant-cublas', float('nan')):8.3f}ms "
            f"{r.get('graph_step_ms_invariant', float('nan')):9.3f}ms"
        )
    print(
        f"\nembedded pair, {n_prompts} FIM prompts (~{info['prompt_tokens_mean']:.0f} tokens), {n_tokens} new tokens "
        f"each, greedy; graph auto: {info['tokens_per_verify']:.2f} tokens per verify, draft model on "
        f"{info['model_draft_share']:.0%} of steps"
    )
    eager_auto = next(r for r in pair if r["method"] == "eager spec: auto")["decode_tok_s"]
    print(f"{'method':26s} {'decode tok/s':>12s} {'incl. prefill':>13s} {'x eager auto':>12s} {'identical':>9s}")
    for r in pair:
        print(
            f"{r['method']:26s} {r['decode_tok_s']:12.0f} {r['with_prefill_tok_s']:13.0f} "
            f"{r['decode_tok_s'] / eager_auto:12.2f} {r['identical_to_eager_plain']:>9s}"
        )
    for name, r in replays.items():
        print(
            f"replay on {name} (draft: 0.5B shape): {r['replay_tok_s']:.0f} tok/s per stream, graph plain "
            f"{r['graph_plain_tok_s']:.0f} tok/s ({r['speedup']:.2f}x)"
        )
    for label, r in result["batched"].items():
        print(
            f"batched {bshape} x {r['streams']}, {label} (doc {r['doc_tokens']}, +{r['new_prompt_tokens']} "
            f"prompt tokens, {r['new_tokens']} new): aggregate {r['aggregate_tok_s']:.0f} tok/s (full batch "
            f"{r['full_batch_tok_s'] or 0:.0f} tok/s, step {r['full_batch_step_ms'] or 0:.2f} ms), first delta "
            f"p50 {r['first_delta_p50_ms']:.1f} ms p95 {r['first_delta_p95_ms']:.1f} ms"
        )
    peer = ""
    if args.llama_server:
        from bench.harness.llama_server_cuda import step_compare

        p = result["peer_step"] = step_compare(args.llama_server, args.gguf, "1.5B", args.context, 128, Path("/tmp"))
        print(
            f"peer: llama-server (CUDA) on the random 1.5B shape ({args.gguf.name}), 1 stream at {args.context} "
            f"cached: step {p['llama_step_ms']:.3f} ms (llama.cpp's timing) vs fimble's graph step "
            f"{p['fimble_step_ms_median']:.3f} ms ({p['step_ratio']}x); greedy outputs identical for the first "
            f"{p['identical_prefix']} of "
            f"{p['compared']} tokens"
        )
        peer = (
            f"; 1.5B single stream fimble {p['fimble_step_ms_median']:.2f} ms vs llama-server {p['llama_step_ms']:.2f} "
            f"ms a step ({p['step_ratio']}x), greedy identical {p['identical_prefix']}/{p['compared']}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    best = max((r for r in pair if r["method"].startswith("graph spec")), key=lambda r: r["decode_tok_s"])
    ratios = ", ".join(f"{r['shape']} {r['graph_step_over_floor']:.2f}x" for r in steps if r["shape"] in SHAPES)
    rep = replays.get("1.5B", {}).get("replay_tok_s")
    conc = result["batched"]["warm, all at once"]
    print(
        f"headline: graph step / floor {ratios}; embedded pair {best['method']} {best['decode_tok_s']:.0f} tok/s "
        f"per stream ({best['decode_tok_s'] / eager_auto:.1f}x eager auto, identical "
        f"{best['identical_to_eager_plain']}); 1.5B replay {rep or 0:.0f} tok/s; {bshape} x {streams} concurrent "
        f"streams {conc['aggregate_tok_s']:.0f} tok/s aggregate, p95 first delta {conc['first_delta_p95_ms']:.0f} ms"
        f"{peer}"
    )


if __name__ == "__main__":
    main()
