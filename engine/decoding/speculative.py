"""Speculative decoding: draft a block, verify it with one target forward pass, keep what agrees.

A step is split around its target pass so that a scheduler (engine/scheduler.py) can run the passes of
many requests together: ``next_draft`` chooses the draft (or asks for greedy draft-model tokens, a
``DraftNeed``), ``begin_step`` returns the verify pass (a ``Forward``), ``end_step`` verifies its
logits. ``step`` does the three in a row, for callers that run one sequence alone.

State between steps: ``ids`` holds the prompt and every committed output token.
The target's KV cache holds all of ``ids`` except the last token, which is fed
with the next block. A rejected suffix of a block is dropped by rolling the
cache's length back (a pointer move, see engine/runtimes/compact.py).

Greedy: keep the longest drafted prefix that equals the target's argmax, plus
the target's own next token. Output equals plain greedy decoding.
Sampling: speculative sampling (engine/decoding/sampling.py). Output is distributed as
plain sampling from the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.decoding.draft_plan import DraftPlan
from engine.decoding.drafters import Draft, ModelDrafter, NgramDrafter
from engine.decoding.passes import DraftNeed, Forward, host_pass, rows_tensor
from engine.decoding.sampling import (
    accept_draft_token,
    constrained_argmax,
    distribution,
    draw,
    greedy_ids,
    residual,
    without,
    without_first,
)
from engine.decoding.spec_policy import VerifyCosts
from engine.options import DecodeOptions

if TYPE_CHECKING:  # greedy decoding on numpy rows (the ggml runtime) runs without torch
    from torch import Tensor


@dataclass
class StepStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    target_tokens: int = 0  # positions run through the target (prefill excluded)

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per verify step (accepted drafts + the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


MAX_HEAL_DRAFT = 4  # tokens of healed text checked along with the prompt's last pass


class SpeculativeDecoder:
    # Heal drafts (prefill_draft): off only to measure against, or to compare outputs in a test.
    heal_drafts = True

    def __init__(
        self,
        runtime,
        cache,
        stop_ids: set[int],
        options: DecodeOptions,
        model_drafter: ModelDrafter | None = None,
        ngram_drafter: NgramDrafter | None = None,
        forced: str = "",
        token_index=None,
        acceptance: dict | None = None,  # the drafters' running acceptance to update (draft_plan.AcceptanceBook)
    ):
        self.runtime, self.cache, self.stop_ids = runtime, cache, stop_ids
        self.opt = options
        self.model_drafter = model_drafter if options.drafter in ("auto", "model") else None
        self.ngram_drafter = ngram_drafter if options.drafter in ("auto", "ngram") else None
        self.plan = DraftPlan(runtime, options, self.model_drafter, self.ngram_drafter, acceptance)
        self.gen = _generator(options.seed) if options.seed is not None else None
        self.ids: list[int] = []
        self.output: list[int] = []
        self.done = False
        self.finish_reason: str | None = None
        self.stats = StepStats()
        # Token healing (engine/decoding/healing.py): text the first tokens must re-type.
        self.forced = forced if token_index is not None else ""
        self.token_index = token_index
        # Set to a list to record, for every greedy choice (stop tokens included), the token and the logits
        # row it was the argmax of, healing mask applied: how a test tells a near-tie flip from a divergence.
        self.trace: list[tuple[int, Tensor]] | None = None
        # A scheduler's host copy of the argmax of each row of the pass being verified (``Forward.best``):
        # the same tokens ``_choose``/``_verify`` would pick from those rows, without a device sync.
        self._best: list[int] | None = None
        # Whether a token was chosen past the healed text (``options.no_empty`` masks stop tokens until then).
        self._said = False
        # Build verify blocks as host lists (a slotted round copies all of its blocks to the device at once).
        self.host_tokens = False
        self._pending: tuple[Draft, int, Forward] | None = None

    # -- token choice ---------------------------------------------------------
    @property
    def reads_logits(self) -> bool:  # sampling, healing, a trace, no_empty's first free choice (argmax: a stop?)
        return bool(self.opt.temperature > 0 or self.trace is not None or self.forced or self._no_stop_next)

    @property
    def _no_stop_next(self) -> bool:
        """Whether the next free choice (after the healed text) must not be a stop token (``no_empty``)."""
        return self.opt.no_empty and not self._said and bool(self.stop_ids)

    def _choose(self, logits: Tensor | np.ndarray) -> int:
        """The next token from one row of logits (numpy only when greedy with nothing forced: _numpy_rows)."""
        best = None if self.reads_logits else self._best
        if best is not None:  # called with the last row only (and never for no_empty's first free choice)
            return best[-1]
        if not self.forced:
            logits = without(logits, self.stop_ids) if self._no_stop_next else logits
            self._said = True
        if self.forced:
            allowed = self.token_index.allowed_ids(self.forced)  # (looked up once: after a space, 52,820 ids)
            if allowed.size and self.opt.temperature <= 0 and self.trace is None:
                # the same choice as the mask below, without masking the whole row
                tok = constrained_argmax(logits, allowed)
                text = self.token_index.text.get(tok, "")
                self.forced = self.forced[len(text) :] if self.forced.startswith(text) and text else ""
                return tok
            if allowed.size:
                logits = _masked(logits, allowed)
        if self.opt.temperature <= 0:
            tok = greedy_ids(logits.reshape(1, -1))[0]
        else:
            tok = draw(distribution(logits, self.opt.temperature, self.opt.top_p), self.gen)
        if self.trace is not None:
            self.trace.append((tok, logits.detach().clone()))
        if self.forced:
            text = self.token_index.text.get(tok, "")
            self.forced = self.forced[len(text) :] if self.forced.startswith(text) and text else ""
        return tok

    def _commit(self, tokens: list[int]) -> list[int]:
        """Append tokens to the output, stopping at a stop token or the token budget."""
        kept = []
        for t in tokens:
            if t in self.stop_ids:
                self.done, self.finish_reason = True, "stop"
                break
            kept.append(t)
            if len(self.output) + len(kept) >= self.opt.max_tokens:
                self.done, self.finish_reason = True, "length"
                break
        self.output.extend(kept)
        return kept

    # -- the loop ---------------------------------------------------------------
    def prefill(self, prompt: list[int], reuse: int = 0, runs: list[tuple[int, int]] | None = None) -> list[int]:
        """Run the prompt (its first ``reuse`` positions are already in the cache); return the tokens it commits:
        the first token, or with a heal draft (``prefill_draft``) up to all of it and the token after.

        ``runs``: only these [start, end) positions need computing (shift reuse put the rest
        in place); in order, the last one ending at the prompt's end.
        """
        if runs:  # scattered stretches, one pass (compact runtime only: shift reuse needs it)
            positions = [p for a, b in runs for p in range(a, b)]
            import torch  # shift reuse: the compact runtime's

            tokens = torch.tensor([prompt[p] for p in positions], dtype=torch.long, device=self.runtime.device)
            logits = self.runtime.forward_at(tokens, positions, self.cache)[-1:]
            return self.prefill_verified(prompt, [], logits)
        if reuse < self.cache.length:
            self.cache.rollback(reuse)
        draft = self.prefill_draft(len(prompt))
        logits = host_pass(self.runtime, prompt[reuse:] + draft, self.cache, reuse, 1 + len(draft), self.numpy_ok)
        return self.prefill_verified(prompt, draft, logits)

    def prefill_draft(self, prompt_len: int) -> list[int]:
        """Heal draft: the tokens that spell the healed text (engine/decoding/healing.py), fed after the prompt in
        its last pass. The model's constrained choice at each row decides (``prefill_verified``), so the output
        is what one constrained step at a time gives; when the model re-types the text as it is usually spelt, a
        keystroke's first visible token comes from the prompt's own pass instead of one or more passes later.
        Greedy only (a sampled constrained choice stays one token a step)."""
        if not (self.heal_drafts and self.forced and self.opt.temperature <= 0):
            return []
        draft = self.token_index.spell(self.forced, MAX_HEAL_DRAFT)
        return draft if prompt_len + len(draft) < self.cache.max_len else []

    def prefill_verified(self, prompt: list[int], draft: list[int], logits: Tensor) -> list[int]:
        """Choose the first tokens from the prompt pass's last ``len(draft) + 1`` rows of ``logits`` (the draft fed
        after the prompt); keep the accepted drafts in the cache; commit."""
        new: list[int] = []
        for i, tok in enumerate(draft):
            new.append(self._choose(logits[i]))
            if new[-1] != tok:
                break
        else:
            new.append(self._choose(logits[len(draft)]))
        self.cache.rollback(min(self.cache.length, len(prompt) + len(new) - 1))
        self.ids = list(prompt) + new
        return self._commit(new)

    def prefill_done(
        self, prompt: list[int], logits: Tensor, best: list[int] | None = None, draft: list[int] | None = None
    ) -> list[int]:
        """The prompt's last pass is back (``draft``: the heal draft it carried): commit its first tokens."""
        self._best = best
        try:
            return self.prefill_verified(prompt, draft or [], logits)
        finally:
            self._best = None

    @property
    def gamma(self) -> int:
        return self.plan.gamma

    @property
    def costs(self) -> VerifyCosts | None:
        return self.plan.costs

    @costs.setter
    def costs(self, costs: VerifyCosts | None) -> None:
        self.plan.costs = costs

    def next_draft(self) -> Draft | DraftNeed | None:
        """The next step's draft, a DraftNeed where greedy draft-model tokens are needed (a scheduler runs those of
        all its sequences together), or None when decoding is over."""
        if self.done:
            return None
        if len(self.ids) >= self.cache.max_len:
            self.done, self.finish_reason = True, "context"
            return None
        self.plan.new_round()
        if self.forced:  # healing: one constrained token at a time, no drafting
            return Draft([])
        plan = self.plan.choose(self.ids, len(self.output), self.cache.max_len)
        if isinstance(plan, Draft):
            return plan
        if self.opt.temperature > 0:  # sampled drafts carry their distributions: drafted here, alone
            return self.model_drafter.propose(
                self.ids, plan, self.opt.temperature, self.opt.top_p, self.opt.confidence_gate, self.gen
            )
        return DraftNeed(self.model_drafter, self.ids, plan, self.opt.confidence_gate)

    def begin_step(self, draft: Draft) -> Forward:
        """The verify pass of the next step, for ``draft``."""
        k = len(draft.tokens)
        start = len(self.ids) - 1
        block = [self.ids[-1]] + draft.tokens
        numpy = self._numpy_rows
        if not (numpy or self.host_tokens):
            import torch  # a torch runtime's pass

            block = torch.tensor(block, dtype=torch.long, device=self.runtime.device)
        fwd = Forward(block, self.cache, start, k + 1, decoder=self, numpy=numpy, reads_logits=self.reads_logits)
        self._pending = (draft, start, fwd)
        return fwd

    def shorten(self, rows: int) -> None:
        """Cut the pending verify block to ``rows`` rows (its draft to ``rows - 1`` tokens) before it runs.

        Lossless: the committed tokens are still the target's own choices; only fewer drafts are checked."""
        assert self._pending is not None
        draft, start, fwd = self._pending
        if rows >= len(fwd.tokens):
            return
        g = rows - 1
        draft = Draft(draft.tokens[:g], draft.probs[:g] if draft.probs is not None else None)
        fwd.tokens, fwd.num_logits = fwd.tokens[:rows], rows
        self._pending = (draft, start, fwd)

    def expected_tokens(self) -> list[float]:
        """Tokens the pending step commits on average with its first g drafts, for g = 0..len(draft)
        (engine/decoding/draft_plan.py ``expected``)."""
        assert self._pending is not None
        return self.plan.expected(len(self._pending[0].tokens))

    def abandon_step(self) -> None:
        """Drop the pending pass (its text hit a stop meanwhile): the cache goes back to the committed tokens."""
        assert self._pending is not None
        _, start, _ = self._pending
        self._pending = None
        self.cache.rollback(start)

    def end_step(self, logits: Tensor | np.ndarray) -> list[int]:
        """Verify the pending pass's logits: the tokens it commits (possibly none if it stopped)."""
        assert self._pending is not None
        draft, start, fwd = self._pending
        self._pending = None
        self._best = fwd.best
        try:
            return self._finish_round(draft, start, logits)
        finally:
            self._best = None

    def step(self) -> list[int]:
        """One whole step run here, alone: draft, verify pass, verify. Returns the tokens it committed."""
        draft = self.next_draft()
        if draft is None:
            return []
        if isinstance(draft, DraftNeed):
            draft = draft.drafter.propose(draft.context, draft.k, 0.0, 1.0, draft.gate, self.gen)
        fwd = self.begin_step(draft)
        if fwd.numpy:
            logits = self.runtime.numpy_logits(fwd.tokens, fwd.cache, fwd.start, fwd.num_logits)
        else:
            logits = self.runtime(fwd.tokens, fwd.cache, fwd.start, fwd.num_logits)
        return self.end_step(logits)

    @property
    def _numpy_rows(self) -> bool:
        """Greedy, no trace, and a runtime that returns numpy rows (engine/runtimes/ggml_runtime.py): this round
        needs only each row's argmax (under a healing constraint, among the allowed tokens: constrained_argmax)."""
        return self.opt.temperature <= 0 and self.numpy_ok

    @property
    def numpy_ok(self) -> bool:
        """Whether a pass may answer numpy rows: a runtime that gives them, and no trace (it keeps torch rows)."""
        return self.trace is None and self.runtime.numpy_rows

    def _finish_round(self, draft: Draft, start: int, logits: Tensor | np.ndarray) -> list[int]:
        """Verify ``draft`` against the block's ``logits`` (the block fed at ``start``), roll the cache
        back past the rejected drafts, account and commit."""
        new = self._verify(draft, logits)
        n_accepted = len(new) - 1
        self.cache.rollback(start + 1 + n_accepted)  # keep the fed token and the accepted drafts
        self.ids.extend(new)
        k = len(draft.tokens)
        self.stats.steps += 1
        self.stats.drafted += k
        self.stats.accepted += n_accepted
        self.stats.target_tokens += k + 1
        self.plan.account(k, n_accepted, new[0])
        return self._commit(new)

    def _verify(self, draft: Draft, logits: Tensor | np.ndarray) -> list[int]:
        d = draft.tokens
        best = None if self.reads_logits else self._best
        if best is not None:  # (no draft: the one row's argmax, with no tensor indexed)
            n = 0
            while n < len(d) and d[n] == best[n]:
                n += 1
            return d[:n] + [best[n]]
        logits = rows_tensor(logits)
        if not d:
            return [self._choose(logits[-1])]
        if self._no_stop_next:  # the first free choice (drafts come only once the healed text is re-typed)
            logits = without_first(logits, self.stop_ids)
        self._said = True
        if self.opt.temperature <= 0:
            best = greedy_ids(logits)
            n = 0
            while n < len(d) and d[n] == best[n]:
                n += 1
            if self.trace is not None:
                self.trace.extend((best[j], logits[j].detach().clone()) for j in range(n + 1))
            return d[:n] + [best[n]]
        return speculative_sample(draft, distribution(logits, self.opt.temperature, self.opt.top_p), self.gen)


def speculative_sample(draft: Draft, p, gen) -> list[int]:
    """Speculative sampling: the drafted prefix the target accepts, then one token drawn from the residual (or,
    all accepted, from the target's next row). ``p``: the target's distributions, one row per drafted token + 1."""
    d = draft.tokens
    for i, tok in enumerate(d):
        q = draft.probs[i] if draft.probs is not None else None
        if not accept_draft_token(p[i], q, tok, gen):
            return d[:i] + [draw(residual(p[i], q, tok), gen)]
    return d + [draw(p[len(d)], gen)]


def _generator(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def _masked(logits, allowed: np.ndarray):
    """``logits`` with every token but ``allowed`` (an id array, TokenIndex.allowed_ids) at -inf (numpy rows or a
    tensor)."""
    if isinstance(logits, np.ndarray):
        mask = np.full_like(logits, -np.inf)
        mask[allowed] = 0.0
        return logits + mask
    import torch

    mask = torch.full_like(logits, float("-inf"))
    mask[torch.from_numpy(allowed).to(logits.device)] = 0.0
    return logits + mask
