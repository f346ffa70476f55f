"""Shift reuse (opt-in, approximate): keep cached pieces that moved, re-rotating their keys.

After an edit, the pieces behind it still sit in the document's cache, only at other
positions. Keys carry their position as a RoPE rotation, so a piece moved by ``d``
positions gets its keys rotated by ``d`` more (rotations compose: R(p + d) = R(d) R(p));
values carry no position. llama.cpp's cache reuse does the same.

It is approximate: a reused piece's keys and values were computed while it attended to
the old text before it. The exact path never uses this; ``bench/kv_shift_quality.py``
measures what it costs in completion quality.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.caching.prompt_plan import Piece

if TYPE_CHECKING:  # shift reuse runs on the torch runtimes only: the ggml path never loads torch
    import torch


@dataclass(frozen=True)
class Move:
    src: int  # first position in the old cache
    dst: int  # first position in the new prompt
    length: int


def plan_shift(old: list[Piece], new: list[Piece], exact: int) -> tuple[list[Move], list[tuple[int, int]]]:
    """Which new pieces after position ``exact`` to take from ``old`` (by content), and which to recompute.

    Returns the moves and the [start, end) runs of positions to recompute, in order. The
    last piece (the FIM middle token) is always recomputed: its logits start decoding.
    """
    by_key: dict[bytes, list[int]] = defaultdict(list)
    for i, p in enumerate(old):
        by_key[p.key].append(i)
    used: set[int] = set()
    moves: list[Move] = []
    runs: list[tuple[int, int]] = []
    prev: int | None = None
    for j, piece in enumerate(new):
        end = piece.start + piece.length
        if end <= exact:
            continue
        src = None
        if piece.start >= exact and j < len(new) - 1:
            src = _pick(old, by_key, used, prev, piece)
        if src is None:
            _extend(runs, max(piece.start, exact), end)
            prev = None
            continue
        used.add(src)
        prev = src
        s = old[src].start
        if moves and moves[-1].src + moves[-1].length == s and moves[-1].dst + moves[-1].length == piece.start:
            last = moves.pop()
            moves.append(Move(last.src, last.dst, last.length + piece.length))
        else:
            moves.append(Move(s, piece.start, piece.length))
    return moves, runs


def _pick(
    old: list[Piece], by_key: dict[bytes, list[int]], used: set[int], prev: int | None, piece: Piece
) -> int | None:
    """The old piece to reuse: the one after the previous match if it fits (keeps runs whole), else the first free."""
    if prev is not None and prev + 1 < len(old) and prev + 1 not in used and old[prev + 1].key == piece.key:
        return prev + 1
    for i in by_key.get(piece.key, ()):
        if i not in used and old[i].length == piece.length:
            return i
    return None


def _extend(runs: list[tuple[int, int]], start: int, end: int) -> None:
    if runs and runs[-1][1] == start:
        runs[-1] = (runs[-1][0], end)
    else:
        runs.append((start, end))


def apply_moves(cache, inv_freq: torch.Tensor, moves: list[Move]) -> int:
    """Move cached keys/values as planned (sources are read before anything is written). Returns tokens moved."""
    staged = []
    for m in moves:
        if m.src == m.dst:
            continue  # already in place
        sl = slice(m.src, m.src + m.length)
        staged.append((m, cache.keys[:, :, sl].clone(), cache.values[:, :, sl].clone()))
    for m, keys, values in staged:
        sl = slice(m.dst, m.dst + m.length)
        cache.keys[:, :, sl] = rerotate(keys, m.dst - m.src, inv_freq)
        cache.values[:, :, sl] = values
    return sum(m.length for m in moves)


def rerotate(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys rotated by ``delta`` more positions (HF half-split RoPE layout, like compact.rotate)."""
    import torch

    from engine.runtimes.compact import rotate

    angles = delta * inv_freq.to(device=keys.device, dtype=torch.float64)
    emb = torch.cat((angles, angles))
    cos, sin = emb.cos().to(torch.float32), emb.sin().to(torch.float32)
    return rotate(keys.float(), cos, sin).to(keys.dtype)
