"""pygls' protocol with three fixes a long-lived completion server needs.

1. pygls 2.1 files every notification's handler future in ``_request_futures`` under a
   random id and never removes it (one entry per keystroke, forever). We drop each entry
   once its future is done.
2. A request whose params don't fit the LSP types (say ``line: -1``) got no response at
   all: pygls raised while decoding and the client waited forever. It now gets
   InvalidParams.
3. Text synchronisation goes to our own document store (lsp_server/documents.py), not to
   pygls' workspace copy, which re-splits the whole document on every edit. ``didChange`` is
   read as plain JSON by the server (lsp_server/change_params.py), not structured by pygls.

It also takes every frame's raw payload (``receive``): bad UTF-8, bad JSON, batches,
requests before ``initialize`` or after ``shutdown`` each get their JSON-RPC error instead
of silence, a string field sent as null or a number is refused rather than coerced to
"None", and error responses never carry a traceback.

A large message's JSON structure is bounded before it is parsed (``structure_problem``):
``json.loads`` runs on the event loop that every session shares, in one piece, and 14 MB of
``[[],[],...]`` held it 4.7 s, a ``didChange`` of 160,000 edits 1.7 s (and then 146 s of
slices). A refused message gets ``-32600`` with ``id: null`` (its id is not read).

Messages dropped as invalid (a notification has no response to carry an error) are counted
(``fimble/stats`` counter ``dropped_messages``) and logged by kind at most a few times a session
(``log_dropped``): 2,000 invalid ``didChange`` notifications wrote 6,000 log lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Generator
from functools import partial
from typing import Any

import attrs
from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInternalError, JsonRpcInvalidParams
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method

from lsp_server.pacing import run_in_slices

log = logging.getLogger(__name__)
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
SERVER_NOT_INITIALIZED = -32002
INTERNAL_ERROR_MESSAGE = "Internal error (details are in the server log)"
LOGGED_PER_KIND = 3  # dropped messages of one kind logged in full per session; then at 10, 100, 1000, ...
# A message over LARGE_MESSAGE characters has its JSON structure counted (at C speed) before it is parsed.
# The bounds keep a didChange of 20,000 edits (180,000 strings, 60,000 objects, 100,000 commas; about
# 0.1 s of parsing here) and any large document's text (one string) well inside them.
LARGE_MESSAGE = 256 << 10
MAX_JSON_STRINGS = 1 << 18  # keys included
MAX_JSON_CONTAINERS = 1 << 17  # objects and arrays
MAX_JSON_COMMAS = 1 << 18
MAX_JSON_SKELETON = 1 << 20  # characters outside strings, where the strings are few
_FEW_STRINGS = 1 << 11


def plain(value: Any) -> Any:
    """Params of custom methods arrive as pygls namedtuples ("Object"): turn them back into dicts and lists."""
    if hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


_UNPARSEABLE = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        return _UNPARSEABLE


def structure_steps(text: str, chunk: int = 1 << 20) -> Generator[None, None, str | None]:
    """Why parsing ``text`` would hold the shared loop too long (too many JSON values), or None; a generator
    that yields between pieces of about ``chunk`` characters (lsp_server/pacing.py runs it in slices).

    Counts only (C speed, no parse): strings by their quotes (escapes taken out first); where the strings
    are few, the characters outside them exactly; where they are many, the brackets and commas of the
    whole text, which then bound what the strings hold too (a large document's text is one string)."""
    quotes = containers = commas = plain_chars = inside = 0
    in_string, pos = False, 0
    while pos < len(text):
        end = min(pos + chunk, len(text))
        while end < len(text) and text[end - 1] == "\\":  # never cut an escape in two
            end += 1
        plain = text[pos:end].replace("\\\\", "").replace('\\"', "")
        pos = end
        quotes += plain.count('"')
        if quotes > 2 * MAX_JSON_STRINGS:
            return f"the message holds more than {MAX_JSON_STRINGS:,} JSON strings"
        containers += plain.count("{") + plain.count("[")
        commas += plain.count(",")
        plain_chars += len(plain)
        if quotes <= 2 * _FEW_STRINGS:  # where the strings are few: the characters inside them, exactly
            at = 0
            while True:
                q = plain.find('"', at)
                if in_string:
                    inside += (len(plain) if q < 0 else q + 1) - at
                if q < 0:
                    break
                in_string, at = not in_string, q + 1
                if in_string:
                    inside += 1  # the opening quote
        if pos < len(text):
            yield
    if quotes <= 2 * _FEW_STRINGS:
        if plain_chars - inside > MAX_JSON_SKELETON:
            return f"the message holds more than {MAX_JSON_SKELETON:,} characters of JSON outside its strings"
        return None
    if containers > MAX_JSON_CONTAINERS:
        return f"the message holds more than {MAX_JSON_CONTAINERS:,} JSON objects and arrays"
    if commas > MAX_JSON_COMMAS:
        return f"the message holds more than {MAX_JSON_COMMAS:,} JSON values"
    return None


def structure_problem(text: str) -> str | None:
    """``structure_steps`` at once."""
    steps = structure_steps(text)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _error(msg_id: Any, code: int, message: str) -> dict:
    return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}}


@attrs.define
class _Answered:
    """Stands in for a message already answered with an error; handle_message ignores it."""

    jsonrpc: str = "answered"


def _strict_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _valid_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _id_of(data: Any) -> Any:
    """The message's id if it can address a response, else None (JSON null)."""
    if isinstance(data, dict) and _valid_id(data.get("id")):
        return data["id"]
    return None


class FimbleProtocol(LanguageServerProtocol):
    def __init__(self, server: Any, converter: Any):
        super().__init__(server, converter)
        # cattrs turns null or 5 into "None" / "5" where LSP wants a string: refuse instead.
        self._converter.register_structure_hook(str, _strict_str)
        self.phase = "new"  # "new" -> "running" (initialize received) -> "shutdown"
        self._dropped: dict[str, int] = {}

    def log_dropped(self, kind: str, what: str) -> None:
        """A message dropped as invalid (``kind``: a short, fixed name; ``what``: a fixed text, never the
        message's content): counted, and logged the first LOGGED_PER_KIND times in this session, then once
        at every power of ten, so that a flood cannot fill the log."""
        n = self._dropped[kind] = self._dropped.get(kind, 0) + 1
        stats = getattr(self._server, "stats", None)
        if stats is not None:
            stats.count("dropped_messages")
        if n <= LOGGED_PER_KIND:
            log.warning(
                "%s%s",
                what,
                " (further ones are counted in fimble/stats, and logged at 10, 100, 1000, ...)"
                if n == LOGGED_PER_KIND
                else "",
            )
        elif n >= 10 and str(n).rstrip("0") == "1":
            log.warning("%s: %d in this session", what, n)

    # -- frames in -----------------------------------------------------------------------------
    def receive(self, payload: bytes | str) -> None:
        """One frame's payload: check it, answer what is wrong, hand the rest to pygls. Never raises."""
        if isinstance(payload, bytes):
            try:
                payload = payload.decode("utf-8")
            except UnicodeDecodeError:
                # (its id where the message is small enough to parse for it at once)
                msg_id = _id_of(_loads(payload.decode("utf-8", "replace"))) if len(payload) <= LARGE_MESSAGE else None
                self.send_error(msg_id, PARSE_ERROR, "Parse error: the message is not valid UTF-8")
                return
        if len(payload) > LARGE_MESSAGE:
            pacer = getattr(self._server, "pacer", None)
            if pacer is not None and _loop_running():  # checked in slices, before the session's next frame
                # (pacer.pending, not pacer.defer: "deferred" counts the heavy changes and opens themselves)
                pacer.pending = asyncio.ensure_future(self._receive_large(payload, pacer))
                return
            if not self._structure_ok(structure_problem(payload)):
                return
        self._receive_text(payload)

    async def _receive_large(self, payload: str, pacer: Any) -> None:
        if self._structure_ok(await run_in_slices(structure_steps(payload))):
            self._receive_text(payload)
            # A heavy change it deferred (pacer.pending) is done before the next frame: settle awaits this task
            # or, where this task ran before settle looked, the deferred work itself. Left in place for that.
            inner = pacer.pending
            if inner is not None and inner is not asyncio.current_task():
                await inner

    def _structure_ok(self, problem: str | None) -> bool:
        if problem is None:
            return True
        self.log_dropped("too-large-structure", f"refused a message: {problem}")
        self.send_error(None, INVALID_REQUEST, f"Invalid Request: {problem}")
        return False

    def _receive_text(self, payload: str) -> None:
        data = _loads(payload)
        if data is _UNPARSEABLE:
            self.send_error(None, PARSE_ERROR, "Parse error: the message is not valid JSON")
        elif isinstance(data, list):
            # LSP has no batches. JSON-RPC 2.0 lets us answer one: an error per element.
            errors = [
                _error(_id_of(item), INVALID_REQUEST, "Invalid Request: batches are not supported") for item in data
            ] or [_error(None, INVALID_REQUEST, "Invalid Request: empty batch")]
            self._send_data(errors)
        else:
            try:
                self._receive_one(data)
            except Exception:  # one message must never end the session
                log.exception("unable to handle a message")
                if isinstance(data, dict) and "method" in data and _valid_id(data.get("id")):
                    self.send_error(data["id"], JsonRpcInternalError.CODE, INTERNAL_ERROR_MESSAGE)

    def _receive_one(self, data: Any) -> None:
        if not isinstance(data, dict) or data.get("jsonrpc") != "2.0":
            self.send_error(_id_of(data), INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message")
            return
        method, params = data.get("method"), data.get("params")
        is_request = "id" in data
        if is_request and not _valid_id(data["id"]) and (method is not None or data["id"] is not None):
            self.send_error(None, INVALID_REQUEST, "Invalid Request: id must be a string or an integer")
            return
        if "method" not in data:
            if not is_request or ("result" not in data and "error" not in data):
                self.send_error(None, INVALID_REQUEST, "Invalid Request: no method")
                return
        elif not isinstance(method, str) or not (params is None or isinstance(params, dict | list)):
            if is_request:
                self.send_error(data["id"], INVALID_REQUEST, "Invalid Request: bad method or params")
            else:
                self.log_dropped("bad-method", "dropped a notification with a bad method or params")
            return
        else:
            if method == types.EXIT:
                self._server.end_session(0 if self.phase == "shutdown" else 1)
                return
            if self.phase == "new" and method != types.INITIALIZE:
                if is_request:  # and the engine is not started for it
                    self.send_error(data["id"], SERVER_NOT_INITIALIZED, "Server not initialized")
                return
            if self.phase == "shutdown":
                if is_request:
                    self.send_error(data["id"], INVALID_REQUEST, "Invalid Request: the server is shutting down")
                return
            if method == types.INITIALIZE and self.phase != "new":
                self.send_error(data["id"], INVALID_REQUEST, "Invalid Request: already initialized")
                return
        if method == types.TEXT_DOCUMENT_DID_CHANGE:  # read as plain JSON (lsp_server/change_params.py)
            self._server.receive_change(params)
            if is_request:  # a client bug; answered as pygls answered it
                self._send_response(data["id"], None)
            return
        if "method" in data and "params" not in data:
            data = {**data, "params": None}  # JSON-RPC lets params be omitted; pygls' generic types need it
        try:
            message = self.structure_message(data)
        except JsonRpcException:  # requests were answered by structure_message
            # (by name only where the server has the method: the kinds must stay few, whatever a client sends)
            name = method if method in self.fm.features else ("response" if method is None else "unknown method")
            self.log_dropped(f"params:{name}", f"dropped a {name} message whose params do not fit the LSP types")
            return
        if isinstance(message, _Answered):
            return  # (an initialize with bad params leaves the session uninitialized)
        if method == types.INITIALIZE and is_request:
            self.phase = "running"
        elif method == types.SHUTDOWN and is_request:
            self.phase = "shutdown"
        self.handle_message(message)

    # -- frames out ----------------------------------------------------------------------------
    def send_error(self, msg_id: Any, code: int, message: str) -> None:
        self._send_data(_error(msg_id, code, message))

    def _send_response(self, msg_id: Any, result: Any = None, error: Any = None) -> None:  # type: ignore[override]
        """Error responses lose pygls' traceback and exception text: those go to the log only."""
        if error is not None and (error.code == JsonRpcInternalError.CODE or error.data is not None):
            error = types.ResponseError(
                code=error.code,
                message=INTERNAL_ERROR_MESSAGE if error.code == JsonRpcInternalError.CODE else error.message,
            )
        super()._send_response(msg_id, result, error)

    def _execute_handler(self, msg_id, handler, callback, args=None, kwargs=None):  # type: ignore[override]
        super()._execute_handler(msg_id, handler, callback, args, kwargs)
        future = self._request_futures.get(msg_id)
        if future is not None:
            future.add_done_callback(partial(self._forget, msg_id))

    def _forget(self, msg_id: Any, future: Any) -> None:
        if self._request_futures.get(msg_id) is future:
            del self._request_futures[msg_id]

    def structure_message(self, data: dict[str, Any]):  # type: ignore[override]
        try:
            return super().structure_message(data)
        except JsonRpcException as exc:
            if isinstance(data, dict) and "id" in data and "method" in data:
                err = exc if isinstance(exc, JsonRpcInvalidParams) else JsonRpcInvalidParams(str(exc))
                self._send_response(data["id"], error=err.to_response_error())
                return _Answered()
            raise

    @lsp_method(types.INITIALIZE)
    def lsp_initialize(self, params: types.InitializeParams):
        """pygls' initialize, plus the server's ``experimental`` capabilities (PROTOCOL.md, Capabilities)."""
        result = yield from super().lsp_initialize(params)
        experimental = getattr(self._server, "experimental_capabilities", None)
        if callable(experimental):
            result.capabilities.experimental = experimental()
        return result

    # -- text sync: our handlers only --------------------------------------------------------
    @lsp_method(types.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: types.DidOpenTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_OPEN)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: types.DidCloseTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_CLOSE)) is not None:
            yield handler, (params,), None
