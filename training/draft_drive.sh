#!/usr/bin/env bash
# The drafter's distillation (issue 24) on the GPU machine, driven by calls made back to back (the machine stays
# warm 30 s after each; the device tool sends at most 64 MiB a call). Each call carries one ignored folder
# .devcarry/draft/calls/cK holding a copy of this script (drive.sh) and its share of the inputs; the command is
# `bash .devcarry/draft/calls/cK/drive.sh`.
#   c1: job.sh (training/draft_job.sh), budget, src.sha256 (training/fetch_qwen.py SOURCE_SHA256), he/, adapter/,
#       site/gguf, src.piece00 (the registry GGUF's first bytes)
#   c2: langs/ (training/corpus_langs.py's bundle), src.piece01
#   c3..: src.pieceNN (the rest of the GGUF, cut with no gap); NPIECES holds how many there are in all
# With the tracked files over 150 KB moved aside (bench/gpu_kernels_h200.sh prep), every call fits.
# This copies a call's folder into /tmp/up, starts the job once every piece is there, and with POLL=S waits up to
# S seconds for the job (a call carrying only this script polls), then puts its outputs in $OUT.
set -u
D=$(cd "$(dirname "$0")" && pwd)
UP=/tmp/up
W=/tmp/dd
mkdir -p $UP
cp -r "$D"/. $UP/
have=$(ls $UP/src.piece* 2>/dev/null | wc -l)
echo "pieces here: $have of $(cat $UP/NPIECES 2>/dev/null); $(date -u +%T)"
if [ -e $UP/NPIECES ] && [ "$have" = "$(cat $UP/NPIECES)" ] && [ -d $UP/langs ] && [ ! -e $W/started ]; then
    mkdir -p $W/out && touch $W/started
    rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r engine training bench lsp_server pyproject.toml /tmp/repo/
    (cd /tmp/repo && setsid nohup bash $UP/job.sh > $W/out/job.log 2>&1 < /dev/null &)
    echo "job started"
fi
if [ -n "${POLL:-}" ]; then
    end=$(( $(date +%s) + POLL ))
    while [ ! -e $W/done ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
fi
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
cat /proc/loadavg
tail -n 4 $W/out/job.log 2>/dev/null
grep -v Warning $W/out/train.log 2>/dev/null | tail -n 5 | cut -c1-600
if [ -e $W/done ]; then
    cp $W/out/config.json $W/out/token_map.json $W/out/draft_report.json $W/out/model.part* $W/out/model.sha256 "$OUT"/ 2>/dev/null
    cut -c1-4000 $W/out/train.log > "$OUT"/train.log
    cp $W/out/job.log "$OUT"/
    echo "DONE"
fi
