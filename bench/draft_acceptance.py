"""How often the default model's drafter is right, per language, on files it never trained on (issue 24).

    python -m bench.draft_acceptance [--bundle DIR] [--cursors 6] [--threads 2] [--quick] [--json PATH]

For each language, cursors at seeded line starts of real files: the prompt the engine builds (2,000 characters
before, 1,000 after), then a greedy completion to its end (<|endoftext|> or 48 tokens) twice on the ggml runtime:
plain, and with the draft model alone drafting fixed blocks of 4 (no confidence gate, no n-gram drafts, no cost
policy), so every round asks the drafter for the same thing. Columns: drafted and accepted tokens, the mean accepted
run of a 4-token draft, the per-token acceptance ``a`` that run implies (a + a^2 + a^3 + a^4 = run), the drafter's
step and whether the outputs equal plain decoding's (they must: the target verifies every token).

Files: fimble's own Python engine, its VS Code extension's TypeScript and its Neovim plugin's Lua (none in the
drafter's corpus), and with ``--bundle`` the held-out rows of a training/corpus_langs.py bundle (the files the
distillation held out: JavaScript, TypeScript, Go, Rust, Java, C, C++).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 48
BLOCK = 4
# Half the language server's 4,000-character window: a cold prompt's prefill is most of each cursor's time here.
PREFIX_CHARS = 2000


def repo_files() -> dict[str, list[tuple[str, str]]]:
    def read(paths) -> list[tuple[str, str]]:
        return [(str(p.relative_to(REPO)), p.read_text()) for p in sorted(paths) if p.stat().st_size > 3000]

    return {
        "python (fimble engine/)": read((REPO / "engine").glob("*.py")),
        "typescript (editors/vscode)": read((REPO / "editors" / "vscode" / "src").rglob("*.ts")),
        "lua (editors/nvim)": read((REPO / "editors" / "nvim").rglob("*.lua")),
    }


def bundle_files(folder: Path) -> dict[str, list[tuple[str, str]]]:
    from training.corpus_langs import read_parts

    out: dict[str, list[tuple[str, str]]] = {}
    for row in read_parts(folder):
        if row["held_out"] and len(row["text"]) > 3000:
            out.setdefault(f"{row['lang']} (held out)", []).append((row["path"], row["text"]))
    return out


def cursors(files: list[tuple[str, str]], n: int, rng: random.Random) -> list[tuple[str, str]]:
    """(prefix, suffix) at ``n`` line starts, each in a file drawn at random, past its first 600 characters."""
    out = []
    for _ in range(n):
        _path, text = rng.choice(files)
        cut = text.find("\n", rng.randrange(600, len(text) - 200)) + 1
        if cut <= 0:
            continue
        out.append((text[max(0, cut - PREFIX_CHARS) : cut], text[cut : cut + 1000]))
    return out


def decode(target, prompt: list[int], drafter) -> tuple[list[int], int, int, float]:
    """(tokens, drafted, accepted, seconds) of a greedy completion of ``prompt``."""
    from engine.decoding.speculative import DecodeOptions, SpeculativeDecoder

    if drafter is None:
        opts = DecodeOptions(max_tokens=MAX_TOKENS, drafter="none")
    else:
        opts = DecodeOptions(
            max_tokens=MAX_TOKENS, drafter="model", gamma=BLOCK, max_gamma=BLOCK, adaptive_gamma=False,
            confidence_gate=0.0,
        )  # fmt: skip
    cache = target.runtime.new_cache(len(prompt) + MAX_TOKENS + 16)
    t0 = time.perf_counter()
    dec = SpeculativeDecoder(target.runtime, cache, set(target.stop_ids), opts, drafter, None)
    dec.prefill(prompt)
    while not dec.done:
        dec.step()
    return dec.output, dec.stats.drafted, dec.stats.accepted, time.perf_counter() - t0


def implied_rate(run: float) -> float:
    """The per-token acceptance a with a + a^2 + ... + a^BLOCK = run (bisection; run in [0, BLOCK])."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        if sum(a**i for i in range(1, BLOCK + 1)) < run:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="target GGUF (default: the default model)")
    ap.add_argument("--draft", type=Path, help="drafter folder (default: the default model's)")
    ap.add_argument("--bundle", type=Path, help="a training/corpus_langs.py bundle: its held-out rows too")
    ap.add_argument("--cursors", type=int, default=6, help="cursors per language")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2 cursors per language, fimble's own files only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["FIMBLE_GGML_THREADS"] = str(args.threads)

    from bench.vs_llamacpp import fimble_request
    from engine.caching.prompt_plan import PromptBuilder
    from engine.decoding.drafters import ModelDrafter
    from engine.loader import default_models, load_draft, load_model

    default_target, default_draft = default_models()
    target = load_model(args.model or default_target)
    draft_dir = args.draft or default_draft
    if draft_dir is None:
        raise SystemExit("draft_acceptance: no drafter for this model: pass --draft DIR")
    draft = load_draft(draft_dir, target)
    drafter = ModelDrafter(draft.runtime, draft.max_len)
    builder = PromptBuilder(target)
    n = 2 if args.quick else args.cursors
    langs = repo_files()
    if args.bundle and not args.quick:
        langs.update(bundle_files(args.bundle))
    load_before = os.getloadavg()
    rows = []
    for lang, files in langs.items():
        if not files:
            continue
        rng = random.Random(f"{args.seed}:{lang}")
        row = {"language": lang, "cursors": 0, "drafted": 0, "accepted": 0, "rounds": 0, "equal": 0, "tokens": 0}
        for prefix, suffix in cursors(files, n, rng):
            prompt = builder.build(fimble_request(prefix, suffix, None, MAX_TOKENS, heal=False)).ids
            plain, *_ = decode(target, prompt, None)
            spec, drafted, accepted, _s = decode(target, prompt, drafter)
            row["cursors"] += 1
            row["drafted"] += drafted
            row["accepted"] += accepted
            row["rounds"] += -(-drafted // BLOCK)  # fixed blocks (a shorter last one where the budget ends)
            row["equal"] += int(plain == spec)
            row["tokens"] += len(spec)
        run = row["accepted"] / max(1, row["rounds"])
        row["mean_run"] = run
        row["rate"] = implied_rate(min(run, BLOCK - 1e-9))
        rows.append(row)
        print(
            f"{lang:30s} cursors {row['cursors']:3d}  drafted {row['drafted']:5d}  accepted {row['accepted']:5d} "
            f"({row['accepted'] / max(1, row['drafted']):.2f})  run of {BLOCK}: {run:.2f}  a = {row['rate']:.2f}  "
            f"=plain {row['equal']}/{row['cursors']}",
            flush=True,
        )
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    size = (Path(draft_dir) / "model.safetensors").stat().st_size
    # The drafter's own step at 256 cached positions (engine/decoding/spec_policy.py's probe).
    from engine.decoding.spec_policy import verify_costs

    step_ms = verify_costs(draft.runtime).step_s * 1e3
    target_ms = verify_costs(target.runtime).step_s * 1e3
    total_d = sum(r["drafted"] for r in rows)
    total_a = sum(r["accepted"] for r in rows)
    equal = sum(r["equal"] for r in rows)
    cursors_n = sum(r["cursors"] for r in rows)
    load_after = os.getloadavg()
    print(
        f"\ndrafter {Path(draft_dir).name}: {cfg['num_hidden_layers']} layers x {cfg['hidden_size']}, vocabulary "
        f"{cfg['vocab_size']}, {size / 1e6:.1f} MB; step {step_ms:.2f} ms against the target's {target_ms:.2f} ms "
        f"({step_ms / target_ms:.3f}); threads {args.threads}; load {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )
    print(
        f"headline: the drafter's 4-token drafts: {total_a}/{total_d} tokens accepted "
        f"({total_a / max(1, total_d):.2f}) over {len(rows)} languages; outputs equal plain on {equal}/{cursors_n}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": rows,
                    "drafter": {"config": cfg, "bytes": size, "step_ms": step_ms, "target_step_ms": target_ms},
                    "threads": args.threads,
                    "load": [load_before, load_after],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
