"""The in-process engine of ``fimble lsp``: the scheduler (engine/scheduler.py) with one active request.

One worker thread runs the model; callers only see the API in engine/api.py. Requests run one at a time in
arrival order, through the same request loop as fimble serve's batches (engine/steps.py). Cancellation is a
flag the request checks before every step and between prefill chunks, so a cancelled request stops within
one pass. Each document keeps its own KV caches (engine/caching/kv_store.py); when no completion is waiting,
the worker pre-warms documents the host named (``prewarm``), a chunk at a time (engine/background.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine import env_settings
from engine.background import BACKGROUND_S, PREWARM_CHUNK, REANCHOR_IDLE_S
from engine.documents import REUSE_MODES
from engine.errors import ModelLoadError
from engine.loader import LoadedModel, default_models, load_draft, load_model
from engine.model_info import QWEN_DRAFT_SHA256
from engine.runtimes.draft_vocab import check_weights, is_mapped_draft
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
log = logging.getLogger("fimble.local")


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
    """Load the target (default: the embedded model) and, where it shares the tokenizer, a draft: a folder with a
    token map is a sub-vocabulary drafter, run with the target's tokenizer (engine.loader.load_draft).

    ``FIMBLE_QUANT=int8`` loads both with int8 weights (CPU only; engine/runtimes/quant.py).
    ``runtime``: as engine.loader.load_model's (default ``$FIMBLE_RUNTIME``, else auto)."""
    quant = env_settings.read("FIMBLE_QUANT")
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
        # The Qwen default named by its path gets its drafter too (the embedded target named by path keeps
        # decoding without its draft, as callers of the embedded pair expect).
        is_default = model is None or (
            default_draft is not None
            and is_mapped_draft(default_draft)
            and Path(model).expanduser().resolve() == Path(default_target).resolve()
        )
        draft_path = draft or (default_draft if is_default else None)
        if draft is None and draft_path is not None and is_mapped_draft(draft_path) and target.backend != "ggml":
            # The default Qwen drafter runs on the ggml runtime only (engine.loader.load_draft): a target on
            # another one (fimble serve's batching, a GPU) decodes without it, as it did before it existed.
            log.info("fimble: not using the draft %s: it runs beside a ggml target only", draft_path)
            draft_path = None
        if draft_path is not None:
            try:
                if draft is None and is_mapped_draft(draft_path):  # the shipped drafter: its pinned digest
                    check_weights(Path(draft_path), QWEN_DRAFT_SHA256)
                draft_model = load_draft(
                    draft_path, target, device=device, trust_remote_code=trust_remote_code, quant=quant, runtime=runtime
                )
            except ModelLoadError as exc:
                if draft is not None:  # a draft the user named: its error is theirs to see
                    raise
                # The default drafter only speeds decoding up: without it the output is the same.
                log.warning("fimble: decoding without the default draft model: %s", exc)
    return LocalEngine(target, draft_model, start_thread=start_thread, kv_budget_bytes=kv_budget_bytes)
