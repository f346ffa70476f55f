"""Shared helpers for the LSP suite: a real server over stdio, a real engine, both client capability sets.

Model: $FIMBLE_MODEL if set, else the embedded model in models/, else the small stand-ins
in /tmp/ftrain (same format) that exist while the embedded model trains.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from lsprotocol import types
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities

from bench.harness.raw_lsp import SERVER_CMD, SERVER_ENV  # the same server command and model as the raw client

REPO = Path(__file__).resolve().parents[2]
CLIENTS = ["visual-studio-code", "neovim"]


def capabilities(name: str, encodings: list[str] | None = None) -> types.ClientCapabilities:
    """A real editor's capability set plus inline completion (none of the recorded sets has it)."""
    caps = client_capabilities(name)
    caps.text_document.inline_completion = types.InlineCompletionClientCapabilities()
    if encodings is not None:
        caps.general = types.GeneralClientCapabilities(position_encodings=encodings)
    return caps


def init_params(name: str, options: dict | None = None, encodings: list[str] | None = None) -> types.InitializeParams:
    opts = {"streaming": True, "maxTokens": 24, "maxLines": 4}
    opts.update(options or {})
    return types.InitializeParams(capabilities=capabilities(name, encodings), initialization_options=opts)


class Deltas:
    """Collects fimble/completionDelta notifications, with arrival times."""

    def __init__(self, client: LanguageClient):
        self.items: list[tuple[float, dict]] = []
        self._event = asyncio.Event()

        def on_delta(params: Any) -> None:  # a plain function: pygls tags it with attributes
            self.items.append((time.perf_counter(), plain(params)))
            self._event.set()

        client.feature("fimble/completionDelta")(on_delta)

    def of(self, request_id: Any) -> list[dict]:
        return [p for _, p in self.items if p["requestId"] == request_id]

    async def wait(self, pred, timeout: float = 30.0) -> list[dict]:
        """Wait until some delta satisfies ``pred``; return all deltas so far."""
        deadline = time.perf_counter() + timeout
        while not any(pred(p) for _, p in self.items):
            self._event.clear()
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError("no matching fimble/completionDelta")
            try:
                await asyncio.wait_for(self._event.wait(), left)
            except TimeoutError:
                pass
        return [p for _, p in self.items]


def open_doc(client: LanguageClient, uri: str, text: str, language: str = "python", version: int = 1) -> None:
    client.text_document_did_open(types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, language, version, text)))


def change(
    client: LanguageClient, uri: str, version: int, start: tuple[int, int], end: tuple[int, int], text: str
) -> None:
    rng = types.Range(types.Position(*start), types.Position(*end))
    client.text_document_did_change(
        types.DidChangeTextDocumentParams(
            types.VersionedTextDocumentIdentifier(uri=uri, version=version),
            [types.TextDocumentContentChangePartial(range=rng, text=text)],
        )
    )


def inline_params(uri: str, line: int, character: int, invoked: bool = True) -> types.InlineCompletionParams:
    kind = types.InlineCompletionTriggerKind.Invoked if invoked else types.InlineCompletionTriggerKind.Automatic
    return types.InlineCompletionParams(
        context=types.InlineCompletionContext(trigger_kind=kind),
        text_document=types.TextDocumentIdentifier(uri),
        position=types.Position(line, character),
    )


async def inline(
    client: LanguageClient, uri: str, line: int, character: int, msg_id: Any = None, invoked: bool = True
) -> Any:
    """Send textDocument/inlineCompletion, optionally with a chosen JSON-RPC id (to cancel it or match deltas)."""
    return await client.protocol.send_request_async(
        types.TEXT_DOCUMENT_INLINE_COMPLETION, inline_params(uri, line, character, invoked), msg_id=msg_id
    )


def plain(value: Any) -> Any:
    """pygls hands custom-method payloads over as namedtuples: back to dicts and lists."""
    if hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


async def stats(client: LanguageClient) -> dict:
    return plain(await client.protocol.send_request_async("fimble/stats", {}))


async def configure(client: LanguageClient, **settings: Any) -> None:
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings={"fimble": settings}))
    await stats(client)  # a round trip: the notification has been handled once this returns


async def server_text(client: LanguageClient, uri: str) -> dict | None:
    return plain(await client.protocol.send_request_async("fimble/debug/document", {"uri": uri}))


def items_of(result: Any) -> list:
    if result is None:
        return []
    return list(result.items) if hasattr(result, "items") else list(result)


SAMPLE = '''import os
import sys


def read_config(path):
    """Read a key=value file into a dict."""
    config = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition("=")
            config[key.strip()] = value.strip()
    return config


def main():
    config = read_config(sys.argv[1])
    for key in sorted(config):
        print(key, config[key])


if __name__ == "__main__":
    main()
'''


# Every test module starts the real server the way an editor would.
# --debug: the suite reads the server's copy of documents through fimble/debug/document.
SERVER = ClientServerConfig(server_command=SERVER_CMD + ["--debug"], server_env=SERVER_ENV)

# An unfinished call in the middle of SAMPLE: every model has something to say there.
UNFINISHED_LINE = "        print(key, "
UNFINISHED_DOC = SAMPLE.replace("        print(key, config[key])", UNFINISHED_LINE)
UNFINISHED_CURSOR = (UNFINISHED_DOC.splitlines().index(UNFINISHED_LINE), len(UNFINISHED_LINE))
