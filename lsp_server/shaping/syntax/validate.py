"""Final checks on a model completion before the editor shows it.

Stages, each of which may only shorten the text (the first three mirror what the streaming
decoder would have stopped on; the last needs the whole completion):

1. bracket   - BracketGuard: cut before a closer that closes past its scope.
2. duplicate - cut at the first line equal (after strip) to the next non-empty line below the
               cursor, when the completion's own brackets are balanced there.
3. scope_end - Python: cut at a statement line indented at or left of the enclosing def/class
               header (of a module-level compound statement's header where none encloses it;
               of the cursor line when the completion opens a def/class on it).
               Brace languages: cut right after the `}` that closes the block around the
               cursor when the document left that block unclosed (a block the document
               already closes is handled by stage 1).
4. syntax    - parse prefix + completion + suffix (with the rest-of-line fit applied); if it
               adds ERROR/MISSING nodes the document did not have, cut to the longest prefix
               at a line, then token, boundary that adds none; if none, drop it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from lsp_server.shaping.syntax.brackets import BracketGuard, fit_to_line_rest, seed_closable
from lsp_server.shaping.syntax.context import CursorContext, classify, scope_indent_width
from lsp_server.shaping.syntax.document import SyntaxDocument
from lsp_server.shaping.syntax.languages import is_indent_scoped
from lsp_server.shaping.syntax.lexer import Frame, FrameKind, Scanner, spec_for

_MAX_PARSES = 40  # bound on candidate reparses in the syntax stage
_TOKEN_EDGE = re.compile(r"\w+|\s+|[^\w\s]")
_SCOPE_LINE = re.compile(r"\s*(?:async\s+)?(?:def|class)\b")


class CutReason(enum.Enum):
    BRACKET = "bracket"
    DUPLICATE_LINE = "duplicate_line"
    SCOPE_END = "scope_end"
    SYNTAX_ERROR = "syntax_error"
    DROPPED = "dropped"  # no prefix passed the syntax check


@dataclass(frozen=True)
class ValidationResult:
    text: str  # what to show (may be empty)
    cut_reason: CutReason | None  # the last stage that shortened the text; None if untouched
    replace_start: int  # byte offset: the cursor
    replace_end: int  # byte offset: cursor + re-typed rest of line (see fit_to_line_rest)

    @property
    def replace_range(self) -> tuple[int, int]:
        return self.replace_start, self.replace_end


def validate_completion(
    doc: SyntaxDocument,
    cursor_byte: int,
    completion: str,
    language: str | None = None,
    context: CursorContext | None = None,
) -> ValidationResult:
    """Cut `completion` (inserted at `cursor_byte`) to what is safe to show; see module doc."""
    lang = language or doc.language_id
    ctx = context if context is not None and context.byte_offset == cursor_byte else classify(doc, cursor_byte)
    text, reason = completion, None

    for stage in (_bracket_cut, _duplicate_cut, _scope_cut):
        cut, why = stage(doc, ctx, text, lang)
        if cut != text:
            text, reason = cut.rstrip(), why
    if text and doc.has_tree:
        cut = _syntax_cut(doc, ctx, text, lang)
        if cut != text:
            text, reason = cut, (CutReason.SYNTAX_ERROR if cut else CutReason.DROPPED)
    ext = fit_to_line_rest(text, ctx.line_suffix, lang)[1] if text else 0
    end = cursor_byte + len(ctx.line_suffix[:ext].encode("utf-8"))
    return ValidationResult(text, reason, cursor_byte, end)


def _seeded(ctx: CursorContext) -> list[Frame]:
    return seed_closable(ctx.frames, ctx.byte_offset, len(ctx.closers_after.encode("utf-8")))


def _bracket_cut(doc: SyntaxDocument, ctx: CursorContext, text: str, lang: str) -> tuple[str, CutReason]:
    guard = BracketGuard(lang, _seeded(ctx))
    guard.feed(text)
    guard.finish()
    return guard.text, CutReason.BRACKET


def _line_states(ctx: CursorContext, text: str, lang: str) -> tuple[list[bool], Scanner]:
    """clean[i]: at the start of completion line i, is the scan in plain code at depth 0?

    "Depth 0" means no bracket, string or comment is open other than seeded brackets the
    completion has not closed yet (those are the surrounding code, not the completion's own).
    """
    clean = [True]
    scanner = Scanner(spec_for(lang), _seeded(ctx), strict=False)

    def on_newline(_: int) -> None:
        clean.append(scanner.own_depth() == 0 and scanner.in_code)

    scanner.on_newline = on_newline
    scanner.feed(text, final=True)
    return clean, scanner


def _duplicate_cut(doc: SyntaxDocument, ctx: CursorContext, text: str, lang: str) -> tuple[str, CutReason]:
    below = _next_nonempty_line_below(doc, ctx.byte_offset)
    if below is None:
        return text, CutReason.DUPLICATE_LINE
    lines = text.split("\n")
    clean, _ = _line_states(ctx, text, lang)
    for i, line in enumerate(lines):
        full = ctx.line_prefix + line if i == 0 else line
        if full.strip() == below and (i == 0 or clean[i]):
            return "\n".join(lines[:i]), CutReason.DUPLICATE_LINE
    return text, CutReason.DUPLICATE_LINE


def _next_nonempty_line_below(doc: SyntaxDocument, offset: int) -> str | None:
    data = doc.bytes
    pos = data.find(b"\n", offset)
    while pos >= 0:
        nxt = data.find(b"\n", pos + 1)
        line = data[pos + 1 : len(data) if nxt < 0 else nxt].strip()
        if line:
            return line.decode("utf-8", errors="replace")
        pos = nxt
    return None


def _scope_cut(doc: SyntaxDocument, ctx: CursorContext, text: str, lang: str) -> tuple[str, CutReason]:
    if "\n" not in text and not any(f.close_pos is None for f in ctx.open_brackets):
        return text, CutReason.SCOPE_END
    clean, scanner = _line_states(ctx, text, lang)
    lines = text.split("\n")
    if is_indent_scoped(lang):
        # The floor is the enclosing def/class, not the innermost block: a middle often ends a
        # nested block and goes on at the function's level (`return False` then `return True`);
        # a line at the def's own level or left of it starts the next definition.
        floor = scope_indent_width(doc, ctx.block_range[0]) if ctx.has_block_header else None
        first = (ctx.line_prefix + lines[0]).rstrip()
        if first.endswith(":") and (len(clean) < 2 or clean[1]):  # the completion opened a block on its line
            own = _width(ctx.line_indent)
            floor = own if floor is None or _SCOPE_LINE.match(first) else min(floor, own)
        if floor is None:
            return text, CutReason.SCOPE_END
        for i in range(1, len(lines)):
            body = lines[i].strip()
            if body and clean[i] and _width(lines[i][: len(lines[i]) - len(lines[i].lstrip())]) <= floor:
                return "\n".join(lines[:i]), CutReason.SCOPE_END
        return text, CutReason.SCOPE_END
    # Brace languages: the innermost block brace the document leaves unclosed.
    block = next((f for f in reversed(ctx.open_brackets) if f.open == "{" and f.kind is FrameKind.BRACKET), None)
    if block is None or block.close_pos is not None:
        return text, CutReason.SCOPE_END
    for frame, at in scanner.seeded_pops:
        if frame.start == block.start and frame.open == "{":
            end = at + 1
            while end < len(text) and text[end] in ");,] \t":
                end += 1
            return text[:end], CutReason.SCOPE_END
    return text, CutReason.SCOPE_END


def _width(indent: str) -> int:
    return len(indent.expandtabs(8))


# -- syntax stage ----------------------------------------------------------------------------------
def _error_keys(doc: SyntaxDocument) -> list[tuple[str, int, int]]:
    return [(n.type, n.start_byte, n.end_byte) for n in doc.error_nodes()]


def _syntax_cut(doc: SyntaxDocument, ctx: CursorContext, text: str, lang: str) -> str:
    old = _error_keys(doc)
    budget = [_MAX_PARSES]

    def ok(candidate: str) -> bool:
        budget[0] -= 1
        return _adds_no_errors(doc, ctx, old, candidate, lang)

    if ok(text):
        return text
    lines = text.split("\n")
    base = 0  # number of whole lines kept
    for i in range(len(lines) - 1, 0, -1):
        if budget[0] <= 0:
            break
        head = "\n".join(lines[:i]).rstrip()
        if head and ok(head):
            base = i
            break
    kept = "\n".join(lines[:base]).rstrip() if base else ""
    if base < len(lines):
        line = lines[base]
        lead = kept + "\n" if base else ""
        edges = [m.end() for m in _TOKEN_EDGE.finditer(line)][:-1]
        for edge in reversed(edges):
            if budget[0] <= 0:
                break
            candidate = (lead + line[:edge]).rstrip()
            if len(candidate) <= len(kept):
                break
            if candidate and ok(candidate):
                return candidate
    return kept


def _adds_no_errors(
    doc: SyntaxDocument, ctx: CursorContext, old: list[tuple[str, int, int]], candidate: str, lang: str
) -> bool:
    """Does inserting `candidate` leave no ERROR/MISSING node the document did not have?

    Errors outside the inserted bytes must match an old error (shifted past the insertion);
    errors touching it may only replace old errors that touched the cursor.
    """
    ext = fit_to_line_rest(candidate, ctx.line_suffix, lang)[1]
    cursor = ctx.byte_offset
    replaced = len(ctx.line_suffix[:ext].encode("utf-8"))
    inserted = candidate.encode("utf-8")
    new = doc.with_edit(cursor, cursor + replaced, inserted)
    ins_end, delta = cursor + len(inserted), len(inserted) - replaced
    old_set = set(old)
    touching_old = sum(1 for _, s, e in old if s <= cursor + replaced and e >= cursor)
    local = 0
    for node in new.error_nodes():
        s, e = node.start_byte, node.end_byte
        if e < cursor or (e == cursor and s < cursor):
            key = (node.type, s, e)
        elif s > ins_end or (s == ins_end and e > ins_end):
            key = (node.type, s - delta, e - delta)
        else:
            local += 1
            continue
        if key not in old_set:
            return False
    return local <= touching_old
