"""Which prompt a completion runs and how much of it a document's cache already holds.

The choices made before a request's first pass (engine/steps.py): the document's caches (engine/caching/
kv_store.py), the positions reused exactly or shifted, the anchored layout where it prefills less
(engine/caching/prompt_plan.py), and the cold window's small prompt where the full one would take too
long (engine/caching/cold_window.py).
"""

from __future__ import annotations

import os

from engine.api import CompletionRequest
from engine.caching.cold_window import COLD_BUDGET_S, bare_request, cold_request
from engine.caching.kv_shift import apply_moves, plan_shift
from engine.caching.kv_store import DocumentKV, KVStore, common_prefix
from engine.caching.prompt_plan import PromptBuilder, PromptPlan, anchor_at
from engine.counters import Counters
from engine.loader import LoadedModel

REUSE_MODES = ("exact", "shift", "none")


def switch(name: str) -> bool:
    """An on/off environment setting, on unless set to off, 0, false or no."""
    return os.environ.get(name, "on").strip().lower() not in ("off", "0", "false", "no")


class DocumentPrompts:
    """Prompt choice and KV reuse for one engine's documents (the worker thread's alone)."""

    def __init__(self, target: LoadedModel, store: KVStore, counters: Counters, *, anchored: bool, cold: bool):
        self.target, self.store, self.counters = target, store, counters
        self.prompts = PromptBuilder(target)
        self.cold_window = cold  # engine/caching/cold_window.py
        self.anchored_layout = anchored  # off only to measure it (bench/lsp_typing.py)
        # On (the default): while the cross-file context is not cached, the cold window answers without it and
        # the background fills it, so a keystroke never pays for the context's prefill. Off: the cold prompt
        # always carries it, and the keystrokes after a ring change prefill it; typing pygls files that way
        # showed text within 1 s after 17% of new lines against 32% with no context and 29% with this on
        # (bench/reports/typing-default-crossfile-on-vs-off-pygls-2026-12-03.txt, a loaded machine).
        self.cold_context_wait = os.environ.get("FIMBLE_COLD_CONTEXT_WAIT", "on").strip().lower() in ("on", "1")
        # Prompt tokens a second: the load-time probe's, then a running mean of timed prefills (None: unknown
        # until one is timed; the cold window waits for it).
        self.prefill_rate: float | None = None

    def open(self, request: CompletionRequest, plan: PromptPlan) -> DocumentKV:
        need = len(plan.ids) + request.options.max_tokens + request.options.max_gamma + 2
        return self.store.open(request.document_id or "", need)

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

    def cold(
        self, request: CompletionRequest, plan: PromptPlan, doc: DocumentKV
    ) -> tuple[CompletionRequest, PromptPlan, DocumentKV]:
        """The request, plan and cache to serve: the small prompt of engine/caching/cold_window.py where the
        full one would prefill more than COLD_BUDGET_S at the measured rate and the small one costs less.
        (The caller then fills the full prompt in the background, a pre-warm.)"""
        full_cost = self.cost(doc, plan, request.reuse)
        cold = self.cold_request(request, full_cost)
        if cold is None:
            return request, plan, doc
        cold_plan = self.prompts.build(cold)
        cold_doc = self.open(cold, cold_plan)
        cold_plan = self.anchored(cold, cold_plan, cold_doc)
        cold_cost = self.cost(cold_doc, cold_plan, cold.reuse, borrow=True)
        context_missing = len(cold_plan.ids) - cold_cost < cold_plan.context_tokens
        if self.cold_context_wait and context_missing and self._over_budget(cold_cost):
            bare = bare_request(cold)
            bare_plan = self.prompts.build(bare)
            bare_doc = self.open(bare, bare_plan)
            bare_plan = self.anchored(bare, bare_plan, bare_doc)
            bare_cost = self.cost(bare_doc, bare_plan, bare.reuse)
            if bare_cost < cold_cost:
                self._release_unused(cold_doc, cold_plan)
                cold, cold_plan, cold_doc, cold_cost = bare, bare_plan, bare_doc, bare_cost
            else:
                self.store.release(bare_doc)
        if cold_cost * 2 > full_cost:
            self._release_unused(cold_doc, cold_plan)
            return request, plan, doc
        self.store.release(doc)
        self.counters.add("cold_prompts")
        return cold, cold_plan, cold_doc

    def _over_budget(self, cost: int) -> bool:
        return bool(self.prefill_rate) and cost > self.prefill_rate * COLD_BUDGET_S

    def _release_unused(self, doc: DocumentKV, plan: PromptPlan) -> None:
        held = doc.ids == plan.ids[: len(doc.ids)]  # (what it borrowed is indexed as its own)
        self.store.release(doc, plan if held else None)

    def cold_request(self, request: CompletionRequest, full_cost: int) -> CompletionRequest | None:
        """The cold window's request where the full prompt would prefill ``full_cost`` tokens, over budget."""
        if not (self.cold_window and request.cold_window and self.prefill_rate) or request.reuse == "none":
            return None
        return cold_request(request) if self._over_budget(full_cost) else None

    def time_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 64 and seconds > 0:  # short passes say more about per-pass overhead than the rate
            rate = tokens / seconds
            self.prefill_rate = rate if self.prefill_rate is None else 0.7 * self.prefill_rate + 0.3 * rate

    def anchored(self, request: CompletionRequest, plan: PromptPlan, doc: DocumentKV) -> PromptPlan:
        """``plan`` (canonical layout), or the anchored layout at the anchor ``doc``'s cache holds where that
        prefills less: lines typed below the anchor then cost what keys within a line cost."""
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
