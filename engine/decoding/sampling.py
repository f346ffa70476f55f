"""Token distributions and the speculative-sampling acceptance rules.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a drafted token x
drawn from q is kept with probability min(1, p(x)/q(x)); on rejection the next
token is drawn from norm(max(0, p - q)). The output is then distributed exactly
as p. A deterministic drafter is the case q = one-hot(x): keep x with
probability p(x), else draw from p with x removed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # greedy choices on numpy rows (the ggml runtime's) need no torch; sampling does
    import torch
    from torch import Tensor


def greedy_ids(logits: Tensor | np.ndarray) -> list[int]:
    """The argmax of each row of ``logits`` ([rows, vocab]): the same index as ``torch.argmax`` (the first
    maximum; a NaN counts as the maximum in both). Numpy rows (the ggml runtime's) and float32 CPU
    tensors go through numpy: right after a llama.cpp pass has evicted torch's dispatch path from the
    caches, a torch call cost 30-90 us here, numpy's argmax ~15 (a 5 ms step of the embedded target)."""
    if isinstance(logits, np.ndarray):
        return logits.argmax(-1).tolist()
    import torch

    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def constrained_argmax(row: Tensor | np.ndarray, allowed: list[int] | np.ndarray) -> int:
    """``greedy_ids`` of one row with every token but ``allowed`` masked out (the lowest id among equal maxima, a
    NaN the maximum), with only the allowed logits leaving the device: one gather and one small copy, where masking a
    whole row of a 150k vocabulary took four kernels before its argmax came back (healing, every keystroke mid-word).
    ``allowed`` in any order (TokenIndex.allowed_ids): ties are broken by id, not by sorting the ids (after a space
    the Qwen vocabulary allows 52,820 tokens: a sort of them cost ~10 ms a choice)."""
    ids = np.asarray(allowed, dtype=np.int64)
    if isinstance(row, np.ndarray):
        values = row[ids]
    else:
        import torch

        # (through numpy: torch.tensor(list) costs ~0.25 us an id; a serve round at 32 editors met ~3 such rows)
        values = row.index_select(0, torch.from_numpy(ids).to(row.device)).float().cpu().numpy()
    top = values.max()
    best = np.isnan(values) if np.isnan(top) else values == top
    return int(ids[best].min())


def distribution(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """Probabilities after temperature and nucleus (top-p) filtering. logits: [..., V]."""
    import torch

    if isinstance(logits, np.ndarray):  # a ggml runtime's rows, sampled
        logits = torch.from_numpy(logits)
    probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p (always at least the top token).
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: Tensor, gen: torch.Generator | None) -> int:
    import torch

    return int(torch.multinomial(probs, 1, generator=gen).item())


def accept_draft_token(p: Tensor, q: Tensor | None, token: int, gen: torch.Generator | None) -> bool:
    """Keep ``token`` drafted from ``q`` (None: a deterministic drafter) against target ``p``."""
    import torch

    ratio = p[token] if q is None else torch.clamp(p[token] / q[token].clamp_min(1e-20), max=1.0)
    return bool(torch.rand((), generator=gen) < ratio)


def residual(p: Tensor, q: Tensor | None, token: int) -> Tensor:
    """The distribution to draw from after ``token`` was rejected."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum()
    # p == q exactly leaves no mass; then any draw from p is correct.
    return p if total <= 0 else r / total


def without(row: Tensor | np.ndarray, ids: set[int]) -> Tensor | np.ndarray:
    """One row of logits with ``ids`` at -inf (a copy): DecodeOptions.no_empty's first choice, stop tokens out."""
    out = sorted(ids)
    if isinstance(row, np.ndarray):
        row = row.copy()
        row[out] = -np.inf
        return row
    import torch

    return row.index_fill(-1, torch.tensor(out, device=row.device), float("-inf"))


def without_first(rows: Tensor | np.ndarray, ids: set[int]) -> Tensor | np.ndarray:
    """A copy of a block's logits with ``ids`` at -inf in its first row (no_empty's choice in a verify block)."""
    rows = rows.copy() if isinstance(rows, np.ndarray) else rows.clone()
    rows[0] = without(rows[0], ids)
    return rows
