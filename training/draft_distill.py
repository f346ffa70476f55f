"""Distil a small drafter for the default model (Qwen2.5-Coder-0.5B FIM-tuned) on the GPU machine (issue 24).

    python -m training.draft_distill --gguf SOURCE.gguf --adapter DIR --humaneval DIR --out DIR
                                     [--langs BUNDLE ...] [--budget-seconds 420]

The teacher is the default model as the install step builds it: the registry's GGUF dequantised by the engine's
own loader, with the shipped FIM adapter's deltas added (training/qwen_fim.py), in bf16 on the GPU. The corpus and
the prompts are the FIM trainer's (training/qwen_fim_train.py): source files of the GPU machine plus the language
bundles, each cursor's prompt built by the engine's own PromptBuilder, followed by the middle; so the drafter
learns on exactly the token streams it drafts in.

The drafter is a 6-layer Llama-shaped model over a sub-vocabulary: the ``--vocab`` - 1 Qwen tokens most frequent in
the training rows (every FIM and end token among them) plus index 0, "any other token". Its input maps other
tokens to 0; it never proposes 0. A head of 16k rows instead of 152k is what makes a draft step cheap on a CPU
(bench/verify_rows.py: a step of the default model is ~26-40 ms; this drafter's is ~1 ms).

Loss: at every position, the KL divergence from the teacher's next-token distribution (restricted to the
sub-vocabulary and renormalised) to the drafter's, weighted ``--middle-weight`` times on the middle's positions
(what the engine drafts) and 1 on the prompt's. The report counts how often the drafter's argmax equals the
teacher's full-vocabulary argmax on held-out middles, per language: the greedy acceptance a draft of one token
would see.

Out: ``draft/`` (config.json, model.safetensors in bf16, token_map.json: the Qwen id of each drafter index, 0 = -1),
``draft_report.json`` and the log.
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

from training.qwen_fim_train import EOT, build_samples, load_base, log, prompt_model

# Tokens the prompts are made of: they must be in the sub-vocabulary whatever their frequency.
FIM_TOKENS = (
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<|endoftext|>",
    "<|im_end|>",
)


def pack_rows(
    samples: list, seq: int, pad: int, middle_weight: float, prompt_weight: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``seq + 1`` tokens (whole samples back to back) and each position's loss weight: position t
    predicts token t+1, weighted ``middle_weight`` where t+1 is in the middle, ``prompt_weight`` in the prompt,
    0 in padding."""
    rows, weights = [], []
    x: list[int] = []
    w: list[float] = []
    for prompt, target, _kind in samples:
        ids = prompt + target
        if len(ids) > seq + 1:
            continue
        if len(x) + len(ids) > seq + 1:
            rows.append(x + [pad] * (seq + 1 - len(x)))
            weights.append(w + [0.0] * (seq + 1 - len(w)))
            x, w = [], []
        x += ids
        # a sample's first token is no target (what precedes it is another sample)
        w += [0.0] + [prompt_weight] * (len(prompt) - 1) + [middle_weight] * len(target)
    if x:
        rows.append(x + [pad] * (seq + 1 - len(x)))
        weights.append(w + [0.0] * (seq + 1 - len(w)))
    xs = np.asarray(rows, dtype=np.int64).reshape(-1, seq + 1)
    ws = np.asarray(weights, dtype=np.float32).reshape(-1, seq + 1)
    return xs, ws[:, 1:]


def choose_vocab(xs: np.ndarray, size: int, vocab: int, forced: list[int]) -> np.ndarray:
    """Qwen ids of drafter indices 1..size-1: ``forced`` first, then the most frequent in ``xs``."""
    counts = np.bincount(xs.reshape(-1), minlength=vocab)
    counts[forced] = 0
    order = np.argsort(-counts, kind="stable")
    keep = list(forced) + [int(i) for i in order[: size - 1 - len(forced)]]
    return np.asarray(keep, dtype=np.int64)


def load_teacher(gguf: Path, adapter: Path, device: str):
    """The default model in torch: the GGUF's weights plus the FIM adapter's deltas, before the bf16 cast."""
    import torch

    from training.qwen_fim import HF_TO_GGUF, load_deltas

    model = load_base(gguf, "cpu")  # float32 on the CPU: the deltas are added at full precision
    by_gguf = {f"{g}.weight": hf for hf, g in HF_TO_GGUF.items()}
    deltas = load_deltas(adapter)
    with torch.no_grad():
        for name, delta in deltas.items():
            _blk, layer, rest = name.split(".", 2)
            module = model.get_submodule(f"model.layers.{layer}.{by_gguf[rest]}")
            module.weight += torch.from_numpy(delta)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype).eval()


def drafter_config(vocab: int, args) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.dim // 64,
        "num_key_value_heads": args.kv_heads,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--adapter", type=Path, required=True, help="the FIM adapter folder (training/qwen_fim.py)")
    ap.add_argument("--humaneval", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--langs", type=Path, action="append", default=[])
    ap.add_argument("--root", type=Path, action="append", help="source roots (default: this Python's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-seconds", type=float, default=420)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--middle-weight", type=float, default=3.0)
    ap.add_argument("--per-file", type=int, default=2)
    ap.add_argument("--max-chars", type=float, default=60e6)
    ap.add_argument("--procs", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.qwen_fim_corpus import gather

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    # -- data: the FIM trainer's corpus and prompts ------------------------------------------------------
    train, held, corpus = gather(args.root, args.humaneval, args.seed, args.procs, args.max_chars)
    files = [(p, t) for _lang, p, t in train]
    held_by_lang: dict[str, list[tuple[str, str]]] = {}
    for lang, p, t in held:
        held_by_lang.setdefault(lang, []).append((p, t))
    if args.langs:
        from training.corpus_langs import split_bundles

        extra_train, extra_held, corpus["extra_train_files"] = split_bundles(args.langs)
        files += extra_train
        for lang, fs in extra_held.items():
            held_by_lang.setdefault(lang, []).extend(fs)
    log(f"corpus: {json.dumps(corpus)[:1500]}")
    random.Random(args.seed).shuffle(files)
    samples = build_samples(args.gguf, files, args.seed, args.per_file, args.procs)
    random.Random(args.seed + 1).shuffle(samples)
    pm = prompt_model(args.gguf)
    pad = pm.token_id(EOT)
    xs, ws = pack_rows(samples, args.seq_len, pad, args.middle_weight)
    held_sets = {
        lang: pack_rows(build_samples(args.gguf, fs[:60], args.seed + 7, 2, args.procs), args.seq_len, pad, 1.0, 0.0)
        for lang, fs in sorted(held_by_lang.items())
        if len(fs) >= 2
    }
    forced = [i for i in (pm.token_id(t) for t in FIM_TOKENS) if i is not None]
    keep = choose_vocab(xs, args.vocab, len(pm.tokenizer), forced)
    in_vocab = np.isin(xs[:, 1:], keep)
    coverage = float((in_vocab * (ws > 0)).sum() / max(1.0, (ws > 0).sum()))
    log(
        f"{len(samples)} samples, {xs.shape[0]} rows of {args.seq_len}; sub-vocabulary {args.vocab} covers "
        f"{coverage:.4f} of target tokens; held-out sets { ({k: v[0].shape[0] for k, v in held_sets.items()}) }; "
        f"data ready after {time.time() - t0:.0f}s"
    )
    vocab = len(pm.tokenizer)
    to_draft = np.zeros(vocab, dtype=np.int64)  # Qwen id -> drafter index; 0: any other token
    to_draft[keep] = np.arange(1, len(keep) + 1)

    # -- models ------------------------------------------------------------------------------------------
    teacher = load_teacher(args.gguf, args.adapter, device)
    head = teacher.lm_head.weight[torch.from_numpy(keep).to(device)].detach()  # [K-1, 896]
    log(f"teacher loaded after {time.time() - t0:.0f}s")
    cfg = drafter_config(len(keep) + 1, args)
    student = LlamaForCausalLM(LlamaConfig(**cfg)).to(device)
    with torch.no_grad():  # embeddings start as the teacher's, projected on their top principal directions
        emb = teacher.model.embed_tokens.weight[torch.from_numpy(keep).to(device)].float()
        emb = emb - emb.mean(0)
        _u, _s, v = torch.linalg.svd(emb[:8192], full_matrices=False)
        proj = emb @ v[: args.dim].T
        student.model.embed_tokens.weight[1:] = proj / proj.std() * 0.02
    student.tie_weights()
    n_params = sum(p.numel() for p in student.parameters())
    log(f"drafter: {n_params / 1e6:.1f} M parameters {json.dumps(cfg)}")
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    map_t = torch.from_numpy(to_draft).to(device)
    keep_t = torch.from_numpy(keep).to(device)

    def teacher_logp(x: torch.Tensor, want_best: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probabilities over drafter indices [B, T, K] with index 0 at -inf, the full-vocabulary argmax)."""
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            h = teacher.model(input_ids=x).last_hidden_state
            best = teacher.lm_head(h).argmax(-1) if want_best else None
            sub = (h @ head.T).float()
        sub = torch.cat([torch.full_like(sub[..., :1], -1e9), sub], -1)
        return F.log_softmax(sub, -1), best

    def student_logits(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            return student(input_ids=map_t[x]).logits.float()

    def agreement(xh: np.ndarray, wh: np.ndarray) -> dict:
        """Share of weighted positions (held-out middles when weights mark them) where the drafter's argmax
        (never index 0) is the teacher's full-vocabulary argmax; and the KL on them."""
        student.eval()
        hit = total = kl_sum = 0.0
        with torch.no_grad():
            for i in range(0, len(xh), args.batch):
                xb = torch.from_numpy(xh[i : i + args.batch]).to(device)
                wb = torch.from_numpy(wh[i : i + args.batch]).to(device)
                t_lp, best = teacher_logp(xb[:, :-1], want_best=True)
                s = student_logits(xb[:, :-1])
                s[..., 0] = -1e9
                s_lp = F.log_softmax(s, -1)
                kl = (t_lp.exp() * (t_lp - s_lp)).sum(-1)
                guess = keep_t[s.argmax(-1) - 1]  # drafter index d >= 1 is Qwen id keep[d - 1]
                mask = wb > 0
                hit += float(((guess == best) & mask).sum())
                total += float(mask.sum())
                kl_sum += float((kl * mask).sum())
        student.train()
        return {"agree": hit / max(1.0, total), "kl": kl_sum / max(1.0, total), "positions": int(total)}

    def held_middles(lang_set: tuple[np.ndarray, np.ndarray]) -> dict:
        xh, wh = lang_set
        return agreement(xh, wh) if len(xh) else {}

    # -- training ------------------------------------------------------------------------------------------
    order = np.random.default_rng(args.seed).permutation(len(xs))
    step = 0
    budget_end = t0 + args.budget_seconds
    total_steps = args.steps or 10**9
    losses: list[float] = []
    t_train = time.time()
    while step < total_steps:
        if args.steps is None and time.time() > budget_end:
            break
        idx = order[(step * args.batch) % len(order) : (step * args.batch) % len(order) + args.batch]
        if len(idx) < args.batch:
            idx = order[: args.batch]
        xb = torch.from_numpy(xs[idx]).to(device)
        wb = torch.from_numpy(ws[idx]).to(device)
        # Cosine decay over the training time left (a step-count estimate from the first steps undershoots:
        # they include the kernels' warm-up), or over --steps.
        if args.steps is None:
            done = (time.time() - t_train) / max(1.0, budget_end - t_train)
        else:
            done = step / total_steps
        lr_scale = min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_scale
        t_lp, _best = teacher_logp(xb[:, :-1])
        s_lp = F.log_softmax(student_logits(xb[:, :-1]), -1)
        kl = (t_lp.exp() * (t_lp - s_lp)).sum(-1)
        loss = (kl * wb).sum() / wb.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
        step += 1
        if step % 50 == 0:
            log(f"step {step} loss {np.mean(losses[-50:]):.4f} lr {args.lr * lr_scale:.2e} t {time.time() - t0:.0f}s")
    positions = step * args.batch * args.seq_len
    log(f"trained {step} steps ({positions / 1e6:.1f} M positions) in {time.time() - t_train:.0f}s")

    per_lang = {lang: held_middles(s) for lang, s in held_sets.items()}
    log(f"held-out middles: {json.dumps(per_lang)}")

    # -- export ----------------------------------------------------------------------------------------------
    from safetensors.torch import save_file

    folder = args.out / "draft"
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in student.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied to the embeddings
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "token_map.json").write_text(json.dumps([-1] + [int(i) for i in keep]))
    report = {
        "steps": step,
        "positions_trained": step * args.batch * args.seq_len,
        "loss_last_50": float(np.mean(losses[-50:])) if losses else None,
        "parameters": n_params,
        "config": cfg,
        "sub_vocab_coverage": coverage,
        "held_out_middles": per_lang,
        "corpus": corpus,
        "samples": len(samples),
        "rows": int(xs.shape[0]),
        "seconds": time.time() - t0,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "draft_report.json").write_text(json.dumps(report, indent=1))
    log("done")


if __name__ == "__main__":
    main()
