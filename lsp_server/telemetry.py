"""Copilot-style completion telemetry: shown, partially accepted, accepted.

Every answered completion gets an id, carried as the argument of the item's command
(``fimble.acceptCompletion``), the way Copilot's ``github.copilot.didAcceptCompletionItem``
does. ``textDocument/didShowCompletion`` and ``textDocument/didPartiallyAcceptCompletion``
carry the item back, so the id is found in ``item.command.arguments[0]``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from lsp_server.stats import Stats

ACCEPT_COMMAND = "fimble.acceptCompletion"
MAX_REMEMBERED = 512


@dataclass
class Shown:
    text: str
    cached: bool
    shown: bool = False


class Telemetry:
    def __init__(self, stats: Stats):
        self.stats = stats
        self._ids = itertools.count(1)
        self._items: OrderedDict[str, Shown] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def new_id(self) -> str:
        return f"fimble-{next(self._ids)}"

    def remember(self, completion_id: str, text: str, cached: bool) -> None:
        self._items[completion_id] = Shown(text, cached)
        while len(self._items) > MAX_REMEMBERED:
            self._items.popitem(last=False)

    @staticmethod
    def id_of(item: Any) -> str | None:
        """The completion id inside an item sent back by the client (a dict: custom methods aren't typed)."""
        if not isinstance(item, dict):
            return None
        cmd = item.get("command")
        args = cmd.get("arguments") if isinstance(cmd, dict) else None
        return args[0] if isinstance(args, list) and args and isinstance(args[0], str) else None

    def did_show(self, params: Any) -> None:
        entry = self._items.get(self.id_of(params.get("item")) or "") if isinstance(params, dict) else None
        self.stats.count("shown")
        if entry is not None and not entry.shown:
            entry.shown = True
            self.stats.count("shown_cached" if entry.cached else "shown_model")

    def did_partially_accept(self, params: Any) -> None:
        n = params.get("acceptedLength") if isinstance(params, dict) else None
        self.stats.count("partially_accepted")
        if isinstance(n, int) and n > 0:
            self.stats.count("accepted_chars", n)

    def accept(self, completion_id: Any) -> None:
        entry = self._items.pop(completion_id, None) if isinstance(completion_id, str) else None
        self.stats.count("accepted")
        if entry is not None:
            self.stats.count("accepted_chars", len(entry.text))
