"""FIM-tune Qwen2.5-Coder-0.5B on fimble's own prompts with low-rank adapters (run on the GPU machine).

    python -m training.qwen_fim_train --gguf SOURCE.gguf --humaneval DIR --out DIR
                                      [--budget-seconds 480 | --steps N] [--rank 16] [--alpha 32]

The base is the registry's GGUF itself (the file training/fetch_qwen.py joins and checks), dequantised
by the engine's own loader (engine/runtimes/gguf_loader.py), so the adapter is trained on exactly the
weights the install step merges it into (training/qwen_fim.py). Its tokenizer is the one fimble
rebuilds from the same file.

Every sample is a prompt built by the engine's own builder (engine/caching/prompt_plan.py,
``PromptBuilder.build``) for a cursor in a source file, followed by what the model must write there and
``<|endoftext|>`` exactly where the suffix takes over; the loss is on those tokens only. So the model
is trained on the prompts it is served: PSM with token healing (newline healing re-types the line
break and indentation), the cursor's line after the middle sentinel, the anchored layout (``anchor``:
the lines typed since an earlier line break after the middle sentinel), the 256-token PSM suffix and the
language server's 4,000 / 1,000-character windows, and Qwen's repository format with other files'
chunks first (engine/caching/context_prompt.py) for a share of samples. Middles: the rest of a line
(an empty line's content, as an editor leaves the cursor after auto-indentation), several whole lines,
the rest of a line mid-line, random character spans, and empty middles (nothing to insert).

Corpus (training/qwen_fim_corpus.py): source files on the GPU machine whose package licence is
permissive, HumanEval-like files dropped, a seeded 2% of files held out (never trained on; written
for bench/quality.py's per-language cursor sets).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

PREFIX_CHARS, SUFFIX_CHARS = 4000, 1000  # the language server's default windows (lsp_server/PROTOCOL.md)
EOT = "<|endoftext|>"
KINDS = ("line", "lines", "rest_of_line", "span", "empty")
KIND_WEIGHTS = (0.32, 0.22, 0.18, 0.18, 0.10)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the model fimble loads, without weights ------------------------------------------------------------
def prompt_model(gguf_path: Path):
    """An engine LoadedModel (tokenizer, template, context length) for the file, no runtime."""
    from engine.loader import LoadedModel
    from engine.runtimes.gguf_loader import _config, _template, _tokenizer, open_meta

    reader = open_meta(gguf_path)  # the header alone, as the ggml runtime reads it (GGUFReader takes 10+ s)
    cfg, _arch = _config(reader, gguf_path)
    tok, tokens = _tokenizer(reader, gguf_path)
    template, stops = _template(reader, tokens)
    return LoadedModel(
        name=gguf_path.stem,
        folder=gguf_path.parent,
        runtime=None,
        tokenizer=tok,
        template=template,
        stop_ids=stops,
        max_len=cfg.max_position_embeddings,
        _vocab=tok.get_vocab(),
    )


# -- cursors ------------------------------------------------------------------------------------------
@dataclass
class Cut:
    prefix: str  # the document before the cursor (within the server's window)
    middle: str  # what the model should write
    suffix: str  # the document after the cursor (within the window)
    kind: str


def _line_starts(text: str) -> list[int]:
    return [0] + [i + 1 for i, c in enumerate(text) if c == "\n" and i + 1 < len(text)]


def choose_cut(text: str, rng: random.Random) -> Cut | None:
    """A cursor and its middle in ``text``, of a kind drawn from KIND_WEIGHTS."""
    kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
    starts = _line_starts(text)
    if len(starts) < 3:
        return None
    i = rng.randrange(1, len(starts))
    ls = starts[i]
    le = text.find("\n", ls)
    le = len(text) if le < 0 else le
    line = text[ls:le]
    indent = len(line) - len(line.lstrip(" \t"))
    if kind in ("line", "lines"):
        if not line.strip():
            return None
        # The cursor after the line's indentation on an otherwise empty line (an editor auto-indents).
        a = ls + indent
        n = 1 if kind == "line" else rng.choice((2, 2, 3, 3, 4, 5, 6, 8))
        j = min(len(starts) - 1, i + n - 1)
        b = text.find("\n", starts[j])
        b = len(text) if b < 0 else b
    elif kind == "rest_of_line":
        if len(line.strip()) < 4:
            return None
        a = ls + rng.randrange(indent + 1, len(line))
        b = le
    elif kind == "span":
        a = rng.randrange(len(text))
        b = min(len(text), a + 1 + int(rng.expovariate(1 / 90)))
    else:  # empty: the cursor at the end of a complete line, nothing missing there
        if not line.strip():
            return None
        a = b = le
    pre, mid, suf = text[:a], text[a:b], text[b:]
    if len(pre) > PREFIX_CHARS:
        cut = pre.find("\n", len(pre) - PREFIX_CHARS)
        pre = pre[cut + 1 :] if 0 <= cut < len(pre) - 1 else pre[-PREFIX_CHARS:]
    suf = suf[:SUFFIX_CHARS]
    if not pre.strip() and not suf.strip():
        return None
    return Cut(pre, mid, suf, kind)


def _context(others: list[tuple[str, str]], rng: random.Random) -> dict | None:
    """Chunks of other files, in the language server's wire format (engine/caching/context_prompt.py)."""
    if not others:
        return None
    chunks = []
    for path, text in rng.sample(others, min(len(others), rng.randint(1, 3))):
        lines = text.split("\n")
        a = rng.randrange(len(lines))
        short = "/".join(Path(path).parts[-2:])  # as a workspace-relative path reads
        chunks.append({"path": short, "text": "\n".join(lines[a : a + rng.randint(5, 40)])})
    return {"repo": "project", "path": "src/current", "comment": "#", "budget": 512, "chunks": chunks}


def sample_ids(
    builder,
    model,
    text: str,
    path: str,
    rng: random.Random,
    others: list[tuple[str, str]],
    eot: int,
    anchor_share: float = 0.2,
    context_share: float = 0.2,
) -> tuple[list[int], list[int], str] | None:
    """(prompt ids, target ids ending in EOT, kind) for one cursor in ``text``, or None."""
    from engine.api import CompletionRequest
    from engine.caching.prompt_plan import _lines_up
    from engine.decoding.speculative import DecodeOptions
    from engine.errors import PromptError

    cut = choose_cut(text, rng)
    if cut is None:
        return None
    ctx = _context(others, rng) if rng.random() < context_share else None
    req = CompletionRequest(cut.prefix, cut.suffix, DecodeOptions(max_tokens=128), context=ctx)
    anchor = _lines_up(cut.prefix, rng.randint(1, 8)) if rng.random() < anchor_share else None
    try:
        plan = builder.build(req, anchor=anchor)
    except PromptError:
        return None
    # What the prompt shows of the prefix: the text before the sentinel plus what follows the middle
    # sentinel. Healing took the rest off; the model re-types it, then writes the middle.
    shown = _shown_prefix(builder, model, req, plan, anchor)
    if shown is None or not cut.prefix.startswith(shown):
        return None
    target_text = cut.prefix[len(shown) :] + cut.middle
    target = model.encode(target_text) + [eot]
    if len(target) > 160:
        return None
    return plan.ids, target, cut.kind


def _shown_prefix(builder, model, req, plan, anchor) -> str | None:
    """The part of ``req.prefix`` the prompt holds (before healing's cut), recomputed as the builder does."""
    from engine.caching.prompt_plan import LINE_CUT
    from engine.decoding.healing import split_heal

    prefix_text = req.prefix
    if req.heal and prefix_text:
        last_piece = LINE_CUT.split(prefix_text)[-1] or prefix_text
        ids = builder._encode(last_piece)[0]
        if ids:
            last = model.tokenizer.decode(ids[-1:], clean_up_tokenization_spaces=False)
            prefix_text, _heal, _c = split_heal(prefix_text, last, builder.newline_healing)
    return prefix_text  # the line head after the middle sentinel is part of it (split_line_head only moves it)


# -- workers --------------------------------------------------------------------------------------------
_W: dict = {}


def _init(gguf_path: str) -> None:
    from engine.caching.prompt_plan import PromptBuilder

    model = prompt_model(Path(gguf_path))
    _W.update(model=model, builder=PromptBuilder(model), eot=model.token_id(EOT))


def _samples(job: tuple[int, list[tuple[str, str]], int, list[tuple[str, str]]]) -> list:
    seed, files, per_file, others = job
    rng = random.Random(seed)
    out = []
    for path, text in files:
        for _ in range(per_file):
            got = sample_ids(_W["builder"], _W["model"], text, path, rng, others, _W["eot"])
            if got is not None:
                out.append(got)
    return out


def build_samples(gguf: Path, files: list[tuple[str, str]], seed: int, per_file: int, procs: int) -> list:
    rng = random.Random(seed)
    jobs = []
    step = 50
    for k in range(0, len(files), step):
        batch = files[k : k + step]
        others = [files[rng.randrange(len(files))] for _ in range(6)]
        jobs.append((seed * 1_000_003 + k, batch, per_file, others))
    out = []
    with get_context("fork").Pool(procs, _init, (str(gguf),)) as pool:
        for got in pool.imap(_samples, jobs, chunksize=1):
            out.extend(got)
    return out


def pack(samples: list, seq: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``seq`` tokens: whole samples back to back (never split), labels only on the targets."""
    rows_x, rows_y = [], []
    x: list[int] = []
    y: list[int] = []
    for prompt, target, _kind in samples:
        ids = prompt + target
        if len(ids) > seq + 1:
            continue
        lab = [-100] * len(prompt) + target
        if len(x) + len(ids) > seq + 1:
            rows_x.append(x + [pad] * (seq + 1 - len(x)))
            rows_y.append(y + [-100] * (seq + 1 - len(y)))
            x, y = [], []
        x += ids
        y += lab
    if x:
        rows_x.append(x + [pad] * (seq + 1 - len(x)))
        rows_y.append(y + [-100] * (seq + 1 - len(y)))
    xs = np.asarray(rows_x, dtype=np.int32).reshape(-1, seq + 1)  # (0, seq + 1) when nothing fits
    ys = np.asarray(rows_y, dtype=np.int32).reshape(-1, seq + 1)
    # Position t predicts token t+1: inputs [:, :-1], labels [:, 1:].
    return xs[:, :-1], ys[:, 1:]


def _load_init(wrapped: dict, folder: Path, rank: int, alpha: float) -> dict:
    """Fill the wrapped layers' A and B from an exported adapter (GGUF tensor names); returns its meta."""
    import torch
    from safetensors.torch import load_file

    from training.qwen_fim import ADAPTER_FILE, ADAPTER_META, gguf_name

    meta = json.loads((folder / ADAPTER_META).read_text())
    if int(meta["rank"]) != rank or float(meta["alpha"]) != alpha:
        raise SystemExit(f"qwen_fim_train: --init-adapter has rank {meta['rank']} alpha {meta['alpha']}; pass the same")
    tensors = load_file(str(folder / ADAPTER_FILE))
    with torch.no_grad():
        for name, m in wrapped.items():
            g = gguf_name(name)
            m.lora_a.copy_(tensors[f"{g}.lora_a"].float())
            m.lora_b.copy_(tensors[f"{g}.lora_b"].float())
    return meta


# -- the model ------------------------------------------------------------------------------------------
def load_base(gguf: Path, device: str):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine.runtimes.gguf_loader import _config, _hf_state, open_reader

    reader = open_reader(gguf)
    cfg, arch = _config(reader, gguf)
    state = _hf_state(reader, cfg, arch)
    hf = Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    model = Qwen2ForCausalLM(hf)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"qwen_fim_train: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype)


def masked_loss(model, x, y):
    """Cross-entropy on the labelled positions only (the LM head runs on those rows alone)."""
    import torch

    hidden = model.model(input_ids=x).last_hidden_state
    keep = y != -100
    h = hidden[keep]
    logits = model.lm_head(h).float()
    return torch.nn.functional.cross_entropy(logits, y[keep].long())


def export(wrapped: dict, rank: int, alpha: float, folder: Path, meta: dict) -> None:
    """adapter.safetensors (A, B in bf16, named by the GGUF tensor they change) and adapter.json."""
    import torch
    from safetensors.torch import save_file

    from training.qwen_fim import ADAPTER_FILE, ADAPTER_META, gguf_name

    tensors = {}
    for name, m in wrapped.items():
        g = gguf_name(name)
        tensors[f"{g}.lora_a"] = m.lora_a.detach().to(torch.bfloat16).cpu().contiguous()
        tensors[f"{g}.lora_b"] = m.lora_b.detach().to(torch.bfloat16).cpu().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (ADAPTER_FILE + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(folder / ADAPTER_FILE)
    (folder / ADAPTER_META).write_text(json.dumps({**meta, "rank": rank, "alpha": alpha}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--humaneval", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--root", type=Path, action="append", help="source roots (default: this Python's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-seconds", type=float, default=480)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--per-file", type=int, default=4, help="cursors drawn per training file")
    ap.add_argument("--max-chars", type=float, default=120e6, help="training text, all languages")
    ap.add_argument("--procs", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--checkpoint-seconds", type=float, default=150)
    ap.add_argument(
        "--langs",
        type=Path,
        action="append",
        default=[],
        help="more files: bundles in training/corpus_langs.py's format (held_out rows: per-language loss only)",
    )
    ap.add_argument(
        "--init-adapter",
        type=Path,
        help="continue from a trained adapter (training/qwen_fim.py's format, GGUF tensor names, same rank)",
    )
    ap.add_argument(
        "--exclude",
        type=Path,
        action="append",
        default=[],
        help="held-out cursor bundles (training/corpus_langs.py's format): no training file may equal one of theirs",
    )
    args = ap.parse_args()

    import torch

    from training import adapter as lora
    from training.qwen_fim_corpus import gather

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    train, held, corpus = gather(args.root, args.humaneval, args.seed, args.procs, args.max_chars)
    log(f"corpus: {json.dumps(corpus)}")
    import lzma

    with lzma.open(args.out / "heldout.jsonl.xz", "wt", encoding="utf-8") as f:
        for lang, path, text in held:
            f.write(json.dumps({"lang": lang, "path": path, "text": text, "held_out": True}) + "\n")
    if args.exclude:
        # The GPU machine's packages may have changed since the held-out cursors were cut from its corpus:
        # a file the bench scores is never trained on, whatever split the corpus makes today.
        from training.corpus import normalized_hash
        from training.corpus_langs import read_parts

        scored = {normalized_hash(r["text"]) for folder in args.exclude for r in read_parts(folder)}
        kept = [row for row in train if normalized_hash(row[2]) not in scored]
        corpus["dropped_scored_copies"] = len(train) - len(kept)
        train = kept
        log(f"{corpus['dropped_scored_copies']} training files equal a held-out cursor's file: dropped")
    files = [(p, t) for _lang, p, t in train]
    extra_held: dict[str, list[tuple[str, str]]] = {}
    if args.langs:
        from training.corpus_langs import split_bundles

        extra_train, extra_held, corpus["extra_train_files"] = split_bundles(args.langs)
        files += extra_train
        log(f"extra files: {json.dumps(corpus['extra_train_files'])}")
    random.Random(args.seed).shuffle(files)
    samples = build_samples(args.gguf, files, args.seed, args.per_file, args.procs)
    kinds = {k: sum(1 for s in samples if s[2] == k) for k in KINDS}
    random.Random(args.seed + 1).shuffle(samples)
    held_files = [(p, t) for _lang, p, t in held]
    held_samples = build_samples(args.gguf, held_files, args.seed + 7, 2, args.procs)
    pad = prompt_model(args.gguf).token_id(EOT)
    xs, ys = pack(samples, args.seq_len, pad)
    hx, hy = pack(held_samples, args.seq_len, pad)
    extra_sets = {
        lang: pack(build_samples(args.gguf, fs, args.seed + 7, 2, args.procs), args.seq_len, pad)
        for lang, fs in sorted(extra_held.items())
    }
    n_target = int((ys != -100).sum())
    log(
        f"{len(samples)} samples {kinds}, {xs.shape[0]} rows of {args.seq_len}, {n_target} target tokens; "
        f"held-out {len(held_samples)} samples; data ready after {time.time() - t0:.0f}s"
    )

    model = load_base(args.gguf, device)
    log(f"base loaded after {time.time() - t0:.0f}s")
    hx_t, hy_t = torch.from_numpy(hx).to(device), torch.from_numpy(hy).to(device)

    @torch.no_grad()
    def held_loss(x_t=None, y_t=None) -> float:
        x_t, y_t = (hx_t, hy_t) if x_t is None else (x_t, y_t)
        model.eval()
        losses = []
        for k in range(0, min(len(x_t), 64), 8):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                losses.append(masked_loss(model, x_t[k : k + 8].long(), y_t[k : k + 8]).item())
        model.train()
        return float(np.mean(losses)) if losses else float("nan")

    extra_t = {
        lang: (torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)) for lang, (x, y) in extra_sets.items()
    }

    def held_losses() -> dict[str, float]:
        """The device corpus's held-out loss, then each extra language's."""
        out = {"device": round(held_loss(), 4)}
        out.update({lang: round(held_loss(x, y), 4) for lang, (x, y) in extra_t.items()})
        return out

    base_held = held_loss()
    base_by_lang = held_losses()
    log(f"held-out target loss, base: {json.dumps(base_by_lang)}")
    wrapped = lora.attach(model, args.rank, args.alpha)
    init_by_lang = None
    if args.init_adapter:
        init_meta = _load_init(wrapped, args.init_adapter, args.rank, args.alpha)
        init_by_lang = held_losses()
        log(f"from {args.init_adapter} ({init_meta.get('steps')} steps): held-out loss {json.dumps(init_by_lang)}")
    params = [p for m in wrapped.values() for p in (m.lora_a, m.lora_b)]
    log(f"adapters on {len(wrapped)} linear layers, rank {args.rank}: {sum(p.numel() for p in params) / 1e6:.2f}M")
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    xs_t, ys_t = torch.from_numpy(xs).to(device), torch.from_numpy(ys).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(xs_t), generator=gen)
    meta = {
        "base": "Qwen2.5-Coder-0.5B-Instruct, the registry GGUF (training/fetch_qwen.py SOURCE_SHA256)",
        "seed": args.seed,
        "targets": list(lora.TARGETS),
    }
    if args.init_adapter:
        meta["continued_from"] = {k: init_meta.get(k) for k in ("steps", "tokens_seen", "rank", "seed")}
    total, step, cursor, tokens_seen = args.steps, 0, 0, 0
    start = last_print = last_ckpt = time.time()
    curve = []
    while total is None or step < total:
        if step == 5:
            probe_t = time.time()
        if total is None and step == 20:
            per = (time.time() - probe_t) / 15
            total = max(21, int(args.budget_seconds / per))
            log(
                f"{per * 1000:.0f} ms/step -> {total} steps ({total * args.batch / max(1, len(xs_t)):.2f} epochs; "
                f"replay with --steps {total})"
            )
        horizon = total or 10**9
        frac = min(1.0, (step - args.warmup) / max(1, horizon - args.warmup))
        lr = (
            args.lr * (step + 1) / args.warmup
            if step < args.warmup
            else args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        )
        for g in opt.param_groups:
            g["lr"] = lr
        if cursor + args.batch > len(order):
            order, cursor = torch.randperm(len(xs_t), generator=gen), 0
        idx = order[cursor : cursor + args.batch].to(device)
        cursor += args.batch
        x, y = xs_t[idx].long(), ys_t[idx]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = masked_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        now = time.time()
        if step == 1 and device == "cuda":
            log(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        if now - last_print > 15 or step == total:
            last_print = now
            curve.append((step, round(loss.item(), 4)))
            log(
                f"step {step}/{total or '?'} loss {loss.item():.3f} lr {lr:.2e} "
                f"{tokens_seen / (now - start) / 1e3:.0f}k tok/s elapsed {now - start:.0f}s"
            )
        if now - last_ckpt > args.checkpoint_seconds:
            last_ckpt = now
            export(wrapped, args.rank, args.alpha, args.out / "checkpoint", {**meta, "steps": step})
    train_s = time.time() - start
    tuned_held = held_loss()
    tuned_by_lang = held_losses()
    export(wrapped, args.rank, args.alpha, args.out / "adapter", {**meta, "steps": step, "tokens_seen": tokens_seen})
    report = {
        "corpus": corpus,
        "samples": len(samples),
        "kinds": kinds,
        "rows": int(xs.shape[0]),
        "target_tokens": n_target,
        "steps": step,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_seen": tokens_seen,
        "train_seconds": train_s,
        "held_out_target_loss_base": base_held,
        "held_out_target_loss_tuned": tuned_held,
        "held_out_loss_by_lang": {"base": base_by_lang, "init": init_by_lang, "tuned": tuned_by_lang},
        "loss_curve": curve,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=1))
    log(f"done: {step} steps in {train_s:.0f}s; held-out target loss {base_held:.4f} -> {tuned_held:.4f}")


if __name__ == "__main__":
    main()
