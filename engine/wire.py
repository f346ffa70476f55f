"""The engine's wire format: the messages between an engine and its client, over a pipe or a websocket.

Each message is one msgpack map. ``fimble lsp``'s engine child (engine/process.py) reads them on its stdin and
writes them on its stdout; ``fimble serve`` (engine/serve/daemon.py) carries the same messages in websocket
frames, after a handshake (engine/serve/protocol.py). One host loop answers them on both
(engine/host_loop.py), and one client sends them on both (engine/wire_client.py).

  client -> engine: {op: submit, id, request} | {op: cancel, id} | {op: counters, id}
                    | {op: prewarm, request} | {op: forget, document} | {op: ping, id} | {op: close}
  engine -> client: {op: delta, id, delta} | {op: result, id, result} (sent just before the final delta)
                    | {op: counters, id, counters} | {op: pong, id}
  the engine child also: {op: ready, info} | {op: fatal, error}
                    | {op: progress, phase, done, total} (from the decode loop: "prefill" before a prompt's pass,
                      with the tokens it will compute; the host's watchdog scales its patience with it)
  the daemon also: {op: error, error} (a bad message; the connection stays up)

A request travels as ``CompletionRequest.to_dict()`` and is read back with ``request_from_dict``; a delta and a
result as their dataclass fields.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import msgpack

from engine.api import CompletionRequest, CompletionResult, DecodeOptions, Delta
from engine.caching.context_prompt import context_from_wire

OPS_TO_ENGINE = ("submit", "cancel", "counters", "prewarm", "forget", "ping", "close")
OPS_FROM_ENGINE = ("delta", "result", "counters", "pong", "ready", "fatal", "progress", "error")


class ProtocolError(ValueError):
    """A message that does not follow this protocol; its text is safe to send back (no document text)."""


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def request_to_dict(request: CompletionRequest) -> dict:
    return request.to_dict()


def request_from_dict(d: dict) -> CompletionRequest:
    opts = dict(d.get("options") or {})
    if "stop" in opts:
        opts["stop"] = tuple(opts["stop"])
    lines = d.get("segment_lines")
    return CompletionRequest(
        prefix=d.get("prefix", ""),
        suffix=d.get("suffix", ""),
        options=DecodeOptions(**opts),
        document_id=d.get("document_id"),
        segment_lines=None if lines is None else [int(x) for x in lines],
        reuse=str(d.get("reuse", "exact")),
        truncate=bool(d.get("truncate", False)),
        heal=bool(d.get("heal", True)),
        cold_window=bool(d.get("cold_window", False)),
        background=bool(d.get("background", False)),
        context=_context(d.get("context")),
        idle_s=_idle_s(d.get("idle_s", 0.0)),
    )


MAX_IDLE_S = 3600.0


def _idle_s(value: Any) -> float:
    """Seconds since the user's last activity, 0-MAX_IDLE_S (a ValueError is a bad request)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_IDLE_S:
        raise ValueError(f"idle_s must be a number from 0 to {MAX_IDLE_S:.0f}")
    return float(value)


def _context(data: Any) -> dict | None:
    """The request's cross-file context, checked and bounded here (a ValueError is a bad request)."""
    context_from_wire(data)
    return data


def delta_message(rid: int, delta: Delta) -> dict:
    return {"op": "delta", "id": rid, "delta": dict(vars(delta))}  # Delta's fields are plain values


def result_message(rid: int, result: CompletionResult) -> dict:
    # (vars and a shallow copy of the stats: asdict deep-copied them, ~0.1 ms a finished request in a serve round)
    return {"op": "result", "id": rid, "result": {**vars(result), "stats": dict(result.stats)}}


def error_delta(rid: int, reason: str, error_type: str | None = None) -> dict:
    """The final delta of a request refused before it ran."""
    return {"op": "delta", "id": rid, "delta": asdict(Delta("", True, "error", reason, error_type))}


def delta_from(msg: dict) -> Delta:
    return Delta(**msg["delta"])


def result_from(msg: dict) -> CompletionResult:
    return CompletionResult(**msg["result"])
