"""Train fimble's embedded tokenizer, target and draft models (run on the GPU machine).

    python -m training.train --out /tmp/fimble-train --humaneval DIR [--seed 0]

Everything that is random draws from ``--seed``. The number of optimiser steps
is sized from the time budget after 20 measured steps (inside the linear
warm-up, so the schedule before that point does not depend on it); the chosen
numbers are printed and saved, and ``--target-steps/--draft-steps`` replay them
exactly. Progress is printed every few seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from training.corpus import HumanEvalFilter, collect, source_roots, split_chunks
from training.fim_samples import EOT, SPECIAL_TOKENS, assemble, make_sample

VOCAB_SIZE = 8192
SEQ_LEN = 4096
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a dry run of the script

# Sized on the 2-core CPU machine with engine/runtimes/compact.py (see models/MODEL_CARD.md):
# the largest shape that decodes >= 150 tok/s and prefills 512 tokens in <= 150 ms.
TARGET_SHAPE = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2
)
# About 10x fewer parameters than the target, same tokenizer.
DRAFT_SHAPE = dict(
    hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train_tokenizer(texts: list[str], seed: int, sample_chars: int = 60_000_000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    sample, total = [], 0
    for i in rng.sample(range(len(texts)), len(texts)):
        sample.append(texts[i])
        total += len(texts[i])
        if total >= sample_chars:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample, trainer=trainer)
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT,
        pad_token=EOT,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != EOT],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def tokenize_stream(tok, texts: list[str], seed: int) -> tuple[np.ndarray, dict]:
    """All texts -> chunks -> plain/PSM/SPM samples -> one packed uint16 token stream."""
    rng = random.Random(seed)
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    samples = []
    for text in texts:
        for chunk in split_chunks(text, rng):
            samples.append(make_sample(chunk, rng))
    pieces = []
    for s in samples:
        pieces.extend((s.prefix, s.middle, s.suffix))
    encoded = (
        tok.encode_batch_fast(pieces, add_special_tokens=False)
        if hasattr(tok, "encode_batch_fast")
        else tok.encode_batch(pieces, add_special_tokens=False)
    )
    out: list[int] = []
    modes = {"plain": 0, "psm": 0, "spm": 0}
    for i, s in enumerate(samples):
        ids = {"prefix": encoded[3 * i].ids, "middle": encoded[3 * i + 1].ids, "suffix": encoded[3 * i + 2].ids}
        out.extend(assemble(s, ids, special))
        modes[s.mode] += 1
    return np.asarray(out, dtype=np.uint16), {"samples": len(samples), "modes": modes, "tokens": len(out)}


def make_config(shape: dict, eot_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        hidden_act="silu",
        **shape,
    )


def batches(stream: torch.Tensor, batch: int, gen: torch.Generator):
    n = stream.numel() - SEQ_LEN - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen, device="cpu").to(stream.device)
        idx = starts[:, None] + torch.arange(SEQ_LEN + 1, device=stream.device)[None]
        window = stream[idx].long()
        yield window[:, :-1], window[:, 1:]


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, seed: int, n_batches: int = 20, batch: int = 16) -> float:
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    it = batches(stream, batch, gen)
    model.eval()
    for _ in range(n_batches):
        x, y = next(it)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
            logits = model(input_ids=x).logits
        losses.append(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
    model.train()
    return float(np.mean(losses))


def train_model(
    name: str,
    config,
    train_stream,
    held_stream,
    seed: int,
    budget_s: float,
    fixed_steps: int | None,
    batch: int,
    peak_lr: float,
) -> tuple[object, dict]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(DEVICE)
    params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {params / 1e6:.2f}M parameters, batch {batch}x{SEQ_LEN}, budget {budget_s:.0f}s")
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1, fused=DEVICE == "cuda")
    gen = torch.Generator().manual_seed(seed)
    data = batches(train_stream, batch, gen)
    warmup, probe = 100, 20
    total = fixed_steps
    start = time.time()
    last_print = 0.0
    losses = []
    step = 0
    while total is None or step < total:
        if total is None and step == probe:
            per_step = (time.time() - start) / probe
            total = max(probe + 1, int(budget_s / per_step))
            log(f"{name}: {per_step * 1000:.0f} ms/step -> {total} steps (replay with --{name}-steps {total})")
        lr_total = total or 10**9
        if step < warmup:
            lr = peak_lr * (step + 1) / warmup
        else:
            frac = (step - warmup) / max(1, lr_total - warmup)
            lr = peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(data)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if time.time() - last_print > 10 or step == total:
            last_print = time.time()
            losses.append((step, loss.item()))
            elapsed = time.time() - start
            tps = step * batch * SEQ_LEN / elapsed
            log(
                f"{name}: step {step}/{total or '?'} loss {loss.item():.3f} lr {lr:.2e} "
                f"{tps / 1e3:.0f}k tok/s elapsed {elapsed:.0f}s"
            )
    train_loss = float(np.mean([v for _, v in losses[-3:]]))
    held = held_out_loss(model, held_stream, seed)
    stats = {
        "parameters": params,
        "steps": step,
        "batch_tokens": batch * SEQ_LEN,
        "tokens_seen": step * batch * SEQ_LEN,
        "final_train_loss": train_loss,
        "held_out_loss": held,
        "seconds": time.time() - start,
        "loss_curve": losses,
        "peak_lr": peak_lr,
        "seed": seed,
    }
    log(f"{name}: done, train loss {train_loss:.3f}, held-out loss {held:.3f}")
    return model, stats


def save_model(model, tokenizer, folder: Path, eot_id: int) -> None:
    from transformers import GenerationConfig

    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="15MB")
    tokenizer.save_pretrained(folder)
    GenerationConfig(eos_token_id=eot_id, pad_token_id=eot_id, do_sample=False).save_pretrained(folder)


def pack(folder: Path, dest: Path, part_bytes: int = 15 * 2**20) -> None:
    """Tar a model folder into parts under the device tool's 16 MiB per-file limit."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(folder, arcname=folder.name)
    data = buf.getvalue()
    dest.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(data), part_bytes):
        (dest / f"{folder.name}.tar.part{i // part_bytes:02d}").write_bytes(data[i : i + part_bytes])
    log(f"packed {folder.name}: {len(data) / 2**20:.1f} MiB into {dest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--humaneval", type=Path, required=True, help="folder with HumanEval-*.jsonl.gz")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-seconds", type=float, default=270)
    ap.add_argument("--draft-seconds", type=float, default=60)
    ap.add_argument(
        "--deadline-seconds",
        type=float,
        help="split what is left of this wall-clock budget after data prep 80/20 between the models",
    )
    ap.add_argument("--target-steps", type=int)
    ap.add_argument("--draft-steps", type=int)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-files", type=int, help="for a quick dry run")
    ap.add_argument("--pack", type=Path, help="also write each model as tar parts here")
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN, help="smaller only for a quick dry run")
    args = ap.parse_args()
    globals()["SEQ_LEN"] = args.seq_len
    random.seed(args.seed)
    np.random.seed(args.seed)
    t0 = time.time()

    he = HumanEvalFilter.from_files(sorted(args.humaneval.glob("HumanEval-*.jsonl.gz")))
    roots = source_roots()
    log(f"collecting Python files under {len(roots)} roots: {[str(r) for r in roots]}")
    texts, corpus_stats = collect(roots, he)
    if args.max_files:
        texts = texts[: args.max_files]
    log(f"corpus: {corpus_stats}")
    # Held-out split by file, decided by a hash-free seeded shuffle so it is reproducible.
    order = list(range(len(texts)))
    random.Random(args.seed).shuffle(order)
    n_held = max(2, len(texts) // 100)
    held_texts = [texts[i] for i in order[:n_held]]
    train_texts = [texts[i] for i in order[n_held:]]

    tok = train_tokenizer(train_texts, args.seed)
    eot_id = tok.token_to_id(EOT)
    log(f"tokenizer trained: vocab {tok.get_vocab_size()}")
    train_np, train_info = tokenize_stream(tok, train_texts, args.seed)
    held_np, held_info = tokenize_stream(tok, held_texts, args.seed + 7)
    chars = sum(map(len, train_texts))
    log(f"train stream {train_info}, {chars / len(train_np):.2f} chars/token; held-out {held_info}")
    train_stream = torch.from_numpy(train_np.astype(np.int32)).to(DEVICE)
    held_stream = torch.from_numpy(held_np.astype(np.int32)).to(DEVICE)
    log(f"data ready after {time.time() - t0:.0f}s")

    tokenizer = wrap_tokenizer(tok)
    report = {
        "corpus": corpus_stats,
        "train_files": len(train_texts),
        "held_out_files": len(held_texts),
        "train_stream": train_info,
        "held_out_stream": held_info,
        "chars_per_token": chars / len(train_np),
        "seq_len": SEQ_LEN,
        "vocab_size": VOCAB_SIZE,
        "seed": args.seed,
    }
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.deadline_seconds:
        left = args.deadline_seconds - (time.time() - t0) - 60  # eval, saving and packing
        args.target_seconds, args.draft_seconds = 0.8 * left, 0.2 * left
        log(f"budgets from deadline: target {args.target_seconds:.0f}s, draft {args.draft_seconds:.0f}s")
    for name, shape, budget, steps, lr in (
        ("target", TARGET_SHAPE, args.target_seconds, args.target_steps, 1.5e-3),
        ("draft", DRAFT_SHAPE, args.draft_seconds, args.draft_steps, 3e-3),
    ):
        model, stats = train_model(
            name, make_config(shape, eot_id), train_stream, held_stream, args.seed, budget, steps, args.batch, lr
        )
        report[name] = stats
        save_model(model, tokenizer, args.out / f"fimble-{name}", eot_id)
        (args.out / "training_report.json").write_text(json.dumps(report, indent=1))
        if args.pack:
            pack(args.out / f"fimble-{name}", args.pack)
        del model
        torch.cuda.empty_cache()
    if args.pack:
        (args.pack / "training_report.json").write_text(json.dumps(report, indent=1))
    log(f"all done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
