"""Bracket bookkeeping between the document and a streamed completion.

- `open_brackets_before`: what the document leaves open at the cursor (from the parse tree, so
  brackets inside strings and comments never count).
- `closers_after_cursor`: the closers an editor auto-inserted right after the cursor.
- `BracketGuard`: stops generation at the first closer that would close past its scope.
- `fit_to_line_rest`: turns a completion that re-types those closers into a replace range, so
  the editor never shows a closer twice.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from lsp_server.shaping.syntax.document import SyntaxDocument
from lsp_server.shaping.syntax.lexer import CLOSERS, Frame, FrameKind, Scanner, spec_for, string_frame
from lsp_server.shaping.syntax.tree_frames import open_frames

_QUOTES = "\"'`"


def open_brackets_before(doc: SyntaxDocument, byte_offset: int) -> list[Frame]:
    """Brackets ( [ { (and `${` / f-string `{`) open at `byte_offset`, outermost first.

    Each Frame has `open`, `start` (byte of the opener), `close_pos` (byte of its closer after
    the cursor, None when the document never closes it) and `container` (owning node type).
    """
    frames, _ = open_frames(doc, byte_offset)
    return [f for f in frames if f.kind in (FrameKind.BRACKET, FrameKind.INTERP)]


def closers_after_cursor(text_after_cursor_on_line: str) -> str:
    """The run of auto-paired closers right after the cursor: `)`, `]`, `}` and quotes.

    A quote followed by a word character opens a string (`|"abc"`) rather than closing one, so
    the run stops there. Whitespace ends the run: editors only auto-pair adjacent closers.
    """
    text = text_after_cursor_on_line
    for i, ch in enumerate(text):
        if ch in ")]}":
            continue
        if ch in _QUOTES:
            nxt = text[i + 1 : i + 2]
            if not (nxt.isalnum() or nxt == "_"):
                continue
        return text[:i]
    return text


def seed_closable(frames: Sequence[Frame], byte_offset: int, closers_run_bytes: int) -> list[Frame]:
    """Copies of `frames` marked closable where the completion may close them.

    A bracket may be closed by the completion when the document never closes it, or when its
    closer is one of the auto-paired closers right after the cursor (the completion re-types
    it). A bracket whose closer sits further on (`f(a, |, c)`, or the `}` of the block around
    the cursor line) is out of the completion's scope. Strings and comments always end.
    """
    run_end = byte_offset + closers_run_bytes
    out = []
    for f in frames:
        f = copy.copy(f)
        f.seeded = True
        if f.kind in (FrameKind.BRACKET, FrameKind.INTERP):
            f.closable = f.close_pos is None or f.close_pos < run_end
        out.append(f)
    return out


class BracketGuard:
    """Streaming stop rule: feed completion chunks, get the index where generation must stop.

    Seeded with the frames open at the cursor. Strings, comments, regex literals and template
    interpolations inside the generated text are tracked per language, so brackets inside them
    never count. `feed` returns the char index (into the whole completion so far) of the first
    closer that has no matching opener (in the completion, or a closable seeded one) or that
    mismatches the innermost opener; the completion must be cut to `text[:index]`. Once it has
    stopped it keeps returning that index.
    """

    def __init__(self, language_id: str | None, frames: Sequence[Frame] = ()) -> None:
        self._scanner = Scanner(spec_for(language_id), [copy.copy(f) for f in frames], strict=True)

    @classmethod
    def from_document(cls, doc: SyntaxDocument, byte_offset: int) -> BracketGuard:
        frames, _ = open_frames(doc, byte_offset)
        line_end = doc.line_bounds(byte_offset)[1]
        rest = doc.bytes[byte_offset:line_end].decode("utf-8", errors="replace")
        run = closers_after_cursor(rest)
        return cls(doc.language_id, seed_closable(frames, byte_offset, len(run.encode("utf-8"))))

    @property
    def stop(self) -> int | None:
        return self._scanner.stopped_at

    @property
    def text(self) -> str:
        """The completion accepted so far (cut at the stop index once stopped)."""
        buf = self._scanner.buf
        return buf if self.stop is None else buf[: self.stop]

    def feed(self, text_chunk: str) -> int | None:
        return self._scanner.feed(text_chunk)

    def finish(self) -> int | None:
        """End of generation: resolve chars that were waiting for lookahead."""
        return self._scanner.finish()


def _typeover_frames(language_id: str | None, run: str) -> list[Frame]:
    """Openers implied by an auto-paired closer run (innermost first) -> frames, outermost first."""
    spec = spec_for(language_id)
    frames = []
    for ch in reversed(run):
        if ch in CLOSERS:
            frames.append(Frame(FrameKind.BRACKET, CLOSERS[ch], ch, seeded=True))
        else:
            frames.append(string_frame(spec, ch, seeded=True))
    return frames


def fit_to_line_rest(completion: str, rest_of_line: str, language_id: str | None = None) -> tuple[str, int]:
    """(shown_text, replace_end_extension) so a completion never duplicates the line's rest.

    The editor replaces [cursor, cursor + replace_end_extension) (in characters of
    `rest_of_line`) with `shown_text`, which is the completion unchanged. The rule:

    1. Typeover. Let R = closers_after_cursor(rest) (the auto-paired closers). Scan the
       completion lexically with R's openers as the state at the cursor. Each time the
       completion closes one of those openers (a closer at its own bracket depth 0, or the
       quote that ends the string the cursor is in), it re-types the next char of R; k counts
       them (always a prefix of R, innermost first). `foo(|)` + `a, b)` -> k = 1.
    2. Whole rest. If all of R was re-typed and the rest after it, T = rest[k:], is not blank,
       and the completion re-types T exactly, either right after the last re-typed closer (at
       its start when R is empty) or as its own ending at bracket depth 0, the whole rest is
       covered: `def f(|)` + `a):` with rest `):` -> 2; `x = |foo` + `bar + foo` -> 3;
       `f(|);` + `a); g();` -> 2.
    3. Otherwise the extension is k; with no R and no match it is 0 (plain insertion).

    Trailing whitespace of the rest is never counted. A closer the completion types for its
    own opener (`foo(|)` + `g(a)`) is not a re-type, so nothing is swallowed by mistake.
    """
    rest = rest_of_line.rstrip()
    if not rest or not completion:
        return completion, 0
    run = closers_after_cursor(rest)
    scanner = Scanner(spec_for(language_id), _typeover_frames(language_id, run), strict=False)
    scanner.feed(completion, final=True)
    k = len(scanner.seeded_pops)
    tail = rest[k:]
    if k < len(run) or not tail.strip():
        return completion, k
    after = scanner.seeded_pops[-1][1] + len(scanner.seeded_pops[-1][0].close) if k else 0
    if completion.startswith(tail, after):
        return completion, len(rest)
    if completion.endswith(tail) and len(completion) - len(tail) >= after:
        head = Scanner(spec_for(language_id), _typeover_frames(language_id, run), strict=False)
        head.feed(completion[: len(completion) - len(tail)], final=True)
        if not head.stack:
            return completion, len(rest)
    return completion, k
