"""Decoding speed: transformers' generate (plain, assisted, prompt lookup) against fimble's engine.

Same prompts, same model, greedy, in one run. Every method decodes exactly
--tokens new tokens (no early stop) so tokens/s compare like for like, and every
method's output is checked against HF plain greedy.

    python -m bench.vs_transformers [--quick] [--device cpu|cuda] [--json PATH]

The last line is the headline: fimble's best speculative speed as a ratio of HF plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_fimble(target, drafter_name, prompt, n, model_drafter, ngram, device) -> tuple[list[int], float, float]:
    opts = DecodeOptions(max_tokens=n, drafter=drafter_name)
    cache = target.runtime.new_cache(len(prompt) + n + 16)
    sync(device)
    t0 = time.perf_counter()
    dec = SpeculativeDecoder(target.runtime, cache, set(), opts, model_drafter, ngram)
    dec.prefill(prompt)
    while not dec.done:
        dec.step()
    sync(device)
    return dec.output, time.perf_counter() - t0, dec.stats.mean_accepted


def run_hf(hf, prompt, n, device, **kwargs) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=device)
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs
    )
    sync(device)
    return out[0, len(prompt) :].tolist(), time.perf_counter() - t0


def prefill_ms(target, hf, length: int, device: str, repeats: int) -> tuple[float, float]:
    ids = torch.randint(10, 8000, (length,), generator=torch.Generator().manual_seed(0)).to(device)
    cache = target.runtime.new_cache(length + 8)
    ours, theirs = [], []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        target.runtime(ids, cache, 0, 1)
        sync(device)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf(input_ids=ids[None], logits_to_keep=1)
        sync(device)
        theirs.append(time.perf_counter() - t0)
    return statistics.median(ours[1:]) * 1e3, statistics.median(theirs[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few prompts, under a minute on the CPU machine")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n_prompts = args.prompts or (6 if args.quick else 24)
    n_tokens = args.tokens or (64 if args.quick else 96)
    dev = args.device
    from transformers import AutoModelForCausalLM

    target = load_model(args.model, device=dev)
    draft = load_model(args.draft, device=dev)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(dev).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).to(dev).eval()
    for m in (hf, hf_draft):  # decode exactly n tokens: no EOS stop anywhere
        m.generation_config.eos_token_id = None
    builder = LocalEngine(target, None, start_thread=False)
    prompts = []
    for source, prefix, suffix in mixed_prompts(n_prompts, args.seed):
        ids, _, _ = builder.build_prompt(CompletionRequest(prefix, suffix, heal=False))
        prompts.append((source, ids))
    model_drafter = ModelDrafter(draft.runtime, draft.max_len)
    ngram = NgramDrafter(history=0)

    methods = {
        "HF generate": lambda p: run_hf(hf, p, n_tokens, dev),
        "HF assisted (draft model)": lambda p: run_hf(hf, p, n_tokens, dev, assistant_model=hf_draft),
        "HF prompt lookup": lambda p: run_hf(hf, p, n_tokens, dev, prompt_lookup_num_tokens=10),
        "fimble plain": lambda p: run_fimble(target, "none", p, n_tokens, None, None, dev),
        "fimble spec: n-gram": lambda p: run_fimble(target, "ngram", p, n_tokens, None, ngram, dev),
        "fimble spec: draft model": lambda p: run_fimble(target, "model", p, n_tokens, model_drafter, None, dev),
        "fimble spec: auto": lambda p: run_fimble(target, "auto", p, n_tokens, model_drafter, ngram, dev),
    }
    # Warm-up on one prompt, so first-call costs are not timed.
    for fn in methods.values():
        fn(prompts[0][1])
    rows = {name: {"seconds": 0.0, "tokens": 0, "identical": 0, "accepted": []} for name in methods}
    for i, (_, prompt) in enumerate(prompts):
        reference = None
        # Interleave methods per prompt so machine noise hits all of them alike.
        for name, fn in methods.items():
            res = fn(prompt)
            out, secs = res[0], res[1]
            if reference is None:
                reference = out
            r = rows[name]
            r["seconds"] += secs
            r["tokens"] += len(out)
            r["identical"] += int(out == reference)
            if len(res) > 2:
                r["accepted"].append(res[2])
        print(f"  prompt {i + 1}/{len(prompts)} ({len(prompt)} tokens)", file=sys.stderr, flush=True)

    base = rows["HF generate"]["tokens"] / rows["HF generate"]["seconds"]
    hf_spec = ("HF assisted (draft model)", "HF prompt lookup")
    fastest_hf = max(rows[k]["tokens"] / rows[k]["seconds"] for k in hf_spec)
    table = []
    for name, r in rows.items():
        tps = r["tokens"] / r["seconds"]
        table.append(
            {
                "method": name,
                "tokens_per_s": tps,
                "ratio_vs_hf_plain": tps / base,
                "ratio_vs_best_hf_speculative": tps / fastest_hf,
                "mean_accepted_per_step": statistics.mean(r["accepted"]) if r["accepted"] else None,
                "identical_to_hf_plain": f"{r['identical']}/{len(prompts)}",
            }
        )
    pre = {n: prefill_ms(target, hf, n, dev, 3 if args.quick else 5) for n in (512, 2048)}

    print(
        f"\nfimble engine bench: {len(prompts)} prompts, {n_tokens} new tokens each, greedy, {dev}, "
        f"threads={torch.get_num_threads()}"
    )
    print(
        f"{'method':28s} {'tok/s':>8s} {'x HF plain':>10s} {'x best HF spec':>14s} {'acc/step':>9s} {'identical':>9s}"
    )
    for row in table:
        acc = f"{row['mean_accepted_per_step']:.2f}" if row["mean_accepted_per_step"] else "-"
        print(
            f"{row['method']:28s} {row['tokens_per_s']:8.1f} {row['ratio_vs_hf_plain']:10.2f} "
            f"{row['ratio_vs_best_hf_speculative']:14.2f} {acc:>9s} {row['identical_to_hf_plain']:>9s}"
        )
    for n, (ours, theirs) in pre.items():
        print(f"prefill {n:5d} tokens: fimble {ours:7.1f} ms   HF forward {theirs:7.1f} ms")
    best = max((r for r in table if r["method"].startswith("fimble spec")), key=lambda r: r["tokens_per_s"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "device": dev,
                    "prompts": len(prompts),
                    "new_tokens": n_tokens,
                    "methods": table,
                    "prefill_ms": {str(k): {"fimble": v[0], "hf": v[1]} for k, v in pre.items()},
                },
                indent=1,
            )
        )
    print(
        f"headline: {best['method']} {best['ratio_vs_hf_plain']:.2f}x HF plain generate, "
        f"{best['ratio_vs_best_hf_speculative']:.2f}x the best HF speculative, outputs identical "
        f"{best['identical_to_hf_plain']}"
    )


if __name__ == "__main__":
    main()
