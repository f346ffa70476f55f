"""OpenAI-compatible ``POST /v1/completions`` (and ``GET /v1/models``) on ``fimble serve``'s port.

Fields: ``model`` (any name; answers carry the served one), ``prompt`` (a string, or a list of
one), ``suffix`` (fill-in-the-middle: the engine lays out its FIM template), ``max_tokens``
(default 16, at most 4096), ``temperature`` (0-2; 0 is greedy), ``top_p``, ``stop`` (a string or
up to 4), ``stream`` (server-sent events: ``data: {chunk}`` lines, then ``data: [DONE]``),
``seed``; ``n`` and ``best_of`` may only be 1, ``echo`` only false, ``logprobs`` only null.
Every bad request gets a 4xx with an OpenAI-shaped JSON error (``{"error": {"message", "type",
"param", "code"}}``) without tracebacks or prompt text. The bearer token (``Authorization: Bearer``,
what OpenAI clients send as their API key) is required whenever the server has one. Connections are
HTTP/1.1 (engine/serve/http11.py: keep-alive, pipelining, chunked bodies); bodies are JSON read with
limits (engine/serve/json_body.py). A client that disconnects mid-completion cancels it.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from typing import Any

import h11

from engine.api import CompletionRequest, DecodeOptions, Delta
from engine.options import MAX_STOP_CHARS
from engine.serve import json_body
from engine.serve.http11 import HTTPConnection, HTTPError, headers_of, is_upgrade
from engine.serve.protocol import MAX_PROMPT_CHARS, OPTION_MAX

MAX_HTTP_STOPS = 4  # OpenAI's own limit
FINISH = {"stop": "stop", "eos": "stop", "length": "length", "context": "length", "cancelled": "stop"}


async def handle(daemon: Any, conn: HTTPConnection, head: h11.Request) -> None:
    """Answer one HTTP request (errors included) on ``conn``, a connection of the daemon's port."""
    daemon.counts["http_requests"] += 1
    try:
        method = head.method.decode("ascii", "replace")
        path = head.target.decode("latin-1").split("?", 1)[0]
        headers = headers_of(head)
        refused = daemon.authorized(headers)
        if refused is not None:  # answered before the body is read, so the connection ends with it
            code, reason = refused.split(" ", 1)
            kind = {"401": "authentication_error", "400": "invalid_request_error"}.get(code, "permission_error")
            raise HTTPError(int(code), reason, kind, close=True)
        if is_upgrade(head):
            raise HTTPError(400, "a websocket upgrade must be a connection's first request", close=True)
        body = await conn.read_body()  # on every route: the next request starts where this body ends
        if path in ("/v1/models", "/models") and method == "GET":
            name = daemon.options.model_name
            data = [{"id": name, "object": "model", "created": 0, "owned_by": "fimble"}]
            await conn.reply(200, {"object": "list", "data": data})
            return
        if path not in ("/v1/completions", "/completions"):
            raise HTTPError(404, f"no route for {method[:10]} {path[:100]}", "not_found_error")
        if method != "POST":
            raise HTTPError(405, "use POST for /v1/completions", headers=(("Allow", "POST"),))
        request, stream_mode, _model = _completion_request(_json_object(body))
        await _complete(daemon, request, stream_mode, daemon.options.model_name, conn)
    except HTTPError as exc:
        daemon.counts["http_errors"] += 1
        if conn.can_reply():
            await conn.reply_error(exc)
        # else a stream had begun: the answer is cut short and the connection closes (conn.next_cycle)


def _json_object(body: bytes) -> dict:
    try:
        value = json_body.loads(body)
    except json_body.JSONLimitError as exc:
        raise HTTPError(400, str(exc)) from None
    if not isinstance(value, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(name, default)
    if value is None:
        value = default
    kind = "an integer" if integer else "a number"
    try:  # json_body bounds number literals; an OverflowError here would otherwise close the connection
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise HTTPError(400, f"'{name}' must be {kind}", param=name)
        if integer and value != int(value):
            raise HTTPError(400, f"'{name}' must be {kind}", param=name)
    except OverflowError:
        raise HTTPError(400, f"'{name}' must be from {low} to {high}", param=name) from None
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
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_HTTP_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise HTTPError(400, f"'stop' must be a string or up to {MAX_HTTP_STOPS} strings", param="stop")
    for name, text in (("prompt", prompt), ("suffix", suffix), *(("stop", s) for s in stop)):
        if not text.isascii():
            try:  # JSON may escape a lone surrogate ("\ud800"), which no tokenizer or msgpack would take
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise HTTPError(400, f"'{name}' holds an unpaired surrogate", param=name) from None
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


async def _complete(daemon: Any, request: CompletionRequest, streaming: bool, model: str, conn: HTTPConnection) -> None:
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

    gone = asyncio.ensure_future(conn.watch_close())  # the client left: its completion stops
    ended = False
    try:
        if streaming:
            await conn.start_stream("text/event-stream")
        text = []
        while True:
            get = asyncio.ensure_future(deltas.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                stream.cancel()  # stop decoding at the next step
                return
            delta = get.result()
            ended = delta.finished
            if delta.finish_reason == "error":
                kind = "invalid_request_error" if delta.error_type == "PromptError" else "server_error"
                message = (delta.error or "completion failed")[:300]
                if streaming:
                    await _event(conn, {"error": {"message": message, "type": kind, "param": None, "code": None}})
                    break
                raise HTTPError(400 if kind == "invalid_request_error" else 500, message, kind)
            text.append(delta.text)
            if streaming and (delta.text or delta.finished):
                finish = FINISH.get(delta.finish_reason or "", "stop") if delta.finished else None
                await _event(conn, body(delta.text, finish))
            if delta.finished:
                break
        if streaming:
            await conn.send_data(b"data: [DONE]\n\n")
            await conn.end_stream()
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
        await conn.reply(200, reply)
    finally:
        gone.cancel()
        if not ended:
            stream.cancel()  # the answer failed (the client vanished mid-write): the engine stops too
        daemon.engine.forget(request.document_id)


async def _event(conn: HTTPConnection, payload: dict) -> None:
    await conn.send_data(b"data: " + json.dumps(payload).encode() + b"\n\n")
