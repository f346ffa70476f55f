"""Drafters propose the next few tokens; the target model verifies them in one pass.

- ``ModelDrafter``: a small model with its own position-addressed KV cache.
- ``NgramDrafter``: prompt lookup. Finds the latest earlier occurrence of the
  last n tokens in the prompt (prefix and suffix), the text generated so far and
  recent completions, and proposes what followed it. No model, no cost.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.caching.kv_store import common_prefix
from engine.decoding.sampling import distribution

if TYPE_CHECKING:  # a draft model runs on torch; the n-gram drafter (the ggml path's) needs none
    import torch
    from torch import Tensor


@dataclass
class Draft:
    tokens: list[int]
    # Per-token proposal distributions [k, V] for sampled drafts; None when deterministic.
    probs: Tensor | None = None
    # An n-gram draft's match: how many context tokens its lookup matched (0 for other drafts).
    match: int = 0


class ModelDrafter:
    """Autoregressive drafting with a small model; stops early below a confidence gate."""

    name = "model"

    def __init__(self, runtime, max_len: int):
        self.runtime = runtime
        self.cache = runtime.new_cache(max_len) if max_len else None
        self.ids: list[int] = []  # tokens whose keys/values sit in self.cache, in order

    def bind(self, cache, ids: list[int]) -> None:
        """Draft into ``cache`` (a document's own draft cache), which holds ``ids``."""
        self.cache, self.ids = cache, ids

    def reset(self) -> None:
        self.cache.rollback(0)
        self.ids = []

    def missing(self, context: list[int]) -> int:
        """Tokens of ``context`` its cache lacks: what the next draft would prefill first."""
        return len(context) - common_prefix(self.ids, context, len(context))

    def _sync(self, context: list[int], numpy: bool = False) -> Tensor | np.ndarray:
        """Make the cache hold ``context``; return the logits after its last token (a numpy row with ``numpy``,
        through the runtime's ``numpy_logits``: no torch call)."""
        common = common_prefix(self.ids, context, len(context) - 1)  # always re-run at least the last token
        self.cache.rollback(common)
        if numpy:
            logits = self.runtime.numpy_logits(list(context[common:]), self.cache, common, 1)[-1]
        else:
            import torch

            new = torch.tensor(context[common:], dtype=torch.long, device=self.runtime.device)
            logits = self.runtime(new, self.cache, common, 1)[-1]
        self.ids = list(context)
        return logits

    def propose(
        self, context: list[int], k: int, temperature: float, top_p: float, gate: float, gen: torch.Generator | None
    ) -> Draft:
        if temperature <= 0 and self.runtime.greedy_drafts:
            # CUDA graphs (engine/runtimes/cuda_graphs.py): the same greedy draft with one host sync, not one per token.
            tokens, self.ids = self.runtime.propose_greedy(self.cache, self.ids, context, k, gate)
            return Draft(tokens)
        if temperature <= 0 and self.runtime.numpy_rows:
            return self._propose_numpy(context, k, gate)
        import torch

        logits = self._sync(context)
        tokens: list[int] = []
        probs: list[Tensor] = []
        greedy = temperature <= 0
        for i in range(k):
            if greedy:
                conf = torch.softmax(logits, -1)
                tok = int(conf.argmax())
                if i > 0 and float(conf[tok]) < gate:
                    break
            else:
                q = distribution(logits, temperature, top_p)
                tok = int(torch.multinomial(q, 1, generator=gen).item())
                if i > 0 and float(q.max()) < gate:
                    break
                probs.append(q)
            tokens.append(tok)
            if i + 1 < k:
                logits = self.runtime(torch.tensor([tok], device=self.runtime.device), self.cache, None, 1)[-1]
                self.ids.append(tok)
        return Draft(tokens, torch.stack(probs) if probs else None)

    def _propose_numpy(self, context: list[int], k: int, gate: float) -> Draft:
        """The greedy draft on numpy rows (the ggml runtime): the torch path's choices (argmax; after the first
        token, stop below the gate) without importing torch, a 2 s import the ggml engine otherwise never pays."""
        row = self._sync(context, numpy=True)
        # A sub-vocabulary drafter's rows are -inf outside these columns (engine/runtimes/mapped_runtime.py):
        # choosing among them alone is the same choice, at ~2k entries instead of a 152k-entry softmax (0.3 ms).
        columns: np.ndarray | None = self.runtime.finite_columns
        tokens: list[int] = []
        for i in range(k):
            tok, conf = _greedy_choice(row if columns is None else row[columns])
            tok = tok if columns is None else int(columns[tok])
            if i > 0 and conf < gate:
                break
            tokens.append(tok)
            if i + 1 < k:
                row = self.runtime.numpy_logits([tok], self.cache, None, 1)[-1]
                self.ids.append(tok)
        return Draft(tokens)


def _greedy_choice(row: np.ndarray) -> tuple[int, float]:
    """(argmax, its softmax probability) of one logit row; -inf entries (a sub-vocabulary drafter's) weigh 0."""
    tok = int(row.argmax())
    top = row[tok]
    # exp(row - top) <= 1 everywhere, so the sum cannot overflow; the top's own term is exactly 1.
    return tok, float(1.0 / np.exp(row - top).sum())


class NgramDrafter:
    """Prompt-lookup drafting over the context and recent completions.

    Token sequences are searched as int32 byte strings with ``bytes.rfind``: a scan
    in C over a few thousand tokens takes microseconds, with no index to build.
    The remembered completions are one byte string, each followed by a separator token (-1, never an id),
    so each n-gram length costs two scans, not one per completion (fimble serve calls this for every
    sequence every round). The context's bytes are extended as the caller's token list grows.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, history: int = 16):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.recent: deque[bytes] = deque(maxlen=history)
        self._joined = b""  # the recent completions, oldest first, each followed by _SEPARATOR
        self._joined_from: tuple[bytes, ...] = ()  # the completions _joined was made of
        self._ctx: list[int] | None = None  # the list the cached bytes were made from
        self._ctx_len = 0
        self._ctx_buf = bytearray()

    def reset(self) -> None:
        pass  # stateless between calls apart from the remembered completions

    def remember(self, completion: list[int]) -> None:
        """Keep a finished completion to draft from in later requests."""
        if completion:
            self.recent.append(array("i", completion).tobytes())

    def _remembered(self) -> bytes:
        # Made again whenever ``recent`` changed, by remember() or by a caller that cleared it (tests do).
        # Comparing the tuples compares 16 references at most: bytes compare equal to themselves at once.
        recent = tuple(self.recent)
        if recent != self._joined_from:
            self._joined_from = recent
            self._joined = b"".join(past + _SEPARATOR for past in recent)
        return self._joined

    def _context_bytes(self, context: list[int]) -> bytearray:
        # A decoder's ids only ever grow, so the bytes of the same list are extended, not rebuilt. (Were the list
        # edited in place, drafts would be worse, never the output: every draft is verified by the target.)
        if context is self._ctx and len(context) >= self._ctx_len:
            if len(context) > self._ctx_len:  # a bytearray grows in place (bytes += copied all of it each call)
                self._ctx_buf += array("i", context[self._ctx_len :]).tobytes()
        else:
            self._ctx_buf = bytearray(array("i", context).tobytes())
        self._ctx, self._ctx_len = context, len(context)
        return self._ctx_buf

    def propose(
        self,
        context: list[int],
        k: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        gate: float = 0.0,
        gen: torch.Generator | None = None,
    ) -> Draft:
        buf = self._context_bytes(context)
        joined = self._remembered()
        # Every n-gram tried ends in the last token: where that token occurs nowhere before (most calls once the
        # text is new), no n-gram does, and two scans answer instead of two per length.
        last = buf[-4:]
        in_context = _rfind_aligned(buf, last, len(buf) - 4) is not None
        if last and not in_context and _rfind_aligned(joined, last, len(joined)) is None:
            return Draft([])
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            pattern = buf[-4 * n :]
            # An occurrence must end before the last token, so that something follows it.
            found = _rfind_aligned(buf, pattern, 4 * (len(context) - 1))
            if found is not None:
                return Draft(_tokens(buf, found + 4 * n, k), match=n)
            # The newest remembered completion holding it, where a token (not the separator) follows it.
            end = len(joined)
            while (found := _rfind_aligned(joined, pattern, end)) is not None:
                after = found + 4 * n
                if joined[after : after + 4] != _SEPARATOR:
                    return Draft(_tokens(joined, after, k), match=n)
                end = after - 4  # ends a completion: look further left
        return Draft([])


_SEPARATOR = array("i", [-1]).tobytes()


def _rfind_aligned(buf: bytes, pattern: bytes, end: int) -> int | None:
    """Byte offset of the last token-aligned occurrence of ``pattern`` ending at or before ``end``."""
    pos = buf.rfind(pattern, 0, end)
    while pos > 0 and pos % 4:
        pos = buf.rfind(pattern, 0, pos + len(pattern) - 1)
    return pos if pos >= 0 and pos % 4 == 0 else None


def _tokens(buf: bytes, offset: int, k: int) -> list[int]:
    tokens = array("i", buf[offset : offset + 4 * k]).tolist()
    return tokens[: tokens.index(-1)] if -1 in tokens else tokens  # a remembered completion ends at its separator


class SessionNgrams:
    """One n-gram drafter per client session, the least recently used dropped beyond ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self._drafters: OrderedDict[str, NgramDrafter] = OrderedDict()

    def get(self, session: str) -> NgramDrafter:
        drafter = self._drafters.pop(session, None) or NgramDrafter()
        self._drafters[session] = drafter  # most recently used last
        while len(self._drafters) > self.limit:
            self._drafters.popitem(last=False)
        return drafter
