"""What a running request asks of whoever runs its passes (engine/scheduler.py), as plain records.

A request is a generator (engine/steps.py) that yields a ``Forward`` (a target pass: its prefill chunks,
then one verify block per step) or a ``DraftNeed`` (greedy draft tokens from its draft model), and is
sent back the logits or the tokens. The scheduler decides how they run: alone, batched with other
requests' passes, or replayed in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the ggml runtime's path runs without torch
    from torch import Tensor


@dataclass
class Forward:
    """One sequence's share of a pass: ``tokens`` at positions ``start..`` into ``cache``."""

    tokens: Tensor | list[int]  # 1-D token ids (a host list: a slotted round stages them itself)
    cache: object  # engine.runtimes.compact.KVCache (or the runtime's own cache type)
    start: int
    num_logits: int = 1
    # Set by a slotted round (scheduler): the argmax of each returned logits row, on the host; the decoder
    # takes greedy choices from it instead of an argmax and a sync of its own.
    best: list[int] | None = None
    # The decoder whose verify block this is (None for a prefill chunk): the scheduler may shorten its draft.
    decoder: object | None = None
    # Run through the runtime's ``numpy_logits`` (host token list in, numpy rows out): a greedy step that needs
    # only each row's argmax, on a runtime that declares ``numpy_rows`` (the ggml runtime).
    numpy: bool = False
    # Whether the rows may be read as logits, not only through ``best`` (a sampled or healed choice; a prefill chunk
    # before the last reads nothing): fed rounds keep those rows aside (engine/serve/slot_passes.py ``launch``).
    reads_logits: bool = True


@dataclass
class FedPass:
    """A sequence's next pass, guessed while its current one still runs (engine/fed_rounds.py): one token at
    ``start`` into ``cache``, the argmax of the last row of ``source`` (its pass in the round in flight), which the
    device copies in without a host round trip. The guess holds when the sequence then asks for exactly that pass."""

    source: object  # the Forward (or FedPass) it follows, in the round launched just before
    cache: object
    start: int
    forward: Forward | None = None  # the sequence's own pass, once it turned out to be this one
    dropped: bool = False  # guessed wrong (or the sequence ended): its row is nobody's
    best: list[int] | None = None  # as Forward.best, once collected
    logits: object = None  # its row, once collected (a RowSpan)

    def matches(self, fwd: object) -> bool:
        """Whether ``fwd`` (the sequence's pass, now known) is the pass this row ran."""
        src = self.source.best
        return (
            isinstance(fwd, Forward)
            and fwd.cache is self.cache
            and fwd.start == self.start
            and fwd.num_logits == 1
            and isinstance(fwd.tokens, list)
            and len(fwd.tokens) == 1
            and bool(src)
            and fwd.tokens[0] == src[-1]
        )


@dataclass
class DraftNeed:
    """A sequence's request for up to ``k`` greedy draft tokens from its draft model after ``context``."""

    drafter: object  # engine.decoding.drafters.ModelDrafter, bound to the sequence's own draft cache
    context: list[int]
    k: int
    gate: float


class RowSpan:
    """Rows ``lo:hi`` of a round's logits, sliced only when read (``span[i]``, ``tensor()``): a greedy step of
    fimble serve's slotted rounds uses the host argmax alone, and 32 tensor slices a round cost ~0.1 ms there."""

    __slots__ = ("logits", "lo", "hi")

    def __init__(self, logits: Tensor, lo: int, hi: int):
        self.logits, self.lo, self.hi = logits, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, i: int) -> Tensor:
        n = self.hi - self.lo
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        return self.logits[self.lo + (i % n)]

    def tensor(self) -> Tensor:
        return self.logits[self.lo : self.hi]


def rows_tensor(logits) -> Tensor:
    """``logits`` as a tensor of rows (a ``RowSpan`` sliced now)."""
    return logits.tensor() if isinstance(logits, RowSpan) else logits


def host_pass(runtime, ids: list[int], cache, start: int | None, num_logits: int = 1, numpy: bool = True):
    """Run host token ids at ``start..`` into ``cache``; the last ``num_logits`` rows of logits. On a runtime that
    declares ``numpy_rows`` (the ggml runtime) through its ``numpy_logits``, numpy rows back: that path never
    imports torch (a 2 s import at every engine start). Elsewhere, or with ``numpy`` off (a caller that keeps
    torch rows), a long tensor on the runtime's device."""
    if numpy and getattr(runtime, "numpy_rows", False):
        return runtime.numpy_logits(list(ids), cache, start, num_logits)
    import torch

    return runtime(torch.tensor(ids, dtype=torch.long, device=runtime.device), cache, start, num_logits)


def run_one(runtime, call: Forward):
    """A pass of one sequence through the runtime's own forward (round-robin mode, other runtimes)."""
    if call.numpy:  # host ids in, numpy rows out (engine/runtimes/ggml_runtime.py): no torch call on the way
        return runtime.numpy_logits(call.tokens, call.cache, call.start, call.num_logits)
    return runtime(call.tokens, call.cache, call.start, call.num_logits)
