"""Per-document KV caches under one byte budget, evicted segment by segment (LRU).

Every document (a request's ``document_id``) owns its own preallocated,
position-addressed caches (``KVCache`` in engine/runtimes/compact.py): one for the target and
one for the draft model. Switching files switches caches; nothing is copied. A cache
is sized to its prompt plus room to decode, and grows (one copy) only when the prompt
outgrows it.

The budget counts every allocated slot. To make room the store drops segments from
the tail of the least recently used document: under the prefix-hash chain a segment
is only valid together with every segment before it, so the tail is what goes first.
A document in use by the running request is pinned and never touched.

Segments are also indexed by their chain key across documents, so a document seen for
the first time (the same file in another window, an untitled copy) starts from another
document's identical leading segments (one copy of those positions).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.caching.cold_window import STAGE_KEY, document_of
from engine.caching.prompt_plan import Piece, PromptPlan, Segment
from engine.errors import FimbleError

if TYPE_CHECKING:
    import torch

ALLOC_STEP = 256  # cache capacities are multiples of this many tokens
MIN_BORROW_TOKENS = 64  # borrowing from another document must save at least this much
UNSIZED_DOCUMENTS = 8  # documents kept for runtimes whose caches cannot be sized (transformers)
STAT_NAMES = (
    "kv_segment_hits",
    "kv_segment_misses",
    "kv_evictions",
    "kv_documents_evicted",
    "kv_grows",
    "kv_borrowed_tokens",
    "kv_staged_tokens",
    "kv_promoted",
)


def session_of(doc_id: str) -> str:
    """The client session a document id belongs to: ids are "<session>\\x00<uri>" where sessions share
    the engine (the LSP server's transports), a bare URI otherwise. A cold-window cache is its document's session's."""
    doc_id = document_of(doc_id)
    return doc_id.partition("\x00")[0] if "\x00" in doc_id else ""


def default_budget_bytes(device: str | torch.device) -> int:
    """1 GiB on CPU; on a GPU a fifth of its memory, at most 8 GiB."""
    if str(device).partition(":")[0] != "cuda":  # (no torch import on the ggml runtime's CPU path)
        return 1 << 30
    import torch

    dev = torch.device(device)
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(dev).total_memory
        return min(8 << 30, total // 5)
    return 1 << 30


def bytes_per_token(runtime) -> int:
    """K and V bytes of one position in a cache made by ``runtime`` (0 where it cannot say)."""
    cfg = getattr(runtime, "cfg", None)
    if cfg is None:
        return 0
    elem = getattr(runtime, "kv_element_bytes", 0)  # the ggml runtime says so: no torch import there
    if not elem:
        import torch

        elem = torch.empty((), dtype=runtime.dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem


@dataclass
class DocumentKV:
    doc_id: str
    target: object  # KVCache
    draft: object | None
    ids: list[int] = field(default_factory=list)  # tokens whose target keys/values are valid, in order
    # Positions whose keys/values equal a from-scratch computation; past it (after a shift
    # reuse) they are approximate and only a later shift request may use them.
    exact_len: int = 0
    draft_ids: list[int] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)  # of the prompt last computed here
    segments: list[Segment] = field(default_factory=list)
    # (prefix text before the anchor, suffix) of the prompt last computed here (prompt_plan.anchor_at)
    held: tuple[str, str] | None = None
    last_used: int = 0
    pinned: bool = False

    @property
    def capacity(self) -> int:
        return self.target.max_len

    def truncate(self, length: int) -> None:
        """Forget everything from position ``length`` on (ids, pieces, segments)."""
        length = min(length, len(self.ids))
        del self.ids[length:]
        self.exact_len = min(self.exact_len, length)
        self.target.length = min(self.target.length, length)
        self.segments = [s for s in self.segments if s.end <= length]
        self.pieces = self.pieces[: bisect.bisect_right([p.start + p.length for p in self.pieces], length)]


class KVStore:
    def __init__(self, target_runtime, draft_runtime, max_len: int, budget_bytes: int):
        self.target_rt, self.draft_rt = target_runtime, draft_runtime
        self.max_len = max_len
        self.bpt = bytes_per_token(target_runtime) + (bytes_per_token(draft_runtime) if draft_runtime else 0)
        # Compact caches can be sized and copied; transformers' caches cannot (one full-size cache each).
        self.sizable = self.bpt > 0
        if self.sizable and budget_bytes < max_len * self.bpt:
            raise FimbleError(
                f"KV cache budget of {budget_bytes >> 20} MiB is below one context window "
                f"({max_len * self.bpt >> 20} MiB for {max_len} tokens)"
            )
        self.budget = budget_bytes
        self.docs: dict[str, DocumentKV] = {}
        self._chains: dict[bytes, tuple[str, int]] = {}  # chain key -> (document, segment end)
        self._clock = 0
        self.stats = dict.fromkeys(STAT_NAMES, 0)

    # -- accounting -----------------------------------------------------------------
    def bytes_used(self) -> int:
        return sum(d.capacity for d in self.docs.values()) * self.bpt

    def summary(self) -> dict:
        # a document's cold-window cache (engine/caching/cold_window.py) is part of that document
        documents = sum(1 for key in self.docs if document_of(key) == key)
        return {
            "kv_bytes": self.bytes_used(),
            "kv_budget_bytes": self.budget,
            "kv_documents": documents,
            "kv_segments": sum(len(d.segments) for d in self.docs.values()),
            "kv_tokens": sum(len(d.ids) for d in self.docs.values()),
            **self.stats,
        }

    # -- documents --------------------------------------------------------------------
    def open(self, doc_id: str, need: int) -> DocumentKV:
        """The document's caches, pinned, holding at least ``need`` positions (evicting others if needed)."""
        need = min(need, self.max_len)
        doc = self.docs.get(doc_id)
        if doc is None:
            cap = self._capacity_for(need)
            self._make_room(cap * self.bpt)
            doc = DocumentKV(
                doc_id, self.target_rt.new_cache(cap), self.draft_rt.new_cache(cap) if self.draft_rt else None
            )
            self.docs[doc_id] = doc
        elif doc.capacity < need:
            cap = self._capacity_for(need)
            doc.pinned = True
            self._make_room((cap - doc.capacity) * self.bpt)
            self._resize(doc, cap)
            self.stats["kv_grows"] += 1
        doc.pinned = True
        return doc

    def release(self, doc: DocumentKV, plan: PromptPlan | None = None, reused: int = 0) -> None:
        """Record what the cache now holds (``doc.ids`` set by the caller) and unpin it."""
        self._clock += 1
        doc.last_used = self._clock
        if plan is not None:
            self._unindex(doc)
            valid = len(doc.ids)
            doc.segments = [s for s in plan.segments if s.end <= valid]
            doc.pieces = [p for p in plan.pieces if p.start + p.length <= valid]
            hits = sum(1 for s in doc.segments if s.end <= reused)
            self.stats["kv_segment_hits"] += hits
            self.stats["kv_segment_misses"] += len(doc.segments) - hits
            for s in doc.segments:
                self._chains[s.chain] = (doc.doc_id, s.end)
        doc.pinned = False

    def forget(self, doc_id: str) -> bool:
        doc = self.docs.pop(doc_id, None)
        if doc is not None:
            self._unindex(doc)
        return doc is not None

    # -- background work on a copy ------------------------------------------------------
    def staging(self, doc: DocumentKV, ids: list[int], keep: int, need: int) -> DocumentKV:
        """A cache beside ``doc`` (pinned) for background work that would overwrite what ``doc`` holds past ``keep``:
        it holds ``doc``'s first ``keep`` positions (one copy), or more of ``ids`` where an earlier, pre-empted run
        left them there. ``doc`` stays as it is for the keystrokes until ``promote``."""
        stage = self.open(doc.doc_id + STAGE_KEY, need)
        if common_prefix(stage.ids, ids, stage.exact_len) >= keep:
            return stage
        for a, b in ((doc.target, stage.target), (doc.draft, stage.draft)):
            if a is None or b is None:
                continue
            if hasattr(b, "copy_prefix_from"):  # llama.cpp contexts
                b.copy_prefix_from(a, keep, ids[:keep])
            else:
                b.keys[:, :, :keep] = a.keys[:, :, :keep]
                b.values[:, :, :keep] = a.values[:, :, :keep]
                b.length = keep
        stage.ids, stage.exact_len = list(ids[:keep]), keep
        draft_keep = common_prefix(doc.draft_ids, ids, keep)
        stage.draft_ids = list(ids[:draft_keep])
        if stage.draft is not None:
            stage.draft.length = min(stage.draft.length, draft_keep)
        self.stats["kv_staged_tokens"] += keep
        return stage

    def promote(self, stage: DocumentKV, doc: DocumentKV) -> DocumentKV:
        """Make ``stage`` (its work done) the cache of ``doc``'s key; ``doc``'s old cache becomes the next stage.
        Returns the promoted cache, still pinned."""
        self._unindex(stage)
        self._unindex(doc)
        stage.doc_id, doc.doc_id = doc.doc_id, stage.doc_id
        self.docs[stage.doc_id], self.docs[doc.doc_id] = stage, doc
        doc.segments, doc.held = [], None  # (the old prompt: only a copy's starting point now)
        self.stats["kv_promoted"] += 1
        return stage

    # -- sharing across documents -----------------------------------------------------
    def borrow(self, doc: DocumentKV, plan: PromptPlan, have: int) -> int:
        """Copy another document's leading segments that equal ``plan``'s, if that beats ``have`` tokens."""
        best: tuple[str, int] | None = None
        for seg in plan.segments:
            found = self._chains.get(seg.chain)
            if (
                found is None
                or found[1] != seg.end
                or found[0] == doc.doc_id
                or found[0] not in self.docs
                or session_of(found[0]) != session_of(doc.doc_id)
            ):  # never across client sessions
                break
            best = found
        if best is None or best[1] < have + MIN_BORROW_TOKENS:
            return have
        src = self.docs[best[0]]
        # Whole matching segments, and on into the next one as far as the tokens agree.
        n = common_prefix(src.ids, plan.ids, min(src.exact_len, len(plan.ids) - 1))
        if n < have + MIN_BORROW_TOKENS:  # a stale index entry, or approximate keys/values
            return have
        for a, b in ((src.target, doc.target), (src.draft, doc.draft)):
            if a is not None and b is not None and hasattr(b, "copy_prefix_from"):  # llama.cpp contexts
                b.copy_prefix_from(a, n, plan.ids[:n])
            elif a is not None and b is not None:
                b.keys[:, :, :n] = a.keys[:, :, :n]
                b.values[:, :, :n] = a.values[:, :, :n]
                b.length = n
        doc.ids = list(plan.ids[:n])
        doc.exact_len = n
        doc.draft_ids = list(plan.ids[:n]) if src.draft_ids[:n] == plan.ids[:n] else []
        if doc.draft is not None and not doc.draft_ids:
            doc.draft.length = 0
        self.stats["kv_borrowed_tokens"] += n
        return n

    def holds(self, doc_id: str, plan: PromptPlan, n: int) -> bool:
        """Whether ``doc_id``'s cache, or one it may borrow from (``borrow``), holds ``plan.ids[:n]``."""
        doc = self.docs.get(doc_id)
        if doc is not None and common_prefix(doc.ids, plan.ids, min(n, doc.exact_len)) >= n:
            return True
        for seg in plan.segments:
            found = self._chains.get(seg.chain)
            if found is None or found[1] != seg.end or session_of(found[0]) != session_of(doc_id):
                return False
            if seg.end >= n:
                return found[0] in self.docs
        return False

    # -- internals --------------------------------------------------------------------
    def _capacity_for(self, need: int) -> int:
        if not self.sizable:
            return self.max_len
        with_room = need + need // 4
        return min(self.max_len, -(-with_room // ALLOC_STEP) * ALLOC_STEP)

    def _unindex(self, doc: DocumentKV) -> None:
        for s in doc.segments:
            if self._chains.get(s.chain, (None,))[0] == doc.doc_id:
                del self._chains[s.chain]

    def _make_room(self, extra: int) -> None:
        """Evict tail segments of least recently used, unpinned documents until ``extra`` bytes fit."""
        if not self.sizable:
            # transformers' caches grow by themselves and cannot be measured here: bound their number.
            while len(self.docs) >= UNSIZED_DOCUMENTS:
                victims = [d for d in self.docs.values() if not d.pinned]
                if not victims:
                    return
                self.forget(min(victims, key=lambda d: d.last_used).doc_id)
                self.stats["kv_documents_evicted"] += 1
            return
        while self.bytes_used() + extra > self.budget:
            victims = [d for d in self.docs.values() if not d.pinned]
            if not victims:
                return  # only the running request's document is left; the budget check at start keeps it in
            victim = min(victims, key=lambda d: d.last_used)
            over = self.bytes_used() + extra - self.budget
            self._shrink(victim, over)

    def _shrink(self, doc: DocumentKV, over: int) -> None:
        """Drop tail segments of ``doc`` until its smaller cache frees ``over`` bytes (or drop it whole)."""
        keep = len(doc.segments)
        while keep > 0:
            valid = doc.segments[keep - 1].end
            if (doc.capacity - self._capacity_for(valid)) * self.bpt >= over:
                break
            keep -= 1
        dropped = len(doc.segments) - keep
        self.stats["kv_evictions"] += dropped
        self._unindex(doc)
        if keep == 0:
            del self.docs[doc.doc_id]
            self.stats["kv_documents_evicted"] += 1
            return
        valid = doc.segments[keep - 1].end
        doc.truncate(valid)
        doc.draft_ids = doc.draft_ids[:valid]
        self._resize(doc, self._capacity_for(valid))
        for s in doc.segments:
            self._chains[s.chain] = (doc.doc_id, s.end)

    def _resize(self, doc: DocumentKV, cap: int) -> None:
        """New caches of ``cap`` positions holding the valid part of the old ones (one copy)."""
        if not self.sizable or cap == doc.capacity:
            return
        doc.target = _copied(self.target_rt, doc.target, cap)
        if doc.draft is not None:
            doc.draft = _copied(self.draft_rt, doc.draft, cap)
            doc.draft_ids = doc.draft_ids[: doc.draft.length]


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on slice equality: comparisons run in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _copied(runtime, old, cap: int):
    new = runtime.new_cache(cap)
    n = min(old.length, cap)
    if hasattr(new, "copy_prefix_from"):  # llama.cpp contexts (engine/runtimes/ggml_runtime.py)
        new.copy_prefix_from(old, n)
        return new
    new.keys[:, :, :n] = old.keys[:, :, :n]
    new.values[:, :, :n] = old.values[:, :, :n]
    new.length = n
    return new
