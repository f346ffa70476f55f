"""Remote engines teams already run, behind the engine interface (engine/api.py).

Two wire formats:

- ``openai``: ``POST {base}/completions`` of an OpenAI-compatible server (vLLM, SGLang, llama-server,
  Ollama, ``fimble serve``). When the model's FIM template is known (``template``, or recognised in the
  model name), fimble lays the FIM prompt out itself (engine/fim.py) and sends ``prompt`` alone (vLLM
  rejects ``suffix``, and servers' own FIM handling varies). Otherwise it sends ``prompt`` + ``suffix``
  and the server applies its own template (Ollama, fimble serve).
- ``llamacpp``: llama.cpp's ``POST {base}/infill`` (``input_prefix``, ``input_suffix``, ``cache_prompt``):
  the server lays out the FIM prompt from its GGUF's own FIM tokens.

Both stream server-sent events. Each request runs in its own thread over ``http.client`` (standard
library: nothing to install); ``cancel()`` shuts the socket, which ends the HTTP stream and makes the
server stop generating. Stop strings and the line limit are also applied here (the server's stop list
may be capped at 4, and none enforces a line limit), and the stream is closed at the first one.
Every failure (server down, 4xx/5xx, malformed event, timeout) ends the stream with a one-line error;
none raises into the caller. Only the backend lives here: the syntax policy, shaping and streaming to
the editor stay on the LSP side of the API.

Security: a plain-http engine on another machine would carry document text and the token in clear,
so it is refused unless ``allow_remote``; https verifies the certificate (ssl's default context).
A prompt that fimble lays out itself puts document text next to FIM sentinels, and the server's
tokenizer may read a sentinel typed in a document as a control token (fimble's own engine never does).
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from engine.api import CompletionRequest, CompletionResult, CompletionStream, Delta, Unwatched
from engine.auth import is_loopback, port_token
from engine.decoding.detok import StopRules
from engine.errors import FimbleError
from engine.remote_spec import (
    KINDS,
    RemoteSpec,
    _text_template,
    check_spec,
    parse_engine,
    read_token,
    template_for_model,
)

log = logging.getLogger(__name__)

__all__ = [
    "KINDS",
    "RemoteEngine",
    "RemoteError",
    "RemoteSpec",
    "check_spec",
    "open_remote",
    "parse_engine",
    "read_token",
    "template_for_model",
]

MAX_LINE = 1 << 20  # one SSE line; a longer one is a malformed stream
MAX_TEXT = 1 << 20  # completion text per request
MAX_ERROR_BODY = 64 << 10
_POOL = 4  # idle keep-alive connections kept


class RemoteError(FimbleError):
    """One request to the remote engine failed; the message is one line naming the server."""


class _Cancelled(Exception):
    pass


class RemoteEngine(Unwatched):
    """An ``Engine`` whose model runs on an HTTP server. Nothing to watch (``Unwatched``): each request has its
    own connection and reports its own failure."""

    error: str | None = None  # a remote engine never "dies": each request reports its own failure
    # Called from request threads with (level, message) when requests start failing and when they recover
    # (EngineHost shows it in the editor); None: only the log hears.
    notify: Callable[[str, str], None] | None = None
    _failing: str | None = None

    def __init__(self, spec: RemoteSpec):
        check_spec(spec)
        self.spec = spec
        parts = urlsplit(spec.url)
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname or "", parts.port or (443 if self._https else 80)
        self._path = parts.path or ("/v1" if spec.kind == "openai" else "")
        self._token = read_token(spec.token_file) if spec.token_file else None
        self._local = self._token is None and is_loopback(self._host)  # then look for a local daemon's token file
        self._ssl = ssl.create_default_context() if self._https else None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self._open: dict[int, _Call] = {}
        self._counters = {
            "submitted": 0,
            "completed": 0,
            "cancelled": 0,
            "errors": 0,
            "connections": 0,
            "reused_connections": 0,
            "events": 0,
        }
        self.model = spec.model
        if spec.kind == "openai" and self.model is None:
            self.model = self._first_model()
        # llama.cpp's /infill lays the prompt out itself; an OpenAI server gets fimble's layout when known.
        self.template = None if spec.kind != "openai" else _text_template(spec.template, self.model)
        self._info = {
            "backend": f"remote-{spec.kind}",
            "url": spec.url,
            "model": self.model,
            "template": (self.template.name if self.template else "server") if spec.kind == "openai" else "server",
        }
        self.started_at = time.monotonic()

    # -- Engine API ------------------------------------------------------------------------
    def info(self) -> dict:
        return self._info

    def submit(self, request: CompletionRequest, on_delta=None) -> CompletionStream:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        rid = next(self._ids)
        call = _Call(self, rid, request)
        stream = CompletionStream(rid, loop, on_delta, on_cancel=call.cancel)
        call.stream = stream
        self._count("submitted")
        with self._lock:
            self._open[rid] = call
        threading.Thread(target=call.run, name=f"fimble-remote-{rid}", daemon=True).start()
        return stream

    def prewarm(self, request: CompletionRequest) -> None:
        """Nothing: the server keeps its own prompt cache (llama.cpp: ``cache_prompt``)."""

    def forget(self, document_id: str) -> None:
        """Nothing: the server's cache is its own."""

    def counters(self, timeout: float = 5.0) -> dict:
        with self._lock:
            return {**self._counters, "open": len(self._open)}

    def _health(self, error: str | None, reason: str) -> None:
        """Log a failure, and tell the user (``notify``) when the server starts failing and when it is back:
        once each, not at every keystroke."""
        if error is not None:
            log.warning("%s", error)
        if reason == "cancelled":
            return
        with self._lock:
            was, self._failing = self._failing, error
        notify = self.notify
        if notify is None:
            return
        if error is not None and was is None:
            notify("warning", f"fimble: {error}")
        elif error is None and was is not None:
            notify("info", f"fimble: remote engine {self.spec.url} answers again")

    def close(self) -> None:
        with self._lock:
            calls, idle, self._idle = list(self._open.values()), self._idle, []
        for call in calls:
            call.cancel()
        for conn in idle:
            conn.close()

    # -- HTTP ------------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counters[key] += n

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """An idle keep-alive connection (reused: True) or a new one."""
        with self._lock:
            if self._idle:
                self._counters["reused_connections"] += 1
                return self._idle.pop(), True
            self._counters["connections"] += 1
        if self._https:
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.spec.timeout_s, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self.spec.timeout_s)
        return conn, False

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < _POOL:
                self._idle.append(conn)
                return
        conn.close()

    def _headers(self, stream: bool) -> dict:
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream" if stream else "application/json",
            "User-Agent": "fimble/0.1",
        }
        token = self._token
        if token is None and self._local:  # a `fimble serve` on this machine: the token it left for its port,
            token = port_token(self._port)  # read each time (a restarted daemon has a new one)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def describe(self, what: str) -> str:
        return f"remote engine {self.spec.url}: {what}"

    def _first_model(self) -> str | None:
        """The first model the server lists (vLLM needs ``model``; llama-server and Ollama accept any)."""
        conn, _ = self._connection()
        try:
            conn.timeout = min(self.spec.timeout_s, 5.0)
            conn.request("GET", f"{self._path}/models", headers=self._headers(False))
            resp = conn.getresponse()
            body = resp.read(MAX_ERROR_BODY)
            if resp.status != 200:
                log.warning("%s", self.describe(f"GET /models answered {resp.status}; sending no model name"))
                return None
            data = json.loads(body)
            models = data.get("data") if isinstance(data, dict) else None
            first = models[0].get("id") if isinstance(models, list) and models and isinstance(models[0], dict) else None
            return first if isinstance(first, str) else None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            log.warning("%s", self.describe(f"could not list models ({_os_error(exc)}); sending no model name"))
            return None
        finally:
            conn.close()

    def body(self, request: CompletionRequest) -> tuple[str, dict]:
        """The request's path and JSON body for this server."""
        o = request.options
        stops = list(dict.fromkeys(s for s in o.stop if s))
        if o.max_lines == 1 and "\n" not in stops:
            stops.append("\n")  # the server stops at the line's end instead of decoding on for nothing
        if self.spec.kind == "llamacpp":
            body = {
                "input_prefix": request.prefix,
                "input_suffix": request.suffix,
                "stream": True,
                "cache_prompt": True,
                "n_predict": o.max_tokens,
                "temperature": o.temperature,
                "top_p": o.top_p,
                "stop": stops,
            }
            if o.seed is not None:
                body["seed"] = o.seed
            return f"{self._path}/infill", body
        body = {"max_tokens": o.max_tokens, "temperature": o.temperature, "top_p": o.top_p, "stream": True, "n": 1}
        if self.model:
            body["model"] = self.model
        if self.template is not None:
            body["prompt"] = self.template.build(request.prefix, request.suffix)
            stops += [s for s in self.template.stop_tokens if s not in stops]
        else:
            body["prompt"], body["suffix"] = request.prefix, request.suffix
        if stops:
            body["stop"] = stops[:4]  # OpenAI's limit; the rest are applied here (StopRules)
        if o.seed is not None:
            body["seed"] = o.seed
        return f"{self._path}/completions", body


class _Call:
    """One request: POST, read the event stream, push Deltas; ``cancel`` shuts the socket."""

    def __init__(self, engine: RemoteEngine, rid: int, request: CompletionRequest):
        self.engine, self.rid, self.request = engine, rid, request
        self.stream: CompletionStream | None = None
        self._cancel = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self.raw = ""  # everything the server sent, before stop rules
        self.sent = 0  # characters of raw already pushed
        self.events = 0
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        o = request.options
        stops = tuple(o.stop) + (engine.template.stop_tokens if engine.template is not None else ())
        self.rules = StopRules(stops, o.max_lines)

    def cancel(self) -> None:
        self._cancel.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # the reader's recv returns at once; the server sees EOF
            except OSError:
                pass

    def run(self) -> None:
        eng = self.engine
        reason, error = "error", None
        try:
            reason = self._exchange()
        except _Cancelled:
            reason = "cancelled"
        except RemoteError as exc:
            error = str(exc)
        except TimeoutError:
            error = eng.describe(f"no answer within {eng.spec.timeout_s:g} s")
        except (OSError, http.client.HTTPException) as exc:
            error = eng.describe(_os_error(exc))
        except Exception as exc:  # never a traceback into the editor: one line, and the log has the rest
            log.exception("remote completion failed")
            error = eng.describe(f"{type(exc).__name__}: {str(exc)[:200]}")
        if self._cancel.is_set() and reason != "stop":
            reason, error = "cancelled", None
        if error is not None:
            reason = "error"
        self._finish(reason, error)

    def _finish(self, reason: str, error: str | None) -> None:
        eng, stream = self.engine, self.stream
        assert stream is not None
        with eng._lock:
            eng._open.pop(self.rid, None)
            eng._counters["events"] += self.events
            eng._counters[{"error": "errors", "cancelled": "cancelled"}.get(reason, "completed")] += 1
        eng._health(error, reason)
        text, _ = self.rules.cut(self.raw)
        rest = text[self.sent :] if reason != "error" and reason != "cancelled" else ""
        now = time.perf_counter()
        stats = {"total_ms": (now - self.t0) * 1e3, "events": self.events}
        if self.t_first is not None:
            stats["first_token_ms"] = (self.t_first - self.t0) * 1e3
        stream.result = CompletionResult(stream.text + rest, reason, self.events, stats)
        if error is not None:
            stream.push(Delta(rest, True, "error", error, "FimbleError"))
        else:
            stream.push(Delta(rest, True, reason))

    def _exchange(self) -> str:
        eng = self.engine
        path, body = eng.body(self.request)
        data = json.dumps(body).encode("utf-8")
        for attempt in (0, 1):
            if self._cancel.is_set():
                raise _Cancelled
            conn, reused = eng._connection()
            self._conn = conn
            try:
                conn.request("POST", path, body=data, headers=eng._headers(True))
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                conn.close()
                if reused and attempt == 0:
                    continue  # the server closed an idle keep-alive connection: once more on a new one
                raise
            except BaseException:
                conn.close()
                raise
            break
        try:
            if resp.status >= 400:
                raise RemoteError(eng.describe(_http_error(resp)))
            ctype = (resp.getheader("Content-Type") or "").lower()
            if "text/event-stream" in ctype:
                reason = self._read_events(resp)
            else:  # a server that ignored "stream": one JSON answer
                self._event(resp.read(MAX_TEXT + MAX_LINE).decode("utf-8", "replace"))
                reason = self._reason or "eos"
            if not self._hit:
                resp.read()  # the rest of the body (after [DONE]): the connection can be reused
                if resp.isclosed() and not resp.will_close:
                    eng._release(conn)
                    self._conn = None
                    return reason
            return reason
        finally:
            if self._conn is not None:
                self._conn = None
                conn.close()

    _reason: str | None = None
    _hit = False

    def _read_events(self, resp: http.client.HTTPResponse) -> str:
        """Read SSE events until the server's last one, a stop rule, or a cancel."""
        data: list[str] = []
        while True:
            if self._cancel.is_set():
                raise _Cancelled
            try:
                line = resp.readline(MAX_LINE + 1)
            except (OSError, http.client.HTTPException, ValueError):
                if self._cancel.is_set():
                    raise _Cancelled from None
                raise
            if self._cancel.is_set():
                raise _Cancelled
            if len(line) > MAX_LINE:
                raise RemoteError(self.engine.describe("sent an event line over 1 MiB"))
            if not line:  # end of the body
                if data:
                    self._event("\n".join(data))
                if self._reason is None:
                    raise RemoteError(self.engine.describe("the stream ended before its last event"))
                return self._reason
            text = line.decode("utf-8", "replace").rstrip("\r\n")
            if text == "":
                if data:
                    done = self._event("\n".join(data))
                    data = []
                    if done:
                        return self._reason or "eos"
                continue
            field, _, value = text.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data":
                data.append(value)
            elif field == "error":  # llama.cpp sends "error: {...}" for a failure mid-stream
                raise RemoteError(self.engine.describe(_error_message(value)))
            # comments (":..."), event:, id:, retry: carry nothing for us

    def _event(self, payload: str) -> bool:
        """One event's data; True when it was the last (the server's end, or a stop rule hit here)."""
        if payload.strip() == "[DONE]":
            self._reason = self._reason or "eos"
            return True
        try:
            msg = json.loads(payload)
        except ValueError:
            raise RemoteError(self.engine.describe(f"sent a malformed event: {payload[:80]!r}")) from None
        if not isinstance(msg, dict):
            raise RemoteError(self.engine.describe(f"sent a malformed event: {payload[:80]!r}"))
        if "error" in msg:
            raise RemoteError(self.engine.describe(_error_message(msg["error"])))
        self.events += 1
        if self.engine.spec.kind == "llamacpp":
            text, end = msg.get("content", ""), None
            if msg.get("stop"):
                end = {"limit": "length", "word": "stop"}.get(msg.get("stop_type"), "eos")
        else:
            choices = msg.get("choices")
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                raise RemoteError(self.engine.describe(f"sent an event without choices: {payload[:80]!r}"))
            choice = choices[0]
            text, end = choice.get("text", ""), choice.get("finish_reason")
            if end is not None:
                # vLLM names the stop string in stop_reason; OpenAI says "stop" for EOS and stop strings alike.
                end = "length" if end == "length" else "stop" if isinstance(choice.get("stop_reason"), str) else "eos"
        if not isinstance(text, str):
            raise RemoteError(self.engine.describe(f"sent a malformed event: {payload[:80]!r}"))
        if text:
            self._text(text)
            if self._hit:
                self._reason = "stop"
                return True
        if end is not None:
            self._reason = end
            # llama-server's stream has no [DONE]; OpenAI's has, after the finish_reason
            return self.engine.spec.kind == "llamacpp"
        return False

    def _text(self, text: str) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.raw += text
        if len(self.raw) > MAX_TEXT:
            raise RemoteError(self.engine.describe("sent more than 1 MiB of text for one completion"))
        cut, hit = self.rules.cut(self.raw)
        upto = len(cut) if hit else self.rules.safe_length(cut)
        if upto > self.sent:
            assert self.stream is not None
            self.stream.push(Delta(cut[self.sent : upto]))
            self.sent = upto
        self._hit = hit


def _os_error(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the server running?)"
    if isinstance(exc, socket.gaierror):
        return "unknown host"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate not trusted ({exc.verify_message})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error ({exc.reason})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the server closed the connection without answering"
    if isinstance(exc, http.client.IncompleteRead):
        return "the server closed the connection mid-answer"
    if isinstance(exc, ConnectionResetError):
        return "the connection was reset"
    if isinstance(exc, http.client.HTTPException):
        return f"bad HTTP answer ({type(exc).__name__})"
    return (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)[:200]


def _error_message(err: object) -> str:
    """A server's error object or string as one short line."""
    if isinstance(err, str):
        try:
            err = json.loads(err)
        except ValueError:
            pass
    if isinstance(err, dict):
        err = err.get("message") or err.get("detail") or err.get("error") or json.dumps(err)[:200]
        if isinstance(err, dict):
            return _error_message(err)
    return " ".join(str(err).split())[:200] or "error"


def _http_error(resp: http.client.HTTPResponse) -> str:
    try:
        raw = resp.read(MAX_ERROR_BODY).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        raw = ""
    try:
        msg = _error_message(json.loads(raw)) if raw.strip() else ""
    except ValueError:
        msg = " ".join(raw.split())[:200]
    status = f"HTTP {resp.status} {resp.reason}".strip()
    hint = {
        401: " (check --engine-token-file)",
        403: " (check --engine-token-file)",
        404: " (check the URL's path: /v1 for OpenAI-compatible servers)",
    }.get(resp.status, "")
    return f"{status}{hint}" + (f": {msg}" if msg else "")


def open_remote(spec: RemoteSpec) -> RemoteEngine:
    return RemoteEngine(spec)
