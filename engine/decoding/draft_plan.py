"""Which drafter drafts a step and how many tokens: n-gram first, the draft model otherwise; adaptive gamma
(+2 after a fully accepted draft, -1 otherwise) or, on runtimes that ask for it, cost-aware lengths
(engine/decoding/spec_policy.py); the running acceptance of each drafter."""

from __future__ import annotations

from engine.decoding.drafters import Draft, ModelDrafter, NgramDrafter
from engine.decoding.spec_policy import Acceptance, VerifyCosts, choose_gamma, verify_costs
from engine.options import DecodeOptions

# A draft model whose cache lacks much of the context must prefill it before it drafts (the default model's drafter:
# 350 ms for a 1,000-token prompt on 2 cores; a keystroke's re-evaluated 256-token suffix, 90 ms). Where that prefill
# would take over DEFER_SYNC_S at the drafter's measured prefill rate, it waits until the completion has produced its
# first tokens, which are what the editor shows first; the background fills the document's draft cache between
# keystrokes (engine/background.py). (The embedded pair's draft prefills ~10x faster: rarely deferred.)
DEFER_SYNC_S = 0.03
DEFER_UNTIL_PRODUCED = 16


class DraftPlan:
    def __init__(
        self, runtime, options: DecodeOptions, model_drafter: ModelDrafter | None, ngram_drafter: NgramDrafter | None
    ):
        self.opt = options
        self.model_drafter, self.ngram_drafter = model_drafter, ngram_drafter
        self.gamma = options.gamma
        # Cost-aware speculation (engine/decoding/spec_policy.py): with adaptive gamma, each round
        # drafts only as many tokens as pay for their verification on this runtime.
        self.costs: VerifyCosts | None = None
        self.draft_cost = 0.0  # a draft model step, in target steps
        self.draft_prefill_rate = 0.0  # the draft model's prompt tokens a second; 0: unknown (never deferred)
        # Only runtimes that ask for it (the ggml runtime, whose q8_0 verify rows cost about as much as a
        # step each): on the compact runtime the policy measured no better than the +2/-1 rule, and its
        # one-time cost probe would delay the first completion, so the default path keeps that rule.
        if (
            runtime.cost_aware_drafting
            and options.adaptive_gamma
            and options.gamma > 0
            and (model_drafter or ngram_drafter)
        ):
            self.costs = verify_costs(runtime)
            if model_drafter is not None and self.costs.step_s > 0:
                own = verify_costs(model_drafter.runtime)
                self.draft_cost = own.step_s / self.costs.step_s if own.step_s > 0 else 0.0
                self.draft_prefill_rate = own.prefill_rate
        self.acceptance = {"ngram": Acceptance(), "model": Acceptance()}
        self.kind = ""  # which drafter drafted this round
        self.shadow: list[int] = []  # an n-gram draft the policy chose not to verify

    def new_round(self) -> None:
        self.kind, self.shadow = "", []

    def choose(self, ids: list[int], produced: int, max_len: int) -> Draft | int:
        """This round's draft after ``ids`` (``produced`` of them output so far, in a cache of ``max_len``): an
        n-gram draft, or how many tokens to ask the draft model for."""
        opt = self.opt
        k = self.gamma if opt.gamma > 0 else 0
        if self.costs is not None:  # the policy picks the length: its ceiling is max_gamma
            k = opt.max_gamma
        k = min(k, opt.max_tokens - produced, max_len - len(ids))
        if k <= 0:
            return Draft([])
        if self.ngram_drafter is not None:
            draft = self.ngram_drafter.propose(ids, k)
            if len(draft.tokens) >= 2 or self.model_drafter is None:
                self.kind = "ngram"
                if self.costs is not None and draft.tokens:
                    g = choose_gamma(self.costs, self.acceptance["ngram"], len(draft.tokens))
                    if g == 0:  # not worth a verify row; still scored against the next token
                        self.shadow = draft.tokens
                    draft = Draft(draft.tokens[:g])
                return draft
        if self.model_drafter is None:
            return Draft([])
        if (
            self.draft_prefill_rate > 0
            and produced < DEFER_UNTIL_PRODUCED
            and self.model_drafter.missing(ids) > DEFER_SYNC_S * self.draft_prefill_rate
        ):
            return Draft([])  # its cache is cold: no prefill of it before the completion's first tokens are out
        self.kind = "model"
        if self.costs is not None:
            k = choose_gamma(self.costs, self.acceptance["model"], k, self.draft_cost)
            if k == 0:  # skipped: drift back toward the prior, so it is tried again later
                self.acceptance["model"].forget()
                return Draft([])
        return k

    def account(self, k: int, n_accepted: int, first: int) -> None:
        """Acceptance estimates and adaptive gamma after a verify pass of ``k`` drafts (``first``: its first
        committed token)."""
        if self.kind and k:
            self.acceptance[self.kind].update(k, n_accepted)
        elif self.shadow:
            self.acceptance["ngram"].update(1, int(self.shadow[0] == first))
        if self.opt.adaptive_gamma and k:
            self.gamma = min(self.opt.max_gamma, self.gamma + 2) if n_accepted == k else max(1, self.gamma - 1)

    def expected(self, k: int) -> list[float]:
        """Tokens a step commits on average with its first g of ``k`` drafts, for g = 0..k (this round's drafter's
        running acceptance, per draft position)."""
        curve = [1.0]
        if not self.kind:
            return curve * (k + 1)
        acceptance, survive = self.acceptance[self.kind], 1.0
        for i in range(k):
            survive *= acceptance.rate(i)
            curve.append(curve[-1] + survive)
        return curve
