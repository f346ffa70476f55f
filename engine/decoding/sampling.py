"""Token distributions and the speculative-sampling acceptance rules.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a drafted token x
drawn from q is kept with probability min(1, p(x)/q(x)); on rejection the next
token is drawn from norm(max(0, p - q)). The output is then distributed exactly
as p. A deterministic drafter is the case q = one-hot(x): keep x with
probability p(x), else draw from p with x removed.
"""

from __future__ import annotations

import torch
from torch import Tensor


def distribution(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """Probabilities after temperature and nucleus (top-p) filtering. logits: [..., V]."""
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
    return int(torch.multinomial(probs, 1, generator=gen).item())


def accept_draft_token(p: Tensor, q: Tensor | None, token: int, gen: torch.Generator | None) -> bool:
    """Keep ``token`` drafted from ``q`` (None: a deterministic drafter) against target ``p``."""
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
