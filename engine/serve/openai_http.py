"""OpenAI-compatible ``POST /v1/completions`` (and ``GET /v1/models``) on ``fimble serve``'s port.

Fields: ``model`` (any name; answers carry the served one), ``prompt`` (a string, or a list of
one), ``suffix`` (fill-in-the-middle: the engine lays out its FIM template), ``max_tokens``
(default 16, at most 4096), ``temperature`` (0-2; 0 is greedy), ``top_p``, ``stop`` (a string or
up to 4), ``stream`` (server-sent events: ``data: {chunk}`` lines, then ``data: [DONE]``),
``seed``; ``n`` and ``best_of`` may only be 1, ``echo`` only false, ``logprobs`` only null.
Errors are OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``) without
tracebacks or prompt text. The bearer token (``Authorization: Bearer``, what OpenAI clients send
as their API key) is required whenever the server has one. One request per connection
(``Connection: close``); a client that disconnects mid-stream cancels its completion.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from typing import Any

from websockets.datastructures import Headers

from engine.api import CompletionRequest, DecodeOptions, Delta
from engine.serve.protocol import OPTION_MAX

MAX_PROMPT_CHARS = 4_000_000
FINISH = {"stop": "stop", "eos": "stop", "length": "length", "context": "length", "cancelled": "stop"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _parse_head(head: bytes) -> tuple[str, str, Headers]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HTTPError(400, "malformed HTTP request line")
    headers = Headers()
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise HTTPError(400, "malformed HTTP header")
        headers[name.strip()] = value.strip()
    return parts[0], parts[1], headers


def is_websocket_upgrade(head: bytes) -> bool:
    try:
        method, _, headers = _parse_head(head)
    except HTTPError:
        return False
    return method == "GET" and headers.get("Upgrade", "").lower() == "websocket"


async def handle(daemon: Any, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer one HTTP request on the daemon's port."""
    daemon.counts["http_requests"] += 1
    try:
        method, target, headers = _parse_head(head)
        path = target.split("?", 1)[0]
        refused = daemon.authorized(headers)
        if refused is not None:
            code, reason = refused.split(" ", 1)
            kind = {"401": "authentication_error", "400": "invalid_request_error"}.get(code, "permission_error")
            raise HTTPError(int(code), reason, kind)
        if path in ("/v1/models", "/models") and method == "GET":
            name = daemon.options.model_name
            _reply(
                writer,
                200,
                {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "fimble"}]},
            )
            return
        if path not in ("/v1/completions", "/completions"):
            raise HTTPError(404, f"no route for {method} {path[:100]}", "not_found_error")
        if method != "POST":
            raise HTTPError(405, "use POST for /v1/completions")
        body = await _read_body(headers, reader, daemon.options.max_message)
        request, stream_mode, _model = _completion_request(body)
        await _complete(daemon, request, stream_mode, daemon.options.model_name, reader, writer)
    except HTTPError as exc:
        daemon.counts["http_errors"] += 1
        _reply(
            writer, exc.status, {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": None}}
        )
        await writer.drain()
        await _discard_unread(reader)
        return
    await writer.drain()


async def _discard_unread(reader: asyncio.StreamReader, most: int = 16 << 20, seconds: float = 2.0) -> None:
    """A lingering close: read and drop what the client is still sending after an early error reply.

    A refused request (413, 401, ...) is answered before its body is read. Closing at once would reset
    the connection while the client is still writing, and the client would see a broken pipe instead of
    the answer. So the body is drained, bounded in bytes and time, then the connection closes.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while most > 0:
        left = deadline - loop.time()
        if left <= 0:
            return
        try:
            chunk = await asyncio.wait_for(reader.read(min(most, 1 << 16)), left)
        except (TimeoutError, ConnectionError):
            return
        if not chunk:
            return
        most -= len(chunk)


async def _read_body(headers: Headers, reader: asyncio.StreamReader, limit: int) -> dict:
    if "Transfer-Encoding" in headers:
        raise HTTPError(411, "send the body with a Content-Length")
    try:
        length = int(headers.get("Content-Length", ""))
    except ValueError:
        raise HTTPError(411, "a Content-Length header is required") from None
    if not 0 <= length <= limit:  # --max-message-mb, as for websocket messages
        raise HTTPError(413, f"the body must be at most {limit} bytes")
    data = await asyncio.wait_for(reader.readexactly(length), 60)
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise HTTPError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return body


def _number(body: dict, name: str, default: float, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(name, default)
    if value is None:
        value = default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (integer and value != int(value))
    ):
        raise HTTPError(400, f"'{name}' must be {'an integer' if integer else 'a number'}", param=name)
    if not low <= value <= high:
        raise HTTPError(400, f"'{name}' must be from {low} to {high}", param=name)
    return int(value) if integer else float(value)


def _completion_request(body: dict) -> tuple[CompletionRequest, bool, str | None]:
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise HTTPError(400, "'prompt' must be a string (or a list of one string)", param="prompt")
    suffix = body.get("suffix") or ""
    if not isinstance(suffix, str):
        raise HTTPError(400, "'suffix' must be a string", param="suffix")
    if len(prompt) + len(suffix) > MAX_PROMPT_CHARS:
        raise HTTPError(400, f"prompt and suffix exceed {MAX_PROMPT_CHARS} characters", param="prompt")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise HTTPError(400, "'model' must be a string", param="model")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop):
        raise HTTPError(400, "'stop' must be a string or up to 4 strings", param="stop")
    for name in ("n", "best_of"):
        if body.get(name, 1) not in (1, None):
            raise HTTPError(400, f"only '{name}': 1 is supported", param=name)
    if body.get("echo"):
        raise HTTPError(400, "'echo' is not supported", param="echo")
    if body.get("logprobs") is not None:
        raise HTTPError(400, "'logprobs' is not supported", param="logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, "'stream' must be true or false", param="stream")
    seed = body.get("seed")
    if seed is not None:
        seed = _number(body, "seed", 0, 0, 2**63 - 1, integer=True)
    options = DecodeOptions(
        max_tokens=_number(body, "max_tokens", 16, 1, OPTION_MAX["max_tokens"], integer=True),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
        stop=tuple(stop),
        seed=seed,
    )
    # Each HTTP request is its own document (freed when it ends): clients share nothing.
    doc = f"openai-{secrets.token_hex(8)}\x00"
    return CompletionRequest(prefix=prompt, suffix=suffix, options=options, document_id=doc), stream, model


async def _complete(
    daemon: Any,
    request: CompletionRequest,
    streaming: bool,
    model: str,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue[Delta] = asyncio.Queue()
    stream = daemon.submit(request, lambda d, _s: loop.call_soon_threadsafe(deltas.put_nowait, d))
    cid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

    def body(text: str, finish: str | None) -> dict:
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
        }

    gone = asyncio.ensure_future(reader.read(1))  # EOF: the client left (it sends nothing more)
    try:
        if streaming:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Connection: close\r\n\r\n"
            )
        text = []
        while True:
            get = asyncio.ensure_future(deltas.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                stream.cancel()  # the client went away: stop decoding at the next step
                return
            delta = get.result()
            if delta.finish_reason == "error":
                kind = "invalid_request_error" if delta.error_type == "PromptError" else "server_error"
                message = (delta.error or "completion failed")[:300]
                if streaming:
                    _event(writer, {"error": {"message": message, "type": kind, "param": None, "code": None}})
                    break
                raise HTTPError(400 if kind == "invalid_request_error" else 500, message, kind)
            text.append(delta.text)
            if streaming and (delta.text or delta.finished):
                _event(
                    writer, body(delta.text, FINISH.get(delta.finish_reason or "", "stop") if delta.finished else None)
                )
                await writer.drain()
            if delta.finished:
                break
        if streaming:
            writer.write(b"data: [DONE]\n\n")
            return
        result = stream.result
        reply = body("".join(text), FINISH.get(result.finish_reason if result else "stop", "stop"))
        prompt_tokens = int(result.stats.get("prompt_tokens", 0)) if result else 0
        completion = result.tokens if result else 0
        reply["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
        _reply(writer, 200, reply)
    finally:
        gone.cancel()
        daemon.engine.forget(request.document_id)


def _event(writer: asyncio.StreamWriter, payload: dict) -> None:
    writer.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


def _reply(writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    reason = {
        200: "OK",
        400: "Bad Request",
        401: "Unauthorized",
        403: "Forbidden",
        404: "Not Found",
        405: "Method Not Allowed",
        411: "Length Required",
        413: "Payload Too Large",
        500: "Internal Server Error",
    }.get(status, "Error")
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        f"Connection: close\r\n\r\n".encode()
        + data
    )
