"""Step-level scheduling for the shared engine (``fimble serve``): every active request advances one pass a round.

``ServeEngine`` is the scheduler of engine/scheduler.py (the same one ``fimble lsp``'s engine is, with one active
request) configured to run up to ``max_active`` requests at once. Each request is engine/steps.py's generator;
a round collects one pass from every active request and runs them together:

- batched (``batch=True``, the compact runtime): one forward for all of them
  (engine/serve/batched.py), each sequence with its own cache and cache length;
- round-robin (``batch=False``, or a transformers runtime): one after another.

On CUDA the compact runtime sits under a ``GraphRuntime`` (engine/runtimes/cuda_graphs.py). There the
rounds are slotted (engine/serve/slot_passes.py): running sequences' target caches live in slots of one
batched cache and a round's short passes replay one captured graph. ``FIMBLE_SERVE_SLOTS=0`` turns that off.
Draft-model passes run eagerly (batched).

Each sequence drafts into its own draft cache (its own ``ModelDrafter``); greedy model drafts of
all sequences run together too, token i of every draft in one draft-model pass
(``batched_greedy_drafts``: 1.33x tok/s at 16 sequences decoding on the 2-core CPU, measured).
Prompt lookup keeps one n-gram drafter per client session.

Fairness: a new request is admitted at the next round and prefills ``PREFILL_CHUNK`` tokens
per round alongside the others' steps, so neither a long completion nor a long prompt holds
back another editor's first token for more than a round.
"""

from __future__ import annotations

import os
import threading

from engine import env_settings
from engine.loader import LoadedModel
from engine.runner import PassRunner
from engine.scheduler import SCHED_COUNTERS, Policy, Scheduler
from engine.serve import gc_pauses
from engine.serve.batched import supports_batch
from engine.serve.prompt_memo import IncrementalPromptBuilder
from engine.steps import AWAIT, STREAM_NOW

__all__ = [
    "AWAIT",
    "MAX_ACTIVE",
    "PREFILL_CHUNK",
    "SCHED_COUNTERS",
    "SLOT_LEN",
    "STREAM_INTERVAL_S",
    "STREAM_NOW",
    "ServeEngine",
    "open_serve_engine",
    "use_serve_kernels",
]

MAX_ACTIVE = 64  # sequences stepped together; more wait their turn
# Prompt tokens a sequence prefills per round. A new request's prompt (often 1,000+ tokens on its
# first keystroke in a file) then costs the others' step at most this many rows per round.
PREFILL_CHUNK = 128
SLOT_LEN = 4096  # positions per slot of the slotted (CUDA graph) rounds; longer documents run eagerly
# After a completion's first text, deltas go out at most this often (engine/steps.py TextOut): ~80 a second, more
# than an editor redraws ghost text, against one per round (400+ a second for one editor on the H200).
STREAM_INTERVAL_S = 0.012


class ServeEngine(Scheduler):
    """The scheduler stepping up to ``max_active`` requests together (see the module docstring)."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        *,
        batch: bool = True,
        max_active: int = MAX_ACTIVE,
        slots: bool | None = None,
        slot_len: int | None = None,
        overlap: bool | None = None,
        threads: int | None = None,
        kv_budget_bytes: int | None = None,
    ):
        batched = batch and supports_batch(target.runtime)
        # Slotted rounds (CUDA): each running sequence's target cache lives in a slot of one BatchedCache and
        # a round's short passes (steps, verify blocks, short prefill chunks) replay one captured batched
        # graph. ``slots``: None = on CUDA with graphs when batching (FIMBLE_SERVE_SLOTS=0 turns it off); True
        # forces it (the CPU runs it without graphs: tests).
        graphs = target.runtime.greedy_drafts
        if slots is None:
            slots = batched and graphs and env_settings.read("FIMBLE_SERVE_SLOTS")
        slotted = bool(slots and batched)
        draft_runtime = draft.runtime if draft is not None else None

        def passes(counts) -> PassRunner:
            if not slotted:
                return PassRunner(target.runtime, draft_runtime, counts, batched=batched)
            from engine.serve.slot_passes import SlottedPasses

            length = slot_len or min(target.max_len, SLOT_LEN)
            return SlottedPasses(target.runtime, draft_runtime, counts, max_active, length)

        # Overlap: a round's host work (streaming text, admitting requests) runs while its passes do. Only graph
        # rounds run asynchronously (CUDA); elsewhere a pass has finished when the launch returns, so overlap
        # would only hold each delta back a round. FIMBLE_SERVE_OVERLAP=0 turns it off on CUDA too: on the H200
        # at 32 editors it doubled tok/s (2,504 -> 5,279) while p95 first delta grew (92 -> 342 ms); whether
        # overlap (the decode loop keeping the interpreter through the GPU wait) caused the tail is not measured
        # yet, and this switch is there to measure it.
        policy = Policy(
            max_active=max_active,
            prefill_chunk=PREFILL_CHUNK,
            stream_interval=STREAM_INTERVAL_S,
            overlap=False,
            session_drafters=True,
            background_window=False,
            anchored=False,
            cold=False,
            refuse_unfit=True,
            error_detail=False,
        )
        # (the daemon runs serve_forever() in its main thread: CPU speed)
        super().__init__(
            target,
            draft,
            policy=policy,
            threads=threads,
            start_thread=False,
            kv_budget_bytes=kv_budget_bytes,
            passes=passes,
        )
        if overlap is None:
            asynchronous = self.slots is not None and self.slots.use_graphs
            overlap = asynchronous and env_settings.read("FIMBLE_SERVE_OVERLAP")
        self.overlap = overlap
        self.batched = batched
        # A keystroke's prompt from the editor's previous one (engine/serve/prompt_memo.py): 32 editors' keystrokes
        # come in one round, and each build held every running sequence back.
        # FIMBLE_SERVE_PROMPT_MEMO=0: PromptBuilder's own build, to compare.
        if env_settings.read("FIMBLE_SERVE_PROMPT_MEMO"):
            self.documents.prompts = self.prompts = IncrementalPromptBuilder(target)
            if self._unfit is not None:
                self._unfit.prompts = self.prompts
        self._gc = gc_pauses.pauses()
        # Healing's prefix search scans every token text until its index is sorted (engine/decoding/healing.py):
        # under fimble serve that scan ran at every keystroke's admission, in the round every other sequence waits
        # on (H200, 32 editors, 8,192-token vocabulary: 968 scans, 2.4 s of a profiled 12 s; Qwen's is 18x larger).
        # So a serving engine sorts it now, at start, before the collector freezes start-up's objects.
        target.token_index.build()  # sorted before serving

    @property
    def slots(self):
        """The SlotGraphs of slotted rounds (None without)."""
        return self.passes.slots

    @slots.setter
    def slots(self, slots) -> None:
        """Another SlotGraphs for the slotted rounds (bench/serve_host.py: one whose device step is simulated)."""
        self.passes.slots = slots

    def serve_forever(self) -> None:
        """Run requests in the calling thread until close(). In a serving process (the decode loop in its main
        thread: fimble serve's engine child or its in-process daemon) start-up's objects are frozen first, so the
        garbage collector's full collections under traffic walk only what serving made (engine/serve/gc_pauses.py);
        tests that run the loop in a thread of their own leave their process's collector alone."""
        if threading.current_thread() is threading.main_thread():
            gc_pauses.freeze_startup()
        super().serve_forever()

    def counters(self) -> dict:
        """The scheduler's counters and this process's garbage-collector pauses (``gc_*``)."""
        return {**super().counters(), **self._gc.snapshot("gc_")}

    def info(self) -> dict:
        return {
            **super().info(),
            "scheduler": ("batched-graphs" if self.slots is not None else "batched") if self.batched else "round-robin",
            "max_active": self.max_active,
        }

    def warm_graphs(self, announce=None) -> int:
        """Capture the slotted rounds' graphs before traffic (engine/serve/slot_passes.py); the number captured."""
        return self.passes.warm(announce) if self.slots is not None else 0


def use_serve_kernels() -> None:
    """The serve workload's GPU kernel set for this process and the children it starts (engine/runtimes/gpu_kernels.py
    ``invariant_default``), unless the user chose one: a serve process batches many streams a round, where the cuBLAS
    set is faster; one editor's engine keeps the Triton set, whose step is faster. Call it before the first CUDA pass,
    which fixes a model's set. (Ray replicas open their engines through ``open_serve_engine`` too.)"""
    from engine.runtimes.gpu_kernels import SERVE_SET

    os.environ.setdefault("FIMBLE_CUDA_INVARIANT", SERVE_SET)


def open_serve_engine(
    model: str | None = None,
    draft: str | None = None,
    *,
    device: str = "cpu",
    use_draft: bool = True,
    batch: bool = True,
    max_active: int = MAX_ACTIVE,
    kv_budget_bytes: int | None = None,
    threads: int | None = None,
) -> ServeEngine:
    """Load the models as ``engine.local.open_engine`` does, into a ServeEngine."""
    from engine.local import open_engine

    use_serve_kernels()  # before the first CUDA pass picks its kernel set

    # Step-level batching runs many sequences through one forward of the compact runtime; the ggml runtime
    # (the CPU default elsewhere) keeps one llama.cpp context per document and could only take turns. So a
    # batching engine loads compact unless FIMBLE_RUNTIME asks otherwise.
    runtime = None if (env_settings.given("FIMBLE_RUNTIME") or not batch) else "compact"
    loaded = open_engine(
        model,
        draft,
        device=device,
        use_draft=use_draft,
        start_thread=False,
        kv_budget_bytes=kv_budget_bytes,
        runtime=runtime,
    )
    return ServeEngine(
        loaded.target,
        loaded.draft,
        batch=batch,
        max_active=max_active,
        threads=threads,
        kv_budget_bytes=loaded.store.budget,
    )
