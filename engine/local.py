"""The in-process engine of ``fimble lsp``: the scheduler (engine/scheduler.py) with one active request.

One worker thread runs the model; callers only see the API in engine/api.py. Requests run one at a time in
arrival order, through the same request loop as fimble serve's batches (engine/steps.py). Cancellation is a
flag the request checks before every step and between prefill chunks, so a cancelled request stops within
one pass. Each document keeps its own KV caches (engine/caching/kv_store.py); when no completion is waiting,
the worker pre-warms documents the host named (``prewarm``), a chunk at a time (engine/background.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.background import BACKGROUND_S, PREWARM_CHUNK, REANCHOR_IDLE_S
from engine.documents import REUSE_MODES
from engine.loader import LoadedModel, default_models, load_model
from engine.scheduler import COUNTER_NAMES, Policy, Scheduler

__all__ = [
    "BACKGROUND_S",
    "COMPLETION_PREFILL_CHUNK",
    "COUNTER_NAMES",
    "PREWARM_CHUNK",
    "REANCHOR_IDLE_S",
    "REUSE_MODES",
    "LocalEngine",
    "open_engine",
]

# A completion's prompt longer than engine/steps.py's PREFILL_TAIL is prefilled this many tokens a pass, and the
# prefill stops between passes once the request is cancelled (the user typed on): its prefix stays in the cache
# for the next keystroke's request, which shares it. Before, a cancelled request's prefill ran to its end
# (256-token passes, ~1.2 s on a 2-core CPU) while the request that replaced it waited.
COMPLETION_PREFILL_CHUNK = 64


class LocalEngine(Scheduler):
    """One request at a time, no batching, every delta streamed as it is decoded; background work in the
    window after the host's latest message."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        threads: int | None = None,
        start_thread: bool = True,
        kv_budget_bytes: int | None = None,
    ):
        super().__init__(
            target,
            draft,
            policy=Policy(max_active=1, prefill_chunk=COMPLETION_PREFILL_CHUNK),
            threads=threads,
            start_thread=start_thread,
            kv_budget_bytes=kv_budget_bytes,
        )


def open_engine(
    model: str | Path | None = None,
    draft: str | Path | None = None,
    *,
    device: str = "cpu",
    template: str | None = None,
    trust_remote_code: bool = False,
    use_draft: bool = True,
    start_thread: bool = True,
    kv_budget_bytes: int | None = None,
    runtime: str | None = None,
) -> LocalEngine:
    """Load the target (default: the embedded model) and, where it shares the tokenizer, a draft.

    ``FIMBLE_QUANT=int8`` loads both with int8 weights (CPU only; engine/runtimes/quant.py).
    ``runtime``: as engine.loader.load_model's (default ``$FIMBLE_RUNTIME``, else auto)."""
    quant = os.environ.get("FIMBLE_QUANT", "none")
    default_target, default_draft = default_models()  # engine/model_info.py: fimble-smollm2 once built
    target = load_model(
        model or default_target,
        device=device,
        template=template,
        trust_remote_code=trust_remote_code,
        quant=quant,
        runtime=runtime,
    )
    draft_model = None
    if use_draft:
        draft_path = draft or (default_draft if model is None else None)
        if draft_path is not None:
            draft_model = load_model(
                draft_path, device=device, trust_remote_code=trust_remote_code, quant=quant, runtime=runtime
            )
    return LocalEngine(target, draft_model, start_thread=start_thread, kv_budget_bytes=kv_budget_bytes)
