"""Smoke test: the keystroke bench runs end to end (as a module, the way it is documented) and prints its headline
last. It runs in a subprocess: the tests import nothing from bench/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.syntax_keystroke", "--places", "4", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("p95 keystroke (reparse + classify):")
    data = json.loads(out.read_text())
    assert data["lines"] == 3000 and data["keystrokes"] > 0
    assert {"p50", "p95", "p99"} <= set(data["keystroke_ms"])
