"""Chunks of other files and how alike two pieces of code are (identifier sets, Jaccard similarity).

A chunk is a run of lines of another file with its identifier set. Similarity is Jaccard over
identifiers, keywords and one-letter names left out (Copilot's neighbouring tabs rank 60-line windows
the same way): cheap to compute, and the words code shares across files are its names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

_IDENT = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
# Python, JavaScript and TypeScript keywords and the most common builtins: shared by every file, so noise.
_STOP = frozenset(
    """
False None True and as assert async await break class continue def del elif else except finally for from
global if import in is lambda nonlocal not or pass raise return try while with yield self cls print len str
int dict list set tuple object super isinstance range type bool bytes float open
abstract any boolean case catch const constructor debugger default delete do enum export extends false
function implements instanceof interface let new null number package private protected public readonly
static string switch this throw true typeof undefined var void require module exports console
""".split()
)
CHUNK_LINES = 32  # lines per chunk of an open document (llama.vim: ~32, Copilot: 60)
CHUNK_MAX_CHARS = 2400  # a chunk of long lines ends early
LINE_MAX_CHARS = 400  # a longer line (minified code, data) is cut: its identifiers say little
CHARS_PER_TOKEN = 3.0  # the server has no tokenizer: code runs 3.5-4 characters a token, so this over-counts
HEADER_TOKENS = 12  # a chunk's path line and separator token


def identifiers(text: str) -> frozenset[str]:
    """The names in ``text``: identifiers of two or more characters that are not keywords."""
    return frozenset(w for w in _IDENT.findall(text) if len(w) > 1 and w not in _STOP)


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    if not a or not b:
        return 0.0
    inter = len(a & b) if len(a) <= len(b) else len(b & a)
    return inter / (len(a) + len(b) - inter)


def estimate_tokens(text: str) -> int:
    return int(len(text) / CHARS_PER_TOKEN) + HEADER_TOKENS


@dataclass(frozen=True, eq=False, slots=True)
class Chunk:
    uri: str
    label: str  # the path shown in the prompt
    start: int  # first line (0-based)
    end: int  # line after the last
    text: str
    kind: str  # "tab" (an open document), "import" (a definition an import names), "edit" (recently edited)
    ids: frozenset[str] = field(repr=False)
    name: str = ""  # the definition's name (imports)

    @property
    def tokens(self) -> int:
        return estimate_tokens(self.text)

    def overlaps(self, other: Chunk) -> bool:
        return self.uri == other.uri and self.start < other.end and other.start < self.end

    def describe(self) -> str:
        """For logs and the debug request: where it comes from, never its text."""
        name = f" {self.name}" if self.name else ""
        return f"{self.kind}{name} {self.label}:{self.start + 1}-{self.end}"


def clip_line(line: str) -> str:
    return line if len(line) <= LINE_MAX_CHARS else line[:LINE_MAX_CHARS] + "\n"


def window_text(lines: Sequence[str], first: int, last: int) -> str:
    """Lines ``first`` to ``last`` (exclusive), each clipped to LINE_MAX_CHARS."""
    return "".join(clip_line(lines[i]) for i in range(max(0, first), min(len(lines), last)))


def chunk_spans(lines: Sequence[str], start: int, stop: int) -> Iterator[tuple[int, int, str]]:
    """(first line, line after the last, text) of consecutive chunks of CHUNK_LINES lines (fewer where the
    lines are long) from line ``start`` to ``stop``; blank ones skipped."""
    first = start
    while first < stop:
        parts, size, i = [], 0, first
        while i < stop and i < first + CHUNK_LINES and size < CHUNK_MAX_CHARS:
            line = clip_line(lines[i])
            parts.append(line)
            size += len(line)
            i += 1
        text = "".join(parts)
        if text.strip():
            yield first, i, text
        first = i
