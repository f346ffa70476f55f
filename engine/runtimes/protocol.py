"""What the engine asks of a model runtime, and the capabilities each runtime class declares.

Runtimes: ``CompactTransformer`` (engine/runtimes/compact.py), ``GraphRuntime`` (cuda_graphs.py),
``GGMLRuntime`` (ggml_runtime.py) and ``HFModel`` (hf_backend.py). Each sets every capability below as a
class attribute; the engine reads them instead of probing for methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor


class Runtime(Protocol):
    # -- capabilities -----------------------------------------------------------------------------
    # ``numpy_logits(ids, cache, start, num_logits)``: host token ids in, numpy rows out, no torch call on the way;
    # greedy steps that need only each row's argmax use it (engine/decoding/speculative.py).
    numpy_rows: bool
    # ``propose_greedy(cache, ids, context, k, gate)``: a whole greedy draft with one host sync (CUDA graphs); a
    # lone sequence's pass also replays its own graph rather than the eager batched forward (engine/runner.py).
    greedy_drafts: bool
    # Time the verify passes once and draft only as many tokens as pay for their rows
    # (engine/decoding/spec_policy.py): where verify rows cost about a step each (q8_0 on llama.cpp).
    cost_aware_drafting: bool
    # ``inv_freq``: cached keys can be re-rotated to new positions (KV shift reuse, engine/caching/kv_shift.py),
    # and ``forward_at(tokens, positions, cache)`` computes scattered positions in one pass.
    shift_reuse: bool

    # -- the calls ---------------------------------------------------------------------------------
    device: Any

    def __call__(self, tokens: Tensor, cache: Any, start: int | None = None, num_logits: int = 1) -> Tensor:
        """Run ``tokens`` at positions ``start..`` into ``cache``; the logits of the last ``num_logits``."""
        ...

    def new_cache(self, max_len: int | None = None) -> Any: ...
