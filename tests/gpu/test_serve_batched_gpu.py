"""On a CUDA GPU: `fimble serve`'s batched scheduler against the unbatched engine, greedy, embedded pair.

On CUDA the scheduler runs a round of two or more sequences through the eager batched forward
(engine/serve/batched.py) on the model under the ``GraphRuntime``, and a lone sequence through its graph.
bf16 GEMMs pick kernels by row count, so a sequence's logits in a batch can differ in the last bf16
bit from the same sequence alone, and greedy outputs can then part at a near tie (as the graph path
does against eager: tests/gpu/test_graph_lossless.py). This test decodes N_PROMPTS requests all at once
through the batched scheduler, one at a time through the same scheduler, and through the plain
``LocalEngine`` (graphs), prints how many are identical, and asserts that none fails and that all of them are
identical with the batch-invariant kernels (the CUDA default, with its row limits: engine/runtimes/row_limits.py),
at least MIN_IDENTICAL of them with the old ones (FIMBLE_CUDA_INVARIANT=0 or FIMBLE_CUDA_ROW_LIMITS=0).
Skipped without CUDA (CI has none); run on the GPU machine with
``python3 -m pytest -s tests/gpu/test_serve_batched_gpu.py``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = Path(__file__).resolve().parents[2]
N_PROMPTS = 32
MAX_TOKENS = 32
MIN_IDENTICAL = 0.8


def test_batched_scheduler_on_cuda_matches_unbatched():
    from bench.harness.prompts import fim_prompts
    from engine.api import CompletionRequest, DecodeOptions
    from engine.local import open_engine
    from engine.serve.scheduler import ServeEngine

    plain = open_engine(REPO / "models" / "fimble-target", REPO / "models" / "fimble-draft", device="cuda")
    try:

        def requests() -> list[CompletionRequest]:
            return [
                CompletionRequest(p, s, options=DecodeOptions(max_tokens=MAX_TOKENS), document_id=f"doc{i}")
                for i, (p, s) in enumerate(fim_prompts(N_PROMPTS, seed=3))
            ]

        expected = [plain.complete(r) for r in requests()]
        engine = ServeEngine(plain.target, plain.draft, batch=True)
        thread = threading.Thread(target=engine.serve_forever, daemon=True)
        thread.start()
        try:
            streams = [engine.submit(r) for r in requests()]
            together = [s.collect() for s in streams]
            counters = engine.counters()
            alone = [engine.submit(r).collect() for r in requests()]
        finally:
            engine.close()
            thread.join(10)
    finally:
        plain.close()
    assert all(e.finish_reason != "error" for e in expected)
    ref = [e.text for e in expected]
    same_together = sum(a == b for a, b in zip(together, ref, strict=True))
    same_alone = sum(a == b for a, b in zip(alone, ref, strict=True))
    same_pair = sum(a == b for a, b in zip(together, alone, strict=True))
    print(
        f"\nserve batched on CUDA, {N_PROMPTS} prompts x {MAX_TOKENS} tokens: batched-together == unbatched "
        f"{same_together}/{N_PROMPTS}, scheduler-alone == unbatched {same_alone}/{N_PROMPTS}, "
        f"together == alone {same_pair}/{N_PROMPTS}; max batch {counters['sched_max_batch']}, "
        f"rounds {counters['sched_rounds']}, rows {counters['sched_batched_rows']}, failed {counters.get('failed')}"
    )
    assert counters["sched_max_batch"] > 1 and not counters.get("failed")
    if _invariant(getattr(plain.target.runtime, "attention", None)):  # bit-identical rows for any batch
        assert same_together == same_alone == same_pair == N_PROMPTS
    assert same_together >= MIN_IDENTICAL * N_PROMPTS


def _invariant(kernels: str | None) -> bool:
    """Whether a batched round's rows are each sequence's bits alone: the Triton set by construction, the default
    (cuBLAS on 16-row passes) with its row limits on."""
    from engine.runtimes import row_limits
    from engine.runtimes.gpu_kernels import INVARIANT_SETS

    return kernels == "invariant" or (kernels in INVARIANT_SETS and row_limits.enabled())
