"""Server settings: defaults, environment, initializationOptions and workspace/didChangeConfiguration.

Keys are camelCase on the wire (PROTOCOL.md lists them). Unknown keys are ignored. A value of
the wrong type keeps the previous value, a number out of range is clamped into it; either way
``merge`` returns one line naming the setting, which the server shows the user.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine import env_settings
from lsp_server.shaping.policy import check_overrides  # no torch

log = logging.getLogger(__name__)

_WIRE = {  # wire name -> attribute
    "model": "model",
    "draft": "draft",
    "noDraft": "no_draft",
    "device": "device",
    "drafter": "drafter",
    "maxLines": "max_lines",
    "maxTokens": "max_tokens",
    "debounceMs": "debounce_ms",
    "earlyAnswerMs": "early_answer_ms",
    "enable": "enable",
    "streaming": "streaming",
    "lineStartAnswers": "line_start",
    "prefixChars": "prefix_chars",
    "suffixChars": "suffix_chars",
    "preload": "preload",
    "answerAt": "answer_at",
    "engineThreads": "engine_threads",
    "prefetch": "prefetch",
    "tokenHealing": "token_healing",
    "policy": "policy",
    "kvCacheMB": "kv_cache_mb",
    "kvShiftReuse": "kv_shift_reuse",
    "prewarm": "prewarm",
    "prewarmDelayMs": "prewarm_delay_ms",
    "languages": "languages",
    "crossFileContext": "cross_file_context",
    "crossFileSources": "cross_file_sources",
    "crossFileBudget": "cross_file_budget",
}
CROSS_FILE_SOURCES = ("openFiles", "imports", "recentEdits")  # lsp_server/context/service.py
_CHOICES = {"drafter": ("auto", "model", "ngram", "none"), "answer_at": ("line", "end")}
# Integer settings: (lowest, highest). Why bounds at all: 10**400 ms overflowed float
# conversions in every request, and a debounce of 10**12 ms left requests unanswered.
_RANGES = {
    "max_lines": (0, 1000),
    "max_tokens": (0, 4096),
    "debounce_ms": (0, 2_000),
    "early_answer_ms": (0, 10_000),
    "prefix_chars": (0, 1_000_000),
    "suffix_chars": (0, 1_000_000),
    "engine_threads": (0, 1024),
    "kv_cache_mb": (0, 1 << 20),
    "prewarm_delay_ms": (0, 60_000),
    "cross_file_budget": (0, 4096),
}
# Upper bounds of the policy override fields that lsp_server/shaping/policy.py checks only from below.
_POLICY_MAX = {"temperature": 10.0, "gamma": 64, "max_gamma": 64, "max_tokens": 4096, "max_lines": 1000}
_DEVICE = re.compile(r"(cpu|mps|cuda(:\d{1,2})?)")
MAX_PATH_CHARS = 4096
MODEL_UNUSABLE = "model not found or not usable"


def usable_model_folder(path: str) -> bool:
    """A folder with a config.json: the least a model folder has (the engine checks the rest)."""
    try:
        return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Settings:
    model: str | None = None  # None: the default model (engine.model_info.default_target)
    draft: str | None = None
    no_draft: bool = False
    device: str = "cpu"
    drafter: str = "auto"
    # Caps on what the syntax policy (lsp_server/shaping/policy.py) decides per cursor context. The
    # defaults don't bind: the policy's largest rows are 8 lines (top_level) and 128 tokens.
    max_lines: int = 8  # 0 = no limit
    max_tokens: int = 128
    # Overrides of the policy table, passed to lsp_server.shaping.policy.decide: {"comment": {"max_tokens":
    # 16}, "*": {"multiline": False}, ...}. Checked when set; a bad one is ignored with a warning.
    policy: dict | None = None
    debounce_ms: int = 0  # server-side wait before starting the model (type-through hits skip it)
    early_answer_ms: int = 150  # answer after this long even without a full line
    # "line": answer at the first full line (or earlyAnswerMs) and keep decoding for type-through;
    # "end": answer when the decode ends (clients that render fimble/completionDelta meanwhile).
    answer_at: str = "line"
    enable: dict[str, bool] = field(default_factory=lambda: {"*": True})
    # Language ids to complete (PROTOCOL.md "Languages"): the user's list, or None to follow the
    # model's own list (``model_languages``, from its fimble.json; None there too: every language).
    languages: tuple[str, ...] | None = None
    model_languages: tuple[str, ...] | None = None  # set by the server from the model folder, not a wire key
    streaming: bool = False  # send fimble/completionDelta notifications
    # Decode from the start of an indentation-only line, so the model may dedent: an answer's range then starts
    # at the line's start (lsp_server/line_start.py). On if the client's capabilities say it can show that
    # (``experimental.fimble.replaceStart``): a range before the cursor is not every client's.
    line_start: bool = False
    prefix_chars: int = 4000
    suffix_chars: int = 1000
    preload: bool = True  # start the engine at `initialized` rather than on the first request
    prefetch: bool = True  # start decoding on a keystroke, before the editor's (debounced) request
    # engine/decoding/healing.py. On: without it the embedded model answers a cursor after indentation
    # mostly with blanks and EOS. It costs first-delta latency (bench/lsp_latency.py --quick:
    # p50 5.8 -> 21.8 ms, p95 23.9 -> 62.3 ms), still inside the 30/80 ms targets.
    token_healing: bool = True
    # torch threads in the engine process (0: torch's default, one per core). One is the
    # default because the editor and this server share the cores: two OpenMP threads that
    # get preempted spin-wait, and a 10 ms step was seen to take 300-500 ms on a busy 2-core box.
    engine_threads: int = 1
    # KV caches (engine/caching/kv_store.py): the engine keeps one per open document under one memory
    # budget. 0 = the engine's default for the device (1 GiB on CPU, a fifth of a GPU's memory).
    kv_cache_mb: int = 0
    # Also reuse cached blocks that an edit moved (keys re-rotated: approximate, not
    # token-identical to recomputing). Off: only the exact common prefix is reused.
    kv_shift_reuse: bool = False
    # Fill a document's KV cache in the background (the engine yields to completions) after
    # didOpen and once edits settle for prewarmDelayMs, so the next completion prefills little.
    prewarm: bool = True
    prewarm_delay_ms: int = 300
    # Other files' code before the file's own prompt (lsp_server/context/): chunks of open documents of the
    # same language, definitions of imported names (open, or on disk inside the workspace folders), recent
    # edits. At most ``cross_file_budget`` tokens; never sent to a remote engine or a shared daemon.
    cross_file_context: bool = True
    cross_file_sources: tuple[str, ...] = CROSS_FILE_SOURCES
    cross_file_budget: int = 512
    # A non-local engine chosen on the command line (--engine): an engine.remote.RemoteSpec, or the
    # shared daemon's spec. Not a wire key: a client never picks the server the code is sent to.
    engine_spec: Any = None

    @classmethod
    def from_env(cls) -> Settings:
        return cls(model=env_settings.read("FIMBLE_MODEL"), draft=env_settings.read("FIMBLE_DRAFT"))

    def engine_key(self) -> tuple:
        """Settings whose change needs a new engine process."""
        return (
            self.model,
            self.draft,
            self.no_draft,
            self.device,
            self.engine_threads,
            self.kv_cache_mb,
            self.engine_spec,
        )

    @property
    def reuse(self) -> str:
        """The engine's KV reuse mode for requests (CompletionRequest.reuse)."""
        return "shift" if self.kv_shift_reuse else "exact"

    @property
    def effective_languages(self) -> tuple[str, ...] | None:
        """The language ids served (None: every language): the ``languages`` setting, else the model's."""
        langs = self.languages if self.languages is not None else self.model_languages
        return None if langs is None or "*" in langs else langs

    def enabled_for(self, language_id: str) -> bool:
        if language_id in self.enable:  # an explicit entry wins over the language list
            return bool(self.enable[language_id])
        langs = self.effective_languages
        if langs is not None and language_id not in langs:
            return False
        return bool(self.enable.get("*", True))

    def merged(self, options: Any) -> Settings:
        return self.merge(options)[0]

    def merge(self, options: Any) -> tuple[Settings, list[str]]:
        """A copy with the given wire options applied, and one line per bad value (named by its wire key).

        Accepts {"fimble": {...}} or the bare dict.
        """
        if not isinstance(options, dict):
            return self, []
        if isinstance(options.get("fimble"), dict):
            options = options["fimble"]
        changes: dict[str, Any] = {}
        problems: list[str] = []
        types = {f.name: f.type for f in fields(self)}
        for key, value in options.items():
            attr = _WIRE.get(key)
            if attr is None:
                continue  # other tools' settings share the object
            if attr == "languages":  # a list of language ids; null: follow the model
                if value is None or (
                    isinstance(value, list)
                    and len(value) <= 256
                    and all(isinstance(v, str) and 0 < len(v) <= 64 for v in value)
                ):
                    changes["languages"] = None if value is None else tuple(dict.fromkeys(value))
                else:
                    problems.append("languages: expected a list of language ids or null; keeping the previous value")
                continue
            if attr == "cross_file_sources":  # a list of source names
                if isinstance(value, list) and len(value) <= 16 and all(v in CROSS_FILE_SOURCES for v in value):
                    changes[attr] = tuple(dict.fromkeys(value))
                else:
                    problems.append(
                        f"crossFileSources: expected a list of {', '.join(CROSS_FILE_SOURCES)}; "
                        "keeping the previous value"
                    )
                continue
            if attr == "policy":  # replaces the previous overrides whole; null or {} clears them
                bad = _policy_over_max(value) or check_overrides(value)  # first: 10**400 overflows float()
                if bad:
                    problems.append(f"policy: {'; '.join(bad)[:500]}; keeping the previous overrides")
                else:
                    changes["policy"] = dict(value) if value else None
                continue
            ok = _check(types[attr], value)
            if ok is None or (attr in _CHOICES and ok not in _CHOICES[attr]) or not _fits(attr, ok):
                problems.append(
                    f"{key}: {_expected(attr, types[attr])}, got {_shown(value)}; keeping {_shown(getattr(self, attr))}"
                )
                continue
            if attr in _RANGES:
                low, high = _RANGES[attr]
                if not low <= ok <= high:
                    clamped = min(max(ok, low), high)
                    problems.append(f"{key}: {_shown(ok)} is outside {low}..{high}; using {clamped}")
                    ok = clamped
            changes[attr] = None if attr in ("model", "draft") and ok == "" else ok
        if isinstance(changes.get("enable"), dict):
            changes["enable"] = {**self.enable, **changes["enable"]}
        for line in problems:
            log.warning("setting %s", line)
        return replace(self, **changes), problems


def _fits(attr: str, value: Any) -> bool:
    """Checks beyond the type: a device torch knows, a sane path, a bounded ``enable`` table."""
    if attr == "device":
        return _DEVICE.fullmatch(value) is not None
    if attr in ("model", "draft"):
        return len(value) <= MAX_PATH_CHARS and "\x00" not in value
    if attr == "enable":
        return len(value) <= 256 and all(isinstance(k, str) and len(k) <= 64 for k in value)
    return True


def _expected(attr: str, kind: str) -> str:
    if attr in _CHOICES:
        return "expected one of " + ", ".join(_CHOICES[attr])
    if attr in _RANGES:
        return f"expected an integer from {_RANGES[attr][0]} to {_RANGES[attr][1]}"
    if attr == "device":
        return "expected cpu, cuda, cuda:N or mps"
    if attr == "enable":
        return "expected true, false or an object of language id -> true/false"
    return {"bool": "expected true or false"}.get(kind, "expected a string (or null for the default)")


def _shown(value: Any) -> str:
    """A value for a message: short (a 10**400 has 401 digits)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _policy_over_max(overrides: dict | None) -> list[str]:
    """Policy values lsp_server/shaping/policy.py would accept but that break decoding (temperature 1e308, 10**400)."""
    problems = []
    rows = overrides.items() if isinstance(overrides, dict) else ()
    for key, row in rows:
        for name, value in row.items() if isinstance(row, dict) else ():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            high = _POLICY_MAX.get(name, 1)  # the others (top_p, confidence_gate) are fractions
            if (isinstance(value, float) and not math.isfinite(value)) or value > high:
                problems.append(f"{key}.{name}: {_shown(value)} is over {high}")
    return problems


def _check(kind: str, value: Any) -> Any:
    """``value`` converted to the field's type, or None if it does not fit."""
    if kind.startswith("str"):
        if value is None and "None" in kind:
            return ""  # null or "": back to the server's default model
        return value if isinstance(value, str) else None
    if kind == "bool":
        return value if isinstance(value, bool) else None
    if kind == "int":
        return value if isinstance(value, int) and not isinstance(value, bool) else None  # range: _RANGES
    if kind.startswith("dict"):
        if isinstance(value, bool):
            return {"*": value}
        if isinstance(value, dict) and all(isinstance(v, bool) for v in value.values()):
            return dict(value)
    return None
