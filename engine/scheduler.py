"""The engine's worker: a queue of requests, and rounds in which every active request advances one pass.

Both engines are this scheduler. ``fimble lsp``'s in-process engine (engine/local.py ``LocalEngine``) runs one
active request and no batching: requests run one at a time in arrival order. ``fimble serve``'s
(engine/serve/scheduler.py ``ServeEngine``) steps up to ``max_active`` requests together, their passes
batched. Each request is the generator of engine/steps.py; a round:

1. answers every request waiting for greedy draft tokens (``PassRunner.drafts``: batched where it can);
2. runs one target pass for every request (``PassRunner`` / ``SlottedPasses``: alone, batched, or a graph);
3. sends each request its logits: it verifies, streams text, and says what it needs next.

A new request is admitted at the next round (fairness: it prefills a chunk per round alongside the others'
steps). Cancellation is checked before every step of every request, and between prefill chunks; a request that
waits is finished at once when cancelled. Two requests for the same document never run together (they share a
cache): the newer waits for the older, which the editor has usually cancelled already. When no completion is
waiting, the worker runs background work (engine/background.py).

The worker owns the models and their caches, so no locks guard the tensors.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine import env_settings
from engine.api import CompletionRequest, CompletionResult, CompletionStream, Delta, Unwatched
from engine.background import Background
from engine.caching.kv_store import KVStore, default_budget_bytes, session_of
from engine.counters import Counters
from engine.decoding.draft_plan import AcceptanceBook
from engine.decoding.drafters import ModelDrafter, NgramDrafter, SessionNgrams
from engine.decoding.spec_policy import Acceptance, verify_costs
from engine.documents import DocumentPrompts
from engine.errors import FimbleError, PromptError
from engine.fed_rounds import rounds_for
from engine.loader import LoadedModel
from engine.runner import PassRunner
from engine.steps import request_steps

COUNTER_NAMES = (
    "submitted",
    "completed",
    "cancelled",
    "failed",
    "decode_steps",
    "tokens_generated",
    "tokens_prefilled",
    "tokens_reused",
    "tokens_shifted",
    "tokens_prewarmed",
    "prewarms_done",
    "prewarms_preempted",
    "prewarms_failed",
    "anchored_prompts",
    "cold_prompts",
    "reanchors_skipped",
    "context_prompts",
    "context_tokens",
    "context_deferred",  # keystrokes served without their context: it was not cached yet (documents.choose)
)
SCHED_COUNTERS = (
    "sched_rounds",
    "sched_passes",
    "sched_batched_rows",
    "sched_max_batch",
    "sched_active",
    "sched_waiting",
    "sched_admitted",
    "sched_graph_rounds",
    "sched_round_ms",  # wall time in rounds (drafts, passes, advancing every sequence)
    "sched_pass_ms",  # of which launching the target passes and waiting for them (not the overlapped work)
    "sched_launch_ms",  # of pass_ms: starting the passes (slotted: staging and the graph's launch; eager: all of it)
    "sched_overlap_ms",  # of which streaming text and admitting requests while the passes run (overlap)
    "sched_advance_ms",  # of which verifying every sequence's logits and preparing its next pass (after the wait)
    "sched_gpu_ms",  # slotted rounds: GPU time of their graph replays
    "sched_graph_batch",  # slotted rounds: the graphs' batch (slots), block (rows a slot) and key length, summed
    "sched_graph_block",
    "sched_graph_keys",
    "sched_shortened",  # verify blocks cut by the round's block choice (SlottedPasses.shorten)
    "sched_slow_rounds",  # rounds of SLOW_ROUND_MS or more (engine/rounds.py): stalls every active request sees
    "sched_slow_round_ms",  # the wall time of those rounds, of which:
    "sched_slow_drafts_ms",  # drafting, choosing blocks, streaming without overlap (before the launch)
    "sched_slow_overlap_ms",  # streaming and admitting while the passes ran
    "sched_slow_advance_ms",  # verifying and preparing each sequence's next pass
    "sched_prebuilt",  # prompts built while their document was busy (_admit)
    "sched_admitted_early",  # of those, admitted in the round that freed their document (_admit(ready_only))
    "sched_refused_unfit",  # prompts refused as too long for the context before being tokenised whole
    "sched_cancel_overlapped",  # cancelled sequences ended while a round's passes ran (engine/steps.py _decode)
    "sched_fed_rounds",  # rounds launched before the one in flight was read (engine/fed_rounds.py)
    "sched_fed_rows",  # guessed 1-token steps fed on the device, of which:
    "sched_fed_matched",  # the sequence's own next pass (its row answered it)
    "sched_fed_dropped",  # not (it drafted, ended, or chose another token): a wasted row
)
MAX_SESSIONS_REMEMBERED = 1024  # per-session n-gram drafters kept (least recently used dropped)
_WAKE = ("wake",)  # queue item: a pre-warm was added


@dataclass
class Policy:
    """How a scheduler runs its requests (engine/local.py and engine/serve/scheduler.py set these)."""

    max_active: int = 1  # requests stepped together; more wait their turn
    prefill_chunk: int = 64  # prompt tokens a request prefills per pass (engine/steps.py)
    stream_interval: float = 0.0  # after a completion's first text, deltas at most this often (0: every step)
    overlap: bool = False  # stream and admit while a round's passes run (asynchronous passes only)
    session_drafters: bool = False  # a draft model drafter per request, an n-gram drafter per client session
    background_window: bool = True  # background work stops BACKGROUND_S after the host's latest message
    anchored: bool = True  # anchored prompt layout (engine/caching/prompt_plan.py)
    cold: bool = True  # cold window (engine/caching/cold_window.py)
    refuse_unfit: bool = False  # refuse prompts too long for the context before tokenising them whole
    error_detail: bool = True  # an internal error's delta carries the exception's text


class Scheduler(Unwatched):
    """An ``Engine`` (engine/api.py) running in this process; nothing of its own to watch (``Unwatched``)."""

    # Set by the engine process (engine/process.py): called (phase, done, total) before a prompt's pass, so
    # the host's watchdog gives a long prefill the time it needs instead of killing it as stuck.
    progress: Callable[[str, int, int], None] | None = None

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        *,
        policy: Policy,
        threads: int | None = None,
        start_thread: bool = True,
        kv_budget_bytes: int | None = None,
        passes: Callable[[Counters], PassRunner] | None = None,
    ):
        if target.template is None:
            raise FimbleError(f"model {target.name} has no fill-in-the-middle tokens; pass a template name")
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise FimbleError(f"draft {draft.name} and target {target.name} do not share a tokenizer")
        self.target, self.draft, self.policy = target, draft, policy
        self.started_at = time.monotonic()
        self.max_active, self.prefill_chunk = policy.max_active, policy.prefill_chunk
        self.stream_interval = policy.stream_interval
        self._threads = threads
        self.counts = Counters(COUNTER_NAMES + SCHED_COUNTERS)
        device = target.runtime.device
        self.store = KVStore(
            target.runtime,
            draft.runtime if draft else None,
            target.max_len,
            kv_budget_bytes or default_budget_bytes(device),
        )
        self.documents = DocumentPrompts(
            target,
            self.store,
            self.counts,
            anchored=policy.anchored and env_settings.read("FIMBLE_ANCHORED_LAYOUT"),
            cold=policy.cold and env_settings.read("FIMBLE_COLD_WINDOW"),
        )
        self.prompts = self.documents.prompts
        self.background = Background(
            self.documents, draft.runtime if draft else None, self.counts, self._completion_waiting
        )
        self.passes = (
            passes or (lambda c: PassRunner(target.runtime, draft.runtime if draft else None, c, batched=False))
        )(self.counts)
        self.drafter_set = Drafters(draft, policy.session_drafters)
        self._unfit = None
        if policy.refuse_unfit:
            from engine.serve import prompt_bound

            self._unfit = prompt_bound.UnfitCheck(target, self.prompts)
        _ = target.token_index  # build it now, not on the first keystroke
        rate = _measured_prefill_rate(target, draft)
        if rate > 0:
            self.documents.prefill_rate = rate
        self._ids = itertools.count(1)
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0  # completions submitted and not yet started
        self._arrivals = itertools.count()
        self.rounds = rounds_for(self.passes, self.counts, policy.overlap, policy.error_detail)
        self._held: list[tuple[int, CompletionRequest, CompletionStream]] = []  # (arrival, ...): not yet admitted
        self._forgets: list[tuple[int, str]] = []  # forgets not done yet: their document is in use, or queued
        # Prompts built ahead for held requests whose document is busy (id(request) -> PromptPlan): built while a
        # round's pass runs, so the request is admitted the moment its document is free (_admit(ready_only)).
        self._plans: dict[int, tuple[CompletionRequest, object]] = {}
        self._publish_kv()
        # On CPU, torch runs small matmuls about 2x slower outside the main thread (its OpenMP team there sleeps
        # between ops). Latency-critical hosts therefore run the engine in its own process and call
        # serve_forever() from that main thread.
        self._worker: threading.Thread | None = None
        if start_thread:
            self._worker = threading.Thread(target=self._run, name="fimble-engine", daemon=True)
            self._worker.start()

    # -- the Engine API (engine/api.py) --------------------------------------------------------
    def submit(self, request: CompletionRequest, on_delta=None) -> CompletionStream:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        stream = CompletionStream(next(self._ids), loop, on_delta)
        self.counts.add("submitted")
        with self._lock:
            self._waiting += 1
        self.background.note_submit(request)
        self._queue.put((request, stream))
        return stream

    def prewarm(self, request: CompletionRequest) -> None:
        """Fill the document's cache for this prompt in the background; completions go first."""
        self.background.want(request)
        self._queue.put(_WAKE)

    def forget(self, document_id: str) -> None:
        """Drop a document's caches (it was closed)."""
        self.background.note_message()
        self._queue.put(("forget", document_id))

    def complete(self, request: CompletionRequest) -> CompletionResult:
        """Blocking convenience: run a request to the end (call from outside an event loop); without a worker
        thread it runs right here, in the caller's thread."""
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
            self._take(block=False)
            self._admit()
            if not self.rounds.active:
                break
            self._round()
        if idle:
            self.background.take_due_reanchors(idle=True)
        # (a window that has closed leaves the pre-warms queued for a later call, as the worker would)
        while self.background.window_left() > 0 and self.background.run_next() is not None:
            self._publish_kv()

    def info(self) -> dict:
        return describe(self.target, self.draft, self.store.budget)

    def counters(self) -> dict:
        return self.counts.snapshot()

    def close(self) -> None:
        self._queue.put(None)
        if self._worker is not None:
            self._worker.join(timeout=5)

    def serve_forever(self) -> None:
        """Run requests in the calling thread until close()."""
        self._run()

    def build_prompt(self, request: CompletionRequest) -> tuple[list[int], str, bool]:
        """Token ids of the FIM prompt and its healing (engine/caching/prompt_plan.py, engine/decoding/healing.py)."""
        plan = self.prompts.build(request)
        return plan.ids, plan.heal, plan.constrained

    def active_documents(self) -> list[str]:
        """Document keys of the requests running now (for tests and the daemon's counters)."""
        return self.rounds.keys()

    # -- what engine/steps.py asks of its scheduler ------------------------------------------------
    def built_ahead(self, request: CompletionRequest):
        """The plan built ahead for ``request`` (removed), or None. The request is kept with it: an id alone could
        name a later request once this one is gone."""
        entry = self._plans.pop(id(request), None)
        return entry[1] if entry is not None and entry[0] is request else None

    def refuse_unfit(self, request: CompletionRequest) -> None:
        """PromptError if the prompt cannot fit the context, found cheaply (engine/serve/prompt_bound.py)."""
        reason = self._unfit.reason(request) if self._unfit is not None else None
        if reason is not None:
            self.counts.add("sched_refused_unfit")
            raise PromptError(reason)

    def drafters(self, request: CompletionRequest) -> tuple[ModelDrafter | None, NgramDrafter]:
        """The request's draft-model drafter and n-gram drafter."""
        return self.drafter_set.for_request(request)

    @property
    def overlap(self) -> bool:
        """Whether requests stream and are admitted while a round's passes run (engine/rounds.py)."""
        return self.rounds.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.rounds.overlap = on

    def finish(self, stream: CompletionStream, text: str, reason: str, tokens: int, stats: dict) -> None:
        self.counts.add("cancelled" if reason == "cancelled" else "completed")
        stream.result = CompletionResult(text, reason, tokens, stats)
        stream.push(Delta("", True, reason))

    # -- the worker loop ------------------------------------------------------------------------
    def _run(self) -> None:
        self.background.windowed = self.policy.background_window
        torch = sys.modules.get("torch")  # loaded by a torch runtime; the ggml runtime's path never imports it
        if self._threads and torch is not None:
            torch.set_num_threads(self._threads)
        while True:
            idle = not self.rounds.active and not self._held and not self._forgets
            # Idle with pre-warms pending (in the background window): run one, then look at the queue again.
            # Else wait for a message, or until the first re-anchor is due.
            busy = self.background.pending and self.background.window_left() > 0
            if not self._take(block=idle and not busy, timeout=self.background.reanchor_wait()):
                break  # close()
            if not self.rounds.active or not self.overlap:  # with overlap, requests arriving while sequences run are
                self._admit()  # admitted during a round's pass (_round)
            if self.rounds.active:
                self._round()
            elif not self._held:
                if busy:
                    self.background.run_next()
                    self._publish_kv()
                else:
                    self.background.take_due_reanchors()

    def _take(self, block: bool, timeout: float | None = None) -> bool:
        """Move queued items in; False once close() was called."""
        while True:
            try:
                item = self._queue.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return True
            block = False
            if item is None:
                self.rounds.cancel_all()
                for _, _, stream in self._held:
                    stream.push(Delta("", True, "cancelled"))
                self._plans.clear()
                return False
            if item is _WAKE:
                continue
            if item[0] == "forget":
                self._forgets.append((next(self._arrivals), item[1]))
            else:
                self._held.append((next(self._arrivals), *item))

    def _admit(self, ready_only: bool = False) -> None:
        """Start held requests whose document is free (up to ``max_active``); answer cancelled ones. A held request
        whose document is busy (its previous completion has not seen the cancel yet) gets its prompt built now.

        ``ready_only``: only requests whose prompt is built already (cheap: no tokenising), for the end of a round,
        where the ones just freed by a cancelled sequence can join the next round's pass instead of the one after."""
        busy = set(self.rounds.keys())
        if self._forgets:  # a forget waits for its document's running request and the ones queued before it
            first_held = {}
            for arrival, request, _ in self._held:
                first_held.setdefault(request.document_id or "", arrival)
            for entry in list(self._forgets):
                arrival, doc_id = entry
                if doc_id not in busy and first_held.get(doc_id, arrival) >= arrival:
                    self._forgets.remove(entry)
                    for key in self.background.forget(doc_id):
                        self.store.forget(key)
                    self._publish_kv()
        keep, started = [], False
        for arrival, request, stream in self._held:
            key, built = request.document_id or "", id(request) in self._plans
            if stream.cancelled:  # cancelled while waiting: answer now, without a pass
                self.built_ahead(request)
                with self._lock:
                    self._waiting -= 1
                self.finish(stream, "", "cancelled", 0, {"queue_ms": 0.0})
            elif key in busy or len(self.rounds.active) >= self.max_active or (ready_only and not built):
                if not ready_only and key in busy and not built:
                    self._build_ahead(request)
                keep.append((arrival, request, stream))
            elif any(d == key and a < arrival for a, d in self._forgets):
                keep.append((arrival, request, stream))  # its document's forget goes first
            else:
                with self._lock:
                    self._waiting -= 1
                busy.add(key)
                self.counts.add("sched_admitted")
                if ready_only:
                    self.counts.add("sched_admitted_early")
                self.rounds.start(request, stream, request_steps(self, request, stream), key)
                started = True
        self._held = keep
        if started and self.max_active == 1 and not self.rounds.active:  # (it ended at once: refused, cancelled)
            self._publish_kv()
        self._gauges()

    def _build_ahead(self, request: CompletionRequest) -> None:
        try:
            self.refuse_unfit(request)
            self._plans[id(request)] = (request, self.prompts.build(request))
            self.counts.add("sched_prebuilt")
        except Exception:  # the request's own error is raised (and answered) when it is admitted
            pass

    def _round(self) -> None:
        ended = self.rounds.run(self._admit)
        if ended and self._plans:  # a keystroke's new request, waiting for its cancelled predecessor: in now
            self._admit(ready_only=True)
        if ended or self.max_active > 1:  # (one request's cache figures change only when it ends)
            self._publish_kv()
        self._gauges()

    def _gauges(self) -> None:
        self.counts.set(sched_active=len(self.rounds.active), sched_waiting=len(self._held))

    def _completion_waiting(self) -> bool:
        with self._lock:
            return self._waiting > 0

    def _publish_kv(self) -> None:  # the store's figures, for counters() (other threads call it while we run)
        self.counts.publish(self.store.summary())


def describe(target: LoadedModel, draft: LoadedModel | None, kv_budget_bytes: int) -> dict:
    """What ``Engine.info`` says of the models an engine runs."""
    return {
        "model": target.name,
        "backend": target.backend,
        "template": target.template.name if target.template else None,
        "draft": draft.name if draft else None,
        "context": target.max_len,
        "vocab": target.vocab_size,
        "kv_budget_bytes": kv_budget_bytes,
    }


def _measured_prefill_rate(target: LoadedModel, draft: LoadedModel | None) -> float:
    """Run the verify-cost probes now (engine/decoding/spec_policy.py; cached on disk per build, model file and
    threads), not on the first completion: timing ~15 passes costs 5-6 s for a 0.5B model on a 2-core CPU.
    Returns the target's prefill rate in tokens a second (0: not measured)."""
    if not target.runtime.cost_aware_drafting:
        return 0.0
    costs = verify_costs(target.runtime)
    if draft is not None:
        verify_costs(draft.runtime)
    return costs.prefill_rate


class Drafters:
    """The drafters a request decodes with: the draft model's and prompt lookup's (engine/decoding/drafters.py).

    Prompt lookup remembers recent completions; with ``per_session`` one n-gram drafter per client session, so
    one user's completions never shape (nor, by acceptance, time) another's drafts."""

    def __init__(self, draft: LoadedModel | None, per_session: bool):
        self.draft, self.per_session = draft, per_session
        self.model = ModelDrafter(draft.runtime, 0) if draft else None
        self.ngram = NgramDrafter()
        self.sessions = SessionNgrams(MAX_SESSIONS_REMEMBERED)
        self.acceptance = AcceptanceBook(MAX_SESSIONS_REMEMBERED)

    def acceptance_for(self, request: CompletionRequest) -> dict[str, Acceptance] | None:
        """The drafters' running acceptance for the request's document and syntax context, updated in place; None
        (the prior) for a seeded sampled request: the draft lengths decide which random numbers its speculative
        sampling draws, and the same seed must give the same text whatever came before."""
        opt = request.options
        if opt.temperature > 0 and opt.seed is not None:
            return None
        return self.acceptance.get(request.document_id or "", opt.context)

    def for_request(self, request: CompletionRequest) -> tuple[ModelDrafter | None, NgramDrafter]:
        if not self.per_session:
            return self.model, self.ngram
        model = ModelDrafter(self.draft.runtime, 0) if self.draft is not None else None
        return model, self.sessions.get(session_of(request.document_id or ""))
