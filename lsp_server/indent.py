"""Completions at a cursor in a line's indentation do not add indentation to the editor's.

An editor auto-indents the line after Enter (VS Code: `def f(x):` + Enter puts the cursor at column
4). The model, without token healing, often re-types indentation there: its tokens merge runs of
spaces, so after a prompt ending in four spaces it emits `    return x`, and the ghost text sits at
column 8. ``IndentFit`` removes that leading whitespace from the completion's
first line, and the same amount from the indentation of each following line (the model placed the
whole block that much deeper), as the text streams: whitespace at a line's start is held back until
the line's first other character shows how much to drop.

It applies only where the cursor has whitespace and nothing else before it on its line, and nothing
after it (``applies``): elsewhere leading whitespace is ordinary text (`x =` + ` 1`).
"""

from __future__ import annotations


def applies(line_before_cursor: str, line_after_cursor: str) -> bool:
    """Whether the cursor sits after the editor's indentation on an otherwise empty line."""
    return bool(line_before_cursor) and not line_before_cursor.strip() and not line_after_cursor.strip()


class IndentFit:
    """Streaming: ``feed`` chunks of the model's text, get the text to keep (a prefix-stable transform)."""

    def __init__(self) -> None:
        self.extra: int | None = None  # whitespace characters the first line added; None until known
        self._at_line_start = True
        self._pending = ""  # whitespace at the current line's start, not yet decided
        self.dropped = 0  # characters removed (for stats and tests)

    def feed(self, chunk: str) -> str:
        out: list[str] = []
        for ch in chunk:
            if not self._at_line_start:
                out.append(ch)
                if ch == "\n":
                    self._at_line_start = True
                continue
            if ch in " \t":
                self._pending += ch
                continue
            pending, self._pending = self._pending, ""
            if ch == "\n":  # a blank line (or the first line ends at once): its whitespace is trailing
                if self.extra is None:
                    self.extra = 0
                self.dropped += len(pending)
                out.append(ch)
                continue
            if self.extra is None:  # the first line's own indentation is what the editor already has
                self.extra = len(pending)
                keep = ""
            else:
                keep = pending[self.extra :] if len(pending) >= self.extra else pending
            self.dropped += len(pending) - len(keep)
            out.append(keep + ch)
            self._at_line_start = False
        return "".join(out)
