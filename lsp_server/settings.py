"""Server settings: defaults, environment, initializationOptions and workspace/didChangeConfiguration.

Keys are camelCase on the wire (PROTOCOL.md lists them). Unknown keys and values of the
wrong type are ignored with a warning rather than failing the session.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine.policy import check_overrides  # no torch

log = logging.getLogger(__name__)

_WIRE = {  # wire name -> attribute
    "model": "model", "draft": "draft", "noDraft": "no_draft", "device": "device", "drafter": "drafter",
    "maxLines": "max_lines", "maxTokens": "max_tokens", "debounceMs": "debounce_ms",
    "earlyAnswerMs": "early_answer_ms", "enable": "enable", "streaming": "streaming",
    "prefixChars": "prefix_chars", "suffixChars": "suffix_chars", "preload": "preload", "answerAt": "answer_at",
    "engineThreads": "engine_threads", "prefetch": "prefetch", "tokenHealing": "token_healing",
    "policy": "policy", "kvCacheMB": "kv_cache_mb", "kvShiftReuse": "kv_shift_reuse", "prewarm": "prewarm",
    "prewarmDelayMs": "prewarm_delay_ms",
}
_CHOICES = {"drafter": ("auto", "model", "ngram", "none"), "answer_at": ("line", "end")}


@dataclass(frozen=True)
class Settings:
    model: str | None = None  # None: the embedded model (engine.loader.DEFAULT_TARGET)
    draft: str | None = None
    no_draft: bool = False
    device: str = "cpu"
    drafter: str = "auto"
    # Caps on what the syntax policy (engine/policy.py) decides per cursor context. The
    # defaults don't bind: the policy's largest rows are 8 lines (top_level) and 128 tokens.
    max_lines: int = 8  # 0 = no limit
    max_tokens: int = 128
    # Overrides of the policy table, passed to engine.policy.decide: {"comment": {"max_tokens":
    # 16}, "*": {"multiline": False}, ...}. Checked when set; a bad one is ignored with a warning.
    policy: dict | None = None
    debounce_ms: int = 0  # server-side wait before starting the model (type-through hits skip it)
    early_answer_ms: int = 150  # answer after this long even without a full line
    # "line": answer at the first full line (or earlyAnswerMs) and keep decoding for type-through;
    # "end": answer when the decode ends (clients that render fimble/completionDelta meanwhile).
    answer_at: str = "line"
    enable: dict[str, bool] = field(default_factory=lambda: {"*": True})
    streaming: bool = False  # send fimble/completionDelta notifications
    prefix_chars: int = 4000
    suffix_chars: int = 1000
    preload: bool = True  # start the engine at `initialized` rather than on the first request
    prefetch: bool = True  # start decoding on a keystroke, before the editor's (debounced) request
    # engine/healing.py. On: without it the embedded model answers a cursor after indentation
    # mostly with blanks and EOS. It costs first-delta latency (bench/lsp_latency.py --quick:
    # p50 5.8 -> 21.8 ms, p95 23.9 -> 62.3 ms), still inside the 30/80 ms targets.
    token_healing: bool = True
    # torch threads in the engine process (0: torch's default, one per core). One is the
    # default because the editor and this server share the cores: two OpenMP threads that
    # get preempted spin-wait, and a 10 ms step was seen to take 300-500 ms on a busy 2-core box.
    engine_threads: int = 1
    # KV caches (engine/kv_store.py): the engine keeps one per open document under one memory
    # budget. 0 = the engine's default for the device (1 GiB on CPU, a fifth of a GPU's memory).
    kv_cache_mb: int = 0
    # Also reuse cached blocks that an edit moved (keys re-rotated: approximate, not
    # token-identical to recomputing). Off: only the exact common prefix is reused.
    kv_shift_reuse: bool = False
    # Fill a document's KV cache in the background (the engine yields to completions) after
    # didOpen and once edits settle for prewarmDelayMs, so the next completion prefills little.
    prewarm: bool = True
    prewarm_delay_ms: int = 300

    @classmethod
    def from_env(cls) -> Settings:
        return cls(model=os.environ.get("FIMBLE_MODEL") or None, draft=os.environ.get("FIMBLE_DRAFT") or None)

    def engine_key(self) -> tuple:
        """Settings whose change needs a new engine process."""
        return self.model, self.draft, self.no_draft, self.device, self.engine_threads, self.kv_cache_mb

    @property
    def reuse(self) -> str:
        """The engine's KV reuse mode for requests (CompletionRequest.reuse)."""
        return "shift" if self.kv_shift_reuse else "exact"

    def enabled_for(self, language_id: str) -> bool:
        return bool(self.enable.get(language_id, self.enable.get("*", True)))

    def merged(self, options: Any) -> Settings:
        """A copy with the given wire options applied. Accepts {"fimble": {...}} or the bare dict."""
        if not isinstance(options, dict):
            return self
        if isinstance(options.get("fimble"), dict):
            options = options["fimble"]
        changes: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(self)}
        for key, value in options.items():
            attr = _WIRE.get(key)
            if attr is None:
                continue  # other tools' settings share the object
            if attr == "policy":  # replaces the previous overrides whole; null or {} clears them
                problems = check_overrides(value)
                if problems:
                    log.warning("ignoring setting policy: %s", "; ".join(problems))
                else:
                    changes["policy"] = dict(value) if value else None
                continue
            ok = _check(types[attr], value)
            if ok is None or (attr in _CHOICES and ok not in _CHOICES[attr]):
                log.warning("ignoring setting %s=%r: wrong type or value", key, value)
                continue
            changes[attr] = None if attr in ("model", "draft") and ok == "" else ok
        if isinstance(changes.get("enable"), dict):
            changes["enable"] = {**self.enable, **changes["enable"]}
        return replace(self, **changes)


def _check(kind: str, value: Any) -> Any:
    """``value`` converted to the field's type, or None if it does not fit."""
    if kind.startswith("str"):
        if value is None and "None" in kind:
            return ""  # null or "": back to the server's default model
        return value if isinstance(value, str) else None
    if kind == "bool":
        return value if isinstance(value, bool) else None
    if kind == "int":
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
    if kind.startswith("dict"):
        if isinstance(value, bool):
            return {"*": value}
        if isinstance(value, dict) and all(isinstance(v, bool) for v in value.values()):
            return dict(value)
    return None
