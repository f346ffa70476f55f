"""Run any other causal LM through transformers, behind the compact runtime's interface.

Same calls as ``CompactTransformer``: ``new_cache``, ``forward(tokens, cache, start,
num_logits)`` and ``cache.rollback(length)``. Rollback crops transformers' cache.
"""

from __future__ import annotations

import torch
from torch import Tensor


class HFCache:
    def __init__(self, max_len: int):
        from transformers import DynamicCache

        self.inner = DynamicCache()
        self.max_len = max_len
        self.length = 0

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}, cache holds {self.length}")
        if length < self.length:
            # A negative argument removes that many tokens in every transformers version (4.x took
            # a length and read negatives that way; 5.x takes only the count to remove).
            self.inner.crop(length - self.inner.get_seq_length())
        self.length = length

    def nbytes(self) -> int:
        return 0  # transformers grows this cache itself; not counted against fimble's budget


class HFModel:
    """Adapter over a transformers ``PreTrainedModel``."""

    # capabilities (engine/runtimes/protocol.py)
    numpy_rows = False
    greedy_drafts = False
    cost_aware_drafting = False
    shift_reuse = False

    def __init__(self, model, max_len: int):
        self.model = model.eval()
        self.max_len = max_len

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self, max_len: int | None = None) -> HFCache:
        return HFCache(max_len or self.max_len)

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, cache: HFCache, start: int | None = None, num_logits: int = 1) -> Tensor:
        start = cache.length if start is None else start
        if start < cache.length:
            cache.rollback(start)
        end = start + tokens.shape[0]
        if end > cache.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the context of {cache.max_len}")
        out = self.model(
            input_ids=tokens[None].to(self.device),
            past_key_values=cache.inner,
            use_cache=True,
            logits_to_keep=min(num_logits, tokens.shape[0]),
            cache_position=torch.arange(start, end, device=self.device),
        )
        cache.inner = out.past_key_values
        cache.length = end
        return out.logits[0].float()
