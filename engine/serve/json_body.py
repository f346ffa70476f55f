"""JSON request bodies read with limits: nesting depth, values, numbers (``fimble serve``'s HTTP API).

``json.loads`` alone has none of these, and each one broke the endpoint: an array nested 100,000 deep raised
RecursionError, ``max_tokens`` of 10**400 raised OverflowError where it met a float, and a 16 MiB body of
``[{},{},...]`` would cost hundreds of MiB of dicts. So before parsing, a scan of the body's *skeleton* (the
body with its strings taken out, at C speed: a request's size is its prompt, a string) bounds how many
strings, how much other JSON and how deep the nesting is; numbers are then parsed through hooks that refuse
long literals and non-finite values. Every refusal is a ``JSONLimitError`` whose message is safe to send back
(it never quotes the body).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 16  # nesting: a completion request needs 3 ({"prompt": ["..."]})
MAX_STRINGS = 4096  # strings, keys included (a request has a few dozen)
MAX_SKELETON = 64 << 10  # bytes of everything but strings' contents: keys' quotes, numbers, punctuation
MAX_NUMBER_CHARS = 40  # a number literal: an int64 seed needs 19 digits, a float's repr at most 24 characters
_STRING = re.compile(rb'"[^"]*"')  # after escaped backslashes and quotes are gone, a string has no quote inside
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JSONLimitError(ValueError):
    """A body refused by a limit, or not JSON; the message quotes nothing of the body."""


def loads(data: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of a UTF-8 ``data``, within the module's limits (JSONLimitError otherwise)."""
    _check_skeleton(data, max_depth)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise JSONLimitError("the body is not UTF-8") from None
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except JSONLimitError:
        raise
    except (ValueError, RecursionError):  # RecursionError: a backstop only, the depth scan comes first
        raise JSONLimitError("the body is not valid JSON") from None


def _check_skeleton(data: bytes, max_depth: int) -> None:
    # Escapes first (a run of backslashes pairs from its start, so ``\\\\`` then ``\\"``): what is left of a
    # string is a quote, text without quotes, a quote. On invalid JSON this may miscount; json.loads refuses it.
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    if plain.count(b'"') > 2 * MAX_STRINGS:  # counted before the regex, whose cost grows with the strings
        raise JSONLimitError(f"the JSON body holds more than {MAX_STRINGS} strings")
    skeleton = _STRING.sub(b"", plain)
    if len(skeleton) > MAX_SKELETON:
        raise JSONLimitError(f"the JSON body holds more than {MAX_SKELETON} bytes outside its strings")
    depth = 0
    for byte in skeleton.translate(None, _NOT_BRACKETS):
        depth += 1 if byte in b"[{" else -1
        if depth > max_depth:
            raise JSONLimitError(f"the JSON body is nested deeper than {max_depth} levels")


def _int(literal: str) -> int:
    if len(literal) > MAX_NUMBER_CHARS:  # 10**400 would parse, then overflow wherever it met a float
        raise JSONLimitError(f"a number in the body is longer than {MAX_NUMBER_CHARS} characters")
    return int(literal)


def _float(literal: str) -> float:
    if len(literal) > MAX_NUMBER_CHARS:
        raise JSONLimitError(f"a number in the body is longer than {MAX_NUMBER_CHARS} characters")
    value = float(literal)
    if not math.isfinite(value):  # 1e400 parses as inf
        raise JSONLimitError("a number in the body is out of range")
    return value


def _constant(name: str) -> float:
    raise JSONLimitError(f"{name} is not JSON")  # json.loads would take NaN and Infinity
