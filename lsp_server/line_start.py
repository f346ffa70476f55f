"""Answers that re-type the cursor line's indentation: the model writes the line from its start.

On a line that holds only indentation (an editor's auto-indent after Enter), a prompt that ends after that
indentation lets the model write only at that depth. When the line belongs one level out (the line after
``return False`` in a nested block, the end of a block), the model then writes whitespace or nothing: 66
of 111 failed HumanEval single-line problems through ``fimble lsp`` were such cursors
(bench/reports/quality-qwen-fim-lsp-shaping-cpu-2026-12-03.txt). So for clients that can show it
(``experimental.fimble.replaceStart``), the decode is anchored at the line's start, in the document
without that indentation, and the model writes the indentation itself:

- text that starts with the line's indentation is answered at the cursor as always (the indentation
  typed through, as type-through does with typed text);
- other text (a dedent) is answered with a range from the line's start over the indentation, as
  Copilot's answers are in VS Code (an inline item's range may start before the cursor on its line).

What the editor has typed since the request counts as usual: an answer that disagrees is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lsp_server.documents import Document
from lsp_server.prompt import Context


@dataclass
class LineStart:
    """A decode anchored at the start of the cursor's line."""

    ctx: Context  # the context at (line, 0): the prefix without the line's indentation
    indent: str  # the indentation the editor has before the cursor
    source: Document = field(repr=False)  # the editor's document, at ctx.version when this was made
    _doc: Document | None = field(default=None, repr=False)

    @property
    def doc(self) -> Document:
        """A scratch copy of the document without that indentation (the plan, and the dedent's shaping, read
        it), made on first use: a type-through answer needs none. Raises ValueError while the editor's
        document is being changed (Document.with_edit)."""
        if self._doc is None:
            line = self.ctx.cursor[0]
            self._doc = self.source.with_edit((line, 0), (line, len(self.indent)), "")
        return self._doc


def line_start(doc: Document, ctx: Context) -> LineStart | None:
    """The decode at the start of ``ctx``'s line, where everything before the cursor on it is indentation
    and nothing but whitespace follows; else None."""
    line, col = ctx.cursor
    if col == 0 or ctx.window[0] >= line or line >= len(doc.lines):
        return None
    text = doc.lines[line]
    indent = text[:col]
    if indent.strip() or text[col:].strip() or not ctx.prefix.endswith(indent):
        return None
    at = Context(
        uri=ctx.uri,
        version=ctx.version,
        doc_length=ctx.doc_length - col,
        window=ctx.window,
        cursor=(line, 0),
        prefix=ctx.prefix[:-col],
        suffix=ctx.suffix,
    )
    return LineStart(at, indent, doc)


def at_cursor(text: str, indent: str) -> str | None:
    """``text`` (written from the line's start) as seen from the cursor after ``indent``: the rest after the
    indentation, "" while it is still part of it, None once it left it (a dedent: answered from the line's
    start)."""
    if text.startswith(indent):
        return text[len(indent) :]
    return "" if indent.startswith(text) else None
