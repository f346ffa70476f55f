#!/usr/bin/env bash
# The drafter's distillation (issue 24) on the GPU machine: started detached by training/draft_drive.sh from
# /tmp/repo (a copy of the repository's code). Inputs in /tmp/up: src.piece* (the registry GGUF that
# training/fetch_qwen.py joins, cut with no gap), src.sha256, adapter/ (models/qwen2.5-coder-0.5b-fim), he/
# (HumanEval infilling, for the corpus's HumanEval filter), langs/ (training/corpus_langs.py's bundle), site/gguf
# (the gguf package; the image lacks it), budget (seconds for training/draft_distill.py, data and teacher included).
# Outputs in /tmp/dd/out: the drafter (weights in parts under the tool's 16 MiB a file), its report and the log.
set -euo pipefail
UP=/tmp/up
W=/tmp/dd
log() { echo "[$(date +%H:%M:%S)] $*"; }
trap 'touch $W/done' EXIT
log "joining $(ls $UP/src.piece* | wc -l) pieces"
cat $UP/src.piece* > $W/src.gguf
echo "$(cat $UP/src.sha256)  $W/src.gguf" | sha256sum -c -
export PYTHONPATH=$UP/site:/tmp/repo PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
python3 -c "import gguf, torch; print('gguf', gguf.__file__, 'cuda', torch.cuda.is_available())"
log "distilling"
python3 -m training.draft_distill --gguf $W/src.gguf --adapter $UP/adapter --humaneval $UP/he \
  --langs $UP/langs --out $W/run --budget-seconds "$(cat $UP/budget)" > $W/out/train.log 2>&1
log "distilled"
cp $W/run/draft/config.json $W/run/draft/token_map.json $W/run/draft_report.json $W/out/
split -b 12000000 -d $W/run/draft/model.safetensors $W/out/model.part
sha256sum $W/run/draft/model.safetensors | tee $W/out/model.sha256
log "job done"
