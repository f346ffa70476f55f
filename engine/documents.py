"""Which prompt a completion runs and how much of it a document's cache already holds.

The choices made before a request's first pass (engine/steps.py): the document's caches (engine/caching/
kv_store.py), the positions reused exactly or shifted, the anchored layout where it prefills less
(engine/caching/prompt_plan.py), and the cold window's small prompt where the full one would take too
long (engine/caching/cold_window.py).
"""

from __future__ import annotations

import dataclasses

from engine import env_settings
from engine.api import CompletionRequest
from engine.caching.cold_window import COLD_BUDGET_S, COLD_KEY, STAGE_KEY, cache_key, cold_request
from engine.caching.kv_shift import apply_moves, plan_shift
from engine.caching.kv_store import DocumentKV, KVStore, common_prefix
from engine.caching.prompt_plan import PromptBuilder, PromptPlan, anchor_at
from engine.counters import Counters
from engine.loader import LoadedModel

REUSE_MODES = ("exact", "shift", "none")


class DocumentPrompts:
    """Prompt choice and KV reuse for one engine's documents (the worker thread's alone)."""

    def __init__(self, target: LoadedModel, store: KVStore, counters: Counters, *, anchored: bool, cold: bool):
        self.target, self.store, self.counters = target, store, counters
        self.prompts = PromptBuilder(target)
        self.cold_window = cold  # engine/caching/cold_window.py
        self.anchored_layout = anchored  # off only to measure it (bench/lsp_typing.py)
        # On (the default): a keystroke runs its cross-file context only where that prefills no more than the
        # same prompt without it (``choose``); the background fills the context while the user is idle. Off: the
        # context always leads, and the keystrokes after a ring change pay its prefill.
        # - Typing pygls files with it always leading showed text within 1 s after 17% of new lines, against 32%
        #   with no context (bench/reports/typing-default-crossfile-on-vs-off-pygls-2026-12-03.txt, loaded).
        # - With it dropped only from cold prompts whose context was not cached, the keystroke cost still rose:
        #   prefill p95 183-263 ms against 73-106 ms, 14 of 49 pauses over 200 ms slower (idle,
        #   bench/reports/typing-crossfile-on-vs-off-idle-2026-12-04.txt): the full prompt with the context was
        #   cold where the one without it was warm.
        self.context_wait = env_settings.read("FIMBLE_CONTEXT_WAIT")
        # Prompt tokens a second: the load-time probe's, then a running mean of timed prefills (None: unknown
        # until one is timed; the cold window waits for it).
        self.prefill_rate: float | None = None

    def open(self, request: CompletionRequest, plan: PromptPlan) -> DocumentKV:
        """``request``'s cache for ``plan``, pinned. A prompt that leads with cross-file context has a cache of its
        own beside the same document's prompt without it (engine/caching/cold_window.py ``cache_key``). A
        background request (Tab-Tab's follow-up, nobody asked for yet) runs on a copy of it, the stage
        (KVStore.staging): it never overwrites what the next keystroke reuses, and starts from the same prompt."""
        key, need = cache_key(request.document_id or "", bool(plan.context_chunks)), self.room(request, plan)
        main = self.store.docs.get(key) if request.background else None
        if not request.background:
            return self.store.open(key, need)
        if main is None or not main.exact_len:
            return self.store.open(key + STAGE_KEY, need)
        stage = self.store.staging(main, main.ids, main.exact_len, need)
        stage.held = main.held  # (its anchor too: a follow-up's lines go after it, as the next keystrokes' would)
        return stage

    def room(self, request: CompletionRequest, plan: PromptPlan) -> int:
        """Positions a cache needs for ``plan`` and ``request``'s answer."""
        return len(plan.ids) + request.options.max_tokens + request.options.max_gamma + 2

    def reuse(self, doc: DocumentKV, plan: PromptPlan, mode: str) -> tuple[int, list[tuple[int, int]] | None, int]:
        """(exactly reused positions, runs to compute or None for "from there on", positions shifted)."""
        if mode == "none":
            return 0, None, 0
        reuse = common_prefix(doc.ids, plan.ids, len(plan.ids) - 1)
        if mode == "exact":
            reuse = min(reuse, doc.exact_len)
        reuse = self.store.borrow(doc, plan, reuse)
        runtime = self.target.runtime
        if mode != "shift" or not runtime.shift_reuse or not self.store.sizable:
            return reuse, None, 0
        inv_freq = runtime.inv_freq
        moves, runs = plan_shift(doc.pieces, plan.pieces, reuse)
        return reuse, runs, apply_moves(doc.target, inv_freq, moves)

    def cost(self, doc: DocumentKV, plan: PromptPlan, mode: str, borrow: bool = False) -> int:
        """Prompt tokens ``plan`` would prefill on ``doc``'s cache (exact reuse; a shift may do better).
        ``borrow``: first copy another document's equal leading segments into it (the cross-file context that
        the full prompt, the cold one and the session's other documents share), as ``reuse`` would."""
        limit = doc.exact_len if mode == "exact" else len(doc.ids)
        have = common_prefix(doc.ids, plan.ids, min(limit, len(plan.ids) - 1))
        if borrow and mode != "none":
            have = self.store.borrow(doc, plan, have)
        return len(plan.ids) - have

    def choose(
        self, request: CompletionRequest, plan: PromptPlan, doc: DocumentKV
    ) -> tuple[CompletionRequest, PromptPlan, DocumentKV]:
        """The request, plan and cache a completion runs (``doc`` is ``request``'s own, open for ``plan``).

        The full prompt at its cheaper layout (``anchored``), or the cold window's small prompt where the full
        one would prefill over budget (``cold``). Where the request carries cross-file context and the cold
        window applies, the same choice is made for the prompt without the context, and the cheaper of the two
        runs, the context's on a tie (``context_wait``): so a keystroke with context costs no more than one
        without, and the context comes in once the background (a pre-warm, while the user is idle) has put it
        in the cache. The caller pre-warms ``request`` whenever another prompt is served."""
        plan = self.anchored(request, plan, doc)
        served, plan, doc, cost = self.cold(request, plan, doc)
        if self.context_wait and plan.context_chunks and self._windowed(request):
            bare = dataclasses.replace(request, context=None)
            bare_plan = self.prompts.build(bare)
            bare_doc = self.open(bare, bare_plan)
            bare_plan = self.anchored(bare, bare_plan, bare_doc)
            b_served, b_plan, b_doc, b_cost = self.cold(bare, bare_plan, bare_doc)
            if b_cost < cost:
                self._release_unused(doc, plan)
                served, plan, doc = b_served, b_plan, b_doc
                self.counters.add("context_deferred")
            else:
                self._release_unused(b_doc, b_plan)
        if served.document_id != request.document_id:  # the cold window's
            self.counters.add("cold_prompts")
        return served, plan, doc

    def cold(
        self, request: CompletionRequest, plan: PromptPlan, doc: DocumentKV
    ) -> tuple[CompletionRequest, PromptPlan, DocumentKV, int]:
        """The request, plan, cache and prefill cost to serve: the small prompt of engine/caching/cold_window.py
        where the full one would prefill more than COLD_BUDGET_S at the measured rate and the small one costs
        under half as much; else the full one."""
        full_cost = self.cost(doc, plan, request.reuse, borrow=True)
        cold = self.cold_request(request, full_cost)
        if cold is None:
            return request, plan, doc, full_cost
        cold_plan = self.prompts.build(cold)
        cold_doc = self.open(cold, cold_plan)
        cold_plan = self.anchored(cold, cold_plan, cold_doc)
        cold_cost = self.cost(cold_doc, cold_plan, cold.reuse, borrow=True)
        if cold_cost * 2 > full_cost:
            self._release_unused(cold_doc, cold_plan)
            return request, plan, doc, full_cost
        self._release_unused(doc, plan)
        return cold, cold_plan, cold_doc, cold_cost

    def defers_context(self, request: CompletionRequest) -> bool:
        """Whether ``request``'s cross-file context would wait (``choose``): it has one, not yet cached."""
        if not (self.context_wait and request.context and self._windowed(request)):
            return False
        plan = self.prompts.build(request)
        return bool(plan.context_chunks) and not self.store.holds(
            cache_key(request.document_id or "", True), plan, plan.context_tokens
        )

    def _windowed(self, request: CompletionRequest) -> bool:
        """Whether ``request`` is one the cold window serves: a keystroke's, not a measure of the full prompt."""
        return self.cold_window and request.cold_window and request.reuse != "none"

    def _over_budget(self, cost: int) -> bool:
        return bool(self.prefill_rate) and cost > self.prefill_rate * COLD_BUDGET_S

    def _release_unused(self, doc: DocumentKV, plan: PromptPlan) -> None:
        held = doc.ids == plan.ids[: len(doc.ids)]  # (what it borrowed is indexed as its own)
        self.store.release(doc, plan if held else None)

    def cold_request(self, request: CompletionRequest, full_cost: int) -> CompletionRequest | None:
        """The cold window's request where the full prompt would prefill ``full_cost`` tokens, over budget."""
        if not (self._windowed(request) and self.prefill_rate):
            return None
        if not self._over_budget(full_cost):
            return None
        cold = self.store.docs.get(cache_key((request.document_id or "") + COLD_KEY, bool(request.context)))
        return cold_request(request, cold.held[0] if cold is not None and cold.held else None)

    def time_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 64 and seconds > 0:  # short passes say more about per-pass overhead than the rate
            rate = tokens / seconds
            self.prefill_rate = rate if self.prefill_rate is None else 0.7 * self.prefill_rate + 0.3 * rate

    def anchored(self, request: CompletionRequest, plan: PromptPlan, doc: DocumentKV, count: bool = True) -> PromptPlan:
        """``plan`` (canonical layout), or the anchored layout at the anchor ``doc``'s cache holds where that
        prefills less: lines typed below the anchor then cost what keys within a line cost. ``count``: in the
        ``anchored_prompts`` counter (a completion's prompt, not a pre-warm's)."""
        anchor = anchor_at(request.prefix, request.suffix, doc.held) if self.anchored_layout else None
        if anchor is None or request.reuse == "none":
            return plan
        alt = self.prompts.build(request, anchor)
        if alt.anchor != anchor:
            return plan
        if self.cost(doc, alt, request.reuse) >= self.cost(doc, plan, request.reuse):
            return plan
        if len(alt.ids) > len(plan.ids):
            self.open(request, alt)  # (room for it)
        if count:
            self.counters.add("anchored_prompts")
        return alt

    def hold(self, doc: DocumentKV, request: CompletionRequest, plan: PromptPlan) -> bool:
        """Remember the anchor of the prompt now in ``doc``'s cache. True where it is an anchored one, to move to
        the cursor line once the user is idle (engine/background.py REANCHOR_IDLE_S)."""
        if plan.anchor is None:
            doc.held = None
            return False
        doc.held = (request.prefix[: plan.anchor], request.suffix)
        return plan.head_lines > 1  # more than the cursor's own line after the sentinel
