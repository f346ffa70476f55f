"""A lower bound on a prompt's tokens that costs at most about a context's worth of tokenising.

Why: the prompt builder (engine/caching/prompt_plan.py) tokenises all of a request's text before it refuses a
prompt that does not fit the context. In ``fimble serve``'s decode loop a 3.9M-character prompt took 21 s to be
refused, and another client's completion waited 21.3 s behind it. With this bound the scheduler refuses such a
prompt having tokenised about a context's worth of it (engine/scheduler.py ``refuse_unfit``). Requests that
may be truncated (``truncate=True``) are never refused: the builder cuts them to fit.

What is counted, and why it is a lower bound of what the builder counts against the context:
- Only the prefix. Every template puts all of it in the prompt (the suffix may be cut: PSM keeps its first 256
  tokens, prefix-only templates drop it), before the middle sentinel or, for the cursor's line, after it; the
  builder checks prefix, suffix and that line together against the context. Token healing
  (engine/decoding/healing.py ``split_heal``) takes at most a few dozen characters, or the last line's
  whitespace, off the end (``_kept_by_healing``): the text before that is all tokenised.
- Spelling: a byte-level BPE token (every fimble model's tokenizer) spells at most ``max_bytes`` bytes, the
  longest in its vocabulary, so ``n`` bytes take at least n / max_bytes tokens, however the text is cut into
  pieces. With an NFC normalizer (Qwen's) that holds for text already in NFC (any ASCII); other text may shrink,
  NFC composing up to 4 code points into one character (U+1FAF decomposes into 4, the most in Unicode 14), so
  it counts characters / (4 x max_bytes). Other tokenizers: no claim (0), a weaker bound, never a wrong one.
  This alone refuses a 3.9M-character prompt at once at a 4k or 8k context, but only prompts over 4.2M
  characters at Qwen's 32k.
- Counting: the builder tokenises the prefix in line pieces (``LINE_CUT``) and sums their counts. The bound
  tokenises the same pieces from the start and stops once past the limit, so it tokenises about a context's
  worth; it takes only pieces that end at a cut point at least ``MAX_ANCHOR_HEAD_CHARS`` before the prefix's end
  (the cursor's line, or an anchored head of at most that many characters, is tokenised on its own after the
  middle sentinel; healing never reaches a cut point, which has a non-space character before it). A piece over
  ``LONG_PIECE_CHARS`` and the text after the last such cut point count by spelling instead. Pieces go through
  the builder's own memo, so a prompt that fits is not tokenised twice.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.api import CompletionRequest
from engine.caching.prompt_plan import LINE_CUT, MAX_ANCHOR_HEAD_CHARS, PromptBuilder
from engine.decoding.healing import MAX_HEAL_CHARS, MAX_NEWLINE_HEAL_CHARS

LONG_PIECE_CHARS = 16_384  # a longer line piece is bounded by its length instead of tokenised
NFC_MAX_MERGE = 4  # code points NFC can compose into one character


@dataclass(frozen=True)
class TokenSpan:
    """How much text one token can spell, where that is known."""

    max_bytes: int | None  # None: unknown (not byte-level BPE, or a normalizer that may drop characters)
    nfc: bool = False  # the tokenizer composes to NFC first


class UnfitCheck:
    """For one model and its prompt builder: why a request cannot fit the context, found before it is tokenised
    whole (Scheduler.refuse_unfit, engine/scheduler.py), or None where it may fit."""

    def __init__(self, target: Any, prompts: PromptBuilder):
        self.target, self.prompts = target, prompts
        self._span: TokenSpan | None = None  # read from the tokenizer on first use

    def reason(self, request: CompletionRequest) -> str | None:
        limit = self.target.max_len - request.options.max_tokens - 8  # the builder's budget (prompt_plan.py)
        if request.truncate or len(request.prefix) <= limit:  # a short prefix costs little to build
            return None
        if self._span is None:
            self._span = token_span(self.target.tokenizer)
        if prefix_tokens_at_least(request.prefix, self._encode, limit, self._span) <= limit:
            return None
        return (
            f"prompt of more than {limit} tokens does not fit the model's context of {self.target.max_len} "
            f"with {request.options.max_tokens} new tokens"
        )

    def _encode(self, text: str) -> list[int]:
        return self.prompts._encode(text)[0]  # the builder's memo: a prompt that fits is not tokenised twice


def token_span(tokenizer: object) -> TokenSpan:
    """What ``tokenizer`` (transformers' fast tokenizer, or engine/runtimes/bpe_tokenizer.py's) allows."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        if backend is None or type(backend.model).__name__ != "BPE":
            return TokenSpan(None)
        normalizer = backend.normalizer
        kind = None if normalizer is None else type(normalizer).__name__
        pre = backend.pre_tokenizer
        if kind not in (None, "NFC") or pre is None or '"ByteLevel"' not in json.dumps(json.loads(pre.__getstate__())):
            return TokenSpan(None)
        # A byte-level vocabulary spells each byte as one character; added tokens are plain text.
        longest = max((len(text) for text in backend.get_vocab(with_added_tokens=False)), default=0)
        added = backend.get_added_tokens_decoder().values()
        longest = max([longest, *(len(t.content.encode("utf-8")) for t in added)])
        return TokenSpan(longest or None, nfc=kind == "NFC")
    except Exception:  # a tokenizer of another shape: no claim about it
        return TokenSpan(None)


def prefix_tokens_at_least(prefix: str, encode: Callable[[str], list[int]], limit: int, span: TokenSpan) -> int:
    """A lower bound on the tokens the prompt builder makes of ``prefix`` (see the module doc); counting stops
    once past ``limit``, so the result is exact up to there, and only "more than ``limit``" beyond."""
    kept = _kept_by_healing(prefix)
    whole = _spelled_at_least(prefix[:kept], span)  # no tokenising: often enough on its own
    if whole > limit:
        return whole
    total, start = 0, 0
    for cut in LINE_CUT.finditer(prefix, 0, max(0, len(prefix) - MAX_ANCHOR_HEAD_CHARS)):
        piece = prefix[start : cut.start()]
        start = cut.start()
        total += _spelled_at_least(piece, span) if len(piece) > LONG_PIECE_CHARS else len(encode(piece))
        if total > limit:
            return total
    return total + _spelled_at_least(prefix[start:kept], span)  # the rest, however the builder cuts it


def _kept_by_healing(prefix: str) -> int:
    """A length token healing never cuts ``prefix`` below (engine/decoding/healing.py ``split_heal`` takes off at
    most MAX_NEWLINE_HEAL_CHARS of trailing whitespace, the whitespace after the last line break, or at most
    MAX_HEAL_CHARS of the last line)."""
    line_break = prefix.rfind("\n")
    at_most = len(prefix) - max(MAX_NEWLINE_HEAL_CHARS, MAX_HEAL_CHARS)
    return max(0, min(at_most, line_break) if line_break >= 0 else at_most)


def _spelled_at_least(text: str, span: TokenSpan) -> int:
    """The fewest tokens that can spell ``text`` (a byte-level BPE token spells at most ``max_bytes`` bytes)."""
    if span.max_bytes is None or not text:
        return 0
    if span.nfc and not unicodedata.is_normalized("NFC", text):  # (ASCII, most code, always is)
        return len(text) // (NFC_MAX_MERGE * span.max_bytes)
    return len(text.encode("utf-8", "surrogatepass")) // span.max_bytes
