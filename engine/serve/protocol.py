"""The wire format of ``fimble serve``: engine/wire.py's msgpack messages over websockets.

Every websocket message is one binary frame holding one msgpack map. A connection starts
with a handshake, then carries exactly the messages of the engine child process
(engine/process.py), so a client is the same code over a pipe or a socket:

  client -> daemon: {op: hello, version: PROTOCOL_VERSION, client: "<name>"}      (first, always)
  daemon -> client: {op: ready, version, session, info}                          (accepted)
                  | {op: refused, error}, then close code 1008                   (wrong version, bad hello)
  then the messages of engine/wire.py, answered by engine/host_loop.py as the engine child answers them, and
  daemon -> client: {op: error, error} (a bad message; the connection stays up)

Authentication happens before the websocket opens: ``Authorization: Bearer <token>`` on the
HTTP upgrade (a wrong or missing token gets HTTP 401 and no websocket). Document ids a client
sends are its own: the daemon keys them as "<session>\\x00<id>", so sessions never see each
other's caches, and a session's documents go when its connection does.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from engine.api import CompletionRequest
from engine.errors import FimbleError
from engine.options import MAX_CONTEXT_CHARS, MAX_STOP_CHARS, MAX_STOPS
from engine.wire import ProtocolError, pack, request_from_dict

__all__ = ["ProtocolError", "pack", "unpack", "hello", "check_hello", "request_id", "document_key", "parse_request"]

PROTOCOL_VERSION = 1
DEFAULT_PORT = 8765
DEFAULT_MAX_MESSAGE = 16 << 20  # bytes in one websocket message (a request carries prefix + suffix)
MAX_PROMPT_CHARS = 4_000_000  # prefix + suffix characters in one request
MAX_ID = 2**53  # request ids: plain integers a JSON client can also represent
REFUSED_CLOSE_CODE = 1008  # policy violation: refused handshake
# Upper bounds of the numeric decode options (the lower ones are DecodeOptions.validate's).
OPTION_MAX = {"max_tokens": 4096, "temperature": 10.0, "gamma": 64, "max_gamma": 64, "max_lines": 1000}


def unpack(data: bytes | str) -> dict:
    """One message; ProtocolError if it is not a msgpack map with a string ``op``."""
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("messages are binary frames holding msgpack maps")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several types for malformed input
        raise ProtocolError("not a msgpack message") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("a message is a map with a string 'op'")
    return msg


def hello(client: str = "fimble") -> dict:
    return {"op": "hello", "version": PROTOCOL_VERSION, "client": client}


def check_hello(msg: dict) -> str | None:
    """None if ``msg`` is an acceptable hello, else why not (sent to the client, then closed)."""
    if msg.get("op") != "hello":
        return "the first message must be {op: hello, version}"
    version = msg.get("version")
    if version != PROTOCOL_VERSION:
        return (
            f"protocol version mismatch: this fimble serve speaks version {PROTOCOL_VERSION}, "
            f"the client sent {version!r}; use a fimble of the same version on both sides"
        )
    return None


def request_id(msg: dict) -> int:
    rid = msg.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid < MAX_ID:
        raise ProtocolError("'id' must be a non-negative integer")
    return rid


def document_key(session: str, document: Any) -> str:
    """The engine-side key of a client's document: namespaced by its session."""
    if document is None:
        document = ""
    if not isinstance(document, str) or len(document) > 8192:
        raise ProtocolError("a document id is a string of at most 8192 characters")
    return f"{session}\x00{document}"


def parse_request(data: Any, session: str) -> CompletionRequest:
    """A submit/prewarm request from the wire, range-checked, its document namespaced by ``session``."""
    if not isinstance(data, dict):
        raise ProtocolError("'request' must be a map")
    for name in ("prefix", "suffix"):
        if not isinstance(data.get(name, ""), str):
            raise ProtocolError(f"'{name}' must be a string")
    if len(data.get("prefix", "")) + len(data.get("suffix", "")) > MAX_PROMPT_CHARS:
        raise ProtocolError(f"prefix and suffix exceed {MAX_PROMPT_CHARS} characters")
    opts = data.get("options") or {}
    if not isinstance(opts, dict):
        raise ProtocolError("'options' must be a map")
    check_options(opts)
    lines = data.get("segment_lines")
    if lines is not None and (not isinstance(lines, list) or len(lines) > 100_000):
        raise ProtocolError("'segment_lines' must be a list of at most 100000 line numbers")
    try:
        req = request_from_dict(data)
        req.options.validate()
    except (TypeError, ValueError, KeyError, FimbleError) as exc:  # validate() raises PromptError (a FimbleError)
        raise ProtocolError(f"bad request: {_short(exc)}") from None
    req.document_id = document_key(session, data.get("document_id"))
    return req


def check_options(opts: dict) -> None:
    """Types and upper bounds of decode options (DecodeOptions.validate checks the lower ones)."""
    for name, value in opts.items():
        if name == "stop":
            if (
                not isinstance(value, (list, tuple))
                or len(value) > MAX_STOPS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in value)
            ):
                raise ProtocolError(f"'stop' must be at most {MAX_STOPS} strings of 1-{MAX_STOP_CHARS} characters")
        elif name == "drafter":
            if not isinstance(value, str):
                raise ProtocolError("'drafter' must be a string")
        elif name == "context":
            if not isinstance(value, str) or len(value) > MAX_CONTEXT_CHARS:
                raise ProtocolError(f"'context' must be a string of at most {MAX_CONTEXT_CHARS} characters")
        elif name in ("adaptive_gamma", "no_empty"):
            if not isinstance(value, bool):
                raise ProtocolError(f"'{name}' must be true or false")
        elif name == "seed":
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63):
                raise ProtocolError("'seed' must be a non-negative integer or null")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProtocolError(f"option '{name}' must be a finite number")
        elif name in OPTION_MAX and value > OPTION_MAX[name]:
            raise ProtocolError(f"option '{name}' must be at most {OPTION_MAX[name]}")


def _short(exc: Exception) -> str:
    """An exception's message, cut short (it must never echo a whole document back)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]
