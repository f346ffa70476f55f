"""A sub-vocabulary drafter on the ggml runtime, called with the target's token ids and answering over its vocabulary.

The drafter's GGUF has K rows (engine/runtimes/draft_vocab.py); the engine speaks only target ids. So every
pass maps its ids to drafter indices first (the target's tokens outside the map become index 0, "any other
token"), and each logit row comes back target-wide: -inf everywhere but at the mapped target ids, so the drafter
never proposes index 0 nor a token it has no row for. The mapping sits in ``numpy_logits`` itself, not in a
wrapper: ``GGMLCache.copy_prefix_from`` (a document's cache re-prefilled) and ``__call__`` both call it on the
runtime the cache holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.runtimes.ggml_runtime import GGMLCache, GGMLRuntime, _check_probe, cached_gguf
from engine.runtimes.model_config import CompactConfig

# A drafter's weights in q8_0 whatever FIMBLE_QUANT says: its precision moves only how many drafts are accepted,
# never the output (the target verifies every token), and q8_0 passes are the fastest on llama.cpp's CPU kernels.
DRAFT_QTYPE = "q8_0"


class MappedGGMLRuntime(GGMLRuntime):
    """A GGMLRuntime whose ``numpy_logits`` takes and gives target-vocabulary ids; ``vocab`` stays the drafter's
    own size (its load-time probes call llama.cpp directly with drafter indices)."""

    def __init__(
        self,
        path: Path,
        cfg: CompactConfig,
        token_map: np.ndarray,
        target_vocab: int,
        threads: int | None = None,
        loaded: tuple[object, bool] | None = None,
    ):
        """``token_map``: draft_vocab.read_token_map's array (entry d: the target id of drafter index d, entry 0
        -1); ``target_vocab``: the width of the target's logit rows."""
        self.target_vocab = int(target_vocab)
        self.target_ids = np.ascontiguousarray(token_map[1:], dtype=np.int64)  # target id of drafter index 1..
        self.finite_columns = self.target_ids  # (GGMLRuntime.finite_columns)
        self.to_draft = np.zeros(self.target_vocab, dtype=np.int32)  # target id -> drafter index, unknown: 0
        self.to_draft[self.target_ids] = np.arange(1, len(token_map), dtype=np.int32)
        super().__init__(path, cfg, threads, loaded)
        if self.vocab != len(token_map):
            raise ValueError(f"{path.name}: {self.vocab} logit rows, but a token map of {len(token_map)}")

    def numpy_logits(
        self, ids: list[int], cache: GGMLCache, start: int | None = None, num_logits: int = 1
    ) -> np.ndarray:
        """The parent's pass on the ids' drafter indices; float32 rows [n, target_vocab]."""
        local = self.to_draft[np.asarray(ids, dtype=np.int64)].tolist()
        rows = super().numpy_logits(local, cache, start, num_logits)
        out = np.full((rows.shape[0], self.target_vocab), -np.inf, dtype=np.float32)
        out[:, self.target_ids] = rows[:, 1:]  # column 0 ("any other token") is never a proposal
        return out


def mapped_draft_runtime(folder: Path, cfg: dict, token_map: np.ndarray, target_vocab: int) -> MappedGGMLRuntime:
    """The drafter folder (its tokenizer files written: draft_vocab.write_draft_tokenizer) exported once to a
    cached GGUF, loaded and probed as ggml_runtime.folder_runtime does."""
    runtime = MappedGGMLRuntime(
        cached_gguf(folder, DRAFT_QTYPE), CompactConfig.from_hf_dict(cfg), token_map, target_vocab
    )
    _check_probe(runtime, folder)
    return runtime


__all__ = ["DRAFT_QTYPE", "MappedGGMLRuntime", "mapped_draft_runtime"]
