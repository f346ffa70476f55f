#!/usr/bin/env bash
# The FIM adapter's second round (issue 25), on the GPU machine: started detached by
# training/qwen_fim_round2_drive.sh from /tmp/repo (a copy of the repository's code; later calls re-send the tree).
# It continues models/qwen2.5-coder-0.5b-fim's adapter on the device corpus's Python/C/C++ (40 M characters: a
# replay share, so the first round's languages are not forgotten) and training/corpus_repos.py's Ruby, Elixir,
# TypeScript React and Dockerfiles, at half the first round's learning rate; no file of a scored held-out bundle
# is trained on (--exclude). The adapter comes back in two parts under the tool's 16 MiB per file.
set -euo pipefail
UP=/tmp/up
W=/tmp/qf
log() { echo "[$(date +%H:%M:%S)] $*"; }
trap 'touch $W/done' EXIT
log "joining $(ls $UP/src.piece* | wc -l) pieces"
cat $UP/src.piece* > $W/src.gguf
echo "$(cat $UP/src.sha256)  $W/src.gguf" | sha256sum -c -
export PYTHONPATH=$UP/site:/tmp/repo PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
python3 -c "import gguf, torch; print('gguf', gguf.__file__, 'cuda', torch.cuda.is_available())"
log "training"
python3 -m training.qwen_fim_train --gguf $W/src.gguf --humaneval $UP/he --out $W/run \
  --budget-seconds "$(cat $UP/budget)" --lr 1e-4 --max-chars 40e6 \
  --langs $UP/langs --init-adapter $UP/init \
  --exclude $UP/ex/allbundle --exclude $UP/ex/dart --exclude $UP/ex/julia --exclude $UP/ex/javascriptreact \
  --exclude $UP/ex/dockerfile > $W/out/train.log 2>&1
log "training done"
cp $W/run/adapter/adapter.json $W/run/training_report.json $W/out/
split -b 9000000 -d $W/run/adapter/adapter.safetensors $W/out/adapter.part
sha256sum $W/run/adapter/adapter.safetensors | tee $W/out/adapter.sha256
log "job done"
