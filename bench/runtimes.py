"""CPU runtimes side by side under fimble's engine: compact torch (f32) against ggml (llama.cpp kernels,
f32 and q8_0), plain and auto (n-gram + draft model) speculative decoding.

Same prompts as bench/vs_transformers.py (bench/harness/prompts.py ``mixed_prompts``: HumanEval infilling and cursors in
stdlib files), greedy, exactly --tokens new tokens each (no early stop), runtimes interleaved per prompt, one thread
each by default.
Checks that each runtime's auto output equals its own plain output. ``--fixed`` adds "fixed" rows: auto
without the cost-aware policy (engine/decoding/spec_policy.py), the +2/-1 adaptive gamma alone, interleaved.

    FIMBLE_GGML_LIB=... python -m bench.runtimes [--quick] [--threads N] [--model DIR --draft DIR] [--json PATH]

The last line is the headline: ggml's plain and auto speed as a ratio of compact's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from bench.harness.prompts import mixed_prompts
from engine.api import CompletionRequest
from engine.decoding.drafters import ModelDrafter, NgramDrafter
from engine.decoding.speculative import DecodeOptions, SpeculativeDecoder
from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from engine.local import LocalEngine

VARIANTS = {"compact f32": ("compact", "none"), "ggml f32": ("ggml", "none"), "ggml q8_0": ("ggml", "int8")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few prompts, under a minute")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT), help="'' for none (auto is then n-gram only)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixed", action="store_true", help="also auto without the cost model (before/after)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n_prompts = args.prompts or (4 if args.quick else 24)
    n_tokens = args.tokens or (48 if args.quick else 96)
    torch.set_num_threads(args.threads)
    os.environ["FIMBLE_GGML_THREADS"] = str(args.threads)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    models = {}
    for name in names:
        rt, quant = VARIANTS[name]
        target = load_model(args.model, runtime=rt, quant=quant)
        draft = load_model(args.draft, runtime=rt, quant=quant) if args.draft else None
        models[name] = (target, ModelDrafter(draft.runtime, draft.max_len) if draft else None)
    builder = LocalEngine(models[names[0]][0], None, start_thread=False)
    prompts = []
    for _, prefix, suffix in mixed_prompts(n_prompts, args.seed):
        ids, _, _ = builder.build_prompt(CompletionRequest(prefix, suffix, heal=False))
        prompts.append(ids)
    ngram = NgramDrafter(history=0)
    methods = {}
    for name, (target, drafter) in models.items():
        methods[f"{name} plain"] = (name, target, "none", None)
        methods[f"{name} auto"] = (name, target, "auto", drafter)
        if args.fixed:
            methods[f"{name} fixed"] = (name, target, "fixed", drafter)

    def run(spec, prompt):
        """(output, prefill seconds, decode seconds, tokens per verify step)"""
        _, target, mode, drafter = spec
        opts = DecodeOptions(max_tokens=n_tokens, drafter="auto" if mode == "fixed" else mode)
        cache = target.runtime.new_cache(len(prompt) + n_tokens + 32)
        dec = SpeculativeDecoder(target.runtime, cache, set(), opts, drafter, ngram if mode != "none" else None)
        if mode == "fixed":
            dec.costs = None  # the policy before the cost model: draft every round
        t0 = time.perf_counter()
        dec.prefill(prompt)
        t1 = time.perf_counter()
        while not dec.done:
            dec.step()
        return dec.output, t1 - t0, time.perf_counter() - t1, dec.stats.mean_accepted

    for spec in methods.values():  # warm-up: first-call costs untimed
        run(spec, prompts[0])
    rows = {m: {"prefill_s": 0.0, "decode_s": 0.0, "tokens": 0, "accepted": [], "equal_plain": 0} for m in methods}
    loads = []
    for i, prompt in enumerate(prompts):
        plain_out = {}
        for m, spec in methods.items():  # interleaved per prompt
            out, pre, dec_s, acc = run(spec, prompt)
            r = rows[m]
            r["prefill_s"] += pre
            r["decode_s"] += dec_s
            r["tokens"] += len(out) - 1  # the decode rate counts the tokens after the first
            if spec[2] == "none":
                plain_out[spec[0]] = out
            else:
                r["accepted"].append(acc)
            r["equal_plain"] += int(out == plain_out[spec[0]])
        loads.append(os.getloadavg()[0])
        print(f"  prompt {i + 1}/{len(prompts)} ({len(prompt)} tokens)", file=sys.stderr, flush=True)
    n_prompt = sum(len(p) for p in prompts)

    def rate(m: str) -> float:
        return rows[m]["tokens"] / rows[m]["decode_s"]

    base = {mode: rate(f"{names[0]} {mode}") for mode in ("plain", "auto")}
    print(
        f"\nruntimes: {len(prompts)} prompts ({n_prompt // len(prompts)} tokens on average) x {n_tokens} new "
        f"tokens, greedy, {args.threads} thread(s), model {Path(args.model).name}, "
        f"load average {min(loads):.1f}-{max(loads):.1f} (1 min)"
    )
    print(
        f"{'method':22s} {'decode tok/s':>12s} {'x ' + names[0]:>16s} {'prefill tok/s':>13s} {'acc/step':>9s} "
        f"{'= own plain':>12s}"
    )
    table = []
    for m, r in rows.items():
        tps = rate(m)
        mode = "plain" if m.endswith("plain") else "auto"  # fixed rows: a ratio of the first runtime's auto
        acc = sum(r["accepted"]) / len(r["accepted"]) if r["accepted"] else 1.0
        pre = n_prompt / r["prefill_s"]
        table.append(
            {
                "method": m,
                "decode_tokens_per_s": tps,
                "ratio": tps / base[mode],
                "prefill_tokens_per_s": pre,
                "accepted_per_step": acc,
                "equal_own_plain": r["equal_plain"],
                "prompts": len(prompts),
            }
        )
        print(
            f"{m:22s} {tps:12.1f} {tps / base[mode]:16.2f} {pre:13.0f} {acc:9.2f} {r['equal_plain']:>8d}/{len(prompts)}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"threads": args.threads, "tokens": n_tokens, "loadavg": loads, "rows": table}, indent=1)
        )
    best = {
        mode: max((t for t in table if t["method"].endswith(mode)), key=lambda t: t["decode_tokens_per_s"])
        for mode in ("plain", "auto")
    }
    print(
        f"headline: decode rate {best['plain']['method']} {best['plain']['ratio']:.2f}x and {best['auto']['method']} "
        f"{best['auto']['ratio']:.2f}x {names[0]}'s ({args.threads} thread(s), load {max(loads):.1f})"
    )


if __name__ == "__main__":
    main()
