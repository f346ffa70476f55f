"""pygls' protocol with three fixes a long-lived completion server needs.

1. pygls 2.1 files every notification's handler future in ``_request_futures`` under a
   random id and never removes it (one entry per keystroke, forever). We drop each entry
   once its future is done.
2. A request whose params don't fit the LSP types (say ``line: -1``) got no response at
   all: pygls raised while decoding and the client waited forever. It now gets
   InvalidParams.
3. Text synchronisation goes to our own document store (lsp_server/documents.py), not to
   pygls' workspace copy, which re-splits the whole document on every edit.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method


def plain(value: Any) -> Any:
    """Params of custom methods arrive as pygls namedtuples ("Object"): turn them back into dicts and lists."""
    if hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


@attrs.define
class _Answered:
    """Stands in for a message already answered with an error; handle_message ignores it."""

    jsonrpc: str = "answered"


class FimbleProtocol(LanguageServerProtocol):
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

    # -- text sync: our handlers only --------------------------------------------------------
    @lsp_method(types.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: types.DidOpenTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_OPEN)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: types.DidChangeTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_CHANGE)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: types.DidCloseTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_CLOSE)) is not None:
            yield handler, (params,), None
