"""``fimble/completionDelta``: stream a request's text-so-far to clients that asked for it.

A subscription ties one request to one generation at an offset (the characters the user
had already typed through). It is valid for one document version: any edit of the
document ends it, so a delta never applies to text the client no longer has. Every
subscription ends with exactly one notification that has ``done: true``.

A request that got no subscription (answered without a decode: its language is off, nothing to
complete, cancelled or failed before the decode started) gets its one ``done`` from
``end_without_decode``, sent by FimbleServer.answer when the request ends: so every streaming
request gets exactly one (PROTOCOL.md), and a client that waits for it never waits in vain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lsp_server.generation import Generation
from lsp_server.line_start import at_cursor

METHOD = "fimble/completionDelta"


@dataclass(eq=False)
class Subscription:
    gen: Generation
    offset: int
    request_id: Any
    token: Any
    completion_id: str
    uri: str
    version: int
    position: dict  # the request's position, client units
    cached: bool
    sent: int = -1  # length of the text last sent
    closed: bool = False
    listener: Callable[[Generation], None] | None = field(default=None, repr=False)
    # text, done -> the end of what ``text`` replaces (client units: past the cursor over the
    # auto-paired closers it re-types), sent as ``replaceEnd`` so a client that builds its item
    # from a delta never doubles a closer (PROTOCOL.md). None: no ``replaceEnd``.
    replace_end: Callable[[str, bool], dict | None] | None = field(default=None, repr=False)
    # A decode from the start of the cursor's line (lsp_server/line_start.py): the editor's indentation before
    # the cursor. Text that keeps it is sent past it, at ``position``; a dedent is sent whole with
    # ``replaceStart`` at the line's start; text still inside the indentation is not sent yet.
    indent: str = ""


class DeltaStreamer:
    def __init__(self, notify: Callable[[str, dict], None]):
        self._notify = notify
        self._by_uri: dict[str, list[Subscription]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_uri.values())

    def subscribe(self, sub: Subscription) -> None:
        """Start streaming; any older subscription on the same document is superseded."""
        self.end_document(sub.uri, "superseded")
        self._by_uri[sub.uri] = [sub]
        sub.listener = lambda gen: self._on_change(sub)
        sub.gen.listeners.append(sub.listener)
        self._on_change(sub)  # text already there (a type-through hit) goes out at once

    def live(self, gen: Generation) -> int:
        return sum(1 for subs in self._by_uri.values() for s in subs if s.gen is gen and not s.closed)

    def end(self, sub: Subscription, reason: str) -> None:
        if sub.closed:
            return
        sub.closed = True
        if sub.listener in sub.gen.listeners:
            sub.gen.listeners.remove(sub.listener)
        subs = self._by_uri.get(sub.uri)
        if subs and sub in subs:
            subs.remove(sub)
            if not subs:
                del self._by_uri[sub.uri]
        # Ended early (edit, newer request, cancel): repeat what the client has, add nothing.
        upto = None if sub.gen.done and reason == sub.gen.finish_reason else sub.offset + max(sub.sent, 0)
        self._send(sub, sub.gen.text[sub.offset : upto], True, reason)

    def end_without_decode(
        self, request_id: Any, token: Any, uri: str, version: int | None, position: dict, reason: str
    ) -> None:
        """The ``done`` delta of a request no subscription was made for: empty text, ``reason`` why."""
        self._notify(
            METHOD,
            {
                "requestId": request_id,
                "token": token,
                "completionId": None,
                "uri": uri,
                "version": version,
                "position": position,
                "text": "",
                "done": True,
                "finishReason": reason,
                "cached": False,
                "replaceEnd": position,
            },
        )

    def end_document(self, uri: str, reason: str) -> None:
        for sub in list(self._by_uri.get(uri, ())):
            self.end(sub, reason)

    def _on_change(self, sub: Subscription) -> None:
        gen = sub.gen
        if gen.done:
            self.end(sub, gen.finish_reason or "stop")
            return
        text = gen.text[sub.offset :]
        if len(text) > sub.sent and text and (not sub.indent or at_cursor(text, sub.indent) != ""):
            self._send(sub, text, False, None)

    def _send(self, sub: Subscription, text: str, done: bool, reason: str | None) -> None:
        """Send ``text`` (the generation's from the subscription's offset; ``sent`` counts it)."""
        sub.sent = len(text)
        sub.gen.mark_shown(sub.offset + len(text))
        replace_start = None
        if sub.indent:
            rest = at_cursor(text, sub.indent)
            if rest is None:  # a dedent: the whole line, over the indentation
                replace_start = {"line": sub.position["line"], "character": 0}
            else:
                text = rest
        params = {
            "requestId": sub.request_id,
            "token": sub.token,
            "completionId": sub.completion_id,
            "uri": sub.uri,
            "version": sub.version,
            "position": sub.position,
            "text": text,
            "done": done,
            "finishReason": reason,
            "cached": sub.cached,
        }
        if sub.replace_end is not None:
            params["replaceEnd"] = sub.replace_end(text, done)
        if replace_start is not None:
            params["replaceStart"] = replace_start
        self._notify(METHOD, params)
