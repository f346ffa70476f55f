"""Cross-file context for a session: candidates from open tabs, imports and recent edits, a ring per document.

Never on the keystroke path. A keystroke's request reads the document's ring as it is
(``for_request``: a dict built when the ring last changed). The work happens in one background task
per session, started REFRESH_DELAY_S after the latest document event (``touch``: didOpen, didChange,
fimble/cursor) and run in slices of at most SLICE_S on the event loop, with a PAUSE_S pause after each, so
other messages are answered between slices:
1. index the open documents of the focused one's language: chunks of CHUNK_LINES lines with their
   identifier sets (each document once per version; at most MAX_TAB_DOCS documents, MAX_INDEX_CHARS each);
2. read the focused document's imports from its tree-sitter trees, find the modules among the open
   documents or, inside the workspace folders the client sent, on disk (lsp_server/context/files.py,
   in a worker thread), parse those in slices and take the imported names' definitions;
3. take the ranges recently edited in other documents;
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
import os
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lsp_server.context.chunks import Chunk, chunk_spans, identifiers, jaccard, window_text
from lsp_server.context.files import MAX_FILE_BYTES, inside, read_inside, resolve_roots, uri_to_path
from lsp_server.context.imports import (
    MAX_PACKAGE_FILES,
    Definition,
    Import,
    extract_definitions,
    extract_imports,
    family,
    java_source_root,
    module_candidates,
)
from lsp_server.context.ring import Ring
from lsp_server.documents import Document, DocumentStore
from lsp_server.shaping.syntax.document import SyntaxDocument  # no torch: tree-sitter only
from lsp_server.stats import Stats

log = logging.getLogger(__name__)
_Module = tuple[str, str, dict[str, Definition], "str | None", list[str]]  # uri, label, definitions, default, lines
REFRESH_DELAY_S = 0.25  # after the latest document event: a burst of events is one refresh
SLICE_S = 0.004  # the longest the work runs on the event loop before it lets other messages in
# ... and for how long it then steps aside: a request's handling takes several loop turns (read, parse, its task,
# each await), and a bare sleep(0) gave it one turn per slice (a request waited 3-5 slices behind the work).
PAUSE_S = 0.002
MAX_TAB_DOCS = 16  # open documents indexed (the most recently touched)
MAX_INDEX_CHARS = 256 * 1024  # of each: a 1 MB file's first quarter
IMPORT_TREES = 4  # the first parse segments of a document (SyntaxDocument: ~150 lines each) hold its imports
MAX_CANDIDATES = 64  # ranked candidates a refresh hands the ring
MAX_DEF_FILES = 64  # parsed definition files kept
DISK_TTL_S = 10.0  # a module looked up on disk is looked up again after this long (it may have changed)
MAX_DISK_LOOKUPS = 256
JUMP_LINES = 32  # a cursor move this far is a new place: refresh the ring (llama.vim: 32)
CURSOR_LINES_BEFORE, CURSOR_LINES_AFTER = 40, 10
# An open document's chunk below this Jaccard is no context: unrelated modules of the same package scored
# 0.10-0.22 against the cursor's text in bench/crossfile.py's cases (and the defining module's chunks no more).
TAB_THRESHOLD = 0.2
RECENT_BONUS = 0.05
RECENT_EDITS = 16
EDIT_LINES = 12  # a recent edit's chunk: this many lines either side of it
_PARSE_LANGS = {".py": "python", ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript",
                ".jsx": "javascriptreact", ".ts": "typescript", ".tsx": "typescriptreact", ".go": "go",
                ".rs": "rust", ".java": "java", ".c": "c", ".h": "cpp", ".cc": "cpp", ".cpp": "cpp", ".cxx": "cpp",
                ".hh": "cpp", ".hpp": "cpp", ".hxx": "cpp"}
_COMMENTS = {"python": "#", "js": "//", "go": "//", "rust": "//", "java": "//", "c": "//"}
_MEMBER = {"rust": "::"}  # how a module's names are reached through its binding: ``mod.name``, Rust ``mod::name``


class _Slice:
    """When the current slice of work on the event loop began (wall clock, and this thread's CPU time)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def over(self) -> bool:
        return time.perf_counter() - self.wall >= SLICE_S


@dataclass
class _DocState:
    ring: Ring = field(default_factory=Ring)
    line: int | None = None  # the cursor line of the last refresh
    signature: tuple = ()  # what the candidates were built from at the last refresh
    wire: tuple[tuple, dict | None] = ((), None)  # (ring version, budget, label) -> the request's context
    scores: dict[int, float] = field(default_factory=dict)  # id(chunk) -> score when chosen (debug)


@dataclass
class _Indexed:
    key: tuple
    label: str
    chunks: list[Chunk]


class CrossFileContext:
    def __init__(self, docs: DocumentStore, stats: Stats,
                 on_change: Callable[[Document, tuple[int, int] | None, Any], None] | None = None) -> None:
        self.docs, self.stats = docs, stats
        self.on_change = on_change  # the ring of this document at this cursor changed: pre-warm it
        self.debug = False  # `fimble lsp --debug`: log the chunks each ring holds
        self.roots: list[str] = []
        self._states: dict[str, _DocState] = {}
        self._index: dict[str, _Indexed] = {}
        # Parsed modules: (definitions, default export, lines); an open document's lines are its own (not kept here:
        # read when its key, which has its version, is current), a disk file's are kept (at most 256 KB each).
        self._defs: OrderedDict[tuple, tuple[dict[str, Definition], str | None, list[str] | None]] = OrderedDict()
        self._disk: dict[tuple[str, ...], tuple[float, tuple[str, str] | None]] = {}  # candidates -> (when, found)
        self._recent: OrderedDict[str, None] = OrderedDict()  # documents by last touch, newest last
        self._seen: dict[str, int] = {}  # uri -> version at its last touch (an edit since: a recent edit)
        self._edits: deque[tuple[str, int]] = deque(maxlen=RECENT_EDITS)
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
        self.roots = resolve_roots(paths[:16])

    @staticmethod
    def enabled(settings: Any) -> bool:
        # Not with a remote engine or a shared daemon: other files' text would leave this process for it.
        return bool(getattr(settings, "cross_file_context", False)) and settings.engine_spec is None \
            and settings.cross_file_budget > 0

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
        if seen is not None and seen != doc.version and cursor is not None:
            block = cursor[0] // EDIT_LINES  # typing on: one entry per place, not one per key
            for old in [e for e in self._edits if e[0] == uri and e[1] // EDIT_LINES == block]:
                self._edits.remove(old)
            self._edits.append((uri, cursor[0]))
        self._seen[uri] = doc.version
        self._recent.pop(uri, None)
        self._recent[uri] = None
        self._focus = (uri, cursor)
        self._arm()

    def closed(self, uri: str) -> None:
        self._states.pop(uri, None)
        self._index.pop(uri, None)
        self._recent.pop(uri, None)
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
            repo, path = self._label(uri)
            wire = {"repo": repo, "path": path, "comment": _COMMENTS.get(fam or "", "#"),
                    "budget": settings.cross_file_budget,
                    "chunks": [{"path": c.label, "text": c.text} for c in chunks]} if chunks else None
            state.wire = (key, wire)
        return state.wire[1]

    @property
    def pending(self) -> bool:
        return self._timer is not None or (self._task is not None and not self._task.done())

    def tables(self) -> dict:
        return {"context_rings": len(self._states), "context_indexed_docs": len(self._index),
                "context_def_files": len(self._defs), "context_disk_lookups": len(self._disk),
                "context_recent_edits": len(self._edits), "context_pending": int(self.pending)}

    def debug_state(self, uri: str | None = None) -> list[dict]:
        """For ``fimble/debug/context`` (only with --debug): each ring's chunks, by where they come from."""
        return [{"uri": u, "chunks": [c.describe() for c in s.ring.items],
                 "scores": [round(s.scores.get(id(c), 0.0), 3) for c in s.ring.items],
                 "tokens": s.ring.tokens, "line": s.line}
                for u, s in self._states.items() if uri is None or u == uri]

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

    async def _yield(self, started: _Slice, force: bool = False) -> None:
        """Let other messages in once this slice has run SLICE_S."""
        if force or started.over():
            self._slice_done(started)
            self.stats.count("context_yields")
            await asyncio.sleep(PAUSE_S)
            started.restart()

    def _slice_done(self, started: _Slice) -> None:
        """The longest slice yet, in CPU microseconds of this thread (a busy machine's waits do not count)."""
        us = int((time.thread_time() - started.cpu) * 1e6)
        if us > self.stats.counters["context_slice_max_us"]:
            self.stats.counters["context_slice_max_us"] = us

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
        started = _Slice()
        try:
            await self._refresh_doc(doc, fam, focus, settings, started)
        finally:
            self._slice_done(started)

    async def _refresh_doc(self, doc: Document, fam: str, focus: tuple, settings: Any, started: _Slice) -> None:
        uri, cursor = focus
        sources = set(settings.cross_file_sources)
        line = min(cursor[0], len(doc.lines) - 1) if cursor is not None else len(doc.lines) - 1
        tabs = await self._index_tabs(fam, uri, started) if "openFiles" in sources else []
        if self._focus != focus or self.docs.get(uri) is not doc:
            return  # moved on meanwhile: the event that moved it armed the next refresh
        imports = await self._import_chunks(doc, fam, line, started) if "imports" in sources else []
        if self._focus != focus or self.docs.get(uri) is not doc:
            return
        edits = self._edit_chunks(fam, uri) if "recentEdits" in sources else []
        state = self._states.setdefault(uri, _DocState())
        signature = (tuple((ix.key, len(ix.chunks)) for ix in tabs),
                     tuple((c.uri, c.start, c.end, c.name) for c, _ in imports),
                     tuple((c.uri, c.start, c.end) for c in edits))
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
            await self._yield(started)
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
            log.info("cross-file context for %s: %s", uri,
                     [f"{c.describe()} ({state.scores[id(c)]:.2f})" for c in state.ring.items] or "none")
        if self.on_change is not None:
            self._quiet = True
            try:
                self.on_change(doc, cursor, settings)
            finally:
                self._quiet = False

    # -- sources -------------------------------------------------------------------------------------
    async def _index_tabs(self, fam: str, focus: str, started: _Slice) -> list[_Indexed]:
        """The indexed open documents of ``fam`` other than ``focus``, most recently touched first."""
        order = [u for u in reversed(self._recent) if u != focus]
        order += [d.uri for d in self.docs if d.uri != focus and d.uri not in self._recent]
        out: list[_Indexed] = []
        for uri in order:
            if len(out) >= MAX_TAB_DOCS:
                break
            doc = self.docs.get(uri)
            if doc is None or family(doc.language_id) != fam or getattr(doc, "changing", False):
                continue
            ix = self._index.get(uri)
            key = (doc.version, doc.length)
            if ix is None or ix.key != key:
                ix = await self._index_doc(doc, key, started)
                if ix is None:
                    continue
            out.append(ix)
        for uri in [u for u in self._index if self.docs.get(u) is None]:  # closed meanwhile
            del self._index[uri]
        return out

    async def _index_doc(self, doc: Document, key: tuple, started: _Slice) -> _Indexed | None:
        lines, total, stop = doc.lines, 0, 0
        while stop < len(lines) and total < MAX_INDEX_CHARS:
            total += len(lines[stop])
            stop += 1
        label = self._label(doc.uri)[1]
        chunks: list[Chunk] = []
        spans = chunk_spans(lines, 0, stop)
        while True:
            span = next(spans, None)
            if span is None:
                break
            first, end, text = span
            chunks.append(Chunk(doc.uri, label, first, end, text, "tab", identifiers(text)))
            if started.over():
                await self._yield(started)
                if self.docs.get(doc.uri) is not doc or (doc.version, doc.length) != key \
                        or getattr(doc, "changing", False):
                    return None  # edited or closed meanwhile: indexed at a later refresh
        self.stats.count("context_indexed_docs")
        ix = _Indexed(key, label, chunks)
        self._index[doc.uri] = ix
        return ix

    def _edit_chunks(self, fam: str, focus: str) -> list[Chunk]:
        out, seen = [], set()
        for uri, line in reversed(self._edits):
            doc = self.docs.get(uri)
            if uri == focus or doc is None or family(doc.language_id) != fam or (uri, line // EDIT_LINES) in seen:
                continue
            seen.add((uri, line // EDIT_LINES))
            first = max(0, line - EDIT_LINES)
            text = window_text(doc.lines, first, line + EDIT_LINES + 1)
            if text.strip():
                out.append(Chunk(uri, self._label(uri)[1], first, min(len(doc.lines), line + EDIT_LINES + 1), text,
                                 "edit", identifiers(text)))
        return out

    async def _import_chunks(self, doc: Document, fam: str, line: int,
                             started: _Slice) -> list[tuple[Chunk, bool]]:
        """Definitions of the names ``doc`` imports, each with whether it is used near the cursor."""
        syntax = doc.syntax
        if not syntax.has_tree:
            return []
        imports = extract_imports(fam, syntax.trees()[:IMPORT_TREES])
        if not imports:
            return []
        window = window_text(doc.lines, line - CURSOR_LINES_BEFORE, line + CURSOR_LINES_AFTER + 1)
        near = identifiers(window)
        doc_path = uri_to_path(doc.uri)
        java_root = java_source_root(syntax.trees()[:IMPORT_TREES], doc_path) if fam == "java" and doc_path else None
        by_path = {p: d for d in self.docs if (p := uri_to_path(d.uri)) is not None}
        out: list[tuple[Chunk, bool]] = []
        for imp in imports:
            modules = await self._modules(fam, imp.module, doc_path, by_path, started, java_root)
            if imp.binding == "*":  # C/C++ ``#include "x.h"``: every name of it used near the cursor
                wanted = [(n, n) for m in modules for n in m[2] if n in near][:32]
            else:
                wanted = self._wanted(imp, window, _MEMBER.get(fam, "."))
            for name, local in wanted:
                module = next((m for m in modules if name in m[2]), None)
                if module is None and name == "default" and modules:
                    module = modules[0]
                if module is not None:
                    out += self._def_chunks(module, [(name, local)], near)
                elif fam in ("python", "rust") and (name, local) in imp.names:  # ``from . import mod``: a submodule
                    sep = "::" if fam == "rust" else "."
                    sub = imp.module + ("" if imp.module.endswith(sep) else sep) + name
                    found = await self._modules(fam, sub, doc_path, by_path, started, java_root)
                    if found:
                        sub_wanted = self._wanted(Import(sub, binding=local), window, _MEMBER.get(fam, "."))
                        out += self._def_chunks(found[0], sub_wanted, near)
            await self._yield(started)
        return out

    @staticmethod
    def _wanted(imp: Import, window: str, member: str = ".") -> list[tuple[str, str]]:
        """(name in the module, local name) to look up: the imported names, the attributes used through a
        module binding near the cursor (``binding.name``; Rust ``binding::name``), the default export."""
        wanted = list(imp.names)
        if imp.binding:
            pattern = re.escape(imp.binding + member) + r"([A-Za-z_$][\w$]*)"
            for attr in dict.fromkeys(re.findall(pattern, window)):
                wanted.append((attr, f"{imp.binding}{member}{attr}"))
        if imp.default:
            wanted.append(("default", imp.default))
        return wanted[:32]

    @staticmethod
    def _def_chunks(module: tuple[str, str, dict[str, Definition], str | None, list[str]],
                    wanted: list[tuple[str, str]], near: frozenset[str]) -> list[tuple[Chunk, bool]]:
        uri, label, defs, default, lines = module
        out = []
        for name, local in wanted:
            d = defs.get((default or local) if name == "default" else name)
            if d is None:
                continue
            text = "".join(lines[r] if r < len(lines) else "" for r in d.rows)
            if not text.strip():
                continue
            text = "".join(line if len(line) <= 400 else line[:400] + "\n" for line in text.splitlines(True))
            used = re.split(r"\.|::", local)[-1] in near or local in near
            out.append((Chunk(uri, label, d.start, d.end, text, "import", identifiers(text), d.name), used))
        return out

    async def _modules(self, fam: str, module: str, doc_path: str | None, by_path: dict[str, Document],
                       started: _Slice, java_root: str | None = None) -> list[_Module]:
        """The files of the module: one (Python, JS, Rust, Java, C), or a Go package folder's files; [] where
        none is found."""
        candidates = module_candidates(fam, module, doc_path, self.roots, java_root)
        if fam != "go":
            found = await self._module(fam, candidates, by_path, started)
            return [found] if found is not None else []
        files: list[str] = []
        for folder in candidates:  # the first folder with Go files open ...
            files = sorted(p for p in by_path if os.path.dirname(p) + "/" == folder and _go_source(p))
            if files:
                break
        if not files and self.roots:  # ... else on disk: one worker-thread call looks through them all
            key = tuple(candidates)
            hit = self._disk.get(key)
            if hit is not None and time.monotonic() - hit[0] < DISK_TTL_S:
                files = list(hit[1] or ())
            else:
                self._slice_done(started)
                listed = await asyncio.to_thread(_first_go_folder, self.roots, candidates)
                started.restart()
                self._disk[key] = (time.monotonic(), listed)
                while len(self._disk) > MAX_DISK_LOOKUPS:
                    self._disk.pop(next(iter(self._disk)))
                files = list(listed or ())
        out = []
        for path in files[:MAX_PACKAGE_FILES]:
            found = await self._module(fam, [path], by_path, started)
            if found is not None:
                out.append(found)
        return out

    async def _module(self, fam: str, candidates: list[str], by_path: dict[str, Document],
                      started: _Slice) -> _Module | None:
        """(uri, label, definitions, default export, lines) of the first of ``candidates`` that is an open
        document, else a file inside the workspace folders; None where neither has one."""
        for path in candidates:
            d = by_path.get(path)
            if d is not None and d.syntax.has_tree and not getattr(d, "changing", False):
                key = ("open", d.uri, d.version, d.length)
                hit = self._defs.get(key)
                if hit is None:
                    hit = (*extract_definitions(fam, d.syntax.trees()), None)
                    self._remember(key, hit)
                return d.uri, self._label(d.uri)[1], hit[0], hit[1], list(d.lines)  # (a snapshot: awaits follow)
        if not self.roots:
            return None
        wanted = tuple(p for p in candidates if p not in by_path)
        hit_disk = self._disk.get(wanted)
        if hit_disk is not None and time.monotonic() - hit_disk[0] < DISK_TTL_S:
            found = hit_disk[1]  # each refresh after a typing pause would read the same files again
        else:
            self._slice_done(started)
            found = await asyncio.to_thread(_read_first, self.roots, list(wanted))
            started.restart()
            self._disk[wanted] = (time.monotonic(), found)
            while len(self._disk) > MAX_DISK_LOOKUPS:
                self._disk.pop(next(iter(self._disk)))
            if found is not None:
                self.stats.count("context_disk_reads")
        if found is None:
            return None
        path, text = found
        key = ("disk", path, hash(text))
        hit = self._defs.get(key)
        if hit is None:
            lang = _PARSE_LANGS.get(os.path.splitext(path)[1])
            if lang is None:
                return None
            steps = SyntaxDocument.build_in_slices(lang, text, SLICE_S)
            while True:  # parsed in slices: a 256 KB file is ~250 ms of tree-sitter
                try:
                    next(steps)
                except StopIteration as done:
                    syntax = done.value
                    break
                await self._yield(started, force=True)
            hit = (*extract_definitions(fam, syntax.trees()), text.splitlines(True))
            self._remember(key, hit)
        uri = "file://" + path
        return uri, self._label(uri)[1], hit[0], hit[1], hit[2]

    def _remember(self, key: tuple, value: tuple) -> None:
        self._defs[key] = value
        self._defs.move_to_end(key)
        while len(self._defs) > MAX_DEF_FILES:
            self._defs.popitem(last=False)

    def _label(self, uri: str) -> tuple[str, str]:
        """(repository name, path) as the prompt shows them: relative to the workspace folder holding the
        file, else its last two path parts (no home directories in the prompt)."""
        path = uri_to_path(uri) or uri
        for root in self.roots:
            if path.startswith(root.rstrip("/") + "/"):
                return os.path.basename(root), os.path.relpath(path, root)
        parts = path.rstrip("/").split("/")
        return (parts[-3] if len(parts) >= 3 else ""), "/".join(parts[-2:])


def _go_source(path: str) -> bool:
    return path.endswith(".go") and not path.endswith("_test.go")


def _first_go_folder(roots: list[str], folders: list[str]) -> tuple[str, ...] | None:
    """The source files (tests left out) of the first of ``folders`` inside ``roots`` that has Go files
    (worker thread: disk)."""
    for folder in folders:
        if inside(roots, folder.rstrip("/")) is None:
            continue
        try:
            with os.scandir(folder) as it:
                names = sorted(e.name for e in it if _go_source(e.name) and e.is_file(follow_symlinks=False))
        except OSError:
            continue
        if names:
            return tuple(os.path.join(folder, n) for n in names[:MAX_PACKAGE_FILES])
    return None


def _read_first(roots: list[str], paths: list[str]) -> tuple[str, str] | None:
    """The first of ``paths`` readable inside ``roots`` (in a worker thread: disk)."""
    for path in paths:
        text = read_inside(roots, path, MAX_FILE_BYTES)
        if text is not None:
            return path, text
    return None
