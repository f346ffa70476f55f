"""``textDocument/didChange`` params read straight from JSON, in steps.

Why not pygls' converter: structuring one change of 20,000 edits into lsprotocol objects took
about 0.3 s on the shared event loop, in one piece, before a handler could slice anything. Here
a change is checked as plain JSON (the same rules the LSP types impose: a string uri and text,
an integer version, unsigned integer lines and characters) a thousand edits per step, and a
change that breaks a rule anywhere is dropped whole, as before: half a change would put the
document out of step with the editor.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

UINTEGER_MAX = 2**31 - 1
STEP_EDITS = 1000

Span = tuple[int, int, int, int]  # start line, start character, end line, end character (client units)


@dataclass(frozen=True)
class Change:
    uri: str
    version: int
    edits: list[tuple[Span | None, str]]  # None: the whole document's new text


def _uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= UINTEGER_MAX


def _position(value: Any) -> tuple[int, int] | None:
    if isinstance(value, dict) and _uint(line := value.get("line")) and _uint(char := value.get("character")):
        return line, char
    return None


def _edit(item: Any) -> tuple[Span | None, str] | None:
    if not isinstance(item, dict) or not isinstance(text := item.get("text"), str):
        return None
    if "range" not in item:
        return None, text
    rng = item["range"]
    if not isinstance(rng, dict):
        return None
    start, end = _position(rng.get("start")), _position(rng.get("end"))
    if start is None or end is None:
        return None
    return (start[0], start[1], end[0], end[1]), text


def count_edits(params: Any) -> tuple[int, int]:
    """(edits, characters of text) a change carries, read cheaply; (0, 0) for params of the wrong shape."""
    changes = params.get("contentChanges") if isinstance(params, dict) else None
    if not isinstance(changes, list):
        return 0, 0
    return len(changes), sum(len(c["text"]) for c in changes if isinstance(c, dict) and isinstance(c.get("text"), str))


def parse_change_steps(params: Any) -> Generator[None, None, Change | None]:
    """The change, or None if any part of it breaks the LSP types; yields every ``STEP_EDITS`` edits."""
    if not isinstance(params, dict):
        return None
    doc, changes = params.get("textDocument"), params.get("contentChanges")
    if not isinstance(doc, dict) or not isinstance(changes, list):
        return None
    uri, version = doc.get("uri"), doc.get("version")
    if (
        not isinstance(uri, str)
        or not isinstance(version, int)
        or isinstance(version, bool)
        or not -(2**31) <= version <= UINTEGER_MAX
    ):
        return None
    edits: list[tuple[Span | None, str]] = []
    for i, item in enumerate(changes):
        edit = _edit(item)
        if edit is None:
            return None
        edits.append(edit)
        if i % STEP_EDITS == STEP_EDITS - 1:
            yield
    return Change(uri, version, edits)
