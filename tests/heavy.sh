#!/usr/bin/env bash
# The heavy suite: the full-size issue bars that the default suite (`python -m pytest -q -n 2 --dist loadfile`, CI's) runs smaller.
# They carry pytest's `heavy` marker (pyproject.toml), which the default run leaves out:
#   - greedy speculative == plain greedy on 200 prompts: the embedded pair (tests/engine/test_lossless_greedy.py),
#     the ggml runtime f32 and q8_0 (test_ggml_runtime.py), int8 (test_int8.py), the default Qwen model with its
#     drafter (test_draft_vocab.py; where the install step has run, about 16 minutes of the run on 2 cores);
#   - the other two cases of two 2x2 grids: speculative sampling's chi-square test, drafter x temperature
#     (test_speculative_sampling.py), and greedy output against llama.cpp's, weight type x flash attention
#     (test_ggml_runtime.py);
#   - 12 random edit sequences of exact KV reuse against a recompute, 50 files under the KV budget (test_kv_reuse.py);
#   - 80 prompts scanned for an empty middle (test_no_empty.py); the default model's verify blocks against its steps
#     in stock's q8_0 order (FIMBLE_Q8_0_AVX2=1, test_q8_rows.py; where the install step has run);
#   - 20,000 keystrokes that keep the LSP server's tables bounded (tests/lsp/test_lsp_bounded.py), 24 cursors whose
#     answers must parse (test_lsp_validated_answers.py);
#   - the default model on a machine loaded by two CPU hogs, never restarted (tests/reliability/
#     test_supervision_processes.py; where the install step has run, several minutes);
#   - Ray Serve with 2 replicas: affinity, a replica's kill and its replacement (tests/remote/test_ray_serve.py; the
#     default suite deploys 1 replica behind fimble serve).
# Run it alone on the machine, from anywhere: bash tests/heavy.sh [more pytest arguments]. The output, with the
# commit and the machine, goes to tests/reports/heavy-latest.txt as well; commit it with the change it checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p tests/reports
REPORT=tests/reports/heavy-latest.txt
{
    echo "# tests/heavy.sh: $PY -m pytest -q -m heavy --durations=0 $*"
    echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(
        git diff --quiet HEAD -- tests 2>/dev/null || echo ' (tests/ changed since)'), $(nproc) cores, $(uname -m)"
    "$PY" -m pytest -q -m heavy --durations=0 "$@" 2>&1
} | tee "$REPORT"
