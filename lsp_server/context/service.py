"""Cross-file context for a session: candidates from open tabs, imports and recent edits, a ring per document.

Never on the keystroke path. A keystroke's request reads the document's ring as it is
(``for_request``: a dict built when the ring last changed). The work happens in one background task
per session, started REFRESH_DELAY_S after the latest document event (``touch``: didOpen, didChange,
fimble/cursor) and run in slices of at most SLICE_S on the event loop, with a PAUSE_S pause after each, so
other messages are answered between slices:
1-3. gather the candidates (lsp_server/context/sources.py): chunks of the open documents of the focused
   one's language, the definitions of the names it imports (open, or on disk inside the workspace
   folders), the ranges recently edited in other documents;
4. refresh the focused document's ring (lsp_server/context/ring.py), only where something changed for
   it: the first time, a cursor jump of more than JUMP_LINES lines, other candidates. Typing in the
   document changes none of these, so its ring, its prompt's head and the engine's cache of it stay.
A ring that changed asks for a pre-warm (``on_change``), so the engine fills the new prompt while the
user is idle.

Ranking: the text around the cursor (CURSOR_LINES_BEFORE / AFTER) as an identifier set; definitions
of imported names score 2 + Jaccard where the name is used there, 1 + Jaccard otherwise; open
documents' chunks score their Jaccard, recent edits theirs plus RECENT_BONUS, and only above
TAB_THRESHOLD: without a candidate above it there is no context at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lsp_server.context.chunks import Chunk, identifiers, jaccard, window_text
from lsp_server.context.files import resolve_roots, uri_to_path
from lsp_server.context.imports import family
from lsp_server.context.ring import Ring
from lsp_server.context.sources import CURSOR_LINES_AFTER, CURSOR_LINES_BEFORE, Slice, Sources
from lsp_server.documents import Document, DocumentStore
from lsp_server.stats import Stats

log = logging.getLogger(__name__)
REFRESH_DELAY_S = 0.25  # after the latest document event: a burst of events is one refresh
MAX_CANDIDATES = 64  # ranked candidates a refresh hands the ring
JUMP_LINES = 32  # a cursor move this far is a new place: refresh the ring (llama.vim: 32)
# An open document's chunk below this Jaccard is no context: unrelated modules of the same package scored
# 0.10-0.22 against the cursor's text in bench/crossfile.py's cases (and the defining module's chunks no more).
TAB_THRESHOLD = 0.2
RECENT_BONUS = 0.05
_COMMENTS = {"python": "#", "js": "//", "go": "//", "rust": "//", "java": "//", "c": "//"}


@dataclass
class _DocState:
    ring: Ring = field(default_factory=Ring)
    line: int | None = None  # the cursor line of the last refresh
    signature: tuple = ()  # what the candidates were built from at the last refresh
    wire: tuple[tuple, dict | None] = ((), None)  # (ring version, budget, label) -> the request's context
    scores: dict[int, float] = field(default_factory=dict)  # id(chunk) -> score when chosen (debug)


class CrossFileContext:
    def __init__(
        self,
        docs: DocumentStore,
        stats: Stats,
        on_change: Callable[[Document, tuple[int, int] | None, Any], None] | None = None,
    ) -> None:
        self.docs, self.stats = docs, stats
        self.on_change = on_change  # the ring of this document at this cursor changed: pre-warm it
        self.debug = False  # `fimble lsp --debug`: log the chunks each ring holds
        self.sources = Sources(docs, stats)  # open documents, imports, recent edits
        self._states: dict[str, _DocState] = {}
        self._seen: dict[str, int] = {}  # uri -> version at its last touch (an edit since: a recent edit)
        self._focus: tuple[str, tuple[int, int] | None] | None = None
        self._settings: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        self._again = False
        self._quiet = False  # while on_change runs: its pre-warm's touch is not an event

    # -- configuration -------------------------------------------------------------------------
    def set_workspace(self, params: Any) -> None:
        """Workspace folders from ``initialize`` params (``workspaceFolders``, else ``rootUri`` / ``rootPath``)."""
        paths = []
        for folder in getattr(params, "workspace_folders", None) or []:
            path = uri_to_path(getattr(folder, "uri", "") or "")
            if path:
                paths.append(path)
        if not paths:
            root_uri = getattr(params, "root_uri", None)
            path = uri_to_path(root_uri) if root_uri else getattr(params, "root_path", None)
            if path:
                paths.append(path)
        self.sources.roots = resolve_roots(paths[:16])

    @staticmethod
    def enabled(settings: Any) -> bool:
        # Not with a remote engine or a shared daemon: other files' text would leave this process for it.
        return (
            bool(getattr(settings, "cross_file_context", False))
            and settings.engine_spec is None
            and settings.cross_file_budget > 0
        )

    # -- events (cheap: they only note what happened and arm the timer) ---------------------------------
    def touch(self, doc: Document, cursor: tuple[int, int] | None, settings: Any) -> None:
        """A document event: opened, changed (``cursor``: where), or the editor's cursor rests there."""
        if self._quiet:
            return
        self._settings = settings
        if not self.enabled(settings):
            return
        uri = doc.uri
        seen = self._seen.get(uri)
        edited = seen is not None and seen != doc.version and cursor is not None
        self.sources.touched(uri, cursor[0] if edited and cursor is not None else None)
        self._seen[uri] = doc.version
        self._focus = (uri, cursor)
        self._arm()

    def closed(self, uri: str) -> None:
        self._states.pop(uri, None)
        self.sources.closed(uri)
        self._seen.pop(uri, None)
        if self._focus is not None and self._focus[0] == uri:
            self._focus = None
        if not len(self.docs):  # the session closed its last document (or ended): no work left to do
            self.close()

    def for_request(self, uri: str, doc: Document | None, settings: Any) -> dict | None:
        """The request's ``context`` (engine/caching/context_prompt.py): the document's ring as it is."""
        if not self.enabled(settings):
            return None
        state = self._states.get(uri)
        if state is None or not state.ring.items:
            return None
        key = (state.ring.version, settings.cross_file_budget)
        if state.wire[0] != key:
            chunks = [c for c in state.ring.items if c.uri != uri]
            fam = family(doc.language_id) if doc is not None else None
            repo, path = self.sources.label(uri)
            wire = (
                {
                    "repo": repo,
                    "path": path,
                    "comment": _COMMENTS.get(fam or "", "#"),
                    "budget": settings.cross_file_budget,
                    "chunks": [{"path": c.label, "text": c.text} for c in chunks],
                }
                if chunks
                else None
            )
            state.wire = (key, wire)
        return state.wire[1]

    @property
    def pending(self) -> bool:
        return self._timer is not None or (self._task is not None and not self._task.done())

    def tables(self) -> dict:
        return {"context_rings": len(self._states), **self.sources.tables(), "context_pending": int(self.pending)}

    def debug_state(self, uri: str | None = None) -> list[dict]:
        """For ``fimble/debug/context`` (only with --debug): each ring's chunks, by where they come from."""
        return [
            {
                "uri": u,
                "chunks": [c.describe() for c in s.ring.items],
                "scores": [round(s.scores.get(id(c), 0.0), 3) for c in s.ring.items],
                "tokens": s.ring.tokens,
                "line": s.line,
            }
            for u, s in self._states.items()
            if uri is None or u == uri
        ]

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()

    # -- the background work ------------------------------------------------------------------
    def _arm(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(REFRESH_DELAY_S, self._start)

    def _start(self) -> None:
        self._timer = None
        if self._task is not None and not self._task.done():
            self._again = True  # the running refresh is followed by another
            return
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                self._again = False
                await self._refresh()
                if not self._again:
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # the context is only an aid: a bug costs it, never the session
            log.exception("cross-file context failed")
            self.stats.count("context_errors")

    async def _refresh(self) -> None:
        focus, settings = self._focus, self._settings
        if focus is None or settings is None or not self.enabled(settings):
            return
        uri, cursor = focus
        doc = self.docs.get(uri)
        fam = family(doc.language_id) if doc is not None else None
        if doc is None or fam is None or getattr(doc, "changing", False):
            return
        self.stats.count("context_refreshes")
        started = Slice(self.stats)
        try:
            await self._refresh_doc(doc, fam, focus, settings, started)
        finally:
            started.done()

    async def _refresh_doc(self, doc: Document, fam: str, focus: tuple, settings: Any, started: Slice) -> None:
        uri, cursor = focus
        sources = set(settings.cross_file_sources)
        line = min(cursor[0], len(doc.lines) - 1) if cursor is not None else len(doc.lines) - 1
        tabs = await self.sources.tab_chunks(fam, uri, started) if "openFiles" in sources else []
        if self._focus != focus or self.docs.get(uri) is not doc:
            return  # moved on meanwhile: the event that moved it armed the next refresh
        imports = await self.sources.import_chunks(doc, fam, line, started) if "imports" in sources else []
        if self._focus != focus or self.docs.get(uri) is not doc:
            return
        edits = self.sources.edit_chunks(fam, uri) if "recentEdits" in sources else []
        state = self._states.setdefault(uri, _DocState())
        signature = (
            tuple((ix.key, len(ix.chunks)) for ix in tabs),
            tuple((c.uri, c.start, c.end, c.name) for c, _ in imports),
            tuple((c.uri, c.start, c.end) for c in edits),
        )
        jump = state.line is None or abs(line - state.line) > JUMP_LINES
        if not jump and signature == state.signature:
            return  # nothing new for this document: its ring (and the engine's cache of it) stays
        state.line, state.signature = line, signature
        window = window_text(doc.lines, line - CURSOR_LINES_BEFORE, line + CURSOR_LINES_AFTER + 1)
        cursor_ids = identifiers(window)
        ranked: list[tuple[float, Chunk]] = []
        for c, used in imports:
            ranked.append(((2.0 if used else 1.0) + jaccard(c.ids, cursor_ids), c))
        for ix in tabs:
            for c in ix.chunks:
                score = jaccard(c.ids, cursor_ids)
                if score >= TAB_THRESHOLD:
                    ranked.append((score, c))
            await started.pause()
        for c in edits:
            score = jaccard(c.ids, cursor_ids) + RECENT_BONUS
            if score >= TAB_THRESHOLD:
                ranked.append((score, c))
        ranked.sort(key=lambda sc: -sc[0])
        if self._focus != focus or self.docs.get(uri) is not doc:
            return
        del ranked[MAX_CANDIDATES:]  # (a ring holds a few chunks: the rest cannot make it in)
        changed = state.ring.update(ranked, cursor_ids, settings.cross_file_budget)
        scores = {id(c): s for s, c in ranked}
        state.scores = {id(c): scores.get(id(c), state.scores.get(id(c), 0.0)) for c in state.ring.items}
        if not changed:
            return
        self.stats.count("context_ring_changes")
        if self.debug:
            log.info(
                "cross-file context for %s: %s",
                uri,
                [f"{c.describe()} ({state.scores[id(c)]:.2f})" for c in state.ring.items] or "none",
            )
        if self.on_change is not None:
            self._quiet = True
            try:
                self.on_change(doc, cursor, settings)
            finally:
                self._quiet = False
