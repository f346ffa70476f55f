"""An engine's background work: pre-warms and re-anchors, run while no completion waits.

A pre-warm fills a document's cache for a prompt the host expects (``Engine.prewarm``), a chunk at a time,
and yields as soon as a completion is waiting. A completion served with the anchored layout
(engine/caching/prompt_plan.py) moves its anchor to the cursor line once nothing has been submitted for
``REANCHOR_IDLE_S``: a pre-warm of the canonical prompt. All of it stops ``BACKGROUND_S`` after the host's
latest message, so a user who stops typing stops the engine.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from engine import env_settings
from engine.api import CompletionRequest
from engine.caching.cold_window import cache_keys
from engine.caching.kv_store import common_prefix
from engine.counters import Counters
from engine.decoding.passes import host_pass
from engine.documents import DocumentPrompts

# Pre-warm prefill chunk: on a 2-core CPU 32 tokens at a 4k context take ~40 ms, the
# longest a completion waits for a running pre-warm to yield.
PREWARM_CHUNK = 32
# A completion served with the anchored layout (lines typed since the anchor after the middle sentinel,
# engine/caching/prompt_plan.py) moves its anchor to the cursor line once nothing has been submitted for
# this long: a pre-warm of the canonical prompt, which re-evaluates the suffix while the user is idle.
REANCHOR_IDLE_S = env_settings.read("FIMBLE_REANCHOR_IDLE_S")
# Background work (pre-warms, re-anchors) starts only this long after the host's latest message (a
# completion, a pre-warm, a forget); what is left waits for the next one. A user who stops typing stops
# the engine within about a chunk of this, instead of paying seconds of prefill for a spot they left.
BACKGROUND_S = env_settings.read("FIMBLE_BACKGROUND_S")


class Background:
    """Pending pre-warms and re-anchors, and their runs. ``note_*`` and ``want`` are called from any thread;
    the rest from the worker."""

    def __init__(
        self, documents: DocumentPrompts, draft_runtime, counters: Counters, completion_waiting: Callable[[], bool]
    ):
        self.documents, self.draft_runtime, self.counters = documents, draft_runtime, counters
        self._completion_waiting = completion_waiting
        self._lock = threading.Lock()
        self._prewarms: OrderedDict[str, CompletionRequest] = OrderedDict()  # newest last
        # Anchored prompts to move to the cursor line when idle: document -> (request, submits then)
        self._reanchors: dict[str, tuple[CompletionRequest, int]] = {}
        self._reanchoring: set[str] = set()  # documents whose pending pre-warm is a re-anchor
        self._submitted: dict[str, int] = {}  # completions submitted per document (a pre-warm's staleness)
        self.last_submit = 0.0  # time.monotonic() of the latest completion submitted
        self.last_message = time.monotonic()  # ... and of the host's latest completion, pre-warm or forget
        # The window applies only while a request loop runs (a worker thread, or serve_forever in the engine
        # process); a caller that runs the work itself (run_pending) asked for it.
        self.windowed = False

    # -- the host's messages (any thread) ------------------------------------------------
    def note_submit(self, request: CompletionRequest) -> None:
        """A completion was submitted: it computes the document's current prompt, so an older pre-warm would
        only undo it."""
        if request.background:
            # Tab-Tab's follow-up runs in the document's stage caches (DocumentPrompts.open): it leaves the
            # keystrokes' caches, and the pre-warm and re-anchor that serve them, as they are.
            return
        key = request.document_id or ""
        with self._lock:
            self._prewarms.pop(key, None)
            self._reanchors.pop(key, None)
            self._submitted[key] = self._submitted.get(key, 0) + 1
            self.last_submit = self.last_message = time.monotonic()

    def want(self, request: CompletionRequest) -> None:
        """Fill the document's cache for this prompt when idle (the newest pre-warm of a document wins). The
        background window counts from the user's activity it was sent for (``request.idle_s`` before now)."""
        key = request.document_id or ""
        with self._lock:
            self._prewarms.pop(key, None)
            self._prewarms[key] = request
            self._reanchoring.discard(key)
            self.last_message = max(self.last_message, time.monotonic() - request.idle_s)

    def note_message(self) -> None:
        with self._lock:
            self.last_message = time.monotonic()

    # -- the worker ------------------------------------------------------------------------
    def forget(self, document_id: str) -> list[str]:
        """Drop a closed document's pending work; the cache keys to forget (its own, its cold window's, each with and
        without the context)."""
        keys = cache_keys(document_id)
        with self._lock:
            for key in keys:
                self._prewarms.pop(key, None)
                self._reanchors.pop(key, None)
                self._submitted.pop(key, None)
        return keys

    def later(self, request: CompletionRequest) -> None:
        """Fill the full prompt of a cold-window answer when the user leaves the engine a moment."""
        with self._lock:
            self._prewarms.setdefault(request.document_id or "", request)

    def reanchor_later(self, request: CompletionRequest) -> None:
        key = request.document_id or ""
        with self._lock:
            self._reanchors[key] = (request, self._submitted.get(key, 0))

    @property
    def pending(self) -> bool:
        return bool(self._prewarms)

    def window_left(self) -> float:
        """Seconds of background work left before the engine goes quiet."""
        if not self.windowed:
            return BACKGROUND_S
        with self._lock:
            return self.last_message + BACKGROUND_S - time.monotonic()

    def reanchor_wait(self) -> float | None:
        """Seconds until the first re-anchor is due (None: none pending)."""
        with self._lock:
            if not self._reanchors:
                return None
            return max(0.0, self.last_submit + REANCHOR_IDLE_S - time.monotonic())

    def take_due_reanchors(self, idle: bool = False) -> bool:
        """Move due re-anchors to the pre-warms (their own document's newer work drops them). True if any.
        ``idle``: as if the user had stopped typing."""
        with self._lock:
            if idle:
                self.last_submit = 0.0
            if not self._reanchors or time.monotonic() < self.last_submit + REANCHOR_IDLE_S:
                return False
            for key, (request, submitted) in self._reanchors.items():
                if self._submitted.get(key, 0) == submitted and key not in self._prewarms:
                    self._prewarms[key] = request
                    self._reanchoring.add(key)
            self._reanchors.clear()
            return bool(self._prewarms)

    def run_next(self) -> CompletionRequest | None:
        """Run the most recent document's pre-warm (until done or a completion waits); None if none pending."""
        with self._lock:
            if not self._prewarms:
                return None
            key, request = self._prewarms.popitem(last=True)
            submitted = self._submitted.get(key, 0)
            whole = key in self._reanchoring
            self._reanchoring.discard(key)
        try:
            self._prewarm(request, submitted, whole)
        except Exception:  # a pre-warm is only an optimisation: a bad one is dropped, never fatal
            self.counters.add("prewarms_failed")
        return request

    def _prewarm(
        self, request: CompletionRequest, submitted: int = 0, whole: bool = False, resume: bool = True
    ) -> bool:
        """Prefill a document's prompt in small chunks; stop at once when a completion is waiting. True once done.

        ``submitted``: the document's completion count when this pre-warm was taken; a
        pre-empted pre-warm resumes later (``resume``) only if no completion for the document came since.
        ``whole``: a re-anchor, worth starting only if it can end in the background window (it works on a copy, so
        half done it costs the keystrokes nothing, but the CPU time spent is lost when the user types on).
        """
        docs = self.documents
        if not whole and docs.defers_context(request):
            # Until its context is cached, a keystroke here runs the prompt without it (DocumentPrompts.choose):
            # fill that one first, as with no context at all, and the context's after it.
            if not self._prewarm(dataclasses.replace(request, context=None), submitted, resume=False):
                self._resume(request, submitted)
                return False
        plan = docs.prompts.build(request)
        doc = own = docs.open(request, plan)
        reuse = 0
        done = False
        try:
            if not whole:
                # The prompt a keystroke there would run: where the cache holds an anchored prompt (lines typed
                # since its anchor after the middle sentinel), that one costs a few tokens. The canonical one would
                # re-evaluate the suffix, and at a cost over the cold budget, fill the cold window's prompt first,
                # neither of which the keystroke would use (bench/reports/typing-shutil-*-2026-12-04.txt). The
                # move to the canonical prompt is the re-anchor's, once the user is idle.
                plan = docs.anchored(request, plan, doc, count=False)
            reuse = common_prefix(doc.ids, plan.ids, min(len(plan.ids), doc.exact_len))
            reuse = docs.store.borrow(doc, plan, reuse)
            rate = docs.prefill_rate
            if whole and rate and (len(plan.ids) - reuse) / rate > self.window_left():
                self.counters.add("reanchors_skipped")
                return True
            cold = docs.cold_request(request, len(plan.ids) - reuse) if not whole else None
            if cold is not None:  # the small prompt first: the next keystroke there answers from it
                self._prewarm(dataclasses.replace(cold, cold_window=False))

            if reuse < doc.exact_len and docs.store.sizable:
                # It would overwrite the prompt the next keystroke reuses (a re-anchor re-evaluates the suffix; a
                # pre-warm at another cursor differs after it): work on a copy, which takes over only once done. A
                # re-anchor cut short here used to leave the keystroke ~150-250 tokens to prefill, and send it to
                # the cold window (bench/reports/typing-shutil-cold-window-on-vs-off-2026-12-04.txt).
                doc = docs.store.staging(own, plan.ids, reuse, docs.room(request, plan))
                reuse = common_prefix(doc.ids, plan.ids, min(len(plan.ids), doc.exact_len))
            pos = self._fill(doc, plan.ids, reuse)
            done = pos == len(plan.ids)
            if done and doc is not own:
                docs.store.promote(doc, own)  # (``own`` is the stage now)
            if done and docs.hold(doc, request, plan):
                self.reanchor_later(request)
        finally:
            if own is not doc:
                docs.store.release(own)
            docs.store.release(doc, plan, reuse)
        self.counters.add("prewarms_done" if done else "prewarms_preempted")
        if not done and resume:
            self._resume(request, submitted)
        return done

    def _fill(self, doc, ids: list[int], reuse: int) -> int:
        """Prefill ``ids[reuse:]`` into ``doc``'s caches until done or a completion waits; how far the target got."""

        def target_holds(n: int) -> None:
            doc.ids = ids[:n]
            doc.exact_len = n

        pos = self._prefill_chunks(self.documents.target.runtime, doc.target, ids, reuse, PREWARM_CHUNK, target_holds)
        self.counters.add("tokens_prewarmed", pos - reuse)
        if self.draft_runtime is not None and doc.draft is not None:
            held = ids[:pos]
            # The draft model is ~10x cheaper per token: bigger chunks yield as fast.
            self._prefill_chunks(
                self.draft_runtime,
                doc.draft,
                held,
                common_prefix(doc.draft_ids, held, pos),
                4 * PREWARM_CHUNK,
                lambda n: setattr(doc, "draft_ids", held[:n]),
            )
        return pos

    def _resume(self, request: CompletionRequest, submitted: int) -> None:
        """Run ``request`` again later unless something newer for its document arrived."""
        with self._lock:
            if self._submitted.get(request.document_id or "", 0) == submitted:
                self._prewarms.setdefault(request.document_id or "", request)

    def _prefill_chunks(
        self, runtime, cache, ids: list[int], pos: int, chunk: int, holds: Callable[[int], None]
    ) -> int:
        """Run ``ids[pos:]`` into ``cache`` ``chunk`` tokens at a time until done or a completion waits.

        ``holds(n)`` records that the cache holds ``ids[:n]``. It is called only once something
        is written, so when the prompt is already there, what follows it in the cache (a
        decoded answer the user may accept) stays usable. Returns how far it got.
        """
        while pos < len(ids) and not self._completion_waiting() and self.window_left() > 0:
            end = min(len(ids), pos + chunk)
            holds(pos)  # what followed ``pos`` is about to be overwritten
            cache.length = min(cache.length, pos)
            host_pass(runtime, ids[pos:end], cache, pos, 1)
            pos = end
            holds(pos)
        return pos
