"""The in-process engine: one worker thread runs the model; callers only see the API in engine/api.py.

The worker owns the models and their caches, so no locks guard the tensors.
Requests run one at a time in arrival order. Cancellation is a flag the decode
loop checks before every step, so a cancelled request stops within one step.
Each document keeps its own KV caches (engine/caching/kv_store.py); when no completion is
waiting, the worker pre-warms documents the host named (``prewarm``), a chunk at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from engine.api import CompletionRequest, CompletionResult, CompletionStream, Delta
from engine.caching.cold_window import COLD_BUDGET_S, COLD_KEY, cold_request
from engine.caching.kv_shift import apply_moves, plan_shift
from engine.caching.kv_store import DocumentKV, KVStore, common_prefix, default_budget_bytes
from engine.caching.prompt_plan import PromptBuilder, PromptPlan, anchor_at
from engine.decoding.detok import IncrementalDetokenizer, StopRules
from engine.decoding.drafters import ModelDrafter, NgramDrafter
from engine.decoding.healing import unheal
from engine.decoding.spec_policy import verify_costs
from engine.decoding.speculative import SpeculativeDecoder
from engine.errors import FimbleError, PromptError
from engine.loader import LoadedModel, default_models, load_model

COUNTER_NAMES = ("submitted", "completed", "cancelled", "failed", "decode_steps", "tokens_generated",
                 "tokens_prefilled", "tokens_reused", "tokens_shifted", "tokens_prewarmed", "prewarms_done",
                 "prewarms_preempted", "prewarms_failed", "anchored_prompts", "cold_prompts",
                 "reanchors_skipped", "context_prompts", "context_tokens")
REUSE_MODES = ("exact", "shift", "none")
# Pre-warm prefill chunk: on a 2-core CPU 32 tokens at a 4k context take ~40 ms, the
# longest a completion waits for a running pre-warm to yield.
PREWARM_CHUNK = 32
# A completion's prompt longer than this is prefilled this many tokens a pass, and the prefill stops
# between passes once the request is cancelled (the user typed on): its prefix stays in the cache for
# the next keystroke's request, which shares it. Before, a cancelled request's prefill ran to its end
# (256-token passes, ~1.2 s on a 2-core CPU) while the request that replaced it waited.
COMPLETION_PREFILL_CHUNK = 64
# A completion served with the anchored layout (lines typed since the anchor after the middle sentinel,
# engine/caching/prompt_plan.py) moves its anchor to the cursor line once nothing has been submitted for
# this long: a pre-warm of the canonical prompt, which re-evaluates the suffix while the user is idle.
REANCHOR_IDLE_S = float(os.environ.get("FIMBLE_REANCHOR_IDLE_S", 0.75))
# Background work (pre-warms, re-anchors) starts only this long after the host's latest message (a
# completion, a pre-warm, a forget); what is left waits for the next one. A user who stops typing stops
# the engine within about a chunk of this, instead of paying seconds of prefill for a spot they left.
BACKGROUND_S = float(os.environ.get("FIMBLE_BACKGROUND_S", 1.5))
_WAKE = ("wake",)  # queue item: a pre-warm was added


class LocalEngine:
    # Set by the engine process (engine/process.py): called (phase, done, total) before a prompt's pass, so
    # the host's watchdog gives a long prefill the time it needs instead of killing it as stuck.
    progress: Callable[[str, int, int], None] | None = None

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, threads: int | None = None,
                 start_thread: bool = True, kv_budget_bytes: int | None = None):
        if target.template is None:
            raise FimbleError(f"model {target.name} has no fill-in-the-middle tokens; pass a template name")
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise FimbleError(f"draft {draft.name} and target {target.name} do not share a tokenizer")
        self.target, self.draft = target, draft
        self._threads = threads
        device = getattr(target.runtime, "device", "cpu")
        self.store = KVStore(target.runtime, draft.runtime if draft else None, target.max_len,
                             kv_budget_bytes or default_budget_bytes(device))
        self.prompts = PromptBuilder(target)
        self.model_drafter = ModelDrafter(draft.runtime, 0) if draft else None
        self.ngram_drafter = NgramDrafter()
        _ = target.token_index  # build it now, not on the first keystroke
        # Prompt tokens a second: the load-time probe's, then a running mean of timed prefills (None: unknown
        # until one is timed; the cold window waits for it).
        self._prefill_rate: float | None = None
        self.cold_window = _switch("FIMBLE_COLD_WINDOW")  # engine/caching/cold_window.py
        self.anchored_layout = _switch("FIMBLE_ANCHORED_LAYOUT")  # off only to measure it (bench/typing.py)
        if getattr(target.runtime, "cost_aware_drafting", False):
            # The verify-cost probe (engine/decoding/spec_policy.py) times ~15 passes once per runtime:
            # 5-6 s for a 0.5B model on a 2-core CPU, which the first completion used to wait for.
            costs = verify_costs(target.runtime)
            if costs.prefill_rate > 0:
                self._prefill_rate = costs.prefill_rate
            if draft is not None:
                verify_costs(draft.runtime)
        self._ids = itertools.count(1)
        self._queue: queue.Queue = queue.Queue()
        self._prewarms: OrderedDict[str, CompletionRequest] = OrderedDict()  # newest last
        # Anchored prompts to move to the cursor line when idle: document -> (request, submits then)
        self._reanchors: dict[str, tuple[CompletionRequest, int]] = {}
        self._last_submit = 0.0  # time.monotonic() of the latest completion submitted
        self._last_message = time.monotonic()  # ... and of the host's latest completion, pre-warm or forget
        self._reanchoring: set[str] = set()  # documents whose pending pre-warm is a re-anchor
        self._looping = False  # the request loop runs (a worker thread, or serve_forever in the engine process)
        self._submitted: dict[str, int] = {}  # completions submitted per document (a pre-warm's staleness)
        self._waiting = 0  # completions submitted and not yet started
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._kv_summary = self.store.summary()
        self._lock = threading.Lock()
        # On CPU, torch runs small matmuls about 2x slower outside the main thread (its
        # OpenMP team there sleeps between ops). Latency-critical hosts therefore run the
        # engine in its own process and call serve_forever() from that main thread.
        self._worker: threading.Thread | None = None
        if start_thread:
            self._worker = threading.Thread(target=self._run, name="fimble-engine", daemon=True)
            self._worker.start()

    # -- public API -------------------------------------------------------------------
    def submit(self, request: CompletionRequest, on_delta=None) -> CompletionStream:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        stream = CompletionStream(next(self._ids), loop, on_delta)
        self._count("submitted")
        with self._lock:
            self._waiting += 1
            # This request computes the document's current prompt: an older pre-warm would only undo it.
            key = request.document_id or ""
            self._prewarms.pop(key, None)
            self._reanchors.pop(key, None)
            self._submitted[key] = self._submitted.get(key, 0) + 1
            if not request.background:
                self._last_submit = self._last_message = time.monotonic()
        self._queue.put((request, stream))
        return stream

    def prewarm(self, request: CompletionRequest) -> None:
        """Fill the document's cache for this prompt in the background; completions go first."""
        with self._lock:
            key = request.document_id or ""
            self._prewarms.pop(key, None)
            self._prewarms[key] = request
            self._reanchoring.discard(key)
            self._last_message = time.monotonic()
        self._queue.put(_WAKE)

    def forget(self, document_id: str) -> None:
        """Drop a document's caches (it was closed)."""
        with self._lock:
            self._last_message = time.monotonic()
        self._queue.put(("forget", document_id))

    def complete(self, request: CompletionRequest) -> CompletionResult:
        """Blocking convenience: run a request to the end (call from outside an event loop).

        Without a worker thread the request runs right here, in the caller's thread.
        """
        stream = self.submit(request)
        if self._worker is None:
            self.run_pending()
        stream.collect()
        assert stream.result is not None
        return stream.result

    def run_pending(self, idle: bool = False) -> None:
        """Without a worker thread: run everything queued (completions, then pre-warms) here; ``idle``:
        as if the user had stopped typing, re-anchors too."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            self._handle(item)
        if idle:
            with self._lock:
                self._last_submit = 0.0
            self._take_due_reanchors()
        while self._next_prewarm() is not None:
            pass

    def info(self) -> dict:
        t = self.target
        return {"model": t.name, "backend": t.backend, "template": t.template.name if t.template else None,
                "draft": self.draft.name if self.draft else None, "context": t.max_len, "vocab": t.vocab_size,
                "kv_budget_bytes": self.store.budget}

    def counters(self) -> dict:
        with self._lock:
            return {**self._counters, **self._kv_summary}

    def close(self) -> None:
        self._queue.put(None)
        if self._worker is not None:
            self._worker.join(timeout=5)

    def serve_forever(self) -> None:
        """Run requests in the calling thread until close()."""
        self._run()

    # -- worker -------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _run(self) -> None:
        self._looping = True
        if self._threads:
            torch.set_num_threads(self._threads)
        while True:
            # Idle with pre-warms pending (in the background window): run one, then look at the queue again.
            # Else wait for a message, or until the first re-anchor is due.
            busy = bool(self._prewarms) and self._window_left() > 0
            try:
                item = self._queue.get(block=not busy, timeout=None if busy else self._reanchor_wait())
            except queue.Empty:
                if busy:
                    self._next_prewarm()
                else:
                    self._take_due_reanchors()
                continue
            if item is None:
                return
            self._handle(item)

    def _window_left(self) -> float:
        """Seconds of background work left before the engine goes quiet (always some outside the request
        loop: run_pending's caller asked for the work)."""
        if not self._looping:
            return BACKGROUND_S
        with self._lock:
            return self._last_message + BACKGROUND_S - time.monotonic()

    def _reanchor_wait(self) -> float | None:
        with self._lock:
            if not self._reanchors:
                return None
            return max(0.0, self._last_submit + REANCHOR_IDLE_S - time.monotonic())

    def _take_due_reanchors(self) -> bool:
        """Move due re-anchors to the pre-warms (their own document's newer work drops them). True if any."""
        with self._lock:
            if not self._reanchors or time.monotonic() < self._last_submit + REANCHOR_IDLE_S:
                return False
            for key, (request, submitted) in self._reanchors.items():
                if self._submitted.get(key, 0) == submitted and key not in self._prewarms:
                    self._prewarms[key] = request
                    self._reanchoring.add(key)
            self._reanchors.clear()
            return bool(self._prewarms)

    def _handle(self, item) -> None:
        if item is _WAKE or item is None:
            return
        if item[0] == "forget":
            for key in (item[1], item[1] + COLD_KEY):
                with self._lock:
                    self._prewarms.pop(key, None)
                    self._reanchors.pop(key, None)
                    self._submitted.pop(key, None)
                self.store.forget(key)
        else:
            with self._lock:
                self._waiting -= 1
            self._run_one(item)
        self._snapshot_kv()

    def _next_prewarm(self) -> CompletionRequest | None:
        with self._lock:
            if not self._prewarms:
                return None
            key, request = self._prewarms.popitem(last=True)  # the most recent document first
            submitted = self._submitted.get(key, 0)
            whole = key in self._reanchoring
            self._reanchoring.discard(key)
        try:
            self._prewarm(request, submitted, whole)
        except Exception:  # a pre-warm is only an optimisation: a bad one is dropped, never fatal
            self._count("prewarms_failed")
        self._snapshot_kv()
        return request

    def _snapshot_kv(self) -> None:
        """Publish the store's figures for counters(), which other threads call while the worker runs."""
        summary = self.store.summary()
        with self._lock:
            self._kv_summary = summary

    def _run_one(self, item: tuple[CompletionRequest, CompletionStream] | None) -> None:
        if item is None:
            return
        request, stream = item
        try:
            self._serve(request, stream)
        except FimbleError as exc:
            self._count("failed")
            stream.push(Delta("", True, "error", str(exc), type(exc).__name__))
        except Exception as exc:  # never let one request kill the worker
            self._count("failed")
            stream.push(Delta("", True, "error", f"internal error: {type(exc).__name__}: {exc}"))

    def build_prompt(self, request: CompletionRequest) -> tuple[list[int], str, bool]:
        """Token ids of the FIM prompt and its healing (engine/caching/prompt_plan.py, engine/decoding/healing.py)."""
        plan = self.prompts.build(request)
        return plan.ids, plan.heal, plan.constrained

    # -- KV reuse -------------------------------------------------------------------------
    def _open_document(self, request: CompletionRequest, plan: PromptPlan) -> DocumentKV:
        need = len(plan.ids) + request.options.max_tokens + request.options.max_gamma + 2
        return self.store.open(request.document_id or "", need)

    def _reuse(self, doc: DocumentKV, plan: PromptPlan, mode: str) -> tuple[int, list[tuple[int, int]] | None, int]:
        """(exactly reused positions, runs to compute or None for "from there on", positions shifted)."""
        if mode == "none":
            return 0, None, 0
        reuse = common_prefix(doc.ids, plan.ids, len(plan.ids) - 1)
        if mode == "exact":
            reuse = min(reuse, doc.exact_len)
        reuse = self.store.borrow(doc, plan, reuse)
        inv_freq = getattr(self.target.runtime, "inv_freq", None)
        if mode != "shift" or inv_freq is None or not self.store.sizable:
            return reuse, None, 0
        moves, runs = plan_shift(doc.pieces, plan.pieces, reuse)
        return reuse, runs, apply_moves(doc.target, inv_freq, moves)

    def _serve(self, request: CompletionRequest, stream: CompletionStream) -> None:
        t0 = time.perf_counter()
        if stream.cancelled:
            self._finish(stream, "", "cancelled", 0, {"queue_ms": 0.0})
            return
        opt = request.options
        opt.validate()
        if request.reuse not in REUSE_MODES:
            raise PromptError(f"unknown reuse mode {request.reuse!r}: use {', '.join(REUSE_MODES)}")
        plan = self.prompts.build(request)
        doc = self._open_document(request, plan)
        plan = self._anchored(request, plan, doc)
        request, plan, doc = self._cold(request, plan, doc)
        prompt, heal, constrained = plan.ids, plan.heal, plan.constrained
        if plan.context_chunks:  # cross-file context at the prompt's head (engine/caching/context_prompt.py)
            self._count("context_prompts")
            self._count("context_tokens", plan.context_tokens)
        t_prompt = time.perf_counter()
        reuse = 0
        try:
            reuse, runs, shifted = self._reuse(doc, plan, request.reuse)
            prefilled = sum(b - a for a, b in runs) if runs is not None else len(prompt) - reuse
            decoder = SpeculativeDecoder(self.target.runtime, doc.target, self.target.stop_ids, opt,
                                         self.model_drafter, self.ngram_drafter, heal if constrained else "",
                                         self.target.token_index if constrained else None)
            if self.model_drafter is not None:
                self.model_drafter.bind(doc.draft, doc.draft_ids)
            doc.ids = []  # the cache is about to change; valid again after prefill
            if self.progress is not None:
                self.progress("prefill", 0, prefilled)
            start = reuse
            if runs is None:
                filled = self._prefill_until_cancelled(doc, prompt, reuse, stream)
                if filled is None:
                    self._count("tokens_prefilled", doc.exact_len - reuse)
                    self._finish(stream, "", "cancelled", 0, {"queue_ms": 0.0})
                    return
                start = filled
            first = decoder.prefill(prompt, start, runs)
            self._count("tokens_prefilled", prefilled)
            self._count("tokens_reused", len(prompt) - prefilled)
            self._count("tokens_shifted", shifted)
            t_first = time.perf_counter()
            self._time_prefill(prefilled, t_first - t_prompt)
            text, shown, reason = self._decode(decoder, stream, first, heal, constrained)
            # Keys/values of prompt + accepted output stay valid for the next request.
            doc.ids = decoder.ids[: doc.target.length]
            doc.exact_len = len(doc.ids) if runs is None or not shifted else reuse
            self._hold(doc, request, plan)
        finally:
            if self.model_drafter is not None:
                doc.draft_ids = self.model_drafter.ids if doc.ids else []
                self.model_drafter.bind(None, [])
            self.store.release(doc, plan, reuse)
        if self.ngram_drafter is not None:
            self.ngram_drafter.remember(decoder.output)
        t_end = time.perf_counter()
        s = decoder.stats
        stats = {"prompt_tokens": len(prompt), "reused_tokens": len(prompt) - prefilled,
                 "prefilled_tokens": prefilled, "shifted_tokens": shifted, "truncated_tokens": plan.truncated,
                 "prompt_ms": (t_prompt - t0) * 1e3, "first_token_ms": (t_first - t0) * 1e3,
                 "total_ms": (t_end - t0) * 1e3, "new_tokens": len(decoder.output), "steps": s.steps,
                 "drafted": s.drafted, "accepted": s.accepted, "mean_accepted": s.mean_accepted,
                 "context_tokens": plan.context_tokens, "context_chunks": plan.context_chunks}
        self._finish(stream, text[:shown], reason or "stop", len(decoder.output), stats)

    def _cost(self, doc: DocumentKV, plan: PromptPlan, mode: str) -> int:
        """Prompt tokens ``plan`` would prefill on ``doc``'s cache (exact reuse; a shift may do better)."""
        limit = doc.exact_len if mode == "exact" else len(doc.ids)
        return len(plan.ids) - common_prefix(doc.ids, plan.ids, min(limit, len(plan.ids) - 1))

    def _cold(self, request: CompletionRequest, plan: PromptPlan,
              doc: DocumentKV) -> tuple[CompletionRequest, PromptPlan, DocumentKV]:
        """The request, plan and cache to serve: the small prompt of engine/caching/cold_window.py where the
        full one would prefill more than COLD_BUDGET_S at the measured rate and the small one costs less;
        the full prompt then fills the document's cache in the background (a pre-warm)."""
        full_cost = self._cost(doc, plan, request.reuse)
        cold = self._cold_request(request, full_cost)
        if cold is None:
            return request, plan, doc
        cold_plan = self.prompts.build(cold)
        cold_doc = self._open_document(cold, cold_plan)
        cold_plan = self._anchored(cold, cold_plan, cold_doc)
        if self._cost(cold_doc, cold_plan, cold.reuse) * 2 > full_cost:
            self.store.release(cold_doc)
            return request, plan, doc
        self.store.release(doc)
        self._count("cold_prompts")
        # The full prompt fills when the user leaves the engine a moment (a pre-warm). A chunk of it before
        # each cold answer was tried: it filled a spot within ~40 keystrokes, but the chunk's time on every
        # answer cut the pauses with text within 1 s from 66% to 38% (bench/typing.py, default model).
        with self._lock:
            self._prewarms.setdefault(request.document_id or "", request)
        return cold, cold_plan, cold_doc

    def _cold_request(self, request: CompletionRequest, full_cost: int) -> CompletionRequest | None:
        """The cold window's request where the full prompt would prefill ``full_cost`` tokens, over budget."""
        if not (self.cold_window and request.cold_window and self._prefill_rate) or request.reuse == "none":
            return None
        return cold_request(request) if full_cost > self._prefill_rate * COLD_BUDGET_S else None

    def _time_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 64 and seconds > 0:  # short passes say more about per-pass overhead than the rate
            rate = tokens / seconds
            self._prefill_rate = rate if self._prefill_rate is None else 0.7 * self._prefill_rate + 0.3 * rate

    def _anchored(self, request: CompletionRequest, plan: PromptPlan, doc: DocumentKV) -> PromptPlan:
        """``plan`` (canonical layout), or the anchored layout at the anchor ``doc``'s cache holds where that
        prefills less: lines typed below the anchor then cost what keys within a line cost."""
        anchor = anchor_at(request.prefix, request.suffix, doc.held) if self.anchored_layout else None
        if anchor is None or request.reuse == "none":
            return plan
        alt = self.prompts.build(request, anchor)
        if alt.anchor != anchor:
            return plan
        if self._cost(doc, alt, request.reuse) >= self._cost(doc, plan, request.reuse):
            return plan
        if len(alt.ids) > len(plan.ids):
            self._open_document(request, alt)  # (room for it)
        self._count("anchored_prompts")
        return alt

    def _hold(self, doc: DocumentKV, request: CompletionRequest, plan: PromptPlan) -> None:
        """Remember the anchor of the prompt now in ``doc``'s cache; an anchored one moves to the cursor
        line once the user is idle (REANCHOR_IDLE_S)."""
        if plan.anchor is None:
            doc.held = None
            return
        doc.held = (request.prefix[: plan.anchor], request.suffix)
        if plan.head_lines > 1:  # more than the cursor's own line after the sentinel
            key = request.document_id or ""
            with self._lock:
                self._reanchors[key] = (request, self._submitted.get(key, 0))

    def _decode(self, decoder: SpeculativeDecoder, stream: CompletionStream, first: list[int], heal: str,
                constrained: bool) -> tuple[str, int, str | None]:
        """Stream text until a stop, the end of decoding or a cancel. Returns (text, shown, reason)."""
        opt = decoder.opt
        detok = IncrementalDetokenizer(self.target.tokenizer)
        rules = StopRules(opt.stop, opt.max_lines)
        shown = 0
        new_tokens = first
        reason = None
        while True:
            self._count("tokens_generated", len(new_tokens))
            detok.add(new_tokens)
            text, hit = rules.cut(unheal(detok.text, heal, constrained))
            if hit:
                reason = "stop"
            safe = len(text) if (hit or decoder.done) else rules.safe_length(text)
            if safe > shown:
                stream.push(Delta(text[shown:safe]))
                shown = safe
            if reason or decoder.done:
                break
            if stream.cancelled:
                reason = "cancelled"
                break
            new_tokens = decoder.step()
            self._count("decode_steps")
        if decoder.done and not reason:
            detok.flush()
            text, _ = rules.cut(unheal(detok.text, heal, constrained))
            if len(text) > shown:
                stream.push(Delta(text[shown:]))
                shown = len(text)
            reason = "eos" if decoder.finish_reason == "stop" else decoder.finish_reason
        return text, shown, reason

    # -- pre-warm -----------------------------------------------------------------------
    def _prewarm(self, request: CompletionRequest, submitted: int = 0, whole: bool = False) -> None:
        """Prefill a document's prompt in small chunks; stop at once when a completion is waiting.

        ``submitted``: the document's completion count when this pre-warm was taken; a
        pre-empted pre-warm resumes later only if no completion for the document came since.
        ``whole``: a re-anchor, worth starting only if it can end in the background window (half done,
        it would have overwritten the anchored prompt the next keystroke reuses).
        """
        plan = self.prompts.build(request)
        doc = self._open_document(request, plan)
        reuse = 0
        done = False
        try:
            reuse = common_prefix(doc.ids, plan.ids, min(len(plan.ids), doc.exact_len))
            reuse = self.store.borrow(doc, plan, reuse)
            if whole and self._prefill_rate and (len(plan.ids) - reuse) / self._prefill_rate > self._window_left():
                self._count("reanchors_skipped")
                return
            cold = self._cold_request(request, len(plan.ids) - reuse) if not whole else None
            if cold is not None:  # the small prompt first: the next keystroke there answers from it
                self._prewarm(dataclasses.replace(cold, cold_window=False))

            def target_holds(n: int) -> None:
                doc.ids = plan.ids[:n]
                doc.exact_len = n

            pos = self._prefill_chunks(self.target.runtime, doc.target, plan.ids, reuse, PREWARM_CHUNK, target_holds)
            self._count("tokens_prewarmed", pos - reuse)
            if self.model_drafter is not None and doc.draft is not None:
                ids = plan.ids[:pos]
                # The draft model is ~10x cheaper per token: bigger chunks yield as fast.
                self._prefill_chunks(self.draft.runtime, doc.draft, ids, common_prefix(doc.draft_ids, ids, pos),
                                     4 * PREWARM_CHUNK, lambda n: setattr(doc, "draft_ids", ids[:n]))
            done = pos == len(plan.ids)
            if done:
                self._hold(doc, request, plan)
        finally:
            self.store.release(doc, plan, reuse)
        self._count("prewarms_done" if done else "prewarms_preempted")
        key = request.document_id or ""
        if not done:
            with self._lock:  # resume later unless something newer for this document arrived
                if self._submitted.get(key, 0) == submitted:
                    self._prewarms.setdefault(key, request)

    def _prefill_chunks(self, runtime, cache, ids: list[int], pos: int, chunk: int,
                        holds: Callable[[int], None]) -> int:
        """Run ``ids[pos:]`` into ``cache`` ``chunk`` tokens at a time until done or a completion waits.

        ``holds(n)`` records that the cache holds ``ids[:n]``. It is called only once something
        is written, so when the prompt is already there, what follows it in the cache (a
        decoded answer the user may accept) stays usable. Returns how far it got.
        """
        while pos < len(ids) and not self._completion_waiting() and self._window_left() > 0:
            end = min(len(ids), pos + chunk)
            holds(pos)  # what followed ``pos`` is about to be overwritten
            cache.length = min(cache.length, pos)
            runtime(torch.tensor(ids[pos:end], dtype=torch.long, device=runtime.device), cache, pos, 1)
            pos = end
            holds(pos)
        return pos

    def _prefill_until_cancelled(self, doc: DocumentKV, prompt: list[int], pos: int,
                                 stream: CompletionStream) -> int | None:
        """Prefill the prompt a chunk a pass, leaving the answer's own pass (which computes the logits it
        needs) more than a chunk and at most two: as in llama.cpp's own prefill, its rows take the many-row
        kernels (engine/runtimes/ggml_runtime.py ``_blocks``). None once ``stream`` is cancelled (the cache
        then holds what was filled, ``doc.ids`` says what)."""
        runtime, cache = self.target.runtime, doc.target
        while len(prompt) - pos > 2 * COMPLETION_PREFILL_CHUNK:
            if stream.cancelled:
                return None
            end = pos + COMPLETION_PREFILL_CHUNK
            cache.length = min(cache.length, pos)
            runtime(torch.tensor(prompt[pos:end], dtype=torch.long, device=runtime.device), cache, pos, 1)
            pos = end
            doc.ids, doc.exact_len = prompt[:pos], pos
        return pos

    def _completion_waiting(self) -> bool:
        with self._lock:
            return self._waiting > 0

    def _finish(self, stream: CompletionStream, text: str, reason: str, tokens: int, stats: dict) -> None:
        self._count("cancelled" if reason == "cancelled" else "completed")
        stream.result = CompletionResult(text, reason, tokens, stats)
        stream.push(Delta("", True, reason))


def _switch(name: str) -> bool:
    """An on/off environment setting, on unless set to off, 0, false or no."""
    return os.environ.get(name, "on").strip().lower() not in ("off", "0", "false", "no")


def open_engine(model: str | Path | None = None, draft: str | Path | None = None, *, device: str = "cpu",
                template: str | None = None, trust_remote_code: bool = False,
                use_draft: bool = True, start_thread: bool = True,
                kv_budget_bytes: int | None = None, runtime: str | None = None) -> LocalEngine:
    """Load the target (default: the embedded model) and, where it shares the tokenizer, a draft.

    ``FIMBLE_QUANT=int8`` loads both with int8 weights (CPU only; engine/runtimes/quant.py).
    ``runtime``: as engine.loader.load_model's (default ``$FIMBLE_RUNTIME``, else auto)."""
    quant = os.environ.get("FIMBLE_QUANT", "none")
    default_target, default_draft = default_models()  # engine/model_info.py: fimble-smollm2 once built
    target = load_model(model or default_target, device=device, template=template,
                        trust_remote_code=trust_remote_code, quant=quant, runtime=runtime)
    draft_model = None
    if use_draft:
        draft_path = draft or (default_draft if model is None else None)
        if draft_path is not None:
            draft_model = load_model(draft_path, device=device, trust_remote_code=trust_remote_code, quant=quant,
                                     runtime=runtime)
    return LocalEngine(target, draft_model, start_thread=start_thread, kv_budget_bytes=kv_budget_bytes)
