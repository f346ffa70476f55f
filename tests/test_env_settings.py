"""engine/env_settings.py: one table of every FIMBLE_* environment variable, each range-checked.

Every kind takes its good values and refuses bad ones with a one-line message naming the variable; the defaults
are those the call sites used before the table; a source scan keeps every FIMBLE_* name the product reads in the
table (a new setting cannot skip it); a bad value stops ``fimble`` and the engine child at start with status 2.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine import env_settings
from engine.env_settings import SETTINGS, TABLE, SettingError, check_environment, read

REPO = Path(__file__).resolve().parent.parent


def value(name: str, raw: str | None):
    return read(name, {} if raw is None else {name: raw})


def refused(name: str, raw: str) -> str:
    with pytest.raises(SettingError) as info:
        value(name, raw)
    message = str(info.value)
    assert message.startswith(name + " ") and "\n" not in message and repr(raw.strip() or raw) in message
    return message


def test_switches_take_on_and_off_words_and_refuse_others():
    for raw in ("1", "on", "true", "yes", "ON", " Yes "):
        assert value("FIMBLE_COLD_WINDOW", raw) is True
    for raw in ("0", "off", "false", "no", "OFF", " 0 "):
        assert value("FIMBLE_COLD_WINDOW", raw) is False
    for raw in ("2", "maybe", "enable"):
        assert "0 or 1" in refused("FIMBLE_COLD_WINDOW", raw)
    assert value("FIMBLE_CUDA_PDL", "ON") == "on" and value("FIMBLE_CUDA_PDL", "") == "auto"  # a choice, not a switch


def test_switches_the_c_library_reads_take_exactly_what_it_reads():
    """FIMBLE_Q8_0_AVX2: the C code (ggml_patch.py) tests the first character for '1', so "on" would be off there."""
    assert value("FIMBLE_Q8_0_AVX2", "1") is True and value("FIMBLE_Q8_0_AVX2", "0") is False
    for raw in ("on", "true", "yes", "2"):
        refused("FIMBLE_Q8_0_AVX2", raw)
    assert value("FIMBLE_Q8_0_LANES", "avx2") == "avx2" and value("FIMBLE_Q8_0_LANES", None) == ""
    refused("FIMBLE_Q8_0_LANES", "AVX2")  # strcmp: case matters there
    refused("FIMBLE_Q8_0_LANES", "avx512")


def test_choices_take_their_names_and_refuse_others():
    assert value("FIMBLE_RUNTIME", "GGML") == "ggml" and value("FIMBLE_RUNTIME", " compact ") == "compact"
    assert "one of auto, compact, ggml" in refused("FIMBLE_RUNTIME", "onnx")
    assert value("FIMBLE_QUANT", "int8") == "int8"
    refused("FIMBLE_QUANT", "int4")
    for raw, want in (("0", "0"), ("off", "0"), ("no", "0"), ("1", "1"), ("yes", "1"), ("cuBLAS", "cublas")):
        assert value("FIMBLE_CUDA_INVARIANT", raw) == want
    for raw in ("tritn", "cuBLAS-set", "2"):
        refused("FIMBLE_CUDA_INVARIANT", raw)
    assert value("FIMBLE_DEFAULT_MODEL", "qwen-1.5b") == "qwen-1.5b"
    refused("FIMBLE_DEFAULT_MODEL", "qwen-7b")  # was a logged warning, then ignored
    assert value("FIMBLE_LOG", "DEBUG") == "debug" and env_settings.log_level({"FIMBLE_LOG": "info"}) == 20
    refused("FIMBLE_LOG", "loud")
    assert value("FIMBLE_GGML_FLASH", "on") == "on" and value("FIMBLE_GGML_LIB", "py-sync") == "py-sync"
    refused("FIMBLE_GGML_FLASH", "maybe")
    refused("FIMBLE_GGML_LIB", "ctypes")


def test_whole_numbers_take_their_range_and_refuse_the_rest():
    assert value("FIMBLE_CUDA_INVARIANT_ROWS", "32") == 32 and value("FIMBLE_GGML_THREADS", "256") == 256
    assert "out of range" in refused("FIMBLE_CUDA_INVARIANT_ROWS", "0")  # was raised to 1, silently
    assert "out of range" in refused("FIMBLE_GGML_THREADS", "257")
    assert "whole number in 1..256" in refused("FIMBLE_GGML_THREADS", "1.5")
    refused("FIMBLE_CUDA_INVARIANT_ROWS", "sixteen")  # was a ValueError traceback at import
    assert [value("FIMBLE_CUDA_PREFETCH", raw) for raw in ("0", "1", "2", "4")] == [0, 1, 2, 4]
    assert "one of 0, 1, 2, 4" in refused("FIMBLE_CUDA_PREFETCH", "3")


def test_seconds_take_their_range_and_refuse_the_rest():
    assert value("FIMBLE_REQUEST_BUDGET_S", "2.5") == 2.5 and value("FIMBLE_REQUEST_BUDGET_S", "900") == 900.0
    message = refused("FIMBLE_REQUEST_BUDGET_S", "abc")
    assert message == "FIMBLE_REQUEST_BUDGET_S must be seconds in 0.1..3600, not 'abc'"
    assert "out of range" in refused("FIMBLE_REQUEST_BUDGET_S", "0")
    for raw in ("-1", "nan", "inf", "1e9"):
        refused("FIMBLE_ENGINE_STALL_S", raw)
    assert value("FIMBLE_COLD_BUDGET_S", "0.0005") == 0.0005 and value("FIMBLE_BACKGROUND_S", "0") == 0.0
    assert value("FIMBLE_FOLLOW_UP_WITHIN_S", "600") == 600.0
    refused("FIMBLE_FOLLOW_UP_WITHIN_S", "-3")  # was kept at its default, silently
    assert value("FIMBLE_QUIET_AFTER_S", "0") == 0.0 and value("FIMBLE_QUIET_AFTER_S", "0.5") == 0.5  # 0: never
    assert "0 or seconds in 0.5..600" in refused("FIMBLE_QUIET_AFTER_S", "0.2")


def test_paths_are_taken_as_given_and_a_configs_file_must_exist(tmp_path):
    assert value("FIMBLE_MODEL", "/models/x") == "/models/x" and value("FIMBLE_MODEL", None) is None
    assert value("FIMBLE_DRAFT", "") is None  # empty: the default (the CLI's `or None`)
    refused("FIMBLE_LINEAR_CONFIGS", str(tmp_path / "missing.json"))
    sweep = tmp_path / "sweep.json"
    sweep.write_text("{}")
    assert value("FIMBLE_LINEAR_CONFIGS", str(sweep)) == str(sweep)


def test_unset_or_empty_is_the_default_and_the_defaults_are_the_call_sites_old_ones():
    for s in TABLE:
        assert value(s.name, None) == s.default and value(s.name, "") == s.default, s.name
        if s.default not in (None, ""):
            assert s.kind != "path"
    want = {
        # the switches the old code read as on unless "0" (or off/0/false/no), off unless 1
        "FIMBLE_CUDA_GRAPHS": True,
        "FIMBLE_SERVE_SLOTS": True,
        "FIMBLE_SERVE_OVERLAP": True,
        "FIMBLE_SERVE_PROMPT_MEMO": True,
        "FIMBLE_SERVE_GC_FREEZE": True,
        "FIMBLE_PROBE_CACHE": True,
        "FIMBLE_CONTEXT_WAIT": True,
        "FIMBLE_ANCHORED_LAYOUT": True,
        "FIMBLE_COLD_WINDOW": True,
        "FIMBLE_CUDA_ROW_LIMITS": True,
        "FIMBLE_ATTENTION_FIXED_TRIPS": True,
        "FIMBLE_WIDE_TILES": True,
        "FIMBLE_CUDA_PDL": "auto",  # on for layers 1,536 wide or more (measured 2026-12-06; was off before)
        "FIMBLE_Q8_0_AVX2": False,
        # choices and numbers
        "FIMBLE_RUNTIME": "auto",
        "FIMBLE_QUANT": "none",
        "FIMBLE_LOG": "warning",
        "FIMBLE_DEFAULT_MODEL": "",
        "FIMBLE_CUDA_INVARIANT": "1",
        "FIMBLE_GGML_FLASH": "auto",
        "FIMBLE_CUDA_INVARIANT_ROWS": 16,
        "FIMBLE_CUDA_PREFETCH": 2,
        "FIMBLE_GGML_THREADS": None,
        # seconds
        "FIMBLE_REQUEST_BUDGET_S": 20.0,
        "FIMBLE_ENGINE_STALL_S": 6.0,
        "FIMBLE_ENGINE_STEP_S": 30.0,
        "FIMBLE_ENGINE_PREFILL_S_PER_TOKEN": 0.1,
        "FIMBLE_ENGINE_BUSY_CEILING_S": 600.0,
        "FIMBLE_COLD_BUDGET_S": 0.5,
        "FIMBLE_REANCHOR_IDLE_S": 0.75,
        "FIMBLE_BACKGROUND_S": 1.5,
        "FIMBLE_FOLLOW_UP_WITHIN_S": 1.5,
        "FIMBLE_QUIET_AFTER_S": 1.5,
    }
    assert {name: value(name, None) for name in want} == want
    for s in TABLE:  # every default is a value its own setting takes
        if s.default not in (None, ""):
            raw = {True: "1", False: "0"}.get(s.default, str(s.default)) if s.kind == "switch" else str(s.default)
            assert value(s.name, raw) == s.default, s.name


def test_check_environment_lists_every_bad_variable_and_ignores_unknown_names():
    good = {"FIMBLE_COLD_WINDOW": "off", "FIMBLE_REQUEST_BUDGET_S": "300", "FIMBLE_E2E_MODEL": "anything", "PATH": "x"}
    assert check_environment(good) == []
    bad = {**good, "FIMBLE_REQUEST_BUDGET_S": "abc", "FIMBLE_CUDA_PDL": "2", "FIMBLE_SLOW": "whatever"}
    errors = check_environment(bad)
    assert len(errors) == 2
    assert any(e.startswith("FIMBLE_REQUEST_BUDGET_S ") for e in errors)
    assert any(e.startswith("FIMBLE_CUDA_PDL ") for e in errors)
    with pytest.raises(KeyError, match="FIMBLE_NOT_A_SETTING"):
        read("FIMBLE_NOT_A_SETTING")


def test_every_setting_has_a_meaning_and_a_kind():
    assert len(SETTINGS) == len(TABLE)  # no name twice
    for s in TABLE:
        assert s.meaning and "\n" not in s.meaning and s.kind in ("switch", "choice", "whole", "seconds", "path")
        assert re.fullmatch(r"FIMBLE_[A-Z0-9_]+", s.name)
        if s.kind in ("whole", "seconds") and not s.choices:
            assert s.low <= s.high
    assert "FIMBLE_REQUEST_BUDGET_S" in env_settings.describe()


# -- the source scan: every FIMBLE_* name the product reads is in the table -----------------------------------
SOURCES = sorted(p for folder in ("engine", "lsp_server") for p in (REPO / folder).rglob("*.py"))
READ = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\s*[\[(]|getenv\s*\()\s*["'](FIMBLE_[A-Z0-9_]+)["']""")
LITERAL = re.compile(r"""["'](FIMBLE_[A-Z0-9_]+)["']""")
PY_READ = re.compile(r"""os\.(?:environ(?:\.get)?\s*[\[(]|getenv\s*\()\s*["']FIMBLE_""")


def test_every_fimble_name_read_from_the_environment_is_in_the_table():
    read_names, literals, direct = set(), set(), []
    for path in SOURCES:
        text = path.read_text()
        read_names |= set(READ.findall(text))
        literals |= set(LITERAL.findall(text))
        if path.name != "env_settings.py" and PY_READ.search(text):
            direct.append(str(path.relative_to(REPO)))
    assert {"FIMBLE_Q8_0_AVX2", "FIMBLE_Q8_0_LANES"} <= read_names  # the C library's getenv (ggml_patch.py)
    assert read_names - set(SETTINGS) == set()
    # ... and every quoted FIMBLE_* name (PDL_ENV = "FIMBLE_CUDA_PDL", env_settings.read("...")) too
    assert literals - set(SETTINGS) == set()
    assert direct == [], "read FIMBLE_* settings through engine.env_settings.read"


def test_every_table_entry_is_read_somewhere():
    """A setting the code stopped reading leaves the table too."""
    text = "\n".join(p.read_text() for p in SOURCES if p.name != "env_settings.py")
    assert [s.name for s in TABLE if s.name not in text] == []


# -- real processes: a bad value stops the start with one line and status 2 ----------------------------------
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not (k.startswith("FIMBLE_") and k in SETTINGS)}
    return {**env, **extra}


@pytest.mark.parametrize("args", [["lsp"], ["serve", "--port", "0"], ["complete", "nowhere.py:1:1"]])
def test_fimble_with_a_bad_setting_exits_2_with_one_line(args):
    r = subprocess.run(
        [sys.executable, "-m", "lsp_server.cli", *args],
        env=_env(FIMBLE_REQUEST_BUDGET_S="abc"),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines() == ["fimble: FIMBLE_REQUEST_BUDGET_S must be seconds in 0.1..3600, not 'abc'"]


def test_fimble_names_every_bad_setting_at_once():
    r = subprocess.run(
        [sys.executable, "-m", "lsp_server", "lsp"],
        env=_env(FIMBLE_LOG="loud", FIMBLE_CUDA_INVARIANT="tritn", FIMBLE_E2E_MODEL="mine"),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 2, r.stderr
    assert lines[0].startswith("fimble: FIMBLE_LOG ") and lines[1].startswith("fimble: FIMBLE_CUDA_INVARIANT ")


def test_the_engine_child_refuses_a_bad_setting_and_its_parent_says_why(monkeypatch):
    from engine.errors import FimbleError
    from engine.process import EngineProcess

    monkeypatch.setenv("FIMBLE_COLD_BUDGET_S", "-1")
    r = subprocess.run(
        [sys.executable, "-m", "engine.process"], capture_output=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 2 and b"Traceback" not in r.stderr, r.stderr
    assert r.stderr.decode().splitlines() == [
        "fimble: FIMBLE_COLD_BUDGET_S is out of range: it must be seconds in 0..3600, not '-1'"
    ]
    with pytest.raises(FimbleError, match="FIMBLE_COLD_BUDGET_S"):  # the fatal message: a start failure explained
        EngineProcess(startup_timeout=60)
