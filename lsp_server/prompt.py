"""The text around the cursor that goes to the engine: a prefix window and a suffix window.

The engine reuses its KV cache for the longest common token prefix with the previous
request, and the model's FIM order is suffix first (SPM). So both windows must stay
byte-identical while the user types at the cursor:
- the suffix is a function of the text after the cursor only (typing never changes it);
- the prefix starts at a remembered (line, column) that moves only in big jumps: when the
  prefix grows past ``prefix_chars`` it restarts about half that far back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lsp_server.documents import Document

_SURROGATE = re.compile("[\ud800-\udfff]")
LONG_LINE_BLOCK = 1024  # mid-line window starts are multiples of this, so they move in jumps


@dataclass(frozen=True)
class Context:
    """What one request sees: the windows and where they sit in the document."""

    uri: str
    version: int
    doc_length: int
    window: tuple[int, int]  # where ``prefix`` starts
    cursor: tuple[int, int]  # (line, code point column)
    prefix: str
    suffix: str


def clean(text: str) -> str:
    """Lone surrogates (a non-UTF-8 file read with surrogateescape) cannot be encoded: use U+FFFD."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def _choose_window(doc: Document, line: int, col: int, target: int) -> tuple[int, int]:
    """Start of a prefix window of about ``target`` characters ending at the cursor, at a line start."""
    if col >= target:  # a very long line: start inside it, on a block boundary
        return line, max(0, (col - target // 2) // LONG_LINE_BLOCK * LONG_LINE_BLOCK)
    total = col
    start = line
    while start > 0 and total + len(doc.lines[start - 1]) <= target:
        start -= 1
        total += len(doc.lines[start])
    return start, 0


def _prefix(doc: Document, window: tuple[int, int], line: int, col: int, limit: int) -> str | None:
    """Text from ``window`` to the cursor, or None if the window is past the cursor or too long."""
    wl, wc = window
    if wl > line or (wl == line and wc > col) or wl >= len(doc.lines):
        return None
    if wl == line:
        text = doc.lines[line][wc:col]
        return text if len(text) <= limit else None
    parts = [doc.lines[wl][wc:]]
    total = len(parts[0])
    for i in range(wl + 1, line):
        parts.append(doc.lines[i])
        total += len(doc.lines[i])
        if total > limit:
            return None
    parts.append(doc.lines[line][:col])
    total += col
    return "".join(parts) if total <= limit else None


def suffix_text(doc: Document, line: int, col: int, limit: int) -> str:
    """The rest of the cursor's line and whole following lines, up to ``limit`` characters."""
    first = doc.lines[line][col : col + limit]
    parts = [first]
    total = len(first)
    for i in range(line + 1, len(doc.lines)):
        nxt = doc.lines[i]
        if total + len(nxt) > limit:
            break
        parts.append(nxt)
        total += len(nxt)
    return "".join(parts)


def build_context(doc: Document, line: int, col: int, prefix_chars: int, suffix_chars: int) -> Context:
    """Windows for a cursor at (line, code point column). Updates ``doc.window`` when it jumps."""
    prefix = _prefix(doc, doc.window, line, col, prefix_chars) if doc.window else None
    if prefix is None:
        doc.window = _choose_window(doc, line, col, prefix_chars // 2)
        prefix = _prefix(doc, doc.window, line, col, prefix_chars) or ""
    return Context(
        uri=doc.uri,
        version=doc.version,
        doc_length=doc.length,
        window=doc.window,
        cursor=(line, col),
        prefix=prefix,
        suffix=suffix_text(doc, line, col, suffix_chars),
    )


def typed_since(doc: Document, ctx: Context) -> str | None:
    """What was typed at ``ctx``'s cursor since ``ctx`` was taken, or None if the document changed otherwise.

    Any series of edits whose net effect is an insertion at the cursor counts (typing,
    typing and backspacing). The check reads one window, never the whole document.
    """
    delta = doc.length - ctx.doc_length
    if delta < 0 or ctx.window[0] >= len(doc.lines):
        return None
    n = len(ctx.prefix)
    cur = doc.text_from(ctx.window, n + delta + len(ctx.suffix))
    if len(cur) != n + delta + len(ctx.suffix) or not cur.startswith(ctx.prefix) or not cur.endswith(ctx.suffix):
        return None
    return cur[n : n + delta]
