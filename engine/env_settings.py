"""Every ``FIMBLE_*`` environment variable fimble reads, in one table: its kind, default, range and meaning.

``read(name)`` returns a setting's typed value (its default when unset or empty) or raises ``SettingError``, one
line that names the variable, what it takes and what it got. ``check_environment()`` lists those lines for every
bad variable at once: ``fimble`` (lsp_server/cli.py) and the engine child (engine/process.py) call it first and stop
with status 2, so a typo stops the start instead of crashing an import later, being ignored, or waiting for the
first CUDA engine. Unknown ``FIMBLE_*`` names are not errors (tests and editors' scripts use their own).

Kinds: a switch (on/off: 1/0, on/off, true/false, yes/no); a choice among named values (case-insensitive); a whole
number in a range; seconds in a range; a path. Two switches are read by the patched llama.cpp library
(engine/runtimes/ggml_patch.py, with getenv): they take exactly what the C code reads, untrimmed.

Plain Python only: the LSP process imports this, and it never imports torch (tests/test_boundaries.py).
``python -m engine.env_settings`` prints the table.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OFF_WORDS = ("0", "off", "false", "no")
ON_WORDS = ("1", "on", "true", "yes")


class SettingError(ValueError):
    """A ``FIMBLE_*`` variable's value is not one its setting takes (one line, the variable named)."""


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``kind`` is "switch", "choice", "whole", "seconds" or "path"."""

    name: str
    kind: str
    default: Any
    meaning: str
    choices: tuple[str, ...] = ()  # choice: the accepted names (lower case); whole: the only numbers taken, if any
    aliases: tuple[tuple[str, str], ...] = ()  # choice: another spelling -> the name it means
    low: float = 0.0  # whole/seconds: the range, both ends included
    high: float = 0.0
    zero: bool = False  # seconds: 0 (off) is taken too, below ``low``
    exact: bool = False  # read by C code (getenv): taken as given, no trimming or case folding; switches 0/1 only
    file: bool = False  # path: must name an existing file

    def expects(self) -> str:
        """What the setting takes, for messages: "seconds in 0.1..3600"."""
        if self.kind == "switch":
            return "0 or 1" if self.exact else "0 or 1 (or off/on, false/true, no/yes)"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "whole":
            return (
                "one of " + ", ".join(self.choices)
                if self.choices
                else f"a whole number in {_num(self.low)}..{_num(self.high)}"
            )
        if self.kind == "seconds":
            span = f"seconds in {_num(self.low)}..{_num(self.high)}"
            return f"0 or {span}" if self.zero else span
        return "the path of an existing file" if self.file else "a path"

    def parse(self, raw: str | None) -> Any:
        """``raw`` (the variable's text, None when unset) as this setting's value; SettingError if it takes none."""
        text = raw if self.exact or raw is None else raw.strip()
        if not text:
            return self.default
        if self.kind == "switch":
            word = text if self.exact else text.lower()
            if word in (("1",) if self.exact else ON_WORDS):
                return True
            if word in (("0",) if self.exact else OFF_WORDS):
                return False
        elif self.kind == "choice":
            word = text if self.exact else text.lower()
            word = dict(self.aliases).get(word, word)
            if word in self.choices:
                return word
        elif self.kind in ("whole", "seconds"):
            return self._number(text)
        elif not self.file or os.path.isfile(text):
            return text
        raise SettingError(f"{self.name} must be {self.expects()}, not {text!r}")

    def _number(self, text: str) -> int | float:
        try:
            value: int | float = int(text) if self.kind == "whole" else float(text)
        except ValueError:
            raise SettingError(f"{self.name} must be {self.expects()}, not {text!r}") from None
        if self.choices:
            ok = str(value) in self.choices
        else:
            ok = self.low <= value <= self.high or (self.zero and value == 0)  # (NaN is in no range)
        if not ok:
            raise SettingError(f"{self.name} is out of range: it must be {self.expects()}, not {text!r}")
        return value


def _num(x: float) -> str:
    return f"{x:g}"


def switch(name: str, default: bool, meaning: str, *, exact: bool = False) -> Setting:
    return Setting(name, "switch", default, meaning, exact=exact)


def choice(name: str, default: str, choices: tuple[str, ...], meaning: str, **kw: Any) -> Setting:
    return Setting(name, "choice", default, meaning, choices=choices, **kw)


def whole(name: str, default: int | None, low: int, high: int, meaning: str, **kw: Any) -> Setting:
    return Setting(name, "whole", default, meaning, low=low, high=high, **kw)


def seconds(name: str, default: float, low: float, high: float, meaning: str, *, zero: bool = False) -> Setting:
    return Setting(name, "seconds", default, meaning, low=low, high=high, zero=zero)


def path(name: str, meaning: str, *, file: bool = False) -> Setting:
    return Setting(name, "path", None, meaning, file=file)


LOG_LEVELS = ("debug", "info", "warning", "warn", "error", "critical", "fatal", "notset")  # logging's level names
_INVARIANT_ALIASES = tuple((w, "0") for w in OFF_WORDS[1:]) + tuple((w, "1") for w in ON_WORDS[1:])

# The table. Defaults and meanings are those of the code that reads each one (named at the end of each meaning).
TABLE: tuple[Setting, ...] = (
    # -- models and logging --------------------------------------------------------------------------------------
    path("FIMBLE_MODEL", "model folder or GGUF file: --model's default (lsp_server/cli.py, settings.py)"),
    path("FIMBLE_DRAFT", "draft model folder: --draft's default (lsp_server/cli.py, settings.py)"),
    choice(
        "FIMBLE_DEFAULT_MODEL",
        "",
        ("embedded", "smollm2", "qwen", "qwen-instruct", "qwen-1.5b"),
        "pins the model used when none is named; unset: the best one installed (engine/model_info.py)",
    ),
    choice("FIMBLE_LOG", "warning", LOG_LEVELS, "log level: --log-level's default, and the engine child's"),
    path("FIMBLE_RUNTIME_DIR", "folder of listeners' token files; unset: $XDG_RUNTIME_DIR/fimble (engine/auth.py)"),
    path("FIMBLE_CACHE_DIR", "cache folder (probes, GGUFs); unset: $XDG_CACHE_HOME/fimble (runtimes/probe_cache.py)"),
    switch("FIMBLE_PROBE_CACHE", True, "keep load-time probe results between starts (runtimes/probe_cache.py)"),
    # -- runtime choice and the CPU (llama.cpp) runtime --------------------------------------------------------
    choice(
        "FIMBLE_RUNTIME",
        "auto",
        ("auto", "compact", "ggml"),
        "forward-pass runtime; auto: ggml on the CPU where its library is built, else compact (engine/loader.py)",
    ),
    choice("FIMBLE_QUANT", "none", ("none", "int8"), "int8 weights on the CPU's compact runtime (engine/local.py)"),
    whole(
        "FIMBLE_GGML_THREADS",
        None,
        1,
        256,
        "ggml threads; unset: $OMP_NUM_THREADS, else 1 (2 cores or fewer) or 2 (runtimes/ggml_runtime.py)",
    ),
    choice(
        "FIMBLE_GGML_FLASH",
        "auto",
        ("auto", "on", "off"),
        "llama.cpp flash attention; auto is off (runtimes/ggml_runtime.py)",
    ),
    choice(
        "FIMBLE_GGML_LIB",
        "",
        ("llama-cpp-python", "py-sync"),
        "llama.cpp binding to load; unset: each in turn (runtimes/ggml_lib.py)",
    ),
    switch(
        "FIMBLE_Q8_0_AVX2",
        False,
        "1: stock llama.cpp's q8_0 order, not the lane-order kernel (the C library: runtimes/ggml_patch.py)",
        exact=True,
    ),
    switch(
        "FIMBLE_Q8_0_PACK",
        True,
        "0: q8_0 weights stay blocks, not packed in the lane order at load (C library: runtimes/ggml_patch_packed.py)",
        exact=True,
    ),
    choice(
        "FIMBLE_Q8_0_LANES",
        "",
        ("avx2",),
        "avx2: the AVX2 lane kernel on an AVX-512 VNNI CPU; unset: the CPU's best (C library: ggml_patch.py)",
        exact=True,
    ),
    # -- CUDA --------------------------------------------------------------------------------------------------
    switch("FIMBLE_CUDA_GRAPHS", True, "replay CUDA graphs for decode steps (engine/loader.py)"),
    choice(
        "FIMBLE_CUDA_INVARIANT",
        "1",
        ("0", "1", "triton", "cublas"),
        "batch-invariant kernel set: 1 = the default (triton; fimble serve: cublas), 0 = off (runtimes/gpu_kernels.py)",
        aliases=_INVARIANT_ALIASES,
    ),
    # A row multiple cuBLAS projections are padded to: 16 makes every pass of 1-16 tokens one shape; far more rows
    # only pads passes with rows nobody reads.
    whole("FIMBLE_CUDA_INVARIANT_ROWS", 16, 1, 256, "cublas set: rows every projection pads to (gpu_kernels.py)"),
    switch("FIMBLE_CUDA_ROW_LIMITS", True, "cublas set: probed rows per product and base padding (row_limits.py)"),
    switch(
        "FIMBLE_ATTENTION_FIXED_TRIPS",
        True,
        "attention split loops of fixed trip count; 0: the bounded loop (runtimes/gpu_kernels.py)",
    ),
    choice(
        "FIMBLE_CUDA_PDL",
        "auto",
        ("auto", "on", "off", "1", "0"),
        "programmatic dependent launch of Triton kernels; auto: layers 1,536 wide or more (runtimes/gpu_linear.py)",
    ),
    whole(
        "FIMBLE_CUDA_PREFETCH",
        2,
        0,
        4,
        "weight slabs a dependent projection prefetches into L2 (runtimes/gpu_linear.py)",
        choices=("0", "1", "2", "4"),
    ),
    path(
        "FIMBLE_LINEAR_CONFIGS",
        "a bench/gpu_linear.py sweep (JSON) of Triton product configs (runtimes/gpu_linear.py)",
        file=True,
    ),
    switch("FIMBLE_WIDE_TILES", True, "wide prefill tiles where probed equal; 0: 16-row tiles (gpu_linear.py)"),
    # -- fimble serve --------------------------------------------------------------------------------------------
    switch("FIMBLE_SERVE_SLOTS", True, "CUDA: batched rounds replay one graph over slots (serve/scheduler.py)"),
    switch("FIMBLE_SERVE_OVERLAP", True, "CUDA: a round's host work overlaps its passes (serve/scheduler.py)"),
    # Off by default: at 32 editors on an H100 (2026-12-07) fed rounds gave 0.8x the plain loop's tok/s, since drafting
    # sequences and new requests sit out a round each (docs/decisions.md, fed rounds).
    # A keystroke's last prefill pass (its new tokens and the heal draft) is cut to this many rows in a slotted round
    # (engine/steps.py _prefill): a longer pass pads every slot of the round's graph to its block. 0: no cap.
    whole("FIMBLE_SERVE_TAIL_ROWS", 0, 0, 16, "slotted rounds: rows of a keystroke's last prefill pass (steps.py)"),
    switch("FIMBLE_SERVE_FEED", False, "CUDA: the next round launched before this one is read (fed_rounds.py)"),
    switch("FIMBLE_SERVE_PROMPT_MEMO", True, "build a prompt from the editor's previous one (serve/scheduler.py)"),
    switch("FIMBLE_SERVE_GC_FREEZE", True, "freeze start-up objects out of the collector (serve/gc_pauses.py)"),
    # -- prompts and caches ----------------------------------------------------------------------------------
    switch("FIMBLE_CONTEXT_WAIT", True, "cross-file context only once it costs no prefill (engine/documents.py)"),
    switch("FIMBLE_ANCHORED_LAYOUT", True, "the anchored prompt layout while typing (engine/scheduler.py)"),
    switch("FIMBLE_COLD_WINDOW", True, "answer a spot with no cached prompt from a small one (engine/scheduler.py)"),
    # Prefill the cold window spares; a budget past any prefill turns it off in effect (bench/quality.py: 3600).
    seconds("FIMBLE_COLD_BUDGET_S", 0.5, 0, 3600, "prefill a first completion at a new spot may cost (cold_window.py)"),
    seconds("FIMBLE_REANCHOR_IDLE_S", 0.75, 0, 600, "idle time before an anchored prompt re-anchors (background.py)"),
    seconds(
        "FIMBLE_BACKGROUND_S", 1.5, 0, 600, "background work runs this long after the last message (background.py)"
    ),
    # -- the LSP side's time limits --------------------------------------------------------------------------
    # Up to an hour: a large model on a loaded CPU takes minutes for a first prompt (a test waits 900 s on one).
    seconds("FIMBLE_REQUEST_BUDGET_S", 20.0, 0.1, 3600, "longest a request waits on a running engine (answer.py)"),
    seconds("FIMBLE_ENGINE_STALL_S", 6.0, 0.1, 3600, "pinged, silent this long and idle: stalled (engine_host.py)"),
    # Down to 0.01 s: tests make every request stuck at once.
    seconds(
        "FIMBLE_ENGINE_STEP_S", 30.0, 0.01, 3600, "a request this long without progress, idle: stuck (engine_host.py)"
    ),
    seconds(
        "FIMBLE_ENGINE_PREFILL_S_PER_TOKEN", 0.1, 0, 60, "... plus this per announced prompt token (engine_host.py)"
    ),
    seconds(
        "FIMBLE_ENGINE_BUSY_CEILING_S", 600.0, 0.1, 3600, "computing with no sign this long: runaway (engine_host.py)"
    ),
    seconds(
        "FIMBLE_FOLLOW_UP_WITHIN_S", 1.5, 0, 600, "Tab-Tab's follow-up starts only this soon after an edit (decodes.py)"
    ),
    # 0: never; otherwise at least half a second (the range lsp_server/decodes.py took before this table).
    seconds(
        "FIMBLE_QUIET_AFTER_S",
        1.5,
        0.5,
        600,
        "a decode nobody waits on stops this long after the last key; 0: never (lsp_server/decodes.py)",
        zero=True,
    ),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in TABLE}


def setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not in engine/env_settings.py's table") from None


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """``name``'s value from the environment (``os.environ`` unless given), its default when unset or empty."""
    return setting(name).parse((os.environ if environ is None else environ).get(name))


def given(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` is set to something (a bad value raises, as ``read`` does)."""
    read(name, environ)
    return bool((os.environ if environ is None else environ).get(name, "").strip())


def check_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """One message per table variable whose value its setting does not take (none: an empty list)."""
    environ = os.environ if environ is None else environ
    errors = []
    for s in TABLE:
        try:
            s.parse(environ.get(s.name))
        except SettingError as exc:
            errors.append(str(exc))
    return errors


def log_level(environ: Mapping[str, str] | None = None) -> int:
    """FIMBLE_LOG as a ``logging`` level."""
    return int(getattr(logging, read("FIMBLE_LOG", environ).upper()))


def describe() -> str:
    """The table as text: name, what it takes, default, meaning."""
    lines = []
    for s in TABLE:
        if s.kind == "switch":
            default = "on" if s.default else "off"
        else:
            default = "unset" if s.default in (None, "") else s.default
        lines.append(f"{s.name}  ({s.expects()}; default {default})\n    {s.meaning}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
