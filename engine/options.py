"""Per-request decoding options: plain data, no torch, so the LSP process can build requests cheaply."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import PromptError

# Stop strings per request, and characters per stop string. Every step checks each stop string against the
# text so far: 100,000 of them (accepted from an editor's policy settings before this cap) made every
# completion about 10x slower. 16 covers every policy row and client seen; OpenAI's API allows 4.
MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_CONTEXT_CHARS = 64  # a syntax context's name and modifier ("block_body/mid_line")


@dataclass
class DecodeOptions:
    """Per-request decoding knobs. The LSP side's syntax policy sets these per cursor context."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    drafter: str = "auto"  # "auto" (n-gram, else draft model) | "model" | "ngram" | "none"
    gamma: int = 4  # initial draft block length
    max_gamma: int = 12
    adaptive_gamma: bool = True
    confidence_gate: float = 0.3  # the draft model stops drafting below this top probability
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    max_lines: int = 0  # 0: no limit; 1: single line
    seed: int | None = None
    # Say something: the first token after any healed text may not be a stop token (the LSP side sets it on a
    # blank line the user is on, where an editor shows nothing for an empty middle). Plain and speculative
    # decoding apply it alike, so they stay equal.
    no_empty: bool = False
    # The syntax context the options were decided for (the LSP side's policy: "comment", "call_args", ...; "":
    # none). Timing only: the engine keeps its drafters' acceptance per document and context
    # (engine/decoding/draft_plan.py AcceptanceBook), so each context's draft lengths follow its own record.
    context: str = ""

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise PromptError("max_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise PromptError("temperature must be >= 0 and top_p in (0, 1]")
        if self.drafter not in ("auto", "model", "ngram", "none"):
            raise PromptError(f"unknown drafter {self.drafter!r}: use auto, model, ngram or none")
        if self.gamma < 0 or self.max_gamma < 1:
            raise PromptError("gamma must be >= 0 and max_gamma >= 1")
        if not isinstance(self.context, str) or len(self.context) > MAX_CONTEXT_CHARS:
            raise PromptError(f"context must be a string of at most {MAX_CONTEXT_CHARS} characters")
        if len(self.stop) > MAX_STOPS or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise PromptError(f"stop must be at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
