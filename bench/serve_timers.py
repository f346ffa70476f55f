"""Where a fimble serve round's host time goes: wall-clock timers around the decode loop's parts (bench only).

``install(engine)`` wraps the parts of a ``ServeEngine`` (engine/serve/scheduler.py) that a round and an admission
run: the prompt build, the document's cache choice and reuse, the slot hand-out, the decoder's construction, each
sequence's step work (verify, draft, next pass, streaming), the graph's staging, launch and wait, and every graph
replay's own GPU time (``SlotGraphs`` keeps only the fastest replay per graph). Each adds its milliseconds and calls
to the engine's counters as ``t_<part>_ms`` and ``t_<part>_n``, which ``fimble serve``'s ``counters`` op returns, so
bench/serve_load.py prints them per level (``SERVE_LOAD_TIMERS=1``). A timer costs ~1 us a call; nested parts
overlap (``admit`` holds ``start``, which holds ``build``...).
"""

from __future__ import annotations

import functools
import time

PARTS = (
    "admit",  # Scheduler._admit (every call, also those that admit nothing)
    "start",  # Rounds.start: one admitted request up to its first pass
    "build",  # PromptBuilder.build
    "open",  # DocumentPrompts.open
    "choose",  # DocumentPrompts.choose
    "reuse",  # DocumentPrompts.reuse
    "take_slot",
    "give_slot",
    "release",  # KVStore.release
    "decoder",  # SpeculativeDecoder.__init__
    "end_step",
    "next_draft",
    "begin_step",
    "emit",  # TextOut.emit (streaming a step's text)
    "drafts",  # Rounds._drafts
    "shorten",
    "stage",  # SlotGraphs._stage_passes
    "replay",  # SlotGraphs.replay_round (host side of the launch)
    "wait",  # SlotGraphs.wait_round
    "hand_out",
    "gpu",  # each replay's own GPU time (events), not the fastest seen
)


def _timed(counts, name: str, fn):
    ms, n = f"t_{name}_ms", f"t_{name}_n"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            counts.add(ms, (time.perf_counter() - t0) * 1e3)
            counts.add(n)

    return wrapper


def install(engine) -> None:
    """Wrap ``engine``'s parts (instances where the engine owns them, classes for per-request objects)."""
    from engine import steps
    from engine.decoding import speculative

    counts = engine.counts
    with counts._lock:
        for part in PARTS:
            counts._values.setdefault(f"t_{part}_ms", 0.0)
            counts._values.setdefault(f"t_{part}_n", 0)

    def wrap(obj, attr: str, name: str) -> None:
        setattr(obj, attr, _timed(counts, name, getattr(obj, attr)))

    wrap(engine, "_admit", "admit")
    wrap(engine.rounds, "start", "start")
    wrap(engine.rounds, "_drafts", "drafts")
    wrap(engine.prompts, "build", "build")
    wrap(engine.documents, "open", "open")
    wrap(engine.documents, "choose", "choose")
    wrap(engine.documents, "reuse", "reuse")
    wrap(engine.passes, "take_slot", "take_slot")
    wrap(engine.passes, "give_slot", "give_slot")
    wrap(engine.passes, "shorten", "shorten")
    wrap(engine.store, "release", "release")
    decoder = speculative.SpeculativeDecoder
    for attr, name in (("__init__", "decoder"), ("end_step", "end_step"), ("next_draft", "next_draft")):
        wrap(decoder, attr, name)
    wrap(decoder, "begin_step", "begin_step")
    wrap(steps.TextOut, "emit", "emit")
    slots = engine.slots
    if slots is None:
        return
    wrap(slots, "_stage_passes", "stage")
    wrap(slots, "replay_round", "replay")
    wrap(slots, "_hand_out", "hand_out")
    wait = slots.wait_round

    def wait_round(rnd) -> None:
        t0 = time.perf_counter()
        wait(rnd)
        counts.add("t_wait_ms", (time.perf_counter() - t0) * 1e3)
        counts.add("t_wait_n")
        if slots.use_graphs:
            counts.add("t_gpu_ms", slots._began[rnd.turn].elapsed_time(slots._ended[rnd.turn]))
            counts.add("t_gpu_n")

    slots.wait_round = wait_round


def summary(diff) -> dict:
    """Per part over a level: total ms, calls, us per call (``diff(name)``: a counter's change over the level)."""
    out = {}
    for part in PARTS:
        n = diff(f"t_{part}_n")
        if n:
            ms = diff(f"t_{part}_ms")
            out[part] = {"ms": round(ms, 1), "n": int(n), "us_per_call": round(ms * 1e3 / n, 1)}
    return out


def line(timers: dict) -> str:
    """One printed line: each part's total ms and us a call."""
    return "  ".join(f"{k} {v['ms']:.0f}ms/{v['n']} ({v['us_per_call']:.0f}us)" for k, v in timers.items())
