"""Where the cross-file context's candidates come from, and the time slices its work runs in.

- Open documents (``tab_chunks``): the open documents of the focused one's language, most recently
  touched first, in chunks of CHUNK_LINES lines with their identifier sets (each document once per
  version; at most MAX_TAB_DOCS documents, MAX_INDEX_CHARS each).
- Imports (``import_chunks``): the focused document's imports, read from its tree-sitter trees; the
  modules among the open documents or, inside the workspace folders the client sent, on disk
  (lsp_server/context/files.py, in a worker thread), parsed in slices; the imported names' definitions
  (a Go package: every non-test .go file of its folder).
- Recent edits (``edit_chunks``): the ranges recently edited in other documents.

Every candidate is a Chunk (lsp_server/context/chunks.py); the service (service.py) ranks them.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from lsp_server.context.chunks import Chunk, chunk_spans, identifiers, window_text
from lsp_server.context.definitions import Definition, extract_definitions
from lsp_server.context.files import MAX_FILE_BYTES, inside, read_inside, uri_to_path
from lsp_server.context.imports import Import, extract_imports, family, java_source_root
from lsp_server.context.module_paths import MAX_PACKAGE_FILES, module_candidates
from lsp_server.documents import Document, DocumentStore
from lsp_server.shaping.syntax.document import SyntaxDocument  # no torch: tree-sitter only
from lsp_server.stats import Stats

_Module = tuple[str, str, dict[str, Definition], "str | None", list[str]]  # uri, label, definitions, default, lines
SLICE_S = 0.004  # the longest the work runs on the event loop before it lets other messages in
# ... and for how long it then steps aside: a request's handling takes several loop turns (read, parse, its task,
# each await), and a bare sleep(0) gave it one turn per slice (a request waited 3-5 slices behind the work).
PAUSE_S = 0.002
MAX_TAB_DOCS = 16  # open documents indexed (the most recently touched)
MAX_INDEX_CHARS = 256 * 1024  # of each: a 1 MB file's first quarter
IMPORT_TREES = 4  # the first parse segments of a document (SyntaxDocument: ~150 lines each) hold its imports
MAX_DEF_FILES = 64  # parsed definition files kept
DISK_TTL_S = 10.0  # a module looked up on disk is looked up again after this long (it may have changed)
MAX_DISK_LOOKUPS = 256
CURSOR_LINES_BEFORE, CURSOR_LINES_AFTER = 40, 10  # the text around the cursor that ranking reads
RECENT_EDITS = 16
EDIT_LINES = 12  # a recent edit's chunk: this many lines either side of it
_PARSE_LANGS = {
    ".py": "python",
    ".js": "javascript",
    ".mjs": "javascript",
    ".cjs": "javascript",
    ".jsx": "javascriptreact",
    ".ts": "typescript",
    ".tsx": "typescriptreact",
    ".go": "go",
    ".rs": "rust",
    ".java": "java",
    ".c": "c",
    ".h": "cpp",
    ".cc": "cpp",
    ".cpp": "cpp",
    ".cxx": "cpp",
    ".hh": "cpp",
    ".hpp": "cpp",
    ".hxx": "cpp",
}
_MEMBER = {"rust": "::"}  # how a module's names are reached through its binding: ``mod.name``, Rust ``mod::name``


class Slice:
    """When the current slice of work on the event loop began (wall clock, and this thread's CPU time)."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.restart()

    def restart(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def over(self) -> bool:
        return time.perf_counter() - self.wall >= SLICE_S

    async def pause(self, force: bool = False) -> None:
        """Let other messages in once this slice has run SLICE_S."""
        if force or self.over():
            self.done()
            self.stats.count("context_yields")
            await asyncio.sleep(PAUSE_S)
            self.restart()

    def done(self) -> None:
        """The longest slice yet, in CPU microseconds of this thread (a busy machine's waits do not count)."""
        us = int((time.thread_time() - self.cpu) * 1e6)
        if us > self.stats.counters["context_slice_max_us"]:
            self.stats.counters["context_slice_max_us"] = us


@dataclass
class Indexed:
    key: tuple
    label: str
    chunks: list[Chunk]


class Sources:
    def __init__(self, docs: DocumentStore, stats: Stats) -> None:
        self.docs, self.stats = docs, stats
        self.roots: list[str] = []  # the workspace folders (disk reads only inside them)
        self.index: dict[str, Indexed] = {}
        # Parsed modules: (definitions, default export, lines); an open document's lines are its own (not kept here:
        # read when its key, which has its version, is current), a disk file's are kept (at most 256 KB each).
        self.defs: OrderedDict[tuple, tuple[dict[str, Definition], str | None, list[str] | None]] = OrderedDict()
        self.disk: dict[tuple[str, ...], tuple[float, tuple[str, str] | None]] = {}  # candidates -> (when, found)
        self.recent: OrderedDict[str, None] = OrderedDict()  # documents by last touch, newest last
        self.edits: deque[tuple[str, int]] = deque(maxlen=RECENT_EDITS)  # (uri, line), newest last

    def touched(self, uri: str, edited_line: int | None) -> None:
        """A document event on ``uri``; ``edited_line``: an edit there since its last event."""
        if edited_line is not None:
            block = edited_line // EDIT_LINES  # typing on: one entry per place, not one per key
            for old in [e for e in self.edits if e[0] == uri and e[1] // EDIT_LINES == block]:
                self.edits.remove(old)
            self.edits.append((uri, edited_line))
        self.recent.pop(uri, None)
        self.recent[uri] = None

    def closed(self, uri: str) -> None:
        self.index.pop(uri, None)
        self.recent.pop(uri, None)

    def tables(self) -> dict:
        return {
            "context_indexed_docs": len(self.index),
            "context_def_files": len(self.defs),
            "context_disk_lookups": len(self.disk),
            "context_recent_edits": len(self.edits),
        }

    async def tab_chunks(self, fam: str, focus: str, started: Slice) -> list[Indexed]:
        """The indexed open documents of ``fam`` other than ``focus``, most recently touched first."""
        order = [u for u in reversed(self.recent) if u != focus]
        order += [d.uri for d in self.docs if d.uri != focus and d.uri not in self.recent]
        out: list[Indexed] = []
        for uri in order:
            if len(out) >= MAX_TAB_DOCS:
                break
            doc = self.docs.get(uri)
            if doc is None or family(doc.language_id) != fam or getattr(doc, "changing", False):
                continue
            ix = self.index.get(uri)
            key = (doc.version, doc.length)
            if ix is None or ix.key != key:
                ix = await self._index_doc(doc, key, started)
                if ix is None:
                    continue
            out.append(ix)
        for uri in [u for u in self.index if self.docs.get(u) is None]:  # closed meanwhile
            del self.index[uri]
        return out

    async def _index_doc(self, doc: Document, key: tuple, started: Slice) -> Indexed | None:
        lines, total, stop = doc.lines, 0, 0
        while stop < len(lines) and total < MAX_INDEX_CHARS:
            total += len(lines[stop])
            stop += 1
        label = self.label(doc.uri)[1]
        chunks: list[Chunk] = []
        spans = chunk_spans(lines, 0, stop)
        while True:
            span = next(spans, None)
            if span is None:
                break
            first, end, text = span
            chunks.append(Chunk(doc.uri, label, first, end, text, "tab", identifiers(text)))
            if started.over():
                await started.pause()
                if (
                    self.docs.get(doc.uri) is not doc
                    or (doc.version, doc.length) != key
                    or getattr(doc, "changing", False)
                ):
                    return None  # edited or closed meanwhile: indexed at a later refresh
        self.stats.count("context_indexed_docs")
        ix = Indexed(key, label, chunks)
        self.index[doc.uri] = ix
        return ix

    def edit_chunks(self, fam: str, focus: str) -> list[Chunk]:
        out, seen = [], set()
        for uri, line in reversed(self.edits):
            doc = self.docs.get(uri)
            if uri == focus or doc is None or family(doc.language_id) != fam or (uri, line // EDIT_LINES) in seen:
                continue
            seen.add((uri, line // EDIT_LINES))
            first = max(0, line - EDIT_LINES)
            text = window_text(doc.lines, first, line + EDIT_LINES + 1)
            if text.strip():
                out.append(
                    Chunk(
                        uri,
                        self.label(uri)[1],
                        first,
                        min(len(doc.lines), line + EDIT_LINES + 1),
                        text,
                        "edit",
                        identifiers(text),
                    )
                )
        return out

    async def import_chunks(self, doc: Document, fam: str, line: int, started: Slice) -> list[tuple[Chunk, bool]]:
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
            await started.pause()
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
    def _def_chunks(
        module: tuple[str, str, dict[str, Definition], str | None, list[str]],
        wanted: list[tuple[str, str]],
        near: frozenset[str],
    ) -> list[tuple[Chunk, bool]]:
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

    async def _modules(
        self,
        fam: str,
        module: str,
        doc_path: str | None,
        by_path: dict[str, Document],
        started: Slice,
        java_root: str | None = None,
    ) -> list[_Module]:
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
            hit = self.disk.get(key)
            if hit is not None and time.monotonic() - hit[0] < DISK_TTL_S:
                files = list(hit[1] or ())
            else:
                started.done()
                listed = await asyncio.to_thread(_first_go_folder, self.roots, candidates)
                started.restart()
                self.disk[key] = (time.monotonic(), listed)
                while len(self.disk) > MAX_DISK_LOOKUPS:
                    self.disk.pop(next(iter(self.disk)))
                files = list(listed or ())
        out = []
        for path in files[:MAX_PACKAGE_FILES]:
            found = await self._module(fam, [path], by_path, started)
            if found is not None:
                out.append(found)
        return out

    async def _module(
        self, fam: str, candidates: list[str], by_path: dict[str, Document], started: Slice
    ) -> _Module | None:
        """(uri, label, definitions, default export, lines) of the first of ``candidates`` that is an open
        document, else a file inside the workspace folders; None where neither has one."""
        for path in candidates:
            d = by_path.get(path)
            if d is not None and d.syntax.has_tree and not getattr(d, "changing", False):
                key = ("open", d.uri, d.version, d.length)
                hit = self.defs.get(key)
                if hit is None:
                    hit = (*extract_definitions(fam, d.syntax.trees()), None)
                    self._remember(key, hit)
                return d.uri, self.label(d.uri)[1], hit[0], hit[1], list(d.lines)  # (a snapshot: awaits follow)
        if not self.roots:
            return None
        wanted = tuple(p for p in candidates if p not in by_path)
        hit_disk = self.disk.get(wanted)
        if hit_disk is not None and time.monotonic() - hit_disk[0] < DISK_TTL_S:
            found = hit_disk[1]  # each refresh after a typing pause would read the same files again
        else:
            started.done()
            found = await asyncio.to_thread(_read_first, self.roots, list(wanted))
            started.restart()
            self.disk[wanted] = (time.monotonic(), found)
            while len(self.disk) > MAX_DISK_LOOKUPS:
                self.disk.pop(next(iter(self.disk)))
            if found is not None:
                self.stats.count("context_disk_reads")
        if found is None:
            return None
        path, text = found
        key = ("disk", path, hash(text))
        hit = self.defs.get(key)
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
                await started.pause(force=True)
            hit = (*extract_definitions(fam, syntax.trees()), text.splitlines(True))
            self._remember(key, hit)
        uri = "file://" + path
        return uri, self.label(uri)[1], hit[0], hit[1], hit[2]

    def _remember(self, key: tuple, value: tuple) -> None:
        self.defs[key] = value
        self.defs.move_to_end(key)
        while len(self.defs) > MAX_DEF_FILES:
            self.defs.popitem(last=False)

    def label(self, uri: str) -> tuple[str, str]:
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
