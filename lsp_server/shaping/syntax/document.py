"""A source document kept in sync with tree-sitter trees under incremental edits.

Offsets are UTF-8 byte offsets throughout (what tree-sitter uses); helpers convert LSP
positions (UTF-16 code units by default) to bytes so callers never guess.

Segments: the text is cut at top-level statements that start a line into segments of about
`SEGMENT_LINES` lines, each parsed on its own (tree-sitter `included_ranges`, so node offsets
stay absolute). An edit reparses only its segment. Why: when an edit ends a Python block's last
line, tree-sitter's reuse check meets the old DEDENT's external-scanner state before the new one
is lexed, rejects the following subtree and re-lexes everything after the edit to the end of the
parse (known upstream behaviour for external scanners). On a 3,000-line file that made ~1 in 20
keystrokes cost 4-10 ms; with segments the cost is bounded by one segment (a top-level class is
never split, so its size is the bound). Errors stay local to their segment: an unclosed bracket
does not swallow the functions after it, which is what classification and validation want.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass

from tree_sitter import Node, Parser, Point, Range, Tree

from lsp_server.shaping.syntax.languages import get_language, normalize_language_id

SEGMENT_LINES = 150  # target lines per separately parsed segment
_RESPLIT_FACTOR = 4  # re-split a segment that has grown past this many targets


@dataclass
class _Segment:
    start: int  # byte where the segment starts (always a line start)
    end: int  # byte where it ends (next segment's start, or the document end)
    row: int  # row of `start`
    tree: Tree
    tree_start: int  # `start` and `row` as the tree last saw them; a pending shift is
    tree_row: int  # applied lazily when the tree is next used (see _sync)
    split_at_lines: int = 0  # size at which a re-split found no cut: retry only well past it

    def copy(self) -> _Segment:
        return _Segment(
            self.start, self.end, self.row, self.tree.copy(), self.tree_start, self.tree_row, self.split_at_lines
        )


class SyntaxDocument:
    """Text + parse trees. `has_tree` is False for languages without a grammar (plain text).

    Not thread-safe (one tree-sitter parser per document); see `snapshot`.
    """

    def __init__(self, language_id: str, text: str | bytes) -> None:
        self.language_id = normalize_language_id(language_id) or language_id
        self.language = get_language(language_id)
        self._parser = Parser(self.language) if self.language is not None else None
        self._bytes = b""
        self._text: str | None = None
        self._segments: list[_Segment] = []
        self.set_text(text)

    # -- accessors -------------------------------------------------------------------------------
    @property
    def bytes(self) -> bytes:
        return self._bytes

    @property
    def text(self) -> str:
        if self._text is None:  # decoded lazily: edits happen far more often than reads
            self._text = self._bytes.decode("utf-8", errors="replace")
        return self._text

    @property
    def has_tree(self) -> bool:
        return self._parser is not None

    def root_at(self, byte: int) -> Node | None:
        """Root node of the segment holding `byte` (the last segment for the document end)."""
        if not self._segments:
            return None
        return self._tree(self._index_at(byte)).root_node

    def root_before(self, byte: int) -> Node | None:
        """Root node of the segment holding the text just before `byte` (for cursor queries)."""
        return self.root_at(max(0, byte - 1))

    def segment_ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self._segments]

    def trees(self) -> list[Tree]:
        return [self._tree(i) for i in range(len(self._segments))]

    # -- edits -----------------------------------------------------------------------------------
    def set_text(self, text: str | bytes) -> None:
        """Full replacement (LSP full sync): a fresh parse, no stale tree reuse."""
        self._bytes = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        self._text = text if isinstance(text, str) else None
        self._segments = self._build_segments(0, len(self._bytes), 0) if self._parser else []

    def apply_edit(self, start_byte: int, old_end_byte: int, new_text: str | bytes) -> None:
        """Replace bytes [start_byte, old_end_byte) with `new_text`, reparsing incrementally."""
        new = new_text.encode("utf-8") if isinstance(new_text, str) else new_text
        start, old_end = self._check_range(start_byte, old_end_byte)
        old = self._bytes
        self._bytes = old[:start] + new + old[old_end:]
        self._text = None
        if not self._segments:
            return
        delta = len(new) - (old_end - start)
        drows = new.count(b"\n") - old.count(b"\n", start, old_end)
        i = self._index_at(start)
        j = i
        # An edit reaching a later segment's first byte merges the segments it touches.
        while j + 1 < len(self._segments) and old_end >= self._segments[j + 1].start and old_end > start:
            j += 1
        seg = self._segments[i]
        for later in self._segments[j + 1 :]:
            later.start += delta
            later.end += delta
            later.row += drows
        if j > i:
            end = self._segments[j].end + delta
            self._segments[i : j + 1] = self._build_segments(seg.start, end, seg.row)
            return
        self._sync(seg)
        start_point = _point(old, start)
        seg.tree.edit(
            start_byte=start,
            old_end_byte=old_end,
            new_end_byte=start + len(new),
            start_point=start_point,
            old_end_point=_point(old, old_end),
            new_end_point=_advance(start_point, new),
        )
        seg.end += delta
        seg.tree = self._parse(seg.start, seg.end, seg.row, seg.tree)
        if drows > 0:
            self._maybe_resplit(i)

    def _maybe_resplit(self, i: int) -> None:
        """Cut a segment that has grown well past the target, using its own tree's top level."""
        seg = self._segments[i]
        lines = self._bytes.count(b"\n", seg.start, seg.end)
        if lines <= max(_RESPLIT_FACTOR * SEGMENT_LINES, seg.split_at_lines + SEGMENT_LINES):
            return
        cuts = _cut_points(seg.tree.root_node, seg.start, seg.row, self._bytes, seg.end)
        if len(cuts) == 1:
            seg.split_at_lines = lines  # one huge top-level statement: nothing to cut
            return
        bounds = cuts + [(seg.end, -1)]
        self._segments[i : i + 1] = [
            _Segment(s, e, r, self._parse(s, e, r), s, r) for (s, r), (e, _) in zip(bounds, bounds[1:], strict=False)
        ]

    def apply_lsp_edit(
        self,
        start: tuple[int, int],
        end: tuple[int, int],
        new_text: str,
        encoding: str = "utf-16",
    ) -> None:
        """LSP-style edit: (line, character) positions in `encoding` units."""
        s = self.byte_at_position(*start, encoding=encoding)
        e = self.byte_at_position(*end, encoding=encoding)
        self.apply_edit(s, e, new_text)

    def snapshot(self) -> SyntaxDocument:
        """An independent copy (trees are copied, not reparsed) with its own parser.

        A SyntaxDocument is not thread-safe: take a snapshot on the thread that applies edits
        before handing the document to a worker (e.g. for validate_completion).
        """
        clone = object.__new__(SyntaxDocument)
        clone.language_id, clone.language = self.language_id, self.language
        clone._parser = Parser(self.language) if self.language is not None else None
        clone._bytes, clone._text = self._bytes, self._text
        clone._segments = [s.copy() for s in self._segments]
        return clone

    @classmethod
    def build_in_slices(
        cls, language_id: str, text: str | bytes, slice_s: float
    ) -> Generator[None, None, SyntaxDocument]:
        """Parse ``text`` in slices of about ``slice_s`` seconds: a generator that yields between
        slices and returns the document. Why: a whole parse costs about a second per megabyte, and
        its caller (the server's event loop) must answer other messages meanwhile. tree-sitter
        resumes a parse cancelled by its progress callback where it stopped, given the same input.
        The text must not change until the generator is done (apply later edits to the result).
        """
        doc = cls(language_id, "")
        doc._bytes = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        doc._text = text if isinstance(text, str) else None
        if doc._parser is not None:
            doc._segments = yield from doc._build_segments_sliced(0, len(doc._bytes), 0, _Slices(slice_s))
        return doc

    def _parse_sliced(self, start: int, end: int, row: int, slices: _Slices) -> Generator[None, None, Tree]:
        assert self._parser is not None
        data = self._bytes
        self._parser.included_ranges = [Range(Point(row, 0), _point(data, end), start, end)]

        def read(byte: int, _point: Point) -> bytes:
            return data[byte : byte + 65536]

        while True:
            try:
                tree = self._parser.parse(read, progress_callback=slices.over)
            except ValueError:  # cancelled at the deadline: resume in the next slice
                tree = None
            if tree is not None:
                self._parser.included_ranges = []
                return tree
            yield
            slices.renew()

    def _build_segments_sliced(
        self, start: int, end: int, row: int, slices: _Slices
    ) -> Generator[None, None, list[_Segment]]:
        """``_build_segments``, yielding whenever a slice's time is up."""
        whole = yield from self._parse_sliced(start, end, row, slices)
        cuts = yield from _cut_point_steps(whole.root_node, start, row, self._bytes, end, slices)
        if len(cuts) == 1:
            return [_Segment(start, end, row, whole, start, row)]
        bounds = cuts + [(end, -1)]
        segments = []
        for (s, r), (e, _) in zip(bounds, bounds[1:], strict=False):
            tree = yield from self._parse_sliced(s, e, r, slices)
            segments.append(_Segment(s, e, r, tree, s, r))
            if slices.over():
                yield
                slices.renew()
        return segments

    def with_edit(self, start_byte: int, old_end_byte: int, new_text: str | bytes) -> SyntaxDocument:
        """A copy with one edit applied; the original is untouched (used to test completions)."""
        clone = self.snapshot()
        clone.apply_edit(start_byte, old_end_byte, new_text)
        return clone

    # -- positions -------------------------------------------------------------------------------
    def point_at(self, byte: int) -> Point:
        """(row, byte column) of a byte offset, as tree-sitter wants."""
        return _point(self._bytes, byte)

    def line_bounds(self, byte: int) -> tuple[int, int]:
        """[start, end) bytes of the line holding `byte`; end excludes the newline."""
        buf = self._bytes
        start = buf.rfind(b"\n", 0, byte) + 1
        end = buf.find(b"\n", byte)
        return start, len(buf) if end < 0 else end

    def byte_at_position(self, line: int, character: int, encoding: str = "utf-16") -> int:
        """LSP position -> byte offset. Positions past a line's end clamp to that end."""
        buf, start = self._bytes, 0
        for _ in range(line):
            nl = buf.find(b"\n", start)
            if nl < 0:
                return len(buf)
            start = nl + 1
        end = buf.find(b"\n", start)
        line_bytes = buf[start : len(buf) if end < 0 else end]
        if encoding == "utf-8":
            return start + min(character, len(line_bytes))
        units, offset = 0, 0
        for ch in line_bytes.decode("utf-8", errors="replace"):
            if units >= character:
                break
            units += _units(ch, encoding)
            offset += len(ch.encode("utf-8"))
        return start + min(offset, len(line_bytes))

    def position_at_byte(self, byte: int, encoding: str = "utf-16") -> tuple[int, int]:
        """Byte offset -> LSP (line, character) in `encoding` units."""
        row, col = self.point_at(byte)
        if encoding == "utf-8":
            return row, col
        head = self._bytes[byte - col : byte].decode("utf-8", errors="replace")
        return row, sum(_units(ch, encoding) for ch in head)

    # -- errors ----------------------------------------------------------------------------------
    def error_nodes(self) -> Iterator[Node]:
        """ERROR and MISSING nodes, found by descending only into subtrees that have errors."""
        for tree in self.trees():
            stack = [tree.root_node]
            while stack:
                node = stack.pop()
                if node.is_error or node.is_missing:
                    yield node
                    if node.is_missing:
                        continue
                if node.has_error:
                    stack.extend(c for c in node.children if c.has_error)

    # -- segments --------------------------------------------------------------------------------
    def _index_at(self, byte: int) -> int:
        starts = [s.start for s in self._segments]
        return max(0, bisect.bisect_right(starts, byte) - 1)

    def _tree(self, i: int) -> Tree:
        seg = self._segments[i]
        self._sync(seg)
        return seg.tree

    def _sync(self, seg: _Segment) -> None:
        """Apply edits made before the segment as one shift of its leading (unparsed) bytes."""
        if seg.tree_start == seg.start and seg.tree_row == seg.row:
            return
        seg.tree.edit(
            start_byte=0,
            old_end_byte=seg.tree_start,
            new_end_byte=seg.start,
            start_point=Point(0, 0),
            old_end_point=Point(seg.tree_row, 0),
            new_end_point=Point(seg.row, 0),
        )
        seg.tree_start, seg.tree_row = seg.start, seg.row

    def _parse(self, start: int, end: int, row: int, old: Tree | None = None) -> Tree:
        assert self._parser is not None
        end_point = _point(self._bytes, end)
        self._parser.included_ranges = [Range(Point(row, 0), end_point, start, end)]
        tree = self._parser.parse(self._bytes, old) if old is not None else self._parser.parse(self._bytes)
        self._parser.included_ranges = []
        return tree

    def _build_segments(self, start: int, end: int, row: int) -> list[_Segment]:
        """Parse [start, end) and cut it at top-level statements into ~SEGMENT_LINES pieces."""
        whole = self._parse(start, end, row)
        cuts = _cut_points(whole.root_node, start, row, self._bytes, end)
        if len(cuts) == 1:
            return [_Segment(start, end, row, whole, start, row)]
        bounds = cuts + [(end, -1)]
        return [
            _Segment(s, e, r, self._parse(s, e, r), s, r) for (s, r), (e, _) in zip(bounds, bounds[1:], strict=False)
        ]

    def _check_range(self, start: int, end: int) -> tuple[int, int]:
        n = len(self._bytes)
        if not 0 <= start <= end <= n:
            raise ValueError(f"edit range [{start}, {end}) outside document of {n} bytes")
        return start, end


class _Slices:
    """The deadline of the current slice of a sliced parse."""

    def __init__(self, slice_s: float) -> None:
        self.slice_s = slice_s
        self.renew()

    def renew(self) -> None:
        self.deadline = time.perf_counter() + self.slice_s

    def over(self, *_state: object) -> bool:  # also tree-sitter's progress callback: True cancels (resumably)
        return time.perf_counter() > self.deadline


def _cut_points(root: Node, start: int, row: int, data: bytes, end: int) -> list[tuple[int, int]]:
    """(byte, row) segment starts: top-level children at column 0, about SEGMENT_LINES apart."""
    steps = _cut_point_steps(root, start, row, data, end, None)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


def _cut_point_steps(
    root: Node, start: int, row: int, data: bytes, end: int, slices: _Slices | None
) -> Generator[None, None, list[tuple[int, int]]]:
    """``_cut_points``, yielding when a slice's time is up (a file of 150,000 one-line statements
    has as many top-level children: a 0.3 s loop)."""
    cuts = [(start, row)]
    cursor = root.walk()  # one child at a time: no list of every child at once
    more, i = cursor.goto_first_child(), 0
    while more:
        child = cursor.node
        assert child is not None
        r = child.start_point.row
        if child.start_point.column == 0 and child.start_byte > start and r - cuts[-1][1] >= SEGMENT_LINES:
            cuts.append((child.start_byte, r))
        i += 1
        if slices is not None and i % 512 == 0 and slices.over():
            yield
            slices.renew()
        more = cursor.goto_next_sibling()
    if len(cuts) > 1 and data.count(b"\n", cuts[-1][0], end) < SEGMENT_LINES // 3:
        cuts.pop()  # fold a short tail into the previous segment
    return cuts


def _point(buf: bytes, byte: int) -> Point:
    return Point(buf.count(b"\n", 0, byte), byte - (buf.rfind(b"\n", 0, byte) + 1))


def _units(ch: str, encoding: str) -> int:
    if encoding == "utf-16":
        return 2 if ord(ch) > 0xFFFF else 1
    if encoding == "utf-32":
        return 1
    return len(ch.encode("utf-8"))


def _advance(point: Point, inserted: bytes) -> Point:
    """Point reached after inserting `inserted` at `point`."""
    rows = inserted.count(b"\n")
    if rows == 0:
        return Point(point.row, point.column + len(inserted))
    return Point(point.row + rows, len(inserted) - (inserted.rfind(b"\n") + 1))
