"""Token healing: the cursor rarely sits on a token boundary the model saw in training.

A prefix ending in indentation ("...:\\n        ") or mid-word ("os.pa") tokenises
into a last token the model would almost never have been followed by what comes
next. So we take that tail off the prompt and make the first generated tokens
re-type it: each must start with the removed text, or be a prefix of it. The
removed text is then cut from what is shown. Plain and speculative decoding
apply the same constraint, so their outputs stay identical.
"""

from __future__ import annotations

import bisect
import heapq
import threading

import numpy as np

MAX_HEAL_CHARS = 24
SORT_RUN = 8192  # TokenIndex.build sorts this many token texts per C call
# Newline healing re-types the prefix's trailing line break(s) and indentation, up to this long.
MAX_NEWLINE_HEAL_CHARS = 64


class TokenIndex:
    """Each token's text, searchable by prefix.

    Sorting Qwen's 151,936 token texts for the prefix search takes about 1 s on a 2-core CPU, which the first
    completion used to wait for. So queries scan the texts (tens of ms) until ``build()`` has sorted them (a
    long-lived engine calls ``build_soon()`` once it is up); both answer the same, in the same order."""

    def __init__(self, tokenizer, decoded: list[str] | None = None):
        """``decoded``: every token's text (``token_texts(tokenizer)``), where the caller kept it."""
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        if decoded is None:
            decoded = token_texts(tokenizer)
        self._decoded, self._special = decoded, special
        self.text = TokenTexts(decoded, special)
        # (ids sorted by text, their texts, text -> ids, the sorted ids as an array): set once, whole, by build()
        self._index: tuple[list[int], list[str], dict[str, list[int]], np.ndarray] | None = None
        self._build_lock = threading.Lock()

    @property
    def built(self) -> bool:
        return self._index is not None

    def build(self) -> None:
        """Sort the texts for the prefix search (index sorts, not tuples: this runs over every token)."""
        with self._build_lock:
            if self._index is not None:
                return
            decoded = self._decoded
            # Tokens that are part of a multi-byte character never match plain text.
            keep = [tid for tid, t in enumerate(decoded) if t and "\ufffd" not in t and tid not in self._special]
            # Sorted in runs merged in Python, not in one sort: one C call would hold the GIL for the whole sort
            # (~0.3 s), stalling a completion decoding beside it. Stable, as one sort: equal texts keep id order.
            runs = [sorted(keep[a : a + SORT_RUN], key=decoded.__getitem__) for a in range(0, len(keep), SORT_RUN)]
            sorted_ids = list(heapq.merge(*runs, key=decoded.__getitem__))
            sorted_texts = [decoded[i] for i in sorted_ids]
            by_text: dict[str, list[int]] = {}
            for t, i in zip(sorted_texts, sorted_ids, strict=True):
                by_text.setdefault(t, []).append(i)
            self._index = (sorted_ids, sorted_texts, by_text, np.asarray(sorted_ids, dtype=np.int64))

    def build_soon(self) -> threading.Thread:
        """``build()`` on a daemon thread (an engine that serves many requests; one-shot callers scan)."""
        thread = threading.Thread(target=self.build, name="fimble-token-index", daemon=True)
        thread.start()
        return thread

    def _kept(self, tid: int) -> bool:
        t = self._decoded[tid]
        return bool(t) and "\ufffd" not in t and tid not in self._special

    def spell(self, text: str, limit: int = 8) -> list[int]:
        """Up to ``limit`` tokens that spell ``text`` exactly, each the longest token text that fits (the usual
        tokenisation of a word); stops where no token fits. A guess, checked by the model (heal drafts)."""
        index = self._index
        if index is not None:
            by_text = index[2]
        else:  # before build(): the lowest id of each token text inside ``text`` (what by_text[t][0] is)
            by_text = {}
            for tid, t in enumerate(self._decoded):
                if t and t in text and t not in by_text and self._kept(tid):
                    by_text[t] = [tid]
        out: list[int] = []
        at = 0
        while at < len(text) and len(out) < limit:
            for n in range(len(text) - at, 0, -1):
                ids = by_text.get(text[at : at + n])
                if ids:
                    out.append(ids[0])
                    at += n
                    break
            else:
                break
        return out if at == len(text) else []

    def allowed(self, forced: str) -> list[int]:
        """Tokens that keep the output consistent with ``forced``: a prefix of it (shortest first), or starting
        with it (in text order); ids in order within equal texts."""
        index = self._index
        if index is not None:
            sorted_ids = index[0]
            shorter, lo, hi = _span(index, forced)
            return shorter + sorted_ids[lo:hi]
        top = forced + "\U0010ffff"
        shorter: list[tuple[int, int]] = []
        longer: list[tuple[str, int]] = []
        for tid, t in enumerate(self._decoded):
            if len(t) < len(forced) and forced.startswith(t):
                if t and self._kept(tid):
                    shorter.append((len(t), tid))
            elif forced <= t < top and self._kept(tid):
                longer.append((t, tid))
        return [tid for _, tid in sorted(shorter)] + [tid for _, tid in sorted(longer)]

    def allowed_ids(self, forced: str) -> np.ndarray:
        """``allowed(forced)``'s ids as an int64 array, in no promised order (constrained_argmax breaks ties by id).
        Built, the tokens that start with ``forced`` are a view of the sorted index, not a list: after a space the
        Qwen vocabulary allows 52,820 of them, which as a list cost ~10 ms a choice to sort and convert."""
        index = self._index
        if index is None:
            return np.asarray(self.allowed(forced), dtype=np.int64)
        ids_array = index[3]  # the ids in text order, as an array
        shorter, lo, hi = _span(index, forced)
        if not shorter:
            return ids_array[lo:hi]
        return np.concatenate((np.asarray(shorter, dtype=np.int64), ids_array[lo:hi]))


def _span(index: tuple, forced: str) -> tuple[list[int], int, int]:
    """In a built index: the ids of the texts that are shorter prefixes of ``forced`` (shortest first), and the range
    of the sorted texts that start with it."""
    _, sorted_texts, by_text, _ = index
    shorter = [i for n in range(1, len(forced)) for i in by_text.get(forced[:n], ())]
    lo = bisect.bisect_left(sorted_texts, forced)
    return shorter, lo, bisect.bisect_left(sorted_texts, forced + "\U0010ffff")


class TokenTexts:
    """``TokenIndex.text``: a kept token's text by id (``get``), read from the decoded list without a dict."""

    def __init__(self, decoded: list[str], special: set[int]):
        self._decoded, self._special = decoded, special

    def get(self, tid: int, default: str | None = None) -> str | None:
        if 0 <= tid < len(self._decoded):
            t = self._decoded[tid]
            if t and "\ufffd" not in t and tid not in self._special:
                return t
        return default


def token_texts(tokenizer) -> list[str]:
    """Each token id's text. One batched call into the Rust tokenizer: decoding 100k+ tokens one by one
    takes seconds (and this one call still takes about 4 s for Qwen's 151,936 on a slow CPU)."""
    return tokenizer.batch_decode(
        [[i] for i in range(len(tokenizer))], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


def split_heal(prefix: str, last_token_text: str | None, newline: bool = True) -> tuple[str, str, bool]:
    """(prefix to prompt with, text taken off, whether decoding must be constrained to re-type it).

    A prefix that ends in a line break, or in a line break and indentation (the cursor at a
    line start or on its indentation), ends the prompt *before* that break: byte-level BPE
    tokenizers merge "\n" with the next line's indentation, so a prompt ending in a bare
    break is a boundary the model rarely saw. The trailing whitespace is then re-typed under
    a constraint (tokens like "\n    " or "\n        return" fit), and only what follows it
    is shown. ``newline=False`` keeps the older rule, measured against in bench/quality.py:
    indentation taken off without a constraint, the prompt ending at the break.
    A ragged word ("os.pa") must be re-typed exactly, so the first tokens are constrained,
    one verify step each.
    """
    line_start = prefix.rfind("\n") + 1
    tail = prefix[line_start:]
    if newline and line_start > 0 and not tail.strip():
        body = prefix.rstrip()
        trailing = prefix[len(body) :]
        if len(trailing) > MAX_NEWLINE_HEAL_CHARS:  # many blank lines: re-type from the last break only
            trailing = prefix[line_start - 1 :]
            body = prefix[: line_start - 1]
        if body and trailing.isascii() and len(trailing) <= MAX_NEWLINE_HEAL_CHARS:
            return body, trailing, True
    if tail and not tail.strip() and line_start > 0:
        # Cursor on indentation: end the prompt at the line break, as line-aligned training did.
        return prefix[:line_start], tail, False
    t = last_token_text
    # A word, or spaces after a word ("def "): a prompt that ends in a lone space token is a boundary
    # BPE training rarely shows (Qwen2.5-Coder answers "    def " with an immediate end of text).
    if (
        t
        and len(t) <= MAX_HEAL_CHARS
        and len(t) < len(prefix)
        and prefix.endswith(t)
        and t.isascii()
        and "\n" not in t
        and (t.strip() or tail.strip())
    ):
        return prefix[: -len(t)], t, True
    return prefix, "", False


def unheal(text: str, heal: str, constrained: bool) -> str:
    """The generated text minus what the document already has before the cursor."""
    if not heal:
        return text
    if constrained:
        return text[len(heal) :] if len(text) > len(heal) else ""
    return text.lstrip(" \t")
