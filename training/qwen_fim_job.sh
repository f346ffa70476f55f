#!/bin/bash
# The Qwen2.5-Coder-0.5B FIM job on the GPU machine (device tool), started detached from the repo root:
#   setsid nohup bash training/qwen_fim_job.sh SECONDS > /root/qf/job.log 2>&1 &
# Inputs in /root/up, carried in parts under the device tool's per-call transfer limit:
#   src.part* (the registry GGUF that training/fetch_qwen.py joins, cut in pieces; its sha256 is checked),
#   site.tgz (pure-Python packages the image lacks: pygls, lsprotocol, cattrs, gguf, llama_cpp's bindings,
#   diskcache, tree_sitter_python), whl/ (tree-sitter and websockets for Python 3.12), ggml.tar (the
#   llama.cpp library engine.runtimes.ggml_build compiles, x86-64), he/ (HumanEval infilling data).
# Outputs in /root/qf/out: the adapter, the training report and log, the quality JSONs and logs.
# While the GPU trains, the CPUs score today's default (the Instruct q8_0) through `fimble lsp`;
# then the merged FIM model the same way; then both raw (the engine alone), 100 problems a set.
# Poll it with calls that follow each other within the machine's 30 s warm period: once it is given back,
# everything here (and the job) is gone.
set -euo pipefail
BUDGET=${1:-420}
LSP_SETS=${LSP_SETS:-single-line,multi-line,random-span-x2,random-span}
LIMIT=${LIMIT:-300}
RAW_LIMIT=${RAW_LIMIT:-100}
TRAIN_ARGS=${TRAIN_ARGS:-}
REPO=$PWD
W=/root/qf
OUT=$W/out
UP=/root/up
mkdir -p "$W" "$OUT" "$W/instruct" "$W/fim"
log() { echo "[$(date +%H:%M:%S)] $*"; }

log "joining $(ls $UP/src.part* | wc -l) parts"
cat $UP/src.part* > "$W/src.gguf"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/site $UP/whl/*.whl
tar -xzf $UP/site.tgz -C /root/site
tar -xf $UP/ggml.tar -C /root
export PYTHONPATH=/root/site:$REPO PYTHONUNBUFFERED=1 LLAMA_CPP_LIB_PATH=/root/fimble-ggml TOKENIZERS_PARALLELISM=true
python3 - <<EOF
from pathlib import Path
from training.base import _sha256
from training.fetch_qwen import SOURCE_SHA256
got = _sha256(Path("$W/src.gguf"))
assert got == SOURCE_SHA256, f"source sha256 {got} != {SOURCE_SHA256}"
print("source sha256 ok")
EOF
cp "$REPO/models/qwen2.5-coder-0.5b/fimble.json" "$W/instruct/"
cp "$REPO/models/qwen2.5-coder-0.5b/fimble.json" "$W/fim/"
log "the Instruct q8_0 (today's default), as the install step writes it"
python3 -c "
from pathlib import Path
from training.fetch_qwen import requantise, OUT_NAME
requantise(Path('$W/src.gguf'), Path('$W/instruct') / OUT_NAME, 0)
"
OLD=$W/instruct/qwen2.5-coder-0.5b-instruct-q8_0.gguf
NEW=$W/fim/qwen2.5-coder-0.5b-fim-q8_0.gguf

log "training, budget ${BUDGET}s"
# shellcheck disable=SC2086
python3 -m training.qwen_fim_train --gguf "$W/src.gguf" --humaneval "$UP/he" --out "$W/run" \
  --budget-seconds "$BUDGET" $TRAIN_ARGS > "$OUT/train.log" 2>&1 &
TRAIN=$!
# Today's default through fimble lsp while the GPU trains (data preparation has the CPUs first).
until grep -q "base loaded" "$OUT/train.log" 2>/dev/null || ! kill -0 $TRAIN 2>/dev/null; do sleep 3; done
log "old default through fimble lsp"
python3 -m bench.quality --set "$LSP_SETS" --limit "$LIMIT" --variants lsp --procs 14 --data "$UP/he" \
  --model "$OLD" --json "$OUT/q-old-lsp.json" > "$OUT/q-old-lsp.log" 2>&1 || log "old lsp failed"
log "old default lsp done"
wait $TRAIN
log "training done"
cp "$W/run/adapter/"* "$W/run/training_report.json" "$W/run/heldout.jsonl.xz" "$OUT/"
python3 -m training.qwen_fim --source "$W/src.gguf" --out "$NEW" --adapter "$W/run/adapter" --any-digest
log "new model through fimble lsp"
python3 -m bench.quality --set "$LSP_SETS" --limit "$LIMIT" --variants lsp --procs 16 --data "$UP/he" \
  --model "$NEW" --json "$OUT/q-new-lsp.json" > "$OUT/q-new-lsp.log" 2>&1 || log "new lsp failed"
log "new lsp done"
python3 -m bench.quality --set single-line,multi-line,random-span-x2 --limit "$RAW_LIMIT" --variants raw --procs 16 \
  --data "$UP/he" --model "$NEW" --json "$OUT/q-new-raw.json" > "$OUT/q-new-raw.log" 2>&1 || log "new raw failed"
log "new raw done"
python3 -m bench.quality --set single-line,multi-line,random-span-x2 --limit "$RAW_LIMIT" --variants raw --procs 16 \
  --data "$UP/he" --model "$OLD" --json "$OUT/q-old-raw.json" > "$OUT/q-old-raw.log" 2>&1 || log "old raw failed"
log "job done"
