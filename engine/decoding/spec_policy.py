"""Cost-aware speculation: draft only as many tokens as pay for their verification.

The model. A verify pass of ``r`` rows costs ``c(r)`` in units of a 1-row step (``c(1) = 1``).
On a memory-bound runtime (fp32 on CPU, graphs on GPU) ``c`` is nearly flat, so long drafts are
free; on a compute-bound one (q8_0 in llama.cpp on CPU: 1 row 3.5 ms, 4 rows 10.7, 13 rows 27)
it grows almost linearly, and a long draft costs more than it saves. A draft model step costs
``d`` target steps; n-gram lookup costs nothing.

Acceptance: the i-th drafted token is accepted with probability ``h_i`` given that the ones before
it were. A round drafting ``g`` tokens then commits on average ``E(g) = 1 + sum_{j<=g} h_1...h_j``
tokens (the accepted prefix plus the target's own token; ``(1 - a^(g+1)) / (1 - a)`` when every
``h_i = a``) and costs ``c(g+1) + g*d``. ``choose_gamma`` picks the ``g`` in ``0..cap`` with the
most tokens per unit of time, and ``g = 0`` (a plain step) unless that beats a plain step by 3%.
``h`` is a running estimate per drafter kind and draft position (``Acceptance``), decayed, from a
prior of 0.75: per position because acceptance is bursty.

``c`` is measured once per loaded runtime (``verify_costs``): the fastest of a few timed passes of
1, 2, 3, 4, 8 and 16 rows on a scratch cache, linear in between. Timing only changes how many tokens
are drafted, never which tokens are committed: those are the target's greedy choices whatever the
draft, so output stays equal to plain greedy decoding.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass

from engine.decoding.passes import host_pass
from engine.runtimes import probe_cache

# 3 as well as the powers of two: fimble's llama.cpp build runs 3-row blocks of f32 weights in one pass over
# them (engine/runtimes/ggml_patch.py), so a 3-row block costs well under the 2-to-4 interpolation
PROBE_ROWS = (1, 2, 3, 4, 8, 16)
PROBE_DEPTH = 256  # cached positions under the timed passes: a completion's depth (attention's share)
PROBE_REPEATS = 3
MIN_GAIN = 1.03  # drafting must beat a plain step by 3%: timings are noisy


@dataclass
class VerifyCosts:
    """Cost of a pass of ``rows`` rows relative to a 1-row step, and a 1-row step in seconds."""

    rows: tuple[int, ...] = (1,)
    relative: tuple[float, ...] = (1.0,)
    step_s: float = 0.0
    # Prompt tokens a second of the probe's first pass (PROBE_DEPTH tokens, from an empty cache); 0: unknown.
    # The first completion at a new spot sizes its prompt with it (engine/caching/cold_window.py).
    prefill_rate: float = 0.0

    def cost(self, r: int) -> float:
        if r <= self.rows[0]:
            return self.relative[0]
        for i in range(1, len(self.rows)):
            r0, c0, r1, c1 = self.rows[i - 1], self.relative[i - 1], self.rows[i], self.relative[i]
            if r <= r1:
                return c0 + (c1 - c0) * (r - r0) / (r1 - r0)
        if len(self.rows) == 1:
            return self.relative[0]
        (r0, c0), (r1, c1) = (self.rows[-2], self.relative[-2]), (self.rows[-1], self.relative[-1])
        return c1 + (c1 - c0) * (r - r1) / (r1 - r0)


FLAT = VerifyCosts()  # unmeasured: every pass costs one step (the old policy: always draft)
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runtime -> its costs, measured once per load


class Acceptance:
    """Running acceptance estimate of one drafter kind, per draft position, decayed so it follows the text.

    ``h[i]``: how often the (i+1)-th drafted token was accepted when the ones before it were. Kept per
    position because acceptance is bursty (a draft that matches its first tokens usually goes on
    matching), which a single rate would miss. ``survival(g)``: chance the first g are all accepted.
    """

    def __init__(self, positions: int = 16, prior: float = 0.75, weight: float = 2.0, decay: float = 0.9):
        self.hits = [prior * weight] * positions
        self.trials = [weight] * positions
        self.prior, self.weight, self.decay = prior, weight, decay

    def forget(self, keep: float = 0.9) -> None:
        """A round without evidence (the drafter was skipped): move a little back toward the prior."""
        for i in range(len(self.hits)):
            self.hits[i] = self.hits[i] * keep + self.prior * self.weight * (1 - keep)
            self.trials[i] = self.trials[i] * keep + self.weight * (1 - keep)

    def rate(self, i: int) -> float:
        i = min(i, len(self.hits) - 1)
        return self.hits[i] / self.trials[i]

    def update(self, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, accepted + 1, len(self.hits))):  # positions that were tried
            self.hits[i] = self.hits[i] * self.decay + (1.0 if i < accepted else 0.0)
            self.trials[i] = self.trials[i] * self.decay + 1.0

    def expected_tokens(self, g: int) -> float:
        """Tokens a round drafting g commits on average: the accepted prefix plus the target's own."""
        total, surv = 1.0, 1.0
        for i in range(g):
            surv *= self.rate(i)
            total += surv
        return total


def expected_tokens(a: float, g: int) -> float:
    """``Acceptance.expected_tokens`` when every position has rate ``a``: (1 - a^(g+1)) / (1 - a)."""
    if a >= 1.0:
        return g + 1.0
    return (1.0 - a ** (g + 1)) / (1.0 - a)


def best_draft(costs: VerifyCosts, a: float | Acceptance, cap: int, draft_cost: float = 0.0) -> tuple[int, float]:
    """(g, rate): the draft length in ``0..cap`` with the most committed tokens per unit of time, and that rate in
    tokens per 1-row step (a plain step's is 1); ``a`` a rate for every position, or an ``Acceptance``. ``g`` is 0
    unless drafting beats a plain step by MIN_GAIN."""
    if costs.step_s <= 0:  # unmeasured (GPU, or a runtime that cannot be probed): draft all, as before
        return max(0, cap), 1.0
    plain = 1.0 / costs.cost(1)
    best_g, best = 0, 0.0
    for g in range(1, max(0, cap) + 1):
        tokens = a.expected_tokens(g) if isinstance(a, Acceptance) else expected_tokens(a, g)
        rate = tokens / (costs.cost(g + 1) + g * draft_cost)
        if rate > best:
            best_g, best = g, rate
    return (best_g, best) if best > plain * MIN_GAIN else (0, plain)


def choose_gamma(costs: VerifyCosts, a: float | Acceptance, cap: int, draft_cost: float = 0.0) -> int:
    """``best_draft``'s length alone."""
    return best_draft(costs, a, cap, draft_cost)[0]


def _time_pass(runtime, cache, tokens: list[int], start: int) -> float:
    t0 = time.perf_counter()
    host_pass(runtime, tokens, cache, start, len(tokens))
    return time.perf_counter() - t0


def measure(runtime) -> VerifyCosts:
    """Time passes of PROBE_ROWS rows at PROBE_DEPTH on a scratch cache (PROBE_REPEATS rounds)."""
    cache = runtime.new_cache(PROBE_DEPTH + max(PROBE_ROWS) + 1)
    vocab = int(getattr(runtime, "vocab", 0) or getattr(runtime.cfg, "vocab_size", 256))
    toks = [(i * 7919 + 11) % vocab for i in range(PROBE_DEPTH + max(PROBE_ROWS))]
    t0 = time.perf_counter()
    host_pass(runtime, toks[:PROBE_DEPTH], cache, 0, 1)
    prefill_rate = PROBE_DEPTH / max(1e-6, time.perf_counter() - t0)
    best: dict[int, float] = {}
    for _ in range(PROBE_REPEATS):  # interleaved, fastest of each: a busy machine only slows passes
        for r in PROBE_ROWS:
            cache.rollback(PROBE_DEPTH)
            t = _time_pass(runtime, cache, toks[PROBE_DEPTH : PROBE_DEPTH + r], PROBE_DEPTH)
            best[r] = min(best.get(r, t), t)
    cache.rollback(0)
    one = best[1]
    rel = [1.0]
    for r in PROBE_ROWS[1:]:  # a longer pass is never cheaper than a shorter one
        rel.append(max(rel[-1], best[r] / one))
    return VerifyCosts(PROBE_ROWS, tuple(rel), one, prefill_rate)


def verify_costs(runtime) -> VerifyCosts:
    """``measure(runtime)`` once per loaded runtime; flat on GPUs (graph passes of up to 16 rows cost
    about one step) and for runtimes that cannot be probed."""
    cached = _COSTS.get(runtime)
    if cached is not None:
        return cached
    costs = FLAT
    device = getattr(runtime, "device", None)
    if device is not None and str(device).partition(":")[0] == "cpu" and hasattr(runtime, "new_cache"):
        costs = _measured_or_cached(runtime)
    _COSTS[runtime] = costs
    return costs


def _measure_parts(runtime) -> tuple[str, ...] | None:
    """The key of a runtime's verify costs on disk: what its kernels depend on (the ggml runtime's
    ``probe_parts``), the kernel choice it settled on, and this probe's settings; None where the
    runtime names no such identity (the torch runtimes: measured on every load)."""
    parts = getattr(runtime, "probe_parts", None)
    if not parts:
        return None
    settled = f"flash={runtime.flash_attn}:pad={runtime.pad_single}:threads={runtime.threads}"
    return (*parts, settled, f"rows={PROBE_ROWS}:depth={PROBE_DEPTH}:repeats={PROBE_REPEATS}:prefill")


def _read_costs(value: dict) -> VerifyCosts:
    """Cached costs, checked: this probe's rows, finite relative costs from 1 that never fall, a
    positive step time (probe_cache ignores the entry on any error)."""
    rows, rel, step_s = tuple(value["rows"]), tuple(float(x) for x in value["rel"]), float(value["step_s"])
    if rows != PROBE_ROWS or len(rel) != len(rows) or rel[0] != 1.0:
        raise ValueError("rows")
    if not all(math.isfinite(x) and 1.0 <= x <= 1e3 for x in rel) or list(rel) != sorted(rel):
        raise ValueError("costs")
    if not (math.isfinite(step_s) and 0.0 < step_s < 60.0):
        raise ValueError("step time")
    prefill_rate = float(value.get("prefill_rate", 0.0))  # (entries written before it was measured: unknown)
    if not (math.isfinite(prefill_rate) and prefill_rate >= 0.0):
        raise ValueError("prefill rate")
    return VerifyCosts(rows, rel, step_s, prefill_rate)


def _measured_or_cached(runtime) -> VerifyCosts:
    parts = _measure_parts(runtime)
    if parts is not None:
        cached = probe_cache.load("verify-costs", parts, _read_costs)
        if cached is not None:
            return cached
    try:
        costs = measure(runtime)
    except Exception:  # noqa: BLE001  (a runtime without scratch caches: keep drafting as before)
        return FLAT
    if parts is not None:
        probe_cache.store(
            "verify-costs",
            parts,
            {
                "rows": list(costs.rows),
                "rel": list(costs.relative),
                "step_s": costs.step_s,
                "prefill_rate": costs.prefill_rate,
            },
        )
    return costs
