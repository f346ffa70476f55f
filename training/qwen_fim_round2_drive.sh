#!/usr/bin/env bash
# The FIM adapter's second round on the GPU machine (issue 25; run 2026-12-05 11:50-11:58 UTC on an H200).
# The device tool sends the working tree and at most 64 MiB a call, so the inputs travel in 9 calls made back to
# back (the machine stays warm 30 s after each). Each call carries one ignored folder .devcarry/q25c/calls/cK that
# holds a copy of this script (drive.sh) and its share of the inputs; the command is `bash .devcarry/q25c/calls/cK/drive.sh`.
#   c1: job.sh (training/qwen_fim_round2_job.sh), budget (330), src.sha256 (training/fetch_qwen.py SOURCE_SHA256),
#       he/ (../shared/data/humaneval-infilling), langs/ (python -m training.corpus_repos --out langs --exclude ...),
#       ex/ (the held-out cursor bundles bench/quality.py scores), init/ (models/qwen2.5-coder-0.5b-fim's adapter),
#       site/gguf (the gguf package, pure Python; the image lacks it), src.piece0 (the registry GGUF's first 30 MiB)
#   c2..c9: src.piece1..8 (55 MiB each; the GGUF that training/fetch_qwen.py joins, cut with no gap)
# With the tracked files over 150 KB moved aside (weights, big reports), the tree is 7 MiB and every call fits.
# This copies a call's folder into /tmp/up, starts the job once all 9 pieces are there, and with POLL=S waits up to
# S seconds for the job (a call carrying only this script polls), then puts its outputs in $OUT.
set -u
D=$(cd "$(dirname "$0")" && pwd)
UP=/tmp/up
W=/tmp/qf
mkdir -p $UP
cp -r "$D"/. $UP/
echo "pieces here: $(ls $UP/src.piece* 2>/dev/null | wc -l); $(date -u +%T)"
if [ "$(ls $UP/src.piece* 2>/dev/null | wc -l)" = 9 ] && [ ! -e $W/started ]; then
    mkdir -p $W/out && touch $W/started
    rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r engine training bench lsp_server pyproject.toml /tmp/repo/
    (cd /tmp/repo && setsid nohup bash $UP/job.sh > $W/out/job.log 2>&1 < /dev/null &)
    echo "job started"
fi
if [ -n "${POLL:-}" ]; then
    end=$(( $(date +%s) + POLL ))
    while [ ! -e $W/done ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
fi
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
tail -n 5 $W/out/job.log 2>/dev/null
grep -v licences $W/out/train.log 2>/dev/null | tail -n 6 | cut -c1-400
if [ -e $W/done ]; then
    cp $W/out/adapter.json $W/out/adapter.part* $W/out/training_report.json "$OUT"/ 2>/dev/null
    cut -c1-3000 $W/out/train.log > "$OUT"/train.log
    cp $W/out/job.log "$OUT"/
    echo "DONE"
fi
