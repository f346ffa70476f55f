#!/usr/bin/env bash
# fimble serve against llama.cpp's llama-server on one GPU machine, in one run (issue 27, item 4).
#
#   bash bench/peer_h200.sh start     # detached (setsid): build, GGUFs, step, traces; returns at once
#   bash bench/peer_h200.sh status    # the job's log tail
#   bash bench/peer_h200.sh wait 500  # waits (at most 500 s) for the job to end, then its log tail
#   bash bench/peer_h200.sh collect   # copies the results into $OUT (the device tool's folder)
#
# Needs, carried in .devcarry/ (ignored by git): llama.cpp-server-src.tar.gz, llama-cpp-python 0.3.36's
# vendor/llama.cpp (the source fimble's CPU library is built from, engine/runtimes/ggml_build.py; MIT licence),
# docs/models/tests/examples and other backends left out; whl/ with websockets and msgpack for Python 3.12.
# The job: llama-server with CUDA for sm_90 alone (the server target, static), built in the background while the
# random 1.5B shape is written as GGUFs (bf16, f16; bench/harness/llama_server_cuda.py); then the single-stream
# step on both systems, then bench/serve_load.py's trace (1, 8, 32 editors; 128 tokens, no line limit) against
# fimble serve and llama-server interleaved, twice, with the bf16 GGUF; then 32 editors again with the f16 GGUF.
# Poll with `status` inside 30 s of each call's end (the machine goes back when idle); `collect` at the end.
#
# The tool sends the working tree (64 MiB at most). On 2026-12-04 the tracked files were 70.3 MiB with both
# adapters (models/fimble-smollm2, models/qwen2.5-coder-0.5b-fim) moved aside, and .devcarry 6.2 MiB: no call
# fitted. Nothing here reads models/fimble-target's weights (serve_load's --shape and the harness take only its
# tokenizer, template and stop ids: llama_server_cuda.tokenizer_only), so its four shards (51.5 MiB) may be moved
# aside for the calls too, where nothing else reads them meanwhile: 25 MiB then, and the whole job ran in one call
# (454 s: build 271 s, step, traces; bench/reports/serve-peer-h200-2026-12-04.txt).
# The peer's fair settings for this trace: LLAMA_SERVER_ARGS="-bs --cache-ram 0" (GPU sampling; no host prompt
# cache, which otherwise copies a busy slot's KV to host RAM at each keystroke and stalls every slot).
set -u
J=/tmp/peerjob
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
case "${1:-}" in
start)
    mkdir -p $J/out
    setsid nohup bash bench/peer_h200.sh job >$J/job.log 2>&1 </dev/null &
    echo $! >$J/pid
    echo "started $!"
    ;;
wait) # until the job ends or ${2:-500} s pass (polls inside one device call), then its status
    end=$(($(date +%s) + ${2:-500}))
    while [ "$(date +%s)" -lt $end ] && kill -0 "$(cat $J/pid)" 2>/dev/null; do
        sleep 5
    done
    kill -0 "$(cat $J/pid)" 2>/dev/null && echo "job running" || echo "job ended"
    tail -n 1 $J/build.log 2>/dev/null | cut -c1-160
    bash bench/peer_h200.sh status "${3:-25}"
    ;;
status)
    date -u
    tail -n "${2:-15}" $J/job.log
    ls $J/out 2>/dev/null
    ;;
collect)
    cp $J/out/* "$OUT"/ 2>/dev/null
    tail -c 200000 $J/job.log >"$OUT"/job.log
    (cd $J && tar czf "$OUT"/logs.tar.gz *.log 2>/dev/null)
    ls -la "$OUT"
    ;;
job)
    # LLAMA_SERVER_ARGS: more llama-server arguments (e.g. -bs, backend sampling); PEER_F16=0: bf16 only;
    # PEER_TAG: a suffix for the result files; PEER_STEP=0: no single-stream step; PEER_LEVELS: the bf16 trace's levels;
    # PEER_ROUNDS: the traces' rounds (2); PEER_FRESH=1: --fresh-traces (a new trace each round); PEER_AFTER=PATH: after
    # the build and the GGUFs, wait until PATH exists before any timing (e.g. the end of GPU tests run beside this job),
    # at most PEER_AFTER_S seconds (1500); PEER_SERVE=0: the step alone, no traces
    F16=${PEER_F16:-1}
    STEP=${PEER_STEP:-1}
    LEVELS=${PEER_LEVELS:-1,8,32}
    TAG=${PEER_TAG:-}
    ROUNDS=${PEER_ROUNDS:-2}
    AFTER=${PEER_AFTER:-}
    FR=()
    [ "${PEER_FRESH:-0}" = 1 ] && FR=(--fresh-traces)
    set -x
    echo "LLAMA_SERVER_ARGS='${LLAMA_SERVER_ARGS:-}' F16=$F16 TAG=$TAG STEP=$STEP LEVELS=$LEVELS ROUNDS=$ROUNDS" \
        "FRESH=${PEER_FRESH:-0} AFTER=$AFTER"
    export PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    nproc
    nvcc --version | tail -2
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    cmake --version | head -1
    # the toolkit's cuBLAS and the driver's libcuda, where CMake's FindCUDAToolkit looks; else the pip wheels'
    # cuBLAS (torch's) and the mounted driver's libcuda, named to CMake by path (and cuBLAS put on the loader path)
    CU=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    ls "$CU"/lib64 "$CU"/lib64/stubs 2>/dev/null | grep -E "cublas|libcuda\.so" | tr '\n' ' '
    echo
    anyf() { for f in "$@"; do [ -e "$f" ] && return 0; done; return 1; }
    FB=()
    if ! anyf "$CU"/lib64/libcublas.so "$CU"/targets/x86_64-linux/lib/libcublas.so; then
        so=$(find /opt /usr -name 'libcublas.so.*' 2>/dev/null | head -1)
        lt=$(find /opt /usr -name 'libcublasLt.so.*' 2>/dev/null | head -1)
        inc=$(dirname "$(find /opt /usr -name cublas_v2.h 2>/dev/null | head -1)")
        echo "cuBLAS from $so $lt $inc"
        FB+=(-DCUDA_cublas_LIBRARY="$so" -DCUDA_cublasLt_LIBRARY="$lt" -DCMAKE_CUDA_FLAGS="-I$inc"
            -DCMAKE_CXX_FLAGS="-I$inc")
        export LD_LIBRARY_PATH=$(dirname "$so"):$(dirname "$lt"):${LD_LIBRARY_PATH:-}
    fi
    if ! anyf "$CU"/lib64/libcuda.so "$CU"/lib64/stubs/libcuda.so "$CU"/targets/x86_64-linux/lib/stubs/libcuda.so; then
        drv=$( (ldconfig -p | grep -o '/[^ ]*/libcuda\.so[.0-9]*$'; find /usr/local/nvidia /usr/lib* -name 'libcuda.so*' 2>/dev/null) | head -1)
        echo "libcuda from $drv"
        FB+=(-DCUDA_cuda_driver_LIBRARY="$drv")
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .devcarry/whl/*.whl || exit 1
    mkdir -p $J/src
    tar xzf .devcarry/llama.cpp-server-src.tar.gz -C $J/src || exit 1
    export PYTHONPATH=/tmp/site:$J/src/llama.cpp/gguf-py
    t0=$(date +%s)
    (
        cmake -S $J/src/llama.cpp -B $J/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
            -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF \
            -DGGML_CUDA_COMPRESSION_MODE=none -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
            -DGGML_F16C=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
            -DLLAMA_USE_PREBUILT_UI=OFF "${FB[@]}" &&
            cmake --build $J/build --target llama-server -j 16
    ) >$J/build.log 2>&1 &
    build=$!
    python3 -m bench.harness.llama_server_cuda --write-gguf $J/r15-bf16.gguf --dtype bf16 --shape 1.5B
    [ "$F16" = 1 ] && python3 -m bench.harness.llama_server_cuda --write-gguf $J/r15-f16.gguf --dtype f16 --shape 1.5B
    wait $build
    rc=$?
    echo "build rc $rc in $(($(date +%s) - t0)) s"
    tail -5 $J/build.log
    B=$J/build/bin/llama-server
    [ -x $B ] || {
        tail -40 $J/build.log
        exit 1
    }
    $B --version 2>&1 | tail -3
    if [ -n "$AFTER" ]; then
        echo "waiting for $AFTER at $(($(date +%s) - t0)) s"
        until_s=$(($(date +%s) + ${PEER_AFTER_S:-1500})) # bounded: a job whose tests died does not wait forever
        while [ ! -e "$AFTER" ] && [ "$(date +%s)" -lt $until_s ]; do sleep 2; done
        [ -e "$AFTER" ] || {
            echo "$AFTER never came (PEER_AFTER_S ${PEER_AFTER_S:-1500} s): no timing"
            exit 1
        }
        echo "$AFTER there at $(($(date +%s) - t0)) s"
    fi
    G=(--gguf $J/r15-bf16.gguf)
    [ "$F16" = 1 ] && G+=(--gguf $J/r15-f16.gguf)
    [ "$STEP" = 1 ] && python3 -m bench.harness.llama_server_cuda --step --llama-server $B --shape 1.5B \
        "${G[@]}" --json $J/out/step$TAG.json 2>&1 | tee $J/out/step$TAG.txt
    echo "step done at $(($(date +%s) - t0)) s"
    [ "${PEER_SERVE:-1}" = 0 ] && echo JOB DONE && exit 0
    python3 -m bench.serve_load --device cuda --shape 1.5B --levels $LEVELS --no-peer --max-tokens 128 \
        --max-lines 0 --llama-server $B --gguf $J/r15-bf16.gguf --rounds "$ROUNDS" "${FR[@]}" \
        --json $J/out/serve-bf16$TAG.json 2>&1 |
        tee $J/out/serve-bf16$TAG.txt
    echo "serve bf16 done at $(($(date +%s) - t0)) s"
    [ "$F16" = 1 ] && python3 -m bench.serve_load --device cuda --shape 1.5B --levels 32 --no-peer --max-tokens 128 \
        --max-lines 0 --llama-server $B --gguf $J/r15-f16.gguf --rounds "$ROUNDS" "${FR[@]}" \
        --json $J/out/serve-f16.json 2>&1 |
        tee $J/out/serve-f16.txt
    echo "serve f16 done at $(($(date +%s) - t0)) s"
    cp /tmp/llama-server-*.log $J/ 2>/dev/null
    echo JOB DONE
    ;;
*)
    echo "usage: $0 start|status|collect" >&2
    exit 2
    ;;
esac
