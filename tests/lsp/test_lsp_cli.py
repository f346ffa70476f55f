"""``fimble complete FILE:LINE:COL``: a completion on stdout, or one clear line on stderr and exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lsp_helpers import SERVER_ENV

FIMBLE = [sys.executable, "-m", "lsp_server"]
SOURCE = "def add(a, b):\n    return a + \n\nprint(add(1, 2))\n"


def run(*args: str, cmd: list[str] = FIMBLE) -> subprocess.CompletedProcess:
    return subprocess.run([*cmd, *args], env=SERVER_ENV, capture_output=True, text=True, timeout=180)


def test_complete_prints_a_completion(tmp_path: Path):
    f = tmp_path / "add.py"
    f.write_text(SOURCE)
    script = Path(sys.executable).parent / "fimble"  # the console script from pyproject
    cmd = [str(script)] if script.exists() else FIMBLE
    r = run("complete", f"{f}:2:16", "--max-tokens", "8", "--stats", cmd=cmd)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")
    assert "Traceback" not in r.stderr and "tokens" in r.stderr
    assert "context mid_statement" in r.stderr  # the syntax policy chose the options, as in an editor


def test_complete_shapes_as_an_editor_and_raw_does_not(tmp_path: Path):
    f = tmp_path / "add.py"
    f.write_text(SOURCE)
    shaped = run("complete", f"{f}:2:16", "--max-tokens", "24", "--stats")
    raw = run("complete", f"{f}:2:16", "--max-tokens", "24", "--stats", "--raw")
    assert shaped.returncode == 0 and raw.returncode == 0, shaped.stderr + raw.stderr
    assert "context raw" in raw.stderr
    # a mid-statement cursor gets one line at most; the raw decode may run on for 8 lines
    assert shaped.stdout.count("\n") == 1
    assert raw.stdout.startswith(shaped.stdout.rstrip("\n")) or shaped.stdout == "\n"


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--max-tokens", "0", "between 1 and 4096"),
        ("--max-tokens", "100000", "between 1 and 4096"),
        ("--max-lines", "-1", "between 0"),
    ],
)
def test_out_of_range_options_are_one_line_errors(tmp_path: Path, flag: str, value: str, message: str):
    f = tmp_path / "add.py"
    f.write_text(SOURCE)
    r = run("complete", f"{f}:2:16", flag, value)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{missing}:1:1", "no such file"),
        ("{dir}:1:1", "is a directory"),
        ("{file}", "expected FILE:LINE:COL"),
        ("{file}:x:1", "must be numbers"),
        ("{file}:0:1", "1-based"),
        ("{file}:99:1", "past the end"),
        ("{file}:2:99", "past its end"),
        ("{latin1}:1:1", "not UTF-8"),
    ],
)
def test_bad_input_is_one_line_error(tmp_path: Path, spec: str, message: str):
    f = tmp_path / "add.py"
    f.write_text(SOURCE)
    latin1 = tmp_path / "latin1.py"
    latin1.write_bytes("x = 'caf\xe9'\n".encode("latin-1"))
    spec = spec.format(missing=tmp_path / "nope.py", dir=tmp_path, file=f, latin1=latin1)
    r = run("complete", spec)
    assert r.returncode == 2
    assert r.stderr.startswith("fimble: ") and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_bad_model_folder_is_one_line_error(tmp_path: Path):
    f = tmp_path / "add.py"
    f.write_text(SOURCE)
    r = run("complete", f"{f}:2:16", "--model", str(tmp_path / "no-model"))
    assert r.returncode == 2
    assert r.stderr.startswith("fimble: ") and r.stderr.count("\n") == 1, r.stderr
    assert "does not exist" in r.stderr
