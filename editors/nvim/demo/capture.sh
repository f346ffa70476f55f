#!/usr/bin/env bash
# Capture Neovim showing fimble's ghost text (embedded model) in tmux:
#   editors/nvim/demo/capture.sh [OUT.txt]     (default docs/nvim-ghost-text.txt)
# Needs nvim and tmux. Writes the pane with its colours (`tmux capture-pane -p -e`).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
OUT="${1:-$ROOT/docs/nvim-ghost-text.txt}"
FIMBLE="${FIMBLE_BIN:-$ROOT/.venv/bin/fimble}"
WORK="$(mktemp -d)"
SESSION="fimble-demo-$$"
trap 'tmux kill-session -t "$SESSION" 2>/dev/null || true; rm -rf "$WORK"' EXIT

cp "$ROOT/tests/data/demo.py" "$WORK/demo.py"
cat > "$WORK/init.lua" <<LUA
vim.opt.runtimepath:prepend("$ROOT/editors/nvim")
vim.o.swapfile = false
vim.o.number = true
vim.o.laststatus = 2
vim.o.termguicolors = false
vim.g.python_recommended_style = 0
vim.cmd("syntax on")
vim.o.statusline = " %f %= %{luaeval('require(\"fimble\").statusline()')} "
require("fimble").setup({ cmd = { "$FIMBLE", "lsp" }, settings = { maxLines = 4 } })
LUA

tmux new-session -d -s "$SESSION" -x 90 -y 16 -c "$WORK" "TERM=screen-256color nvim --clean -n -u init.lua demo.py"
pane() { tmux capture-pane -t "$SESSION" -p -e; }
wait_for() {  # wait_for PATTERN SECONDS
  local deadline=$((SECONDS + $2))
  until pane | grep -q -- "$1"; do
    ((SECONDS < deadline)) || { echo "timed out waiting for $1" >&2; pane >&2; exit 1; }
    sleep 0.2
  done
}
wait_for "fimble" 60   # the statusline: the server is up
# Warm up (the first answer waits for the model to load), then undo it.
tmux send-keys -t "$SESSION" "7G" "A" "for"
wait_for $'\e\\[38;5;244m' 120   # the ghost text's colour
tmux send-keys -t "$SESSION" Escape "u"
sleep 1
tmux send-keys -t "$SESSION" "A" "for line in f"
wait_for $'\e\\[38;5;244m' 120
# Let the stream finish: wait until the screen stops changing.
prev=""
for _ in $(seq 1 40); do
  sleep 0.5
  cur="$(pane)"
  [[ "$cur" == "$prev" ]] && break
  prev="$cur"
done
pane > "$OUT"
echo "wrote $OUT"
