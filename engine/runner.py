"""How a scheduler's round runs its passes (engine/scheduler.py): one by one, or batched into one forward.

``PassRunner`` runs every pass eagerly: with ``batched`` (the compact runtime) all of a round's passes in one
forward (engine/serve/batched.py), else each through the runtime's own forward (one sequence in
``fimble lsp``, round-robin in ``fimble serve`` over a transformers runtime). fimble serve on CUDA uses
``SlottedPasses`` (engine/serve/slot_passes.py), which replays captured graphs.
"""

from __future__ import annotations

import contextlib

from engine.counters import Counters
from engine.decoding.passes import DraftNeed, Forward, run_one


class PassRunner:
    slots = None  # SlottedPasses: the SlotGraphs its rounds replay

    def __init__(self, target_runtime, draft_runtime, counters: Counters, batched: bool):
        self.runtime, self.draft_runtime, self.counts = target_runtime, draft_runtime, counters
        # (engine/serve/batched.py imports torch: only a batching runner loads it)
        if batched:
            from engine.serve.batched import supports_batch

            batched = supports_batch(target_runtime)
        self.batched = batched
        # On CUDA (GraphRuntime), a lone sequence's pass replays its captured graph (1.7-2.8 ms a step, against
        # 8-11 ms eager); two or more run the eager batched forward together (batched.py).
        self.graphs = target_runtime.greedy_drafts

    # -- a sequence's caches (slotted rounds move them; here they stay where they are) ----------------
    def take_slot(self, doc) -> object | None:
        """Move the document's target cache into a slot for the run (None: it stays where it is)."""
        return None

    def give_slot(self, doc, own) -> None:
        """Move it back (``own``: what ``take_slot`` returned)."""

    def fits_heal_draft(self, rows: int) -> bool:
        """Whether a slotted prompt's last pass of ``rows`` rows (heal draft included) is a short pass."""
        return True

    # -- a round --------------------------------------------------------------------------------------
    def drafts(self, needs: list[DraftNeed]) -> list[list[int]]:
        """Greedy draft tokens for every need: token i of all drafts in one pass where the draft model batches."""
        if self.batched and not (len(needs) == 1 and self.graphs):
            from engine.serve.batched import batched_greedy_drafts, supports_batch

            if supports_batch(self.draft_runtime):
                return batched_greedy_drafts(self.draft_runtime, needs)
        # round-robin: each drafter on its own, exactly as SpeculativeDecoder.step would
        return [n.drafter.propose(n.context, n.k, 0.0, 1.0, n.gate, None).tokens for n in needs]

    can_feed = False  # rounds launched ahead, fed on the device (engine/fed_rounds.py): slotted rounds only

    def shorten(self, calls: list[Forward]) -> None:
        """Cut verify blocks before they run where shorter ones pay better (slotted rounds only)."""

    def launch(self, calls: list[Forward]) -> object:
        """Start the round's passes; ``collect`` waits for them. Here they have run when this returns."""
        return self.run(calls)

    def collect(self, launched) -> list:
        """Each call's logits (in order)."""
        return launched

    def round_done(self, round_ms: float) -> None:
        """A round took ``round_ms`` (slotted rounds learn their host time from it)."""

    def tail_rows(self) -> int:
        """The most rows a keystroke's last prefill pass may take (0: no cap; slotted rounds only)."""
        return 0

    def reading(self, launched):
        """Where the host reads a collected round's rows as logits while a later round runs (fed rounds): here,
        nothing runs ahead, so anywhere."""
        return contextlib.nullcontext()

    def run(self, calls: list[Forward]) -> list:
        runtime = self.runtime
        device = runtime.device
        for c in calls:  # blocks built on the host for a slotted round that runs eagerly after all
            if c.numpy:
                continue
            import torch  # a torch runtime's pass: torch is loaded already

            if isinstance(c.tokens, list):
                c.tokens = torch.tensor(c.tokens, dtype=torch.long)
            if device is not None and c.tokens.device != torch.device(device):
                c.tokens = c.tokens.to(device)
        if self.batched and len(calls) > 0 and not (len(calls) == 1 and self.graphs):
            from engine.serve.batched import batched_forward

            self.counts.add("sched_passes")
            return batched_forward(runtime, calls)
        self.counts.add("sched_passes", len(calls))
        return [run_one(runtime, c) for c in calls]
