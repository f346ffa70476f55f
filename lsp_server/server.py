"""The language server: LSP methods wired to the document store, the completer and the stats.

Handlers stay thin: they convert positions (the negotiated encoding) and shapes, then
call the modules that do the work. Nothing here touches the model directly.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Generator
from typing import Any

from lsprotocol import types
from pygls.exceptions import FeatureRequestError, JsonRpcInvalidParams
from pygls.lsp.server import LanguageServer

from lsp_server.answer import Answer, RequestInfo
from lsp_server.change_params import count_edits, parse_change_steps
from lsp_server.completer import Completer
from lsp_server.documents import Document, DocumentStore, PositionError, run_steps
from lsp_server.engine_host import EngineHost
from lsp_server.pacing import HEAVY_CHARS, HEAVY_EDITS, MAX_DOCUMENT_CHARS, Pacer, run_in_slices
from lsp_server.positions import ENCODINGS, UTF16, advance
from lsp_server.protocol import FimbleProtocol, plain
from lsp_server.session_model import SessionModel
from lsp_server.settings import Settings
from lsp_server.stats import Stats, kv_cache_summary
from lsp_server.telemetry import ACCEPT_COMMAND, Telemetry

log = logging.getLogger(__name__)
VERSION = "0.1.0"
CURSOR_METHOD = "fimble/cursor"
_WORD_TAIL = re.compile(r"\w*$")


class FimbleServer(LanguageServer):
    """One client's session: its documents, settings, requests, streams and type-through cache.

    ``host``: an engine shared with other sessions (one per TCP/WS connection, see
    lsp_server/transports.py). Then the engine's model settings are the command line's, and
    this session's documents reach the engine under ``session_id`` (Completer.engine_doc_id).
    """

    def __init__(
        self,
        defaults: Settings | None = None,
        host: EngineHost | None = None,
        *,
        session_id: str = "",
        debug: bool = False,
    ):
        super().__init__(
            "fimble",
            VERSION,
            protocol_cls=FimbleProtocol,
            text_document_sync_kind=types.TextDocumentSyncKind.Incremental,
        )
        self.docs = DocumentStore()
        self.shared_engine = host is not None
        self.host = host or EngineHost()
        self.model = SessionModel(
            defaults or Settings.from_env(),
            self.host,
            shared_engine=self.shared_engine,
            show=lambda kind, text: self.window_show_message(types.ShowMessageParams(kind, text)),
            notify=self.protocol.notify,
        )
        self.session_id = session_id
        self.debug = debug  # fimble/debug/document answers only then
        self.closer: Callable[[int], None] | None = None  # set by the transport: ends this session
        self.peers: Callable[[], dict] | None = None  # set by the transport: every session's tables
        self._reported_internal: set[str] = set()
        self.stats = Stats()
        self.pacer = Pacer(lambda: self.protocol._request_futures)  # lsp_server/pacing.py
        self.telemetry = Telemetry(self.stats)
        self.completer = Completer(self.docs, self.host, self.stats, self.telemetry, self.protocol.notify)
        self.completer.engine_ns = session_id
        self._skipped_languages: set[str] = set()  # logged once each (PROTOCOL.md, Languages)
        self.host.on_change = self.model.publish_status
        self.host.add_notice_listener(self.model.engine_notice)  # engine died / stalled / restarted / gave up

    @property
    def encoding(self) -> str:
        try:
            enc = self.workspace.position_encoding
        except RuntimeError:  # before initialize
            return UTF16
        value = getattr(enc, "value", enc)
        return value if value in ENCODINGS else UTF16

    # -- helpers for handlers ----------------------------------------------------------------
    def cursor(
        self, uri: str, pos: types.Position, req: RequestInfo | None = None
    ) -> tuple[Document, tuple[int, int]] | None:
        """The open document and the code-point cursor, or None (unknown URI, line past the end, a
        language not enabled: then ``req.no_decode`` says ``disabled``).

        A column inside a character is a client bug we can name: InvalidParams.
        """
        doc = self.docs.get(uri)
        if doc is None or pos.line >= len(doc.lines):
            return None
        if not self.settings.enabled_for(doc.language_id):
            self.stats.count("language_disabled")
            if req is not None:
                req.no_decode = "disabled"
            if doc.language_id not in self._skipped_languages:
                self._skipped_languages.add(doc.language_id)
                log.info(
                    "no completions for language %r: not in the enabled languages %s (setting `languages`)",
                    doc.language_id,
                    list(self.settings.effective_languages or ()),
                )
            return None
        try:
            return doc, doc.to_cp(pos.line, pos.character, self.encoding)
        except PositionError as exc:
            raise JsonRpcInvalidParams(f"Invalid Params: {exc}") from None

    def resting_cursor(self, params: Any) -> tuple[Document, tuple[int, int]] | None:
        """fimble/cursor's document and code-point cursor, or None (bad params: logged, never an error)."""
        params = plain(params)
        td = params.get("textDocument") if isinstance(params, dict) else None
        pos = params.get("position") if isinstance(params, dict) else None
        uri = td.get("uri") if isinstance(td, dict) else None
        line, char = (pos.get("line"), pos.get("character")) if isinstance(pos, dict) else (None, None)
        if not isinstance(uri, str) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (line, char)
        ):
            self.protocol.log_dropped("cursor", f"{CURSOR_METHOD}: bad params ignored")
            self.stats.count("cursor_invalid")
            return None
        try:
            return self.cursor(uri, types.Position(line=line, character=char))
        except (JsonRpcInvalidParams, ValueError):  # a notification has no response to carry the error
            self.protocol.log_dropped("cursor-position", f"{CURSOR_METHOD}: an invalid position ignored")
            self.stats.count("cursor_invalid")
            return None

    def client_position(self, doc: Document, cursor: tuple[int, int]) -> types.Position:
        line, units = doc.from_cp(*cursor, self.encoding)
        return types.Position(line=line, character=units)

    def replace_end(self, doc: Document, answer: Answer) -> types.Position:
        """End of what the answer replaces: the cursor, or past the auto-paired closers it re-types."""
        line, col = answer.cursor
        return self.client_position(doc, (line, min(col + answer.replace_cols, len(doc.line_text(line)))))

    # -- settings, model and status (lsp_server/session_model.py) ------------------------------
    @property
    def settings(self) -> Settings:
        return self.model.settings

    @settings.setter
    def settings(self, value: Settings) -> None:
        self.model.settings = value

    @property
    def defaults(self) -> Settings:
        return self.model.defaults

    def apply_settings(self, options: Any) -> None:
        """Merge wire options (SessionModel.apply); a change of the languages served logs skipped ones anew."""
        if self.model.apply(options):
            self._skipped_languages.clear()

    def experimental_capabilities(self) -> dict:
        """InitializeResult.capabilities.experimental (PROTOCOL.md, Capabilities)."""
        return self.model.experimental_capabilities()

    def publish_status(self) -> None:
        self.model.publish_status()

    def report_server_error(self, error: Exception, source: Any) -> None:
        """pygls' hook for failures outside a request: the details go to the log, never to the client."""
        if source is FeatureRequestError:  # already answered (and logged) with the request's error response
            return
        log.error("internal error (%s): %s", getattr(source, "__name__", source), type(error).__name__)
        if type(error).__name__ not in self._reported_internal:
            self._reported_internal.add(type(error).__name__)  # once each: every keystroke would be noise
            self.window_show_message(
                types.ShowMessageParams(
                    types.MessageType.Error, "fimble: internal error (details are in the server log)"
                )
            )

    def end_session(self, code: int) -> None:
        """`exit`: the transport closes this session (stdio: the process ends with ``code``)."""
        self.close_session()
        if self.closer is not None:
            self.closer(code)

    # -- text sync ---------------------------------------------------------------------------
    def receive_change(self, params: Any) -> None:
        """``textDocument/didChange`` as plain JSON (lsp_server/change_params.py says why).

        A change of many edits or much text runs in slices before this session's next message
        (lsp_server/pacing.py); a small one (typing) at once."""
        edits, chars = count_edits(params)
        if edits <= HEAVY_EDITS and chars <= HEAVY_CHARS:
            run_steps(self._change_steps(params, heavy=False))
        else:
            self.pacer.defer(run_in_slices(self._change_steps(params, heavy=True)))

    def _change_steps(self, params: Any, heavy: bool) -> Generator[None, None, None]:
        change = yield from parse_change_steps(params)
        if change is None:
            self.protocol.log_dropped(
                "didChange", "dropped a textDocument/didChange message whose params do not fit the LSP types"
            )
            return
        doc = self.docs.get(change.uri)
        if doc is None:
            self.stats.count("changes_unknown_document")
            self.protocol.log_dropped("didChange-unknown", "dropped a didChange for a document that is not open")
            return
        if heavy:
            self.completer.hold(doc.uri)
            if len(change.edits) > HEAVY_EDITS:
                doc.begin_batch()
        enc = self.encoding
        cursor = None  # where the cursor is after one plain insertion (typing)
        presumed = None  # the end of the last change's text: where the user presumably is (None: the end)
        try:
            for span, text in change.edits:
                if span is None:
                    yield from doc.set_text_steps(text)
                    presumed = None
                    continue
                start = doc.to_cp(span[0], span[1], enc, lenient=True)
                end = doc.to_cp(span[2], span[3], enc, lenient=True)
                yield from doc.apply_edit_steps(start, end, text)
                presumed = advance(*min(start, end), text)
                if len(change.edits) == 1 and start == end and text:
                    cursor = presumed
                yield
            yield from doc.end_batch_steps()
        finally:
            doc.end_batch()  # (after an error or a cancel: the syntax copy must not stay behind)
        doc.version = change.version
        if doc.length > MAX_DOCUMENT_CHARS:
            self.docs.close(doc.uri)
            self.completer.document_closed(doc.uri)
            self.document_too_large(doc.uri)
            return
        self.completer.document_changed(doc, cursor, self.settings)
        self.completer.schedule_prewarm(doc, presumed, self.settings)

    def document_too_large(self, uri: str) -> None:
        """A document over MAX_DOCUMENT_CHARS is not kept: say so once a session, count every one."""
        self.stats.count("documents_too_large")
        if self.stats.counters["documents_too_large"] == 1:
            self.window_show_message(
                types.ShowMessageParams(
                    types.MessageType.Info,
                    f"fimble: no completions in documents over {MAX_DOCUMENT_CHARS:,} characters",
                )
            )
        log.info("a document over %d characters is not kept", MAX_DOCUMENT_CHARS)

    def close_session(self) -> None:
        """Forget everything of this session: its documents here and in the engine, its decodes."""
        self.protocol.phase = "shutdown"
        self.pacer.close()
        for uri in self.docs.uris():
            self.docs.close(uri)
            self.completer.document_closed(uri)
        if self.completer.active is not None:
            self.completer.active.cancel()
        for future in list(self.protocol._request_futures.values()):
            future.cancel()

    async def answer(
        self, uri: str, pos: types.Position, token: Any, invoked: bool, *, stream: bool
    ) -> tuple[Document, Answer] | None:
        """A completion request's answer (None: nothing to show).

        With ``stream``, the request gets exactly one ``done`` delta (PROTOCOL.md), whichever way it ends.
        A request the Completer subscribed gets it from its subscription (lsp_server/streaming.py); every
        other one (a disabled language, nothing to complete, debounced, no model, cancelled or failed before
        its decode started) gets it here, with empty text, when it ends: one place for every early return,
        so a client waiting for the ``done`` (bench/quality.py, the editors) never waits in vain."""
        req = RequestInfo(
            self.protocol.msg_id,
            token,
            {"line": pos.line, "character": pos.character},
            time.perf_counter(),
            invoked,
            encoding=self.encoding,
        )
        seen = self.docs.get(uri)
        version = seen.version if seen is not None else None  # the version the request saw
        try:
            return await self._answer(uri, pos, req, stream=stream)
        except asyncio.CancelledError:
            req.no_decode = "cancelled"
            raise
        except Exception:
            req.no_decode = "error"
            raise
        finally:
            if stream and not req.streamed:
                self.completer.streamer.end_without_decode(
                    req.request_id, token, uri, version, req.position, req.no_decode
                )

    async def _answer(
        self, uri: str, pos: types.Position, req: RequestInfo, *, stream: bool
    ) -> tuple[Document, Answer] | None:
        target = self.cursor(uri, pos, req)
        if target is None:
            return None
        doc, cursor = target
        answer = await self.completer.complete(doc, cursor, self.settings, req, stream=stream)
        self.model.report_engine_error()
        if answer is not None and self.model.first_latency_ms is None and self.host.state == "ready":
            self.model.first_latency_ms = round((time.perf_counter() - req.t0) * 1e3)
            self.publish_status()
        return None if answer is None else (doc, answer)


def create_server(
    defaults: Settings | None = None, host: EngineHost | None = None, *, session_id: str = "", debug: bool = False
) -> FimbleServer:
    ls = FimbleServer(defaults, host, session_id=session_id, debug=debug)
    _register(ls)
    return ls


def _register(ls: FimbleServer) -> None:
    """Every handler takes the server as ``ls`` (pygls injects it by that name)."""

    @ls.feature(types.INITIALIZE)
    def initialize(ls: FimbleServer, params: types.InitializeParams) -> None:
        ls.apply_settings(params.initialization_options)
        ls.completer.context.set_workspace(params)  # the folders imports may be read from (lsp_server/context/)
        experimental = params.capabilities.experimental
        fimble = (experimental.get("fimble") or {}) if isinstance(experimental, dict) else {}
        if isinstance(fimble, dict) and fimble.get("completionDelta"):
            ls.settings = ls.settings.merged({"streaming": True})
        if isinstance(fimble, dict) and fimble.get("replaceStart"):
            ls.settings = ls.settings.merged({"lineStartAnswers": True})

    @ls.feature(types.INITIALIZED)
    def initialized(ls: FimbleServer, params: types.InitializedParams) -> None:
        ls.model.status_live = True
        if ls.settings.preload:
            ls.host.configure(ls.settings)  # load the model now, not on the first keystroke
        ls.publish_status()

    @ls.feature(types.SHUTDOWN)
    async def shutdown(ls: FimbleServer, params: None) -> None:
        if ls.completer.active is not None:
            ls.completer.active.cancel()
        if not ls.shared_engine:  # a shared engine serves the other sessions on
            await ls.host.close()

    @ls.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
    def did_change_configuration(ls: FimbleServer, params: types.DidChangeConfigurationParams) -> None:
        ls.apply_settings(params.settings)
        if ls.settings.preload or ls.host.state != "stopped":
            ls.host.configure(ls.settings)  # restarts the engine if the model changed

    # -- documents ---------------------------------------------------------------------------
    @ls.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: FimbleServer, params: types.DidOpenTextDocumentParams) -> None:
        td = params.text_document
        if len(td.text) > MAX_DOCUMENT_CHARS:
            ls.document_too_large(td.uri)
            return
        if len(td.text) <= HEAVY_CHARS:
            opened(ls, ls.docs.open(td.uri, td.text, td.version, td.language_id))
        else:  # in slices, before this session's next message (lsp_server/pacing.py)
            ls.pacer.defer(_open_in_slices(ls, td))

    async def _open_in_slices(ls: FimbleServer, td: types.TextDocumentItem) -> None:
        opened(ls, await run_in_slices(ls.docs.open_steps(td.uri, td.text, td.version, td.language_id)))

    def opened(ls: FimbleServer, doc: Document) -> None:
        # No cursor is known yet. Pre-warm as for one at the end of the document: a file
        # opened to be worked on is most often appended to, and its prefix (nearly all of
        # the prompt) is then what the first completion reuses.
        ls.completer.schedule_prewarm(doc, None, ls.settings, delay_ms=0)

    @ls.feature(CURSOR_METHOD)
    def cursor_moved(ls: FimbleServer, params: Any) -> None:
        """Where the editor's cursor rests: pre-warm the KV cache for a completion there (PROTOCOL.md)."""
        ls.stats.count("cursor_notifications")
        target = ls.resting_cursor(params)
        if target is not None:
            ls.completer.cursor_moved(*target, ls.settings)

    @ls.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: FimbleServer, params: types.DidCloseTextDocumentParams) -> None:
        if ls.docs.close(params.text_document.uri) is not None:
            ls.completer.document_closed(params.text_document.uri)

    # -- completions -------------------------------------------------------------------------
    @ls.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(ls: FimbleServer, params: types.InlineCompletionParams) -> types.InlineCompletionList:
        ls.stats.count("requests_inline")
        invoked = params.context.trigger_kind == types.InlineCompletionTriggerKind.Invoked
        got = await ls.answer(
            params.text_document.uri, params.position, params.work_done_token, invoked, stream=ls.settings.streaming
        )
        if got is None:
            return types.InlineCompletionList(items=[])
        doc, answer = got
        pos = ls.client_position(doc, answer.cursor)
        item = types.InlineCompletionItem(
            insert_text=answer.text,
            range=types.Range(pos, ls.replace_end(doc, answer)),
            command=types.Command(title="Accept completion", command=ACCEPT_COMMAND, arguments=[answer.completion_id]),
        )
        return types.InlineCompletionList(items=[item])

    @ls.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions(resolve_provider=False))
    async def completion(ls: FimbleServer, params: types.CompletionParams) -> types.CompletionList:
        ls.stats.count("requests_completion")
        invoked = params.context is None or params.context.trigger_kind == types.CompletionTriggerKind.Invoked
        got = await ls.answer(params.text_document.uri, params.position, params.work_done_token, invoked, stream=False)
        if got is None:
            return types.CompletionList(is_incomplete=True, items=[])
        doc, answer = got
        line, col = answer.cursor
        # Replace the word before the cursor, so the client's filter (the word) matches the item.
        word = _WORD_TAIL.search(doc.line_text(line)[:col]).group()
        start = ls.client_position(doc, (line, col - len(word)))
        end = ls.replace_end(doc, answer)
        new_text = word + answer.text
        label = new_text.strip().splitlines()[0][:80] if new_text.strip() else new_text
        item = types.CompletionItem(
            label=label,
            kind=types.CompletionItemKind.Text,
            detail="fimble",
            sort_text="0",
            filter_text=new_text,
            insert_text_format=types.InsertTextFormat.PlainText,
            text_edit=types.TextEdit(range=types.Range(start, end), new_text=new_text),
            command=types.Command(title="Accept completion", command=ACCEPT_COMMAND, arguments=[answer.completion_id]),
        )
        # Incomplete: the client asks again as the user types, and type-through answers that.
        return types.CompletionList(is_incomplete=True, items=[item])

    # -- telemetry ---------------------------------------------------------------------------
    @ls.feature("textDocument/didShowCompletion")
    def did_show(ls: FimbleServer, params: Any) -> None:
        ls.telemetry.did_show(plain(params))

    @ls.feature("textDocument/didPartiallyAcceptCompletion")
    def did_partially_accept(ls: FimbleServer, params: Any) -> None:
        ls.telemetry.did_partially_accept(plain(params))

    @ls.command(ACCEPT_COMMAND)
    def accept(ls: FimbleServer, *args: Any) -> None:
        ls.telemetry.accept(plain(args[0]) if args else None)

    # -- fimble's own requests ---------------------------------------------------------------
    @ls.feature("fimble/stats")
    async def stats(ls: FimbleServer, params: Any) -> dict:
        snap = ls.stats.snapshot()
        counters = await ls.host.counters()
        snap["engine"] = {**ls.host.info(), "counters": counters, "error": ls.model.public_engine_error()}
        snap["kvCache"] = kv_cache_summary(counters, ls.stats.counters)
        snap["tokens"] = {k: ls.stats.counters[k] for k in ("tokens_generated", "tokens_shown", "tokens_never_shown")}
        snap["tokens"].update(ls.completer.pending_accounting())
        snap["tables"] = {
            "documents": len(ls.docs),
            "pygls_request_futures": len(ls.protocol._request_futures),
            "pygls_result_types": len(ls.protocol._result_types),
            "telemetry_items": len(ls.telemetry),
            "asyncio_tasks": len(asyncio.all_tasks()),
            **ls.completer.tables(),
        }
        snap["settings"] = {
            "streaming": ls.settings.streaming,
            "maxLines": ls.settings.max_lines,
            "maxTokens": ls.settings.max_tokens,
            "model": ls.settings.model,
            "encoding": ls.encoding,
            "policy": ls.settings.policy,
            "kvCacheMB": ls.settings.kv_cache_mb,
            "kvShiftReuse": ls.settings.kv_shift_reuse,
            "prewarm": ls.settings.prewarm,
            "prewarmDelayMs": ls.settings.prewarm_delay_ms,
            "languages": None if (langs := ls.settings.effective_languages) is None else list(langs),
        }
        snap["lastPolicy"] = ls.completer.last_policy
        snap["pacing"] = {"deferred": ls.pacer.deferred, "paused": ls.pacer.paused}  # lsp_server/pacing.py
        if ls.peers is not None:  # all sessions of this listener: counts only, nothing of their content
            snap["server"] = ls.peers()
        return snap

    def debug_document(ls: FimbleServer, params: Any) -> dict | None:
        params = plain(params)
        uri = params.get("uri") if isinstance(params, dict) else None
        doc = ls.docs.get(uri) if isinstance(uri, str) else None
        if doc is None:
            return None
        return {
            "uri": doc.uri,
            "version": doc.version,
            "text": doc.source,
            "lines": len(doc.lines),
            "length": doc.length,
        }

    def debug_context(ls: FimbleServer, params: Any) -> list[dict]:
        """Each document's cross-file context ring: where its chunks come from (lsp_server/context/)."""
        params = plain(params)
        uri = params.get("uri") if isinstance(params, dict) else None
        return ls.completer.context.debug_state(uri if isinstance(uri, str) else None)

    if ls.debug:  # it reads out document text: only with `fimble lsp --debug`
        ls.feature("fimble/debug/document")(debug_document)
        ls.feature("fimble/debug/context")(debug_context)
        ls.completer.context.debug = True  # the log names the chunks each ring holds
