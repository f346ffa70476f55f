"""Where a completion starts re-typing the text that already follows the cursor.

A fill-in-the-middle model that runs past the middle goes on writing the suffix: on an empty line
of flask's app.py the default model wrote `return response`, a blank line and the next method's
signature, all of it a few lines below the cursor. Tabby (removeDuplicateSuffixLines,
dropDuplicated) and Continue (stopAtSimilarLine) cut such text after decoding; this is fimble's
version, used by lsp_server.shaping.shaper.CompletionShaper while streaming and at the end.

    ov = SuffixOverlap(line_prefix, after_cursor)   # once per cursor
    cut = ov.cut(completion)                        # None, or keep completion[:cut]

The rules (constants below; tests/syntax/test_syntax_suffix_overlap.py):

- The suffix texts: the rest of the cursor's line when it is not blank, then the next non-blank
  lines, up to WINDOW texts in all. Lines are compared with all whitespace removed, so
  indentation and spacing never matter (a re-typed line at another indentation is still a
  re-type, and Python's indentation is the syntax stage's business).
- The completion's lines: every line after the first; the first too when the cursor is at a line
  start (only whitespace before it), because then it is a whole line of its own. A mid-line first
  line continues the cursor's line (its re-typing of the line's rest is fit_to_line_rest's job: it
  becomes a replace range). Blank completion lines are skipped, as blank suffix lines are.
- Two lines match when equal (EXACT) or, both at least NEAR_MIN_CHARS long, when difflib's ratio
  is at least NEAR_RATIO (NEAR): the model's re-types drift a little (a name, a default). On
  shorter lines a char or two is another statement (HumanEval/64: `return vowels` above
  `return n_vowels`), so they must be equal.
- A run: completion lines matching consecutive suffix texts, from some suffix text j on. The
  completion is cut at the start of the first line that begins a run that is re-typing:
  1. two or more lines with at least RUN_MIN_CHARS in all and an EXACT one among them (or three
     NEAR lines): `else:` + `return None` re-typed is a re-type; `}` + `}` is not (closers are
     the bracket guard's business);
  2. one EXACT line of at least LINE_MIN_CHARS, or one NEAR line, that re-types the very next
     line (the first suffix line below the cursor's line): where a model that runs past the
     middle lands;
  3. one EXACT line of at least LINE_MIN_CHARS that re-types a line further down.
  Further down than the next line (rules 1 and 3), a match counts only as the same statement of
  the same block: the matched line is indented as the completion's line, and no suffix line from
  the next one down to it is indented less. A shallower line between (`elif c == ')':`, `else:`,
  the function's end) puts the match in another branch or after the block, and a deeper or
  shallower match is another statement; there the same text legitimately recurs (HumanEval/1:
  `current_string.append(c)` in both branches; HumanEval/111: `for i in list1:` in the function
  body with another inside an `if` below).
  A single short or common line (`}`, `)`, `else:`, `return x`) never cuts alone. The rest of the
  cursor's line counts in runs only (alone, re-typing it is fit_to_line_rest's replace range).
- The cut keeps the text before that line, less trailing blank lines and whitespace; a
  completion whose first line re-types the next line is cut to nothing.

Streaming: `cut` on the completed lines of a prefix never finds a later cut than it finds on the
whole text (runs only grow), so a stop found while streaming stands. Costs: matches are memoised
per distinct line, so each new line costs at most WINDOW comparisons.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

__all__ = ["SuffixOverlap", "Overlap", "repeats_a_suffix_line", "suffix_overlap_cut", "text_after"]

WINDOW = 10  # suffix texts compared: a re-type further down is no longer "what follows"
NEAR_RATIO = 0.9  # difflib ratio for a near re-type (Continue: Levenshtein distance < 10% of the line)
NEAR_MIN_CHARS = 20  # shorter lines only match exactly: `return vowels` vs `return n_vowels` is no re-type
LINE_MIN_CHARS = 10  # one line of this many non-space chars cuts alone (`return None`: yes; `return x`: no)
RUN_MIN_CHARS = 8  # a run of short lines must add up to this much: `else:` + `pass` yes, `});` + `}` no
TEXT_AFTER_MAX_BYTES = 16_384  # text_after reads at most this much of the document

EXACT, NEAR = 2, 1


@dataclass(frozen=True)
class Overlap:
    keep: int  # keep completion[:keep]
    line: int  # index of the completion line where the re-type starts
    suffix_index: int  # index of the suffix text it re-types (0: the first, maybe the line's rest)
    lines: int  # completion lines in the run
    exact: bool  # some line of the run is an exact re-type


def _norm(line: str) -> str:
    return "".join(line.split())


def _width(line: str) -> int:
    """Indentation width of `line` (tabs to 8, as Python's tokenizer counts them)."""
    return len(line[: len(line) - len(line.lstrip(" \t"))].expandtabs(8))


def text_after(data: bytes, offset: int, lines: int = WINDOW) -> str:
    """The document text after byte `offset`: the rest of its line and up to `lines` non-blank lines."""
    end, found, pos = min(len(data), offset + TEXT_AFTER_MAX_BYTES), 0, data.find(b"\n", offset)
    while 0 <= pos < end and found < lines:
        nxt = data.find(b"\n", pos + 1)
        stop = len(data) if nxt < 0 else nxt
        if data[pos + 1 : stop].strip():
            found += 1
        pos = nxt
    cut = end if pos < 0 else min(pos, end)
    return data[offset:cut].decode("utf-8", errors="replace")


class SuffixOverlap:
    """The suffix texts at one cursor; `cut` / `find` judge completions against them (see module doc)."""

    def __init__(self, line_prefix: str, after_cursor: str) -> None:
        self.at_line_start = not line_prefix.strip()
        self.line_prefix = line_prefix
        parts = after_cursor.split("\n")
        rest = _norm(parts[0])
        texts = [rest] if rest else []
        texts += [n for n in (_norm(p) for p in parts[1:]) if n]
        self.texts = texts[:WINDOW]
        # Indentation width of each suffix text (the line's rest: the cursor's column, never shallower).
        widths = [10**6] if rest else []
        widths += [_width(p) for p in parts[1:] if p.strip()]
        self.widths = widths[:WINDOW]
        self.has_rest = bool(rest)  # texts[0] is the rest of the cursor's line
        self._memo: dict[str, tuple[int, ...]] = {}

    def _kinds(self, norm: str) -> tuple[int, ...]:
        """For each suffix text: EXACT, NEAR or 0 for the completion line `norm`."""
        got = self._memo.get(norm)
        if got is None:
            got = tuple(_match(norm, t) for t in self.texts)
            if len(self._memo) < 512:
                self._memo[norm] = got
        return got

    def find(self, completion: str) -> Overlap | None:
        """The first run of `completion`'s lines that re-types the suffix, or None."""
        if not self.texts or "\n" not in completion and not self.at_line_start:
            return None
        lines = completion.split("\n")
        cand = [(i, _norm(s)) for i, s in enumerate(lines) if i > 0 or self.at_line_start]
        cand = [(i, n) for i, n in cand if n]
        first_indent = _width(self.line_prefix + lines[0]) if self.at_line_start else 0
        kinds = [self._kinds(n) for _, n in cand]
        next_line = 1 if self.has_rest else 0  # the first suffix line below the cursor's line
        for a, (i, norm) in enumerate(cand):
            for j, kind in enumerate(kinds[a]):
                if not kind:
                    continue
                run = _run_length(kinds, a, j)
                members = [kinds[a + k][j + k] for k in range(run)]
                chars = sum(len(cand[a + k][1]) for k in range(run))
                exact = EXACT in members
                # Deeper in the window, only a match in the same block counts: a shallower suffix line
                # between (`elif c == ')':`) puts it in another branch, where the line may recur.
                indent = first_indent if i == 0 else _width(lines[i])
                same_block = j <= next_line or (self.widths[j] == indent and min(self.widths[next_line:j]) >= indent)
                in_run = run >= 2 and chars >= RUN_MIN_CHARS and (exact or run >= 3) and same_block  # rule 1
                next_one = j == next_line and len(norm) >= LINE_MIN_CHARS  # rule 2 (NEAR implies the length)
                further = kind == EXACT and len(norm) >= LINE_MIN_CHARS and j > next_line and same_block  # rule 3
                if in_run or next_one or further:
                    start = sum(len(s) + 1 for s in lines[:i])
                    keep = len(completion[:start].rstrip())
                    return Overlap(keep, i, j, run, exact)
        return None

    def cut(self, completion: str) -> int | None:
        """Keep `completion[:cut]`; None when it re-types nothing."""
        found = self.find(completion)
        return None if found is None else found.keep


def _run_length(kinds: list[tuple[int, ...]], a: int, j: int) -> int:
    n = 0
    while a + n < len(kinds) and j + n < len(kinds[a + n]) and kinds[a + n][j + n]:
        n += 1
    return n


def _match(a: str, b: str) -> int:
    if a == b:
        return EXACT
    la, lb = len(a), len(b)
    if min(la, lb) < NEAR_MIN_CHARS or 2 * min(la, lb) < NEAR_RATIO * (la + lb):
        return 0  # too short to be "nearly", or too different in length to reach the ratio
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    if sm.real_quick_ratio() < NEAR_RATIO or sm.quick_ratio() < NEAR_RATIO:
        return 0
    return NEAR if sm.ratio() >= NEAR_RATIO else 0


def suffix_overlap_cut(completion: str, line_prefix: str, after_cursor: str) -> int | None:
    """Where to cut `completion` so it does not re-type `after_cursor` (None: keep it whole).

    `line_prefix`: the cursor's line before the cursor; `after_cursor`: the text after it (its
    line's rest first). One-off form of SuffixOverlap(line_prefix, after_cursor).cut(completion).
    """
    return SuffixOverlap(line_prefix, after_cursor).cut(completion)


def repeats_a_suffix_line(completion: str, line_prefix: str, after_cursor: str) -> bool:
    """A looser measure for benches, not a cut rule: does any whole line of `completion` of at least
    LINE_MIN_CHARS non-space chars equal one of the next WINDOW non-blank lines after the cursor's line?

    It counts a single line anywhere in the window, at any indentation, which the cut rules leave
    alone in another branch or block (`return None` in an `if`, with another `return None` below),
    so it bounds the re-typing rate from above.
    """
    ov = SuffixOverlap(line_prefix, after_cursor)
    below = set(ov.texts[1:] if ov.has_rest else ov.texts)
    lines = completion.split("\n")
    return any(
        len(n) >= LINE_MIN_CHARS and n in below
        for i, n in ((i, _norm(s)) for i, s in enumerate(lines))
        if i > 0 or ov.at_line_start
    )
