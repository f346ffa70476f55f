"""Latency histograms and counters for ``fimble/stats``. Fixed buckets: memory never grows."""

from __future__ import annotations

import bisect
import math
from collections import Counter

# Log-spaced bucket upper bounds from 0.05 ms to about 100 s (ratio 1.2 per bucket).
BOUNDS_MS = [0.05 * 1.2**i for i in range(80)]

STAGES = (
    "submit",  # request received -> handed to the engine (server-side work)
    "queue",  # engine queue + transport: time from submit to the engine starting on it
    "prompt_build",  # server windows + engine tokenisation
    "prefill",  # engine prefill of the uncached prompt tokens
    "engine_first_token",  # engine: start of work on the request -> first token
    "first_token",  # request received -> first text available (model or cache)
    "first_line",  # request received -> first complete line
    "complete",  # request received -> generation finished
    "answer",  # request received -> response sent
    "cache_answer",  # response time of requests answered from a finished generation (type-through)
)


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS_MS) + 1)
        self.n = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, ms: float) -> None:
        self.counts[bisect.bisect_left(BOUNDS_MS, ms)] += 1
        self.n += 1
        self.total += ms
        self.max = max(self.max, ms)

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding the q-quantile (at most 20% above the true value)."""
        if not self.n:
            return None
        rank = math.ceil(q * self.n)
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return min(BOUNDS_MS[i], self.max) if i < len(BOUNDS_MS) else self.max
        return self.max

    def summary(self) -> dict:
        r = lambda v: None if v is None else round(v, 3)  # noqa: E731
        # The histogram itself: [upper bound in ms (null: above the last bound), count] for non-empty buckets.
        buckets = [[r(BOUNDS_MS[i]) if i < len(BOUNDS_MS) else None, c] for i, c in enumerate(self.counts) if c]
        return {
            "count": self.n,
            "mean": r(self.total / self.n if self.n else None),
            "p50": r(self.quantile(0.5)),
            "p95": r(self.quantile(0.95)),
            "p99": r(self.quantile(0.99)),
            "max": r(self.max if self.n else None),
            "buckets": buckets,
        }


class Stats:
    def __init__(self) -> None:
        self.latency = {s: Histogram() for s in STAGES}
        self.counters: Counter[str] = Counter()

    def observe(self, stage: str, ms: float) -> None:
        self.latency[stage].add(ms)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def snapshot(self) -> dict:
        c = self.counters
        hits = c["typethrough_hits"] + c["inflight_hits"]
        lookups = hits + c["prefetch_hits"] + c["misses"]
        return {
            "latency_ms": {s: h.summary() for s, h in self.latency.items()},
            "cache": {
                "typethrough_hits": c["typethrough_hits"],
                "inflight_hits": c["inflight_hits"],
                "prefetch_hits": c["prefetch_hits"],
                "misses": c["misses"],
                # type-through only: a prefetch hit is the model working for this very keystroke
                "hit_rate": round(hits / lookups, 4) if lookups else None,
            },
            "counters": dict(sorted(c.items())),
        }


# fimble/stats "kvCache": wire name -> the engine counter it reports (engine/local.py, engine/caching/kv_store.py).
KV_CACHE_FIELDS = (
    ("bytes", "kv_bytes"),
    ("budgetBytes", "kv_budget_bytes"),
    ("documents", "kv_documents"),
    ("segments", "kv_segments"),
    ("tokens", "kv_tokens"),
    ("hits", "kv_segment_hits"),
    ("misses", "kv_segment_misses"),
    ("evictions", "kv_evictions"),
    ("documentsEvicted", "kv_documents_evicted"),
    ("grows", "kv_grows"),
    ("borrowedTokens", "kv_borrowed_tokens"),
    ("prefilledTokens", "tokens_prefilled"),
    ("reusedTokens", "tokens_reused"),
    ("shiftedTokens", "tokens_shifted"),
    ("prewarmedTokens", "tokens_prewarmed"),
    ("prewarmsDone", "prewarms_done"),
    ("prewarmsPreempted", "prewarms_preempted"),
)


def kv_cache_summary(engine_counters: dict, server_counters: Counter[str]) -> dict | None:
    """The engine's KV cache stats under stable camelCase names; None while no engine reports them."""
    if "kv_bytes" not in engine_counters:
        return None
    out = {wire: engine_counters.get(name, 0) for wire, name in KV_CACHE_FIELDS}
    lookups = out["hits"] + out["misses"]
    out["hitRate"] = round(out["hits"] / lookups, 4) if lookups else None
    out["prewarmsSent"] = server_counters["prewarms_sent"]
    out["prewarmsSkipped"] = server_counters["prewarms_skipped"]
    return out
