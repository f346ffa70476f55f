"""Re-run the Qwen FIM corpus split on the GPU machine and check it against the shipped training report.

    python -m training.qwen_fim_split --out DIR [--humaneval DIR]     (on the GPU machine, from the repo root)

training/qwen_fim_corpus.py ``gather`` (roots None: that machine's site-packages and standard library; seed 0;
120e6 training characters, as training/qwen_fim_train.py ran it) is deterministic: sorted candidates, a seeded
shuffle. This prints, per count of models/qwen2.5-coder-0.5b-fim/training_report.json's ``corpus`` (files seen,
dropped, kept, held out, training files and characters per language), whether the re-run gives the same, and
writes what training/held_out_set.py reads: ``heldout.jsonl.xz`` (the held-out rows) and ``train_files.tsv.xz`` /
``held_files.tsv.xz`` (whitespace-collapsed sha1, language, characters, path of each file), and
``split_check.json``. Run 2026-12-04 on an H200 machine's image: every count the same (44 s).
"""

from __future__ import annotations

import argparse
import json
import lzma
import time
from pathlib import Path

from training.corpus import normalized_hash

REPO = Path(__file__).resolve().parent.parent
REPORT = REPO / "models" / "qwen2.5-coder-0.5b-fim" / "training_report.json"


def main() -> None:
    from training.qwen_fim_corpus import gather

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--humaneval", type=Path, default=REPO.parent / "shared/data/humaneval-infilling")
    ap.add_argument("--procs", type=int, default=16)
    args = ap.parse_args()
    t0 = time.time()
    train, held, corpus = gather(None, args.humaneval, 0, args.procs, 120e6)
    report = json.loads(REPORT.read_text())["corpus"]
    compare = {k: "same" if v == corpus.get(k) else f"report {v} now {corpus.get(k)}" for k, v in report.items()}
    print(json.dumps(compare, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    with lzma.open(args.out / "heldout.jsonl.xz", "wt", encoding="utf-8") as f:
        for lang, path, text in held:
            f.write(json.dumps({"lang": lang, "path": path, "text": text, "held_out": True}) + "\n")
    for name, rows in (("train_files", train), ("held_files", held)):
        with lzma.open(args.out / f"{name}.tsv.xz", "wt", encoding="utf-8") as f:
            for lang, path, text in rows:
                f.write(f"{normalized_hash(text)}\t{lang}\t{len(text)}\t{path}\n")
    summary = {k: v for k, v in corpus.items() if k != "licences"}
    check = {"compare": compare, "corpus_now": summary, "seconds": time.time() - t0}
    (args.out / "split_check.json").write_text(json.dumps(check, indent=1))
    print("seconds", round(time.time() - t0), "train", len(train), "held", len(held))


if __name__ == "__main__":
    main()
