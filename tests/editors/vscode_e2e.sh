#!/usr/bin/env bash
# Real VS Code end to end: code-server 4.100.3 (VS Code 1.100.3) from npm, Debian's chromium driven by
# playwright-core over CDP, the built fimble .vsix and the real `fimble lsp`, once with each model:
# the default one (no model set: Qwen2.5-Coder-0.5B once `training.fetch_qwen` installed it; multi-line
# completions) and the small embedded one (one-line completions).
#
#   tests/editors/vscode_e2e.sh            install (cached), build the .vsix, run the driver per model
#   tests/editors/vscode_e2e.sh install    only the install (for a warm cache)
#   FIMBLE_E2E_MODELS=default tests/editors/vscode_e2e.sh    one model only (default, embedded)
#
# Too slow for CI's budget (a cold install is ~10 minutes on 2 cores, a run 4-8 minutes per model): it
# runs from here, and its latest output is committed as docs/e2e/vscode-latest.txt (default model, with
# a screenshot, docs/screenshots/vscode-ghost-text.png) and docs/e2e/vscode-latest-embedded.txt.
# See tests/editors/README.
#
# The install uses only npm and apt (nothing else is reachable here): code-server's postinstall downloads
# ripgrep from GitHub, so it is installed with --ignore-scripts and the postinstall's steps are done by
# hand, with Debian's ripgrep and the native modules rebuilt against the system Node's headers.
# Cached under $FIMBLE_E2E_CACHE (default /var/cache/fimble/vscode-e2e), outside the repository; a
# fresh machine builds it from scratch. Nothing downloads a browser.
set -euo pipefail

CS_VERSION=4.100.3
PLAYWRIGHT_VERSION=1.65.1
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
CACHE="${FIMBLE_E2E_CACHE:-/var/cache/fimble/vscode-e2e}"
CS_DIR="$CACHE/code-server-$CS_VERSION"
CS="$CS_DIR/node_modules/code-server"
DRIVER_DIR="$CACHE/driver"
OUT="${FIMBLE_E2E_OUT:-$REPO/docs/e2e}"

log() { printf '[vscode_e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

need_apt() {  # need_apt BINARY PACKAGE
  command -v "$1" >/dev/null 2>&1 && return 0
  log "installing Debian package $2"
  apt-get install -y --no-install-recommends "$2" >/dev/null || { apt-get update >/dev/null && apt-get install -y --no-install-recommends "$2" >/dev/null; }
}

step() {  # step NAME [in DIR] CMD...: run once (a stamp file marks it done), so an interrupted install resumes
  local name="$1" dir=.
  shift
  if [ "$1" = in ]; then dir="$2"; shift 2; fi
  [ -f "$CS_DIR/.step-$name" ] && return 0
  log "  step $name"
  (cd "$dir" && "$@")
  touch "$CS_DIR/.step-$name"
}

install_code_server() {
  if [ -f "$CS_DIR/.complete" ]; then
    log "code-server $CS_VERSION: cached in $CS_DIR"
    return 0
  fi
  log "installing code-server $CS_VERSION into $CS_DIR (slow: several minutes; each step resumes)"
  mkdir -p "$CS_DIR"
  # 1. The package itself, without its postinstall (which downloads ripgrep from GitHub).
  step 1-package nice npm install --prefix "$CS_DIR" "code-server@$CS_VERSION" --ignore-scripts --no-audit --no-fund --loglevel=error
  # 2. VS Code's own dependencies, again without install scripts.
  step 2-vscode-deps in "$CS/lib/vscode" nice npm install --omit=dev --ignore-scripts --no-audit --no-fund --loglevel=error
  # 3. Debian's ripgrep where @vscode/ripgrep would have downloaded its binary.
  mkdir -p "$CS/lib/vscode/node_modules/@vscode/ripgrep/bin"
  cp "$(command -v rg)" "$CS/lib/vscode/node_modules/@vscode/ripgrep/bin/rg"
  # 4. Native modules against the system Node's headers (/usr/include/node), no header download.
  step 4-rebuild in "$CS/lib/vscode" env npm_config_nodedir=/usr npm_config_yes=true nice npm rebuild --loglevel=error
  # 5. What postinstall.sh does besides installing: the asar and bin-script symlinks.
  (cd "$CS/lib/vscode" && rm -rf node_modules.asar && ln -s node_modules node_modules.asar)
  (cd "$CS/lib/vscode/bin/remote-cli" && rm -f code-server && ln -s code-linux.sh code-server)
  (cd "$CS/lib/vscode/bin/helpers" && rm -f browser.sh && ln -s browser-linux.sh browser.sh)
  # 6. The built-in extensions' dependencies.
  step 6-extensions in "$CS/lib/vscode/extensions" nice npm install --omit=dev --no-audit --no-fund --loglevel=error
  # 7. code-server's own native module (password hashing), built here.
  step 7-argon2 in "$CS_DIR" env npm_config_nodedir=/usr npm_config_build_from_source=true nice npm rebuild argon2 --loglevel=error
  [ -f "$CS_DIR/node_modules/argon2/lib/binding/napi-v3/argon2.node" ] || { log "argon2 was not built"; exit 1; }
  touch "$CS_DIR/.complete"
  log "code-server installed"
}

install_driver() {
  if [ -f "$DRIVER_DIR/.complete" ]; then
    return 0
  fi
  log "installing playwright-core $PLAYWRIGHT_VERSION (no browser download: Debian's chromium is used)"
  rm -rf "$DRIVER_DIR" && mkdir -p "$DRIVER_DIR"
  PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 nice npm install --prefix "$DRIVER_DIR" "playwright-core@$PLAYWRIGHT_VERSION" \
    --no-audit --no-fund --loglevel=error
  touch "$DRIVER_DIR/.complete"
}

need_header() {  # need_header HEADER PACKAGE: a native module's build dependency
  [ -e "/usr/include/$1" ] && return 0
  log "installing Debian package $2 (for $1)"
  apt-get install -y --no-install-recommends "$2" >/dev/null || { apt-get update >/dev/null && apt-get install -y --no-install-recommends "$2" >/dev/null; }
}

install_all() {
  need_apt rg ripgrep
  need_apt chromium chromium
  need_apt g++ g++
  need_apt make make
  need_apt pkg-config pkg-config
  need_header gssapi/gssapi.h libkrb5-dev         # kerberos
  need_header X11/extensions/XKBrules.h libxkbfile-dev  # native-keymap
  need_header libsecret-1/libsecret/secret.h libsecret-1-dev
  install_code_server
  install_driver
}

build_vsix() {
  log "building the extension (.vsix)"
  (cd "$REPO/editors/vscode" && npm ci --no-audit --no-fund --prefer-offline --loglevel=error >/dev/null \
    && npm run bundle >/dev/null && npm run package >/dev/null)
  echo "$REPO/editors/vscode/dist/fimble.vsix"
}

main() {
  install_all
  if [ "${1:-}" = "install" ]; then
    return 0
  fi
  local vsix model name shot status rc=0
  vsix="$(build_vsix)"
  mkdir -p "$OUT"
  for model in ${FIMBLE_E2E_MODELS:-default embedded}; do
    case "$model" in
      default) name=vscode-latest shot="$REPO/docs/screenshots/vscode-ghost-text.png" ;;
      embedded) name=vscode-latest-embedded shot="" ;;
      *) log "unknown model '$model' in FIMBLE_E2E_MODELS (default, embedded)"; return 2 ;;
    esac
    log "running the driver with the $model model (output: $OUT/$name.txt)"
    NODE_PATH="$DRIVER_DIR/node_modules" FIMBLE_CODE_SERVER="$CS/out/node/entry.js" FIMBLE_VSIX="$vsix" \
      FIMBLE_REPO="$REPO" FIMBLE_E2E_OUT="$OUT" FIMBLE_E2E_MODEL="$model" FIMBLE_E2E_NAME="$name" FIMBLE_E2E_SHOT="$shot" \
      node "$REPO/tests/editors/vscode_e2e_driver.js" "$@" 2>&1 | tee "$OUT/$name.txt" && status=0 || status="${PIPESTATUS[0]}"
    [ "$status" -eq 0 ] || rc=1
  done
  return "$rc"
}

main "$@"
