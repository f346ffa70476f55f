"""Open documents as line lists, kept in sync under incremental edits.

Why not pygls' workspace documents: they re-split the whole text on every access (one
10 MB file and 20k keystrokes would cost minutes) and split lines on characters that are
not LSP line breaks (U+2028, form feed, ...). Here only ``\\n``, ``\\r\\n`` and ``\\r``
end a line, an edit touches only the lines it spans, and the total length is tracked so
"what was typed since" checks cost one window, not one document.

Each document also keeps an ``lsp_server.shaping.syntax.SyntaxDocument`` (``Document.syntax``) in step,
edit by edit (incremental reparse of one segment): the syntax policy and the completion
shaper read it. It holds the same text with two same-length substitutions (``syntax_text``):
lone surrogates become U+FFFD, and a lone ``\\r`` (an old Mac line end) becomes ``\\n``.
Why the second: tree-sitter counts only ``\\n`` as a row break while LSP counts ``\\r`` too;
with the substitution rows, lines and byte offsets agree 1:1, so an edit near or after a lone
``\\r`` stays an incremental reparse (before, one lone ``\\r`` anywhere made every keystroke
re-parse the whole document: ~0.7 s a keystroke on a 900 KB file). A language without a
grammar is plain text there. Parse size limit: a document longer than ``SYNTAX_MAX_CHARS``
characters is not parsed (plain text there), whether it was opened that big or grew through
edits; one that shrinks back below ``SYNTAX_RESUME_CHARS`` is parsed again. Why: tree-sitter
takes about a second per megabyte, on the event loop. Likewise a document with a line longer
than ``SYNTAX_MAX_LINE`` (minified code, data) is plain text until no such line is left: an
edit inside a long line re-parses all of it (1-2 s a keystroke in a 900 KB line).
A whole parse (open, full replacement, back under the limits) of more than ``SYNC_PARSE_CHARS``
characters runs in slices of ``PARSE_SLICE_S`` on the event loop, between other messages
(``SyntaxDocument.build_in_slices``): one of more than ``SLICED_PARSE_CHARS`` from its first slice,
a shorter one after a first slice run at once (most finish within it: size does not bound a parse's
time, error recovery does not); meanwhile the syntax copy is plain text, edits made meanwhile are
replayed onto the new trees, incrementally, when the parse is done.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

from lsp_server.positions import UTF16, PositionError, from_codepoints, to_codepoints
from lsp_server.segments import block_start_rows
from lsp_server.shaping.syntax.document import SyntaxDocument  # no torch: tree-sitter only

_BREAK = re.compile(r"(\r\n|\r|\n)")
_OTHER_BREAKS = re.compile("[\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
T = TypeVar("T")
SPLIT_CHUNK_CHARS = 1 << 20
SYNTAX_MAX_CHARS = 1_000_000
# A document over the limit is parsed again only once it is this short: a document edited
# around the limit must not pay a full parse per keystroke.
SYNTAX_RESUME_CHARS = SYNTAX_MAX_CHARS * 9 // 10
SYNTAX_MAX_LINE = 50_000  # characters; about 70 ms of reparse per keystroke inside such a line
SLICED_PARSE_CHARS = 100_000  # a whole parse of more runs in slices (about 100 ms of parse per 100 KB)
SYNC_PARSE_CHARS = 16_000  # ... of at most this many at once; between the two, its first slice at once
PARSE_SLICE_S = 0.03
log = logging.getLogger(__name__)
_BARE_CR = re.compile("\r(?!\n)")
_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8_safe(text: str) -> str:
    """Lone surrogates (a non-UTF-8 file read with surrogateescape) cannot be encoded: use U+FFFD."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def syntax_text(text: str) -> str:
    """The syntax layer's copy of ``text``: UTF-8-safe, a lone ``\\r`` as ``\\n``; as many code points."""
    text = utf8_safe(text)
    return _BARE_CR.sub("\n", text) if "\r" in text else text


def syntax_text_steps(text: str) -> Generator[None, None, str]:
    """``syntax_text`` in pieces of about ``SPLIT_CHUNK_CHARS`` (cut after a ``\n``, so a
    ``\r\n`` stays whole), yielding between them."""
    if len(text) <= SPLIT_CHUNK_CHARS:
        return syntax_text(text)
    pieces, pos = [], 0
    while pos < len(text):
        cut = text.find("\n", pos + SPLIT_CHUNK_CHARS)
        end = len(text) if cut < 0 else cut + 1
        pieces.append(syntax_text(text[pos:end]))
        pos = end
        yield
    return "".join(pieces)


def split_lines(text: str) -> list[str]:
    """Lines with their terminators; the last line has none (and may be empty)."""
    return run_steps(split_lines_steps(text))


def split_lines_steps(text: str) -> Generator[None, None, list[str]]:
    """``split_lines`` in pieces of about ``SPLIT_CHUNK_CHARS``, yielding between them (a 10 MB
    text is about 0.15 s of splitting: the event loop must answer other sessions meanwhile).
    Pieces end just after a ``\n``, so a ``\r\n`` is never cut in two."""
    lines: list[str] = []
    pos, n = 0, len(text)
    while n - pos > SPLIT_CHUNK_CHARS:
        cut = text.find("\n", pos + SPLIT_CHUNK_CHARS)
        if cut < 0:
            break
        piece = _split_piece(text[pos : cut + 1])
        piece.pop()  # the empty line after its last break: the next piece starts there
        lines.extend(piece)
        pos = cut + 1
        yield
    if not lines:
        return _split_piece(text)
    lines.extend(_split_piece(text[pos:]))
    return lines


def _split_piece(text: str) -> list[str]:
    """Lines of ``text`` with terminators; the last is unterminated (maybe empty)."""
    if not _OTHER_BREAKS.search(text):  # str.splitlines also breaks on these; LSP does not
        lines = text.splitlines(keepends=True)
        if not lines or lines[-1].endswith(("\n", "\r")):
            lines.append("")
        return lines
    parts = _BREAK.split(text)
    lines = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
    lines.append(parts[-1])
    return lines


def run_steps(steps: Generator[None, None, T]) -> T:
    """Run a generator of steps to its end at once; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class SlicedParse:
    """A whole parse running in slices on the event loop, and the syntax edits made since its text was taken.

    Each slice is one step of ``steps`` (SyntaxDocument.build_in_slices), then the loop's other work;
    when the last is done, the edits made meanwhile are replayed onto the new trees (incrementally) and
    ``done`` gets them. A parser failure ends it without ``done``: the document stays plain text."""

    def __init__(
        self,
        steps: Generator[None, None, SyntaxDocument],
        loop: asyncio.AbstractEventLoop,
        done: Callable[[SyntaxDocument | None], None],
    ):
        self.steps, self.loop, self.done = steps, loop, done
        self.replay: list[tuple[int, int, str]] = []  # (start byte, end byte, text) of each edit since
        self.handle: asyncio.Handle | None = loop.call_soon(self._slice)
        self.over = False

    def _slice(self) -> None:
        if self.over:
            return
        try:
            next(self.steps)
        except StopIteration as finished:
            self.over = True
            syntax = finished.value
            for start, end, text in self.replay:
                syntax.apply_edit(start, end, text)
            self.done(syntax)
            return
        except Exception:  # a parser failure must not cost the document: it stays plain text
            log.exception("sliced parse failed; the document stays plain text")
            self.over = True
            self.done(None)
            return
        self.handle = self.loop.call_soon(self._slice)

    def cancel(self) -> None:
        self.over = True
        if self.handle is not None:
            self.handle.cancel()
        self.steps.close()


def strip_eol(line: str) -> str:
    if line.endswith("\n"):
        return line[:-2] if line.endswith("\r\n") else line[:-1]
    return line[:-1] if line.endswith("\r") else line


@dataclass
class Document:
    uri: str
    text: str = ""
    version: int = 0
    language_id: str = ""
    lines: list[str] = field(init=False)
    length: int = field(init=False)
    # Start (line, column) of the prompt's prefix window: kept stable so the engine's KV
    # cache keeps matching (see lsp_server/prompt.py); None = choose afresh.
    window: tuple[int, int] | None = None
    syntax: SyntaxDocument = field(init=False, repr=False)
    full_parses: int = field(init=False, default=0, repr=False)  # whole-document parses (open, resync, limit)
    _long_lines: int = field(init=False, default=0, repr=False)  # lines over SYNTAX_MAX_LINE
    _edits: int = field(init=False, default=0, repr=False)  # bumped by every change of the text
    _blocks: tuple[tuple, list[int]] | None = field(init=False, default=None, repr=False)  # block_rows' cache
    _job: SlicedParse | None = field(init=False, default=None, repr=False)  # a sliced whole parse under way
    _anchor: tuple[int, int] = field(init=False, default=(0, 0), repr=False)  # a (line, start byte) in syntax
    _batch: bool = field(init=False, default=False, repr=False)  # edits reach the lines only (see begin_batch)

    def __post_init__(self) -> None:
        self.set_text(self.text)
        self.text = ""  # the lines are the truth; don't keep a second copy

    def set_text(self, text: str) -> None:
        run_steps(self.set_text_steps(text))

    def set_text_steps(self, text: str) -> Generator[None, None, None]:
        """``set_text`` in steps (a generator yielding between pieces of work): see lsp_server/pacing.py."""
        self.lines = yield from split_lines_steps(text)
        self.length = len(text)
        self._long_lines = yield from _count_long_steps(self.lines)
        self.window = None
        if not self._batch:
            yield from self._sync_all_steps(text)

    @property
    def changing(self) -> bool:
        """A change is being applied in steps: the lines and the syntax copy may disagree until it ends."""
        return self._batch

    def begin_batch(self) -> None:
        """Until ``end_batch``, edits change the lines only; the syntax copy is rebuilt once at the end.

        Why: an incremental reparse costs 2-4 ms an edit, so one ``didChange`` holding 20,000 edits
        cost the server over a minute; the lines alone cost microseconds an edit."""
        self.cancel_parse()
        self._batch = True

    def end_batch(self) -> None:
        run_steps(self.end_batch_steps())

    def end_batch_steps(self) -> Generator[None, None, None]:
        if self._batch:
            self._batch = False
            source = yield from self.source_steps()
            yield from self._sync_all_steps(source)

    def _sync_all(self, text: str) -> None:
        run_steps(self._sync_all_steps(text))

    def _sync_all_steps(self, text: str) -> Generator[None, None, None]:
        self._edits += 1
        self._anchor = (0, 0)
        self.cancel_parse()
        lang = self.language_id if self._parse_allowed(SYNTAX_MAX_CHARS) else ""
        self._syntax_lang = lang
        target = SyntaxDocument(lang or "plaintext", "")
        text = yield from syntax_text_steps(text)
        loop = _running_loop()
        if target.has_tree and loop is not None and len(text) > SYNC_PARSE_CHARS:
            steps = SyntaxDocument.build_in_slices(lang, text, PARSE_SLICE_S)
            if len(text) <= SLICED_PARSE_CHARS:
                # Its first slice now: most documents are parsed within it. The parse time of a text is not
                # bounded by its size (error recovery: 99,000 characters of broken Python took 0.4 s on the
                # loop, a document left broken by a change of 20,000 edits 0.2 s), so the rest runs in slices.
                try:
                    next(steps)
                except StopIteration as done:
                    self.syntax = done.value
                    self.full_parses += 1
                    return
            self.syntax = SyntaxDocument("plaintext", text)  # plain text until the parse is done
            self._job = SlicedParse(steps, loop, self._parsed)
            return
        target.set_text(text)
        self.syntax = target
        self.full_parses += target.has_tree

    def _parsed(self, syntax: SyntaxDocument | None) -> None:
        """The sliced parse ended: its trees (None: it failed, the syntax copy stays plain text)."""
        self._job = None
        if syntax is not None:
            self.syntax = syntax
            self._edits += 1
            self.full_parses += 1

    @property
    def parsing(self) -> bool:
        """Whether a sliced whole parse is under way (the syntax copy is plain text until it ends)."""
        return self._job is not None

    def cancel_parse(self) -> None:
        """Stop a sliced parse under way (the text was replaced, or the document closed)."""
        job, self._job = self._job, None
        if job is not None:
            job.cancel()

    def _parse_allowed(self, max_chars: int) -> bool:
        return self.length <= max_chars and not self._long_lines

    def _check_size_limit(self) -> None:
        """Stop parsing a document that grew past the limits; parse again one back well within them."""
        if self._syntax_lang and not self._parse_allowed(SYNTAX_MAX_CHARS):
            self._sync_all(self.source)  # to plain text: no parse
        elif not self._syntax_lang and self.language_id and self._parse_allowed(SYNTAX_RESUME_CHARS):
            self._sync_all(self.source)

    def byte_offset(self, line: int, col: int) -> int:
        """UTF-8 byte offset in ``syntax`` of a (line, code point column) of this document."""
        buf = self.syntax.bytes
        start = self._line_start(line)
        if start is None:
            return len(buf)
        if not col:
            return start
        end = buf.find(b"\n", start)
        text = buf[start : len(buf) if end < 0 else end].decode("utf-8", errors="replace")
        return start + len(text[:col].encode("utf-8"))

    def _line_start(self, line: int) -> int | None:
        """Byte where ``line`` starts in ``syntax`` (None past the end).

        Walked from the last answer (``_anchor``) when it is near: typing asks about the same
        lines again and again, and splitting the whole buffer each time cost ~12 ms a call on a
        150,000-line file (three calls a keystroke).
        """
        buf = self.syntax.bytes
        a_line, pos = self._anchor
        if abs(line - a_line) > 64:
            parts = buf.split(b"\n", line) if line else [buf]
            if len(parts) <= line:
                return None
            pos = len(buf) - len(parts[-1])
        elif line >= a_line:
            for _ in range(line - a_line):
                nl = buf.find(b"\n", pos)
                if nl < 0:
                    return None
                pos = nl + 1
        else:
            for _ in range(a_line - line):
                pos = buf.rfind(b"\n", 0, pos - 1) + 1
        self._anchor = (line, pos)
        return pos

    def block_rows(self, first: int = 0, last: int | None = None) -> list[int] | None:
        """Lines where a top-level definition starts (lsp_server/segments.py), or None without a parse.

        At least those in [``first``, ``last``]: only the parse segments that overlap that range
        are read. Read from the trees the document keeps anyway (no reparse); the latest answer
        is kept until the next edit (a document has about one prompt window at a time).
        """
        if not self.syntax.has_tree:  # no grammar, or too big
            return None
        key = (self._edits, first, last)
        if self._blocks is None or self._blocks[0] != key:
            self._blocks = (key, block_start_rows(self.syntax.trees(), first, last))
        return self._blocks[1]

    @property
    def source(self) -> str:
        return "".join(self.lines)

    def source_steps(self, step: int = 1 << 16) -> Generator[None, None, str]:
        """``source`` in steps of ``step`` lines (joining 10 MB of lines at once held the loop 0.1 s)."""
        if len(self.lines) <= step:
            return self.source
        pieces = []
        for i in range(0, len(self.lines), step):
            pieces.append("".join(self.lines[i : i + step]))
            yield
        return "".join(pieces)

    # -- positions ---------------------------------------------------------------------------
    def line_text(self, line: int) -> str:
        return strip_eol(self.lines[line])

    def to_cp(self, line: int, units: int, encoding: str = UTF16, *, lenient: bool = False) -> tuple[int, int]:
        """(line, code point column) of a client position.

        Raises PositionError for a line past the end and for a column inside a character,
        unless ``lenient`` (edits: clamp to the end, round down inside a character; an edit
        can't be refused, and that is the closest text a broken client can mean).
        """
        if line < 0 or units < 0:
            raise PositionError(f"negative position {line}:{units}")
        if line >= len(self.lines):
            if not lenient:
                raise PositionError(f"line {line} is past the end of the document ({len(self.lines)} lines)")
            last = len(self.lines) - 1
            return last, len(self.line_text(last))
        return line, to_codepoints(self.line_text(line), units, encoding, strict=not lenient)

    def from_cp(self, line: int, col: int, encoding: str = UTF16) -> tuple[int, int]:
        return line, from_codepoints(self.line_text(line), col, encoding)

    # -- reading -----------------------------------------------------------------------------
    def text_between(self, start: tuple[int, int], end: tuple[int, int]) -> str:
        (l0, c0), (l1, c1) = start, end
        if l0 == l1:
            return self.lines[l0][c0:c1]
        return self.lines[l0][c0:] + "".join(self.lines[l0 + 1 : l1]) + self.lines[l1][:c1]

    def text_from(self, start: tuple[int, int], n: int) -> str:
        """Up to ``n`` characters from ``start``."""
        line, col = start
        parts: list[str] = []
        got = 0
        while line < len(self.lines) and got < n:
            piece = self.lines[line][col : col + n - got]
            parts.append(piece)
            got += len(piece)
            line, col = line + 1, 0
        return "".join(parts)

    # -- editing -----------------------------------------------------------------------------
    def with_edit(self, start: tuple[int, int], end: tuple[int, int], text: str) -> Document:
        """A scratch copy with one edit applied (the document an accept will leave: lsp_server/follow_up.py),
        this one untouched; its trees are copied, not reparsed, and the edit is parsed incrementally."""
        if self._batch or self._job is not None:
            raise ValueError("the document is being changed or parsed")
        clone = copy.copy(self)
        clone.lines = list(self.lines)
        clone.syntax = self.syntax.snapshot()
        clone._blocks = None
        clone.apply_edit(start, end, text)
        return clone

    def apply_edit(self, start: tuple[int, int], end: tuple[int, int], text: str) -> None:
        """Replace the code-point range [start, end) with ``text``."""
        run_steps(self.apply_edit_steps(start, end, text))

    def apply_edit_steps(self, start: tuple[int, int], end: tuple[int, int], text: str) -> Generator[None, None, None]:
        """``apply_edit`` in steps (it yields while splitting a large inserted text)."""
        if end < start:
            start, end = end, start
        l0, c0 = start
        l1, c1 = end
        # A large insertion re-syncs the syntax copy as a whole (a sliced parse) instead of an
        # incremental reparse of one segment grown by megabytes, which took seconds on the loop.
        resync = self._batch or len(text) > SLICED_PARSE_CHARS
        b0, b1 = (0, 0) if resync else (self.byte_offset(l0, c0), self.byte_offset(l1, c1))
        # A "\r" is a lone one (a "\n" in ``syntax``) or not by the char after it, so the syntax
        # edit also rewrites a "\r" just before the range, and reads the char just after it.
        cr_before = c0 == 0 and l0 > 0 and self.lines[l0 - 1].endswith("\r")
        after = self.lines[l1][c1 : c1 + 1] or (self.lines[l1 + 1][:1] if l1 + 1 < len(self.lines) else "")
        removed = len(self.text_between((l0, c0), (l1, c1)))
        head, tail = self.lines[l0][:c0], self.lines[l1][c1:]
        # Re-split a region that also covers a neighbouring lone "\r" when the edit puts a
        # "\n" right after it: the two become one line break, as the client counts them.
        first, last = l0, l1
        if c0 == 0 and l0 > 0 and self.lines[l0 - 1].endswith("\r") and (text + tail).startswith("\n"):
            first -= 1
            head = self.lines[first]
        if (head + text + tail).endswith("\r") and last + 1 < len(self.lines) and self.lines[last + 1].startswith("\n"):
            last += 1
            tail += self.lines[last]
        new_lines = yield from split_lines_steps(head + text + tail)
        if last + 1 < len(self.lines):
            new_lines.pop()  # the empty piece after the region's final line break: the next line starts there
        added = yield from _count_long_steps(new_lines)
        self._long_lines += added - _count_long(self.lines[first : last + 1])
        self.lines[first : last + 1] = new_lines
        self.length += len(text) - removed
        self._move_window(first, l1, len(new_lines) - (last - first + 1))
        self._edits += 1
        if resync:
            self._anchor = (0, 0)
            if not self._batch:
                source = yield from self.source_steps()
                yield from self._sync_all_steps(source)
            return
        new = "\r" + text if cr_before else text
        edit = (b0 - cr_before, b1, syntax_text(new + after)[: len(new)])
        if self._anchor[1] > edit[0]:
            self._anchor = (0, 0)  # its line start moved, or its line count did: walk from the top again
        self.syntax.apply_edit(*edit)
        if self._job is not None:
            self._job.replay.append(edit)  # for the trees being built from the text before it
        self._check_size_limit()

    def _move_window(self, first: int, last: int, line_delta: int) -> None:
        """Keep the prompt window on the same text when lines above it change."""
        if self.window is None:
            return
        wl, _ = self.window
        if last < wl:
            self.window = (wl + line_delta, self.window[1])
        elif first <= wl:
            self.window = None  # the edit touches the window's first line: choose again


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # no event loop (tests, the CLI): parse at once
        return None


def _count_long(lines: list[str]) -> int:
    if not lines or max(map(len, lines)) <= SYNTAX_MAX_LINE:  # (all in C: the usual answer, fast)
        return 0
    return sum(len(line) > SYNTAX_MAX_LINE for line in lines)


def _count_long_steps(lines: list[str], step: int = 1 << 17) -> Generator[None, None, int]:
    n = 0
    for i in range(0, len(lines), step):
        n += _count_long(lines[i : i + step])
        if i + step < len(lines):
            yield
    return n


class DocumentStore:
    """Open documents by URI."""

    def __init__(self) -> None:
        self._docs: dict[str, Document] = {}

    def open(self, uri: str, text: str, version: int, language_id: str) -> Document:
        return run_steps(self.open_steps(uri, text, version, language_id))

    def open_steps(self, uri: str, text: str, version: int, language_id: str) -> Generator[None, None, Document]:
        """``open`` in steps; the document is in the store once it is whole."""
        doc = Document(uri, "", version, language_id)
        yield from doc.set_text_steps(text)
        old = self._docs.pop(uri, None)
        if old is not None:
            old.cancel_parse()
        self._docs[uri] = doc
        return doc

    def get(self, uri: str) -> Document | None:
        return self._docs.get(uri)

    def close(self, uri: str) -> Document | None:
        doc = self._docs.pop(uri, None)
        if doc is not None:
            doc.cancel_parse()
        return doc

    def uris(self) -> list[str]:
        return list(self._docs)

    def __len__(self) -> int:
        return len(self._docs)

    def __iter__(self):
        return iter(self._docs.values())


__all__ = ["Document", "DocumentStore", "PositionError", "run_steps", "split_lines", "strip_eol", "utf8_safe"]
