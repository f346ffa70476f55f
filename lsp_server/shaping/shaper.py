"""Shape a streamed completion into what the editor shows: where to stop, what to show, what to replace.

    from lsp_server.shaping.shaper import CompletionShaper
    shaper = CompletionShaper(doc, cursor_byte)          # at request time (snapshots the doc)
    for delta in stream:                                 # while the engine streams
        stop = shaper.feed(delta.text)
        if stop is not None:                             # a closer past the completion's scope:
            stream.cancel()                              # stop decoding, show text[:stop]
            break
    shaped = shaper.finish()                             # -> ShapedCompletion
    # show shaped.text, replacing shaped.replace_start..replace_end (bytes) or shaped.range (LSP)

API (all of it):

- `CompletionShaper(doc, cursor_byte, context=None, encoding="utf-16", snapshot=True)`.
  `doc` is an lsp_server.shaping.syntax.SyntaxDocument, `cursor_byte` a UTF-8 byte offset. The shaper
  takes a snapshot of the document (the caller may keep editing its own), and classifies the
  cursor unless `context` (a CursorContext for that cursor, e.g. from `decide`) is given.
  `encoding` is the LSP position encoding used for `ShapedCompletion.range`.
- `feed(chunk) -> int | None`: add streamed text. Returns None while generation may go on, or
  the character index (into all the text fed so far) where the completion must stop: the
  first closer that would close a bracket or string the completion did not open and may not
  close (lsp_server.shaping.syntax.BracketGuard), or the end of the text kept before a line that starts
  re-typing the text after the cursor (lsp_server.shaping.syntax.suffix_overlap: judged as each line
  completes, so the index may lie inside text fed earlier). Once stopped it keeps returning
  that index; text fed after it is ignored.
- `text` / `stopped` / `stop` / `stop_reason`: the accepted text so far, and whether / where /
  why ("bracket" or "suffix_overlap") it stopped.
- `finish(text=None) -> ShapedCompletion`: end of generation. Runs the guard's lookahead, cuts
  where the whole text starts re-typing the suffix (the same rule as `feed`, now on the last
  line too), then `validate_completion` (bracket, duplicate-line, scope-end and syntax cuts), whose
  replace range comes from `fit_to_line_rest`: when the completion re-types the closers the
  editor auto-inserted after the cursor (or the whole rest of the line), the range covers
  them so nothing is shown twice. Python then gets one more stage (below). Pass `text` to
  shape a complete text without streaming it.

Python stage ("python_syntax"): tree-sitter-python accepts things CPython rejects: a block
header with an empty body (`if x:` followed by a line at the same indentation), a dedent to a
width no enclosing block has. On HumanEval single-line infilling those were most of the shown
completions that broke the program (bench/quality.py). So for Python the text is also checked
with CPython's own parser, on the tree-sitter segment around the cursor (top-level statements,
~150 lines, so the cost stays bounded): the completion passes when the segment then parses, or its first
error is the segment's old first error: outside the inserted text, at the same place (mapped
past the insertion), with the same message, blaming no inserted line (as "expected an
indented block after 'if' statement on line N" does). A completion may leave a document as
broken as it found it, never broken anew. Otherwise the text is cut back to the longest run
of whole lines that passes, or dropped.

`ShapedCompletion` fields: `text` (may be ""; show nothing then), `replace_start` and
`replace_end` (document bytes), `range` (((line, char), (line, char)) in `encoding`),
`cut_reason` (None, "bracket", "suffix_overlap", "duplicate_line", "scope_end", "syntax_error",
"python_syntax" or "dropped": the last stage that shortened the text),
`raw` (the text before shaping) and `context` (the ContextKind value at the cursor).

Costs: `feed` is a lexical scan of the new chunk (microseconds); `finish` reparses the
document with the completion inserted a few times at most (validate_completion caps it).
Thread-safety: one shaper per request; it owns its snapshot, so it may run on any thread.
"""

from __future__ import annotations

import ast
import bisect
import re
import warnings
from dataclasses import dataclass

from lsp_server.shaping.syntax.brackets import BracketGuard, fit_to_line_rest, seed_closable
from lsp_server.shaping.syntax.context import CursorContext, classify
from lsp_server.shaping.syntax.document import SyntaxDocument
from lsp_server.shaping.syntax.languages import is_indent_scoped
from lsp_server.shaping.syntax.suffix_overlap import SuffixOverlap, text_after
from lsp_server.shaping.syntax.validate import validate_completion

__all__ = ["CompletionShaper", "ShapedCompletion"]


@dataclass(frozen=True)
class ShapedCompletion:
    text: str  # what to show ("" = nothing)
    replace_start: int  # document byte offset: the cursor
    replace_end: int  # document byte offset: cursor + re-typed rest of line
    range: tuple[tuple[int, int], tuple[int, int]]  # the same as LSP (line, character) positions
    cut_reason: str | None  # why the raw text was shortened; None if it was not
    raw: str  # the streamed text before shaping
    context: str  # ContextKind value at the cursor


class CompletionShaper:
    """Streaming stop rule + final validation for one completion at one cursor. See module doc."""

    def __init__(
        self,
        doc: SyntaxDocument,
        cursor_byte: int,
        context: CursorContext | None = None,
        encoding: str = "utf-16",
        snapshot: bool = True,
    ) -> None:
        self.doc = doc.snapshot() if snapshot else doc
        self.cursor = max(0, min(cursor_byte, len(self.doc.bytes)))
        if context is None or context.byte_offset != self.cursor:
            context = classify(self.doc, self.cursor)
        self.context = context
        self.encoding = encoding
        frames = seed_closable(context.frames, self.cursor, len(context.closers_after.encode("utf-8")))
        self._guard = BracketGuard(self.doc.language_id, frames)
        self._raw = ""
        self._overlap: SuffixOverlap | None = None  # built at the first line break (most answers have none)
        self._overlap_stop: int | None = None
        self._finished: ShapedCompletion | None = None
        self._py_base: tuple[int, str, int | None] | None | bool = False  # False: not computed yet

    # -- streaming -------------------------------------------------------------------------------
    def feed(self, chunk: str) -> int | None:
        """Add streamed text; the char index to stop at, or None while it may go on."""
        if self.stop is not None or not chunk:
            return self.stop
        self._raw += chunk
        guard_stop = self._guard.feed(chunk)
        if "\n" in chunk:  # a line is complete: has the completion started re-typing the suffix?
            text = self._raw if guard_stop is None else self._raw[:guard_stop]
            self._overlap_stop = self._suffix_cut(text[: text.rfind("\n") + 1])
        return self.stop

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    @property
    def stop(self) -> int | None:
        stops = [s for s in (self._guard.stop, self._overlap_stop) if s is not None]
        return min(stops) if stops else None

    @property
    def stop_reason(self) -> str | None:
        """Why streaming stopped: "bracket" (the guard), "suffix_overlap", or None (it did not)."""
        if self.stop is None:
            return None
        return "suffix_overlap" if self.stop == self._overlap_stop else "bracket"

    @property
    def text(self) -> str:
        """The streamed text accepted so far (cut at the stop once stopped)."""
        text = self._guard.text
        return text if self._overlap_stop is None else text[: self._overlap_stop]

    def _suffix_cut(self, text: str) -> int | None:
        """Where `text` starts re-typing the text after the cursor (None: it does not)."""
        if self._overlap is None:
            self._overlap = SuffixOverlap(self.context.line_prefix, text_after(self.doc.bytes, self.cursor))
        return self._overlap.cut(text)

    def _position(self, byte: int) -> tuple[int, int]:
        return self.doc.position_at_byte(byte, self.encoding)

    # -- the end ---------------------------------------------------------------------------------
    def finish(self, text: str | None = None) -> ShapedCompletion:
        """Shape the whole completion (`text`, or what was fed) into what the editor shows."""
        if text is not None:
            if self._raw:
                raise ValueError("finish(text) is for a shaper that was not fed")
            self.feed(text)
        if self._finished is not None:
            return self._finished
        self._guard.finish()
        guarded, early = self._guard.text, None
        if guarded != self._raw:
            guarded, early = guarded.rstrip(), "bracket"  # rstrip: as validate_completion does after its cuts
        # The whole text, its last line included (feed judged complete lines only).
        cut = self._suffix_cut(guarded) if guarded.strip() else None
        if self._overlap_stop is not None and (cut is None or self._overlap_stop < cut):
            cut = self._overlap_stop
        if cut is not None and cut < len(guarded):
            guarded, early = guarded[:cut], "suffix_overlap"
        lang = self.doc.language_id
        result = validate_completion(self.doc, self.cursor, guarded, lang, self.context)
        shown = result.text if result.text.strip() else ""
        reason = result.cut_reason.value if result.cut_reason is not None else None
        if early is not None and reason is None:
            reason = early  # a cut before validation; validation had nothing more
        end = result.replace_end if shown else self.cursor
        if shown and self.doc.has_tree and is_indent_scoped(lang):
            checked = self._python_cut(shown, end)
            if checked != shown:
                shown, reason = checked, "python_syntax" if checked else "dropped"
                ext = fit_to_line_rest(shown, self.context.line_suffix, lang)[1] if shown else 0
                end = self.cursor + len(self.context.line_suffix[:ext].encode("utf-8"))
        self._finished = ShapedCompletion(
            text=shown,
            replace_start=self.cursor,
            replace_end=end,
            range=(self._position(self.cursor), self._position(end)),
            cut_reason=reason,
            raw=self._raw,
            context=self.context.kind.value,
        )
        return self._finished

    # -- the Python stage -------------------------------------------------------------------------
    def _python_cut(self, text: str, end: int) -> str:
        """`text`, or its longest whole-line prefix that CPython accepts here ("" if none)."""
        if self._python_ok(text, end):
            return text
        lines = text.split("\n")
        for n in range(len(lines) - 1, 0, -1):
            head = "\n".join(lines[:n]).rstrip()
            if not head.strip():
                break
            ext = fit_to_line_rest(head, self.context.line_suffix, self.doc.language_id)[1]
            if self._python_ok(head, self.cursor + len(self.context.line_suffix[:ext].encode("utf-8"))):
                return head
        return ""

    def _python_ok(self, text: str, end: int) -> bool:
        data = self.doc.bytes
        starts = [a for a, _ in self.doc.segment_ranges()] or [0]
        i = max(0, bisect.bisect_right(starts, self.cursor) - 1)
        seg_start = starts[i]
        seg_end = max(starts[i + 1] if i + 1 < len(starts) else len(data), end)
        before = data[seg_start : self.cursor].decode("utf-8", errors="replace")
        after = data[end:seg_end].decode("utf-8", errors="replace")
        if self._py_base is False:
            self._py_base = _first_python_error(before + data[self.cursor : seg_end].decode("utf-8", "replace"))
        new = _first_python_error(before + text + after)
        if new is None:
            return True
        old = self._py_base
        if not old:
            return False  # the segment parsed before: any error now is the completion's
        pos, msg, blamed = new
        lo, hi = len(before), len(before) + len(text)
        first_line = before.count("\n") + 1
        inserted = text.count("\n")
        if blamed is not None and first_line <= blamed <= first_line + inserted:
            return False  # e.g. "expected an indented block after 'if' statement on line N"
        if lo < pos < hi:
            return False  # inside the inserted text
        # Otherwise only the old first error may remain, at its old place. An error that moved
        # further down is no proof: `    if x:` can adopt the indented lines below as its body.
        shift = len(text) - len(data[self.cursor : end].decode("utf-8", errors="replace"))
        mapped = pos - shift if pos >= hi else pos
        if blamed is not None and blamed > first_line + inserted:
            blamed -= inserted
        return (mapped, msg, blamed) == old


_BLAMED_LINE = re.compile(r"on line (\d+)")


def _first_python_error(source: str) -> tuple[int, str, int | None] | None:
    """CPython's first syntax error: (char offset, message with line refs blanked, blamed line)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning for invalid escapes and the like
            ast.parse(source)
        return None
    except SyntaxError as exc:
        line = max(1, exc.lineno or 1)
        starts = [0]
        for m in re.finditer("\n", source):
            starts.append(m.end())
            if len(starts) > line:
                break
        base = starts[line - 1] if line - 1 < len(starts) else len(source)
        msg = exc.msg or ""
        m = _BLAMED_LINE.search(msg)
        at = min(len(source), base + max(0, (exc.offset or 1) - 1))
        return at, _BLAMED_LINE.sub("on line N", msg), (int(m.group(1)) if m else None)
    except (ValueError, RecursionError, MemoryError):
        return None
