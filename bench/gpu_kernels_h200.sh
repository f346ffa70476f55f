#!/bin/bash
# Issue 27 on the GPU machine (the device tool), from the repository root: the kernel sweep, and the GPU test suite
# (the lossless bar: 200 prompts). `start` (sweep, then tests) ran on 2026-12-06 on an H100:
# bench/reports/gpu-tests-h100-2026-12-06.txt. `start next` holds what that session could not run.
#
#   bash bench/gpu_kernels_h200.sh prep     here: wheels in .whl (websockets, msgpack for Python 3.12), the embedded
#                                            target's shards as .devcarry/k27t/target.tar.xz, and every tracked file
#                                            over 150 KB but the embedded draft and the target's tokenizer moved to /tmp/aside (the tree must
#                                            travel under 64 MiB); `bash bench/gpu_kernels_h200.sh back` restores them
#   run: bash bench/gpu_kernels_h200.sh sweep    (no carry; ~7 min) bench/gpu_linear.py's sweep with the swap-AB
#        candidates, the graph step at its configs with attention's fixed trips on, then off
#   run: bash bench/gpu_kernels_h200.sh tests    (carry .whl and .devcarry/k27t; ~8 min) tests/gpu and
#        tests/engine/test_gpu_kernels.py (swap rows, fixed trips = bounded loop, the 200-prompt lossless tests)
#   run: bash bench/gpu_kernels_h200.sh start; sleep 2; bash bench/gpu_kernels_h200.sh wait 560
#        (carry .whl and .devcarry/k27t) both, detached (sweep then tests: ~15 min, past one call's 10): the tests run
#        the Triton set (FIMBLE_CUDA_INVARIANT=triton), fixed trips (the default) and the sweep's configs
#        (FIMBLE_LINEAR_CONFIGS);
#        poll with `wait 560` again (it copies what the job wrote into $OUT)
#   run: bash bench/gpu_kernels_h200.sh start next; sleep 2; bash bench/gpu_kernels_h200.sh wait 560
#        (carry .whl, .devcarry/k27t, .devcarry/whl, .devcarry/llama.cpp-server-src.tar.gz) what 2026-12-06 left
#        unmeasured: the prefill pass per kernel set, the 200 prompts on swap tiles, the peer's step (see `next`)
#   run: bash bench/gpu_kernels_h200.sh start prefill2; ...; wait 560  (carry .whl, .devcarry/k27t) the wide tiles'
#        probe, the GPU suite with the Triton set, 32 editors with each set, the step table with a cold prompt;
#        `bash bench/gpu_kernels_h200.sh wide` the same in the foreground. Both ran on 2026-12-06 (H100):
#        bench/reports/gpu-wide-tiles-h100-2026-12-06.txt
#   run: bash bench/gpu_kernels_h200.sh rounds  (no carry; ~3 min) a serve round's kernels per kernel set (not run yet)
#   run: bash bench/gpu_kernels_h200.sh start verify; sleep 5; bash bench/gpu_kernels_h200.sh wait 560  (carry .whl,
#        .devcarry/k27t; ~11 min, so `wait 560` again) the GPU suite, the step table and 5 x 32 editors after the
#        attention fix of 2026-12-07; `feddiag` (carry .whl) 32 editors per setting with stacks of a hung run
#   run: bash bench/gpu_kernels_h200.sh attn  (carry .whl; ~1 min) attention's geometry per pass shape
set -o pipefail
# The device's Python lacks websockets and msgpack: the wheels carried in .whl, installed into /tmp/site.
wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
}
# A detached job's start: the wheels, the embedded target's shards, its output folder O and the GPU's name and load.
job_setup() {
    wheels
    tar -xJf .devcarry/k27t/target.tar.xz -C models
    O=/tmp/k27job/out
    mkdir -p $O
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
    cat /proc/loadavg | tee -a "$O/gpu.txt"
}
case "${1:-}" in
prep)
    P="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    P="$P --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64"
    for w in websockets==16.0 msgpack==1.1.2; do
        .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P -d .whl $w
    done
    mkdir -p .devcarry/whl && cp .whl/*.whl .devcarry/whl/  # (bench/peer_h200.sh reads them there)
    if [ ! -s .devcarry/llama.cpp-server-src.tar.gz ]; then  # the peer's source: llama-cpp-python's vendored llama.cpp
        mkdir -p /tmp/peersrc && .venv/bin/python -c "from engine.runtimes.ggml_build import fetch_sdist; from pathlib import Path; fetch_sdist(Path('/tmp/peersrc'), Path('/tmp/peersrc/log'))"
        tar xzf /tmp/peersrc/llama_cpp_python-*.tar.gz -C /tmp/peersrc
        X=""
        for d in docs models tests media benches examples pocs .git ggml/src/ggml-{cann,hexagon,hip,metal,musa,opencl,openvino,sycl,vulkan,webgpu,zdnn,zendnn,et,virtgpu}; do
            X="$X --exclude=llama.cpp/$d"
        done
        tar czf .devcarry/llama.cpp-server-src.tar.gz -C /tmp/peersrc/llama_cpp_python-*/vendor $X llama.cpp
    fi
    mkdir -p .devcarry/k27t
    [ -s .devcarry/k27t/target.tar.xz ] || tar -cJf .devcarry/k27t/target.tar.xz -C models $(cd models && ls fimble-target/*.safetensors)
    git ls-files -z | xargs -0 du -b | awk '$1>150000 {print $2}' | grep -v -E '^models/fimble-draft/|^models/fimble-target/tokenizer.json' |
        while read -r f; do mkdir -p "/tmp/aside/$(dirname "$f")"; mv "$f" "/tmp/aside/$f"; done
    ;;
back)
    (cd /tmp/aside && find . -type f) | while read -r f; do mkdir -p "$(dirname "$f")"; mv "/tmp/aside/$f" "$f"; done
    ;;
sweep)
    export PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    cat /proc/loadavg | tee -a "$OUT/gpu.txt"
    # the step at the sweep's configs with attention's fixed trips (the candidate default), then without, to compare
    FIMBLE_ATTENTION_FIXED_TRIPS=1 timeout 420 python3 -m bench.gpu_linear --step --json "$OUT/sweep.json" 2>&1 |
        tee "$OUT/sweep.log"
    FIMBLE_ATTENTION_FIXED_TRIPS=0 timeout 75 python3 -m bench.gpu_linear --step-only \
        --configs-from "$OUT/sweep.json" 2>&1 | tail -2 | sed "s/^/fixed trips 0: /" | tee -a "$OUT/sweep.log"
    ;;
tests)
    wheels
    tar -xJf .devcarry/k27t/target.tar.xz -C models
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    # attention's fixed trips are the default (FIMBLE_ATTENTION_FIXED_TRIPS=0: the bounded loop, the same bits)
    timeout 560 python3 -m pytest -q -s --durations=15 -p no:cacheprovider tests/gpu tests/engine/test_gpu_kernels.py \
        2>&1 | tee "$OUT/tests.log"
    ;;
start) # `start` runs `job` (sweep, then tests), `start next` runs `next`
    mkdir -p /tmp/k27job/out
    setsid nohup bash bench/gpu_kernels_h200.sh "${2:-job}" >/tmp/k27job/job.log 2>&1 </dev/null &
    echo $! >/tmp/k27job/pid
    echo "started $!"
    ;;
wait) # until the job ends or ${2:-500} s pass, then its tail
    end=$(($(date +%s) + ${2:-500}))
    while [ "$(date +%s)" -lt $end ] && kill -0 "$(cat /tmp/k27job/pid)" 2>/dev/null; do
        sleep 5
    done
    kill -0 "$(cat /tmp/k27job/pid)" 2>/dev/null && echo "job running" || echo "job ended"
    date -u
    tail -n 30 /tmp/k27job/job.log
    cp /tmp/k27job/out/* "$OUT"/ 2>/dev/null
    ;;
swaptests)
    # the lossless suite with the Triton set and swap-AB tiles on the embedded pair's own shapes (its 200 prompts run
    # the embedded pair, whose shapes MEASURED_CONFIGS does not hold: the rule's GEMV configs would run otherwise)
    FIMBLE_CUDA_INVARIANT=triton FIMBLE_LINEAR_CONFIGS=tests/gpu/swap_configs_embedded.json \
        bash bench/gpu_kernels_h200.sh tests
    ;;
next)
    # The next session's one detached job (start it with `start next`; ~10 min; carry .whl, .devcarry/k27t,
    # .devcarry/whl, .devcarry/llama.cpp-server-src.tar.gz): llama-server's CUDA build starts at once in the background
    # (bench/peer_h200.sh, which waits for tests.done before timing anything); meanwhile the GPU suite with swap tiles
    # on the embedded pair's shapes (swaptests); then, the build over (so its 16 compiler processes do not slow the
    # host-timed passes), the step table with a 128-token prefill pass per kernel set (is the Triton set's prefill
    # slower than cuBLAS's?); then the peer's single-stream step against fimble's Triton set (the bar: fimble <= 0.8x
    # llama-server's step).
    mkdir -p /tmp/k27job/out
    FIMBLE_CUDA_INVARIANT=triton PEER_F16=0 PEER_SERVE=0 LLAMA_SERVER_ARGS=-bs PEER_TAG=-triton \
        PEER_AFTER=/tmp/k27job/out/tests.done PEER_AFTER_S=1200 bash bench/peer_h200.sh start
    OUT=/tmp/k27job/out bash bench/gpu_kernels_h200.sh swaptests
    for _ in $(seq 60); do  # at most 300 s more for the build
        grep -q "build rc" /tmp/peerjob/job.log 2>/dev/null && break
        sleep 5
    done
    grep "build rc" /tmp/peerjob/job.log
    timeout 150 python3 -m bench.gpu_linear --step-only --json /tmp/k27job/out/step-prefill.json \
        >/tmp/k27job/out/step-prefill.txt 2>&1
    tail -3 /tmp/k27job/out/step-prefill.txt
    touch /tmp/k27job/out/tests.done
    echo "== waiting for the peer's step"
    bash bench/peer_h200.sh wait 600 20
    cp /tmp/peerjob/out/* /tmp/k27job/out/ 2>/dev/null
    echo "== job done"
    ;;
pdl)
    # Programmatic dependent launch and the L2 weight prefetch (engine/runtimes/gpu_linear.py), 2026-12-06 evening.
    # Start with `start pdl` (carry .whl, .devcarry/k27t, .devcarry/whl, .devcarry/llama.cpp-server-src.tar.gz; ~11
    # min), poll with `wait 560`. llama-server's CUDA build starts at once beside: bench/gpu_pdl.py's variants (off,
    # on, prefetch, attention geometries; its GPU-timed replays are what the choice reads, the host-timed steps share
    # the CPU with the build), then the GPU suite with PDL and 2 prefetched slabs, then the single-stream step against
    # llama-server with PDL off (the peer job), then with it on.
    O=/tmp/k27job/out
    mkdir -p $O
    FIMBLE_CUDA_PDL=0 PEER_F16=0 PEER_SERVE=0 LLAMA_SERVER_ARGS="-bs --cache-ram 0" PEER_TAG=-pdl-off \
        PEER_AFTER=/tmp/k27job/tests.done PEER_AFTER_S=900 bash bench/peer_h200.sh start
    wheels
    timeout 100 python3 -m bench.gpu_pdl --shapes 0.5B --sets invariant --variants on,pf2 --rounds 3 \
        --json $O/pdl.json >$O/pdl.txt 2>&1
    tail -6 $O/pdl.txt
    FIMBLE_CUDA_PDL=1 FIMBLE_CUDA_PREFETCH=2 OUT=$O bash bench/gpu_kernels_h200.sh tests >/dev/null 2>&1
    tail -3 $O/tests.log
    touch /tmp/k27job/tests.done
    bash bench/peer_h200.sh wait 300 >/dev/null
    cp /tmp/peerjob/out/* $O/ 2>/dev/null
    tail -4 $O/step-pdl-off.txt
    FIMBLE_CUDA_PDL=1 FIMBLE_CUDA_PREFETCH=2 PYTHONPATH=/tmp/site:/tmp/peerjob/src/llama.cpp/gguf-py timeout 200 \
        python3 -m bench.harness.llama_server_cuda --step --llama-server /tmp/peerjob/build/bin/llama-server \
        --shape 1.5B --gguf /tmp/peerjob/r15-bf16.gguf --json $O/step-pdl-on.json >$O/step-pdl-on.txt 2>&1
    tail -4 $O/step-pdl-on.txt
    echo "== job done"
    ;;
prefill)
    # Is the Triton set's prefill slower than cuBLAS's (the question that keeps it opt-in)? Start with `start prefill`
    # (carry .whl; ~8 min): the per-weight probe of a 512-row pass (bench/gpu_prefill_tiles.py: cuBLAS, the engine's
    # tiles, wider swap tiles and whether they keep a row's bits), the step table with a cold 1,024-token prompt per
    # kernel set, then 32 typing editors through fimble serve on the 1.5B shape, Triton set then cuBLAS set.
    wheels
    O=/tmp/k27job/out
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
    cat /proc/loadavg | tee -a "$O/gpu.txt"
    timeout 200 python3 -m bench.gpu_prefill_tiles --json "$O/prefill-tiles.json" 2>&1 | tee "$O/prefill-tiles.txt"
    timeout 170 python3 -m bench.gpu_linear --step-only --json "$O/step-prefill.json" >"$O/step-prefill.txt" 2>&1
    tail -3 "$O/step-prefill.txt"
    S="python3 -m bench.serve_load --device cuda --shape 1.5B --no-peer --max-tokens 128 --max-lines 0 --levels 32"
    FIMBLE_CUDA_INVARIANT=triton timeout 150 $S --rounds 2 --json "$O/serve-triton.json" >"$O/serve-triton.txt" 2>&1
    tail -4 "$O/serve-triton.txt"
    FIMBLE_CUDA_INVARIANT=cublas timeout 150 $S --rounds 2 --json "$O/serve-cublas.json" >"$O/serve-cublas.txt" 2>&1
    tail -4 "$O/serve-cublas.txt"
    echo "== job done"
    ;;
prefill2)
    # The prefill tiles (gpu_linear.wide_config), counted before the Triton set can be the default. `start prefill2`
    # (carry .whl and .devcarry/k27t; ~12 min: poll twice): the probe, the GPU suite with the Triton set, 32 editors
    # through fimble serve with each set, the step table with a cold 1,024-token prompt.
    wheels
    tar -xJf .devcarry/k27t/target.tar.xz -C models
    O=/tmp/k27job/out
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
    cat /proc/loadavg | tee -a "$O/gpu.txt"
    timeout 200 python3 -m bench.gpu_prefill_tiles --json "$O/prefill-tiles.json" 2>&1 | tee "$O/prefill-tiles.txt" |
        tail -1
    FIMBLE_CUDA_INVARIANT=triton timeout 540 python3 -m pytest -q -s --durations=10 -p no:cacheprovider tests/gpu \
        tests/engine/test_gpu_kernels.py >"$O/tests.log" 2>&1
    grep -E "rows differ|passed|failed|Error" "$O/tests.log" | tail -12
    S="python3 -m bench.serve_load --device cuda --shape 1.5B --no-peer --max-tokens 128 --max-lines 0 --levels 32"
    FIMBLE_CUDA_INVARIANT=triton timeout 150 $S --rounds 2 --json "$O/serve-triton.json" >"$O/serve-triton.txt" 2>&1
    tail -1 "$O/serve-triton.txt"
    FIMBLE_CUDA_INVARIANT=cublas timeout 150 $S --rounds 2 --json "$O/serve-cublas.json" >"$O/serve-cublas.txt" 2>&1
    tail -1 "$O/serve-cublas.txt"
    timeout 170 python3 -m bench.gpu_linear --step-only --json "$O/step-prefill.json" >"$O/step-prefill.log" 2>&1
    tail -1 "$O/step-prefill.log"
    echo "== job done"
    ;;
fed)
    # Fed rounds (engine/fed_rounds.py), 2026-12-07: `start fed` (carry .whl and .devcarry/k27t; ~9 min), poll with
    # `wait 560`. 32 editors through fimble serve on the random 1.5B shape, fed rounds on (3 rounds), off (2), on again
    # (2): the bar's 5 runs, with the plain loop between them on the same machine; then the serve slot tests on CUDA
    # (fed rounds on: batched = unbatched on the 32 prompts with the invariant kernels).
    job_setup
    S="python3 -m bench.serve_load --device cuda --shape 1.5B --no-peer --max-tokens 128 --max-lines 0 --levels 32"
    for run in fed-a:1:3 plain:0:2 fed-b:1:2; do
        IFS=: read -r tag feed rounds <<<"$run"
        FIMBLE_SERVE_FEED=$feed timeout 240 $S --rounds "$rounds" --json "$O/serve-$tag.json" >"$O/serve-$tag.txt" 2>&1
        echo "$tag: $(tail -1 "$O/serve-$tag.txt")"
    done
    timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_serve_graph_slots.py \
        tests/gpu/test_serve_batched_gpu.py >"$O/tests.log" 2>&1
    grep -E "serve slotted|passed|failed|Error" "$O/tests.log" | tail -8
    echo "== job done"
    ;;
plan)
    # The draft plan of 2026-12-07 (prompt lookup scored per match length) against the plan before it (559a52c's
    # engine/decoding/{draft_plan,spec_policy,drafters}.py, carried in .devcarry/oldplan), 32 editors through fimble
    # serve on the random 1.5B shape, plain loop, alternating new / old twice (carry .whl and .devcarry/oldplan;
    # ~7 min in the foreground).
    wheels
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    mkdir -p /tmp/newplan && cp engine/decoding/{draft_plan,spec_policy,drafters}.py /tmp/newplan/
    S="python3 -m bench.serve_load --device cuda --shape 1.5B --no-peer --max-tokens 128 --max-lines 0 --levels 32"
    for tag in new-1 old-1 new-2 old-2; do
        cp "/tmp/newplan/"*.py engine/decoding/
        [[ $tag == old-* ]] && cp .devcarry/oldplan/*.py engine/decoding/
        timeout 100 $S >"$OUT/serve-$tag.txt" 2>&1
        echo "$tag: $(tail -1 "$OUT/serve-$tag.txt")"
    done
    cp "/tmp/newplan/"*.py engine/decoding/
    ;;
verify)
    # The next session's one detached job (2026-12-07; carry .whl and .devcarry/k27t; ~11 min: `start verify`, then
    # `wait 560` twice): what the attention fix (one combine a layer) left unmeasured. The whole GPU suite (its bits
    # changed: the 200-prompt lossless tests); the step table, step / floor per shape (issue 27's second bar); five
    # runs of 32 editors through fimble serve, plain loop (the third).
    job_setup
    timeout 420 python3 -m pytest -q -p no:cacheprovider --durations=10 tests/gpu tests/engine/test_gpu_kernels.py \
        >"$O/tests.log" 2>&1
    tail -3 "$O/tests.log"
    timeout 170 python3 -m bench.gpu_linear --step-only >"$O/step.txt" 2>&1
    tail -2 "$O/step.txt"
    S="python3 -m bench.serve_load --device cuda --shape 1.5B --no-peer --max-tokens 128 --max-lines 0 --levels 32"
    for i in 1 2 3 4 5; do
        timeout 100 $S >"$O/serve-$i.txt" 2>&1  # (8 files come back a call: no json)
        echo "serve $i: $(tail -1 "$O/serve-$i.txt")"
    done
    echo "== job done"
    ;;
attn)
    # 2026-12-07 (no carry; ~1 min): attention's geometry per pass shape (bench/gpu_attention.py). The same session also
    # ran 32 editors with 32 query rows a program against 16 (a setting since removed: 32 was slower);
    # bench/reports/gpu-attention-geometry-h100-2026-12-07/.
    wheels
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout 300 python3 -m bench.gpu_attention --json "$OUT/attn.json" 2>&1 | tee "$OUT/attn.txt"
    ;;
attn2)
    # 2026-12-07: ran at 600b917 (attn2) and 3cc1bfa (attn3) with an attention kernel that skipped the splits past every
    # row and loaded the combine's partials in chunks; slower than this tree's kernel in the same call, so reverted.
    # bench/reports/gpu-attention-skip-h100-2026-12-07/README.md has both cases' commands and figures.
    echo "see bench/reports/gpu-attention-skip-h100-2026-12-07/README.md (git show 3cc1bfa:bench/gpu_kernels_h200.sh)"
    ;;
narrow)
    # 2026-12-07 (carry .whl; ~5 min): narrow swap tiles for the small products (qkv, o) of both shapes, then the graph
    # step at the code's configs and at the sweep's (bench/gpu_linear.py --narrow; its rows-equal check per config).
    wheels
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    cat /proc/loadavg | tee -a "$OUT/gpu.txt"
    timeout 240 python3 -m bench.gpu_linear --weights qkv,o --narrow --json "$OUT/narrow.json" >"$OUT/narrow.txt" 2>&1
    grep -E "^  (0.5B|1.5B)" "$OUT/narrow.txt" | cut -c1-250
    for i in 1; do
        timeout 90 python3 -m bench.gpu_linear --step-only --json "$OUT/step-code-$i.json" 2>&1 | tail -1
        timeout 90 python3 -m bench.gpu_linear --step-only --configs-from "$OUT/narrow.json" \
            --json "$OUT/step-narrow-$i.json" 2>&1 | tail -1
    done
    ;;
feddiag)
    # Where fimble serve stops with fed rounds on (2026-12-07, H100: 32 editors, no result in 240 s). Every Python
    # process dumps its threads' stacks on SIGUSR1 (a sitecustomize) into $OUT; the daemon's log is kept too.
    # carry .whl; ~5 min in the foreground.
    wheels
    mkdir -p /tmp/fh/site
    cat >/tmp/fh/site/sitecustomize.py <<'PY'
import faulthandler, os, signal, sys
_f = open(f"/tmp/fh/{os.getpid()}-{os.path.basename(sys.argv[0] or 'py')}.txt", "w")
_f.write(" ".join(sys.argv) + "\n"); _f.flush()
faulthandler.register(signal.SIGUSR1, file=_f, all_threads=True)
PY
    export PYTHONPATH=/tmp/fh/site:/tmp/site PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    S="python3 -m bench.serve_load --device cuda --shape 1.5B --no-peer --max-tokens 128 --max-lines 0"
    for run in ${FEDDIAG_RUNS:-c32:on:32 p32:off:32 c4:on:4}; do
        IFS=: read -r tag proc level rounds feed tail <<<"$run"
        rm -f /tmp/fh/*.txt /tmp/fimble-serve-load-*.log
        FIMBLE_SERVE_FEED=${feed:-1} FIMBLE_SERVE_TAIL_ROWS=${tail:-0} timeout 150 $S --levels "$level" --rounds "${rounds:-1}" --engine-process "$proc" --json "$OUT/diag-$tag.json" >"$OUT/diag-$tag.txt" 2>&1 &
        for _ in $(seq 100); do sleep 1; [ -s "$OUT/diag-$tag.json" ] && break; done
        if [ ! -s "$OUT/diag-$tag.json" ]; then
            nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >"$OUT/diag-$tag-smi.txt"
            ps -eo pid,ppid,stat,pcpu,etime,args | grep -E -- "-m (bench|engine)" | grep -v grep >"$OUT/diag-$tag-ps.txt"
            pkill -USR1 -f -- "^[^ ]*python3? -m (bench|engine)\."
            sleep 3
            pkill -USR1 -f -- "^[^ ]*python3? -m (bench|engine)\."
            sleep 2
            tail -c 6000 /tmp/fimble-serve-load-*.log >"$OUT/diag-$tag-daemon.log" 2>&1
            for f in /tmp/fh/*.txt; do echo "=== $f"; cat "$f"; done >"$OUT/diag-$tag-stacks.txt"
            pkill -f -- "-m (bench|engine)\."; sleep 3; pkill -9 -f -- "-m (bench|engine)\."
            echo "$tag: hung (stacks kept)"
        else
            echo "$tag: $(tail -1 "$OUT/diag-$tag.txt")"
        fi
        wait
    done
    if [ -n "${FEDDIAG_TESTS:-}" ]; then  # the serve slot tests on CUDA, fed rounds on (carry .devcarry/k27t too)
        tar -xJf .devcarry/k27t/target.tar.xz -C models
        FIMBLE_SERVE_FEED=1 timeout "$FEDDIAG_TESTS" python3 -m pytest -q -s -p no:cacheprovider \
            tests/gpu/test_serve_graph_slots.py tests/gpu/test_serve_batched_gpu.py >"$OUT/tests.log" 2>&1
        grep -E "serve slotted|passed|failed|Error" "$OUT/tests.log" | tail -8
    fi
    ;;
wide)
    # The wide tiles at WIDE_ROWS 16 (batched rounds too), in the foreground (carry .whl and .devcarry/k27t; ~7 min;
    # every result straight into $OUT, so a call cut short by the device budget still returns what ran): 32 editors
    # through fimble serve, Triton set then cuBLAS set; the rows-equal and lossless tests with the Triton set; the probe.
    wheels
    tar -xJf .devcarry/k27t/target.tar.xz -C models
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    cat /proc/loadavg | tee -a "$OUT/gpu.txt"
    S="python3 -m bench.serve_load --device cuda --shape 1.5B --no-peer --max-tokens 128 --max-lines 0 --levels 32"
    FIMBLE_CUDA_INVARIANT=triton timeout 150 $S --rounds 2 --json "$OUT/serve-triton.json" >"$OUT/serve-triton.txt" 2>&1
    grep -E "round [0-9.]+ ms|headline|serve_load:" "$OUT/serve-triton.txt" | cut -c1-330
    FIMBLE_CUDA_INVARIANT=cublas timeout 150 $S --rounds 2 --json "$OUT/serve-cublas.json" >"$OUT/serve-cublas.txt" 2>&1
    grep -E "round [0-9.]+ ms|serve_load:" "$OUT/serve-cublas.txt" | cut -c1-330
    FIMBLE_CUDA_INVARIANT=triton timeout 330 python3 -m pytest -q -s -p no:cacheprovider \
        tests/gpu/test_batch_invariance.py tests/gpu/test_serve_batched_gpu.py tests/gpu/test_serve_graph_slots.py \
        tests/engine/test_gpu_kernels.py -k "not qkv_with_rope and not attention" >"$OUT/tests.log" 2>&1
    grep -E "rows differ|==|passed|failed|Error" "$OUT/tests.log" | tail -14 | cut -c1-300
    timeout 120 python3 -m bench.gpu_prefill_tiles --json "$OUT/prefill-tiles.json" >"$OUT/prefill-tiles.txt" 2>&1
    tail -1 "$OUT/prefill-tiles.txt"
    ;;
rounds)
    # Not run yet. What a serve round's GPU time is made of (the serve loop is GPU-bound: busy 93-94% of a round on
    # 2026-12-06): a 32-sequence slot round on the 1.5B shape, blocks of 1 and 2, per kernel set, profiled kernel by
    # kernel (bench/gpu_profile.py --round; no carry; ~3 min).
    export PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    for k in invariant-cublas invariant; do
        for r in 32x1 32x2; do
            timeout 120 python3 -m bench.gpu_profile --shape 1.5B --attention $k --round $r \
                --json "$OUT/round-$k-$r.json" >"$OUT/round-$k-$r.txt" 2>&1
            tail -1 "$OUT/round-$k-$r.txt"
        done
    done
    ;;
job)
    OUT=/tmp/k27job/out bash bench/gpu_kernels_h200.sh sweep
    echo "== tests: Triton set, fixed trips, the sweep's configs"
    FIMBLE_CUDA_INVARIANT=triton FIMBLE_LINEAR_CONFIGS=/tmp/k27job/out/sweep.json \
        OUT=/tmp/k27job/out bash bench/gpu_kernels_h200.sh tests
    echo "== job done"
    ;;
*)
    sed -n 2,21p "$0"
    exit 2
    ;;
esac
