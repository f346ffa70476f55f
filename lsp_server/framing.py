"""Content-Length framing (stdio and TCP) that survives any byte stream a client sends.

pygls' own loop exits on a header line over its reader's limit and goes deaf after a bad
Content-Length. Here every malformed frame becomes a ``FrameError`` (the caller answers a
JSON-RPC parse error) and reading resynchronises on the next ``Content-Length:`` header,
even one glued to the end of a mis-sized body. Memory stays bounded: header lines are cut
at ``max_header_line`` and a body larger than ``max_message`` is never read as a body.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

DEFAULT_MAX_MESSAGE = 16 << 20  # a large source file, JSON-escaped, in one didOpen fits
MAX_SKIP = 1 << 30  # the body of a frame over the limit is skipped unread up to this size
DEFAULT_MAX_HEADER_LINE = 64 << 10
_CONTENT_LENGTH = re.compile(rb"content-length:", re.IGNORECASE)
# An HTTP request line. A web page can POST to a loopback TCP port (no CORS check happens before
# the bytes are sent) with a body that holds LSP frames: a connection that opens like HTTP ends.
_HTTP_REQUEST = re.compile(rb"[A-Z]{3,10} \S+ HTTP/\d")
# A TCP connection must open with an LSP header, from its first byte: the shortest whole header
# ("Content-Length: 1\r\n\r\n") is longer than this, so an LSP client always sends these bytes first.
# Matching a request line instead missed one longer than the header-line limit (a long URL path).
LSP_OPENINGS = (b"content-length:", b"content-type:")
OPENING_BYTES = 13


@dataclass(frozen=True)
class Limits:
    max_message: int = DEFAULT_MAX_MESSAGE
    max_header_line: int = DEFAULT_MAX_HEADER_LINE


class FrameError(Exception):
    """A frame that cannot be read; the message is safe to send to the client."""


def _content_length(value: bytes, limits: Limits) -> int | str:
    """The length, or the problem with it."""
    value = value.strip()
    if not value or len(value) > 20 or not value.isdigit():
        return "Content-Length is not a non-negative integer"
    n = int(value)
    if n == 0:
        return "Content-Length is 0"
    if n > limits.max_message:
        return f"message of {n} bytes is over the limit of {limits.max_message} bytes"
    return n


async def read_opening(reader: asyncio.StreamReader) -> bytes | None:
    """The connection's first OPENING_BYTES where they begin an LSP header (case aside), else None (a
    browser's request, garbage, or an end before them): the caller closes such a connection before any
    session exists for it."""
    try:
        head = await reader.readexactly(OPENING_BYTES)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return head if any(o.startswith(head.lower()) for o in LSP_OPENINGS) else None


async def read_frames(
    reader: asyncio.StreamReader, limits: Limits, opening: bytes = b""
) -> AsyncIterator[bytes | FrameError]:
    """Yield each message body, or a FrameError for each malformed frame; return at EOF.

    ``reader`` must have been made with ``limit=limits.max_header_line``; ``opening``: bytes already
    read off it (``read_opening``), which start the first line.
    """
    length: int | None = None
    problem: str | None = None
    oversized = 0  # the body of a frame over the limit: skipped unread, so the next frame is found
    in_long_line = False  # the next line read is the tail of one over the limit
    first = True
    while True:
        try:
            line = await reader.readuntil(b"\n")
            if opening:
                line, opening = opening + line, b""
        except asyncio.IncompleteReadError:
            return  # EOF (a partial line is dropped)
        except asyncio.LimitOverrunError as exc:
            # The line is over the limit: drop what is buffered of it and go on reading.
            await reader.readexactly(max(1, exc.consumed))
            problem = problem or f"header line over {limits.max_header_line} bytes"
            in_long_line = True
            continue
        if in_long_line:
            in_long_line = False
            continue
        if first:
            first = False
            if _HTTP_REQUEST.match(line):
                yield FrameError("an HTTP request, not LSP: closing the connection")
                return
        line = line.rstrip(b"\r\n")
        if not line:  # end of a header block
            if problem is None and length is None:
                problem = "no Content-Length header"
            if problem is not None:
                if oversized and not await _skip(reader, oversized):
                    return
                yield FrameError(problem)
            else:
                assert length is not None
                try:
                    body = await reader.readexactly(length)
                except asyncio.IncompleteReadError:
                    return
                yield body
            length, problem, oversized = None, None, 0
            continue
        match = _CONTENT_LENGTH.search(line)
        if match is not None and match.start() > 0:
            # A header glued to the tail of a body whose Content-Length was too small (that
            # body was already answered as unparseable): a new frame starts here.
            line = line[match.start() :]
            length, problem, oversized = None, None, 0
        name, sep, value = line.partition(b":")
        if not sep:
            problem = problem or "malformed header line"
        elif name.strip().lower() == b"content-length":
            got = _content_length(value, limits)
            if length is not None:
                problem = problem or "duplicate Content-Length header"
            elif isinstance(got, str):
                problem = problem or got
                if got.startswith("message of") and problem == got and int(value.strip()) <= MAX_SKIP:
                    oversized = int(value.strip())  # (a larger claim is not believed: resync by headers)
            else:
                length = got
        # Other headers (Content-Type) are accepted and ignored.


async def _skip(reader: asyncio.StreamReader, n: int, chunk: int = 1 << 16) -> bool:
    """Read and drop ``n`` bytes in small pieces (an oversized body is never held whole); False at EOF."""
    while n > 0:
        got = await reader.read(min(n, chunk))
        if not got:
            return False
        n -= len(got)
    return True
