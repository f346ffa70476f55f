"""Would self-speculation by early exit pay for fimble-smollm2? Acceptance x speed, estimated offline.

    python -m bench.early_exit --model models/fimble-smollm2 --held-out-langs DIR [--held-out-python FILE]
                               [--quick] [--json PATH]

A draft made by the first k of the target's layers (then its final norm and tied head) shares the
tokenizer and the shallow layers' KV. For FIM prompts built from files held out of training
(bench/harness/cursor_sets.py), teacher-forced over each middle: the share of positions where the
k-layer argmax equals the full model's (the per-token acceptance a of greedy drafting). With
gamma drafted tokens per step, expected tokens per verify step = (1 - a^(gamma+1)) / (1 - a), and
the cost of a step in full-model passes is about 1 + gamma * k / L (a verify of gamma+1 tokens
costs about one decode step on CPU: stack.md's sizing table). Their ratio is the estimated speed-up
over plain decoding; the peer in the same run is plain decoding (ratio 1.0). No timing is measured:
this only says which k and gamma deserve an implementation (engine/decoding/speculative.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def fim_cases(rows: list[dict], tok, n: int, seed: int) -> list[tuple[list[int], int]]:
    """(ids, start of the middle) for SPM prompts: suffix, prefix, then a 3-10-line middle."""
    rng = random.Random(seed)
    rng.shuffle(rows)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|fim_pre|>", "<|fim_suf|>", "<|fim_mid|>")}
    out = []
    for r in rows:
        lines = r["text"].split("\n")
        if len(lines) < 30:
            continue
        a = rng.randrange(5, len(lines) - 15)
        b = a + rng.randint(3, 10)
        pre, mid, suf = (
            "\n".join(lines[max(0, a - 40) : a]) + "\n",
            "\n".join(lines[a:b]),
            "\n" + "\n".join(lines[b : b + 20]),
        )
        enc = [tok.encode(x, add_special_tokens=False) for x in (suf, pre, mid)]
        seq = [ids["<|fim_suf|>"], *enc[0], ids["<|fim_pre|>"], *enc[1], ids["<|fim_mid|>"]]
        out.append((seq + enc[2], len(seq)))
        if len(out) >= n:
            break
    return out


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.harness.cursor_sets import load_held_out

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "fimble-smollm2")
    ap.add_argument("--held-out-langs", type=Path)
    ap.add_argument("--held-out-python", type=Path)
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="8 cases")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    rows = load_held_out(args.held_out_langs, args.held_out_python)
    cases = fim_cases(rows, tok, 8 if args.quick else args.cases, 0)
    exits = [k for k in (3, 5, 8, 10, 12, 15, 20, 25) if k < layers]
    agree = {k: 0 for k in exits}
    total = 0
    with torch.no_grad():
        for seq, mid in cases:
            out = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
            final = out.logits[0, mid - 1 : -1].argmax(-1)
            total += final.numel()
            for k in exits:
                h = model.model.norm(out.hidden_states[k][0, mid - 1 : -1])
                agree[k] += int((model.lm_head(h).argmax(-1) == final).sum())
    table = []
    for k in exits:
        a = agree[k] / max(1, total)
        for gamma in (2, 4, 6):
            per_step = (1 - a ** (gamma + 1)) / (1 - a) if a < 1 else gamma + 1
            cost = 1 + gamma * k / layers
            table.append(
                {
                    "exit_layer": k,
                    "acceptance": a,
                    "gamma": gamma,
                    "tokens_per_step": per_step,
                    "cost_in_full_passes": cost,
                    "est_speedup": per_step / cost,
                }
            )
    load = os.getloadavg()
    print(
        f"model {args.model.name}: {layers} layers, {len(cases)} FIM middles, {total} positions; "
        f"threads {torch.get_num_threads()}, load average {load[0]:.1f}"
    )
    print(f"{'exit k':>6s} {'accept':>7s} {'gamma':>5s} {'tok/step':>8s} {'cost':>6s} {'speed-up':>8s}")
    for r in table:
        print(
            f"{r['exit_layer']:6d} {r['acceptance']:7.3f} {r['gamma']:5d} {r['tokens_per_step']:8.2f} "
            f"{r['cost_in_full_passes']:6.2f} {r['est_speedup']:8.2f}"
        )
    best = max(table, key=lambda r: r["est_speedup"])
    if args.json:
        args.json.write_text(json.dumps({"cases": len(cases), "positions": total, "rows": table}, indent=1))
    print(
        f"headline: best early exit k={best['exit_layer']} gamma={best['gamma']}: acceptance "
        f"{best['acceptance']:.3f}, estimated {best['est_speedup']:.2f}x plain decoding (peer: plain = 1.00x)"
    )


if __name__ == "__main__":
    main()
