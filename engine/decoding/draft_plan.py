"""Which drafter drafts a step and how many tokens: n-gram first, the draft model otherwise; adaptive gamma
(+2 after a fully accepted draft, -1 otherwise) or, on runtimes that ask for it, cost-aware lengths
(engine/decoding/spec_policy.py); the running acceptance of each drafter."""

from __future__ import annotations

import copy
from collections import OrderedDict

from engine.caching.kv_store import session_of
from engine.decoding.drafters import Draft, ModelDrafter, NgramDrafter
from engine.decoding.spec_policy import Acceptance, VerifyCosts, best_draft, choose_gamma, verify_costs
from engine.options import DecodeOptions

DRAFTER_KINDS = ("ngram", "ngram2", "ngram1", "model")
# Prompt lookup keeps a record per match length: "ngram1" and "ngram2" for drafts found by matching the context's last
# one or two tokens, "ngram" for three or more. Their drafts differ in kind, not degree. Simulated on the greedy
# output of 12 of bench/vs_llamacpp.py's cold prompts (default model; bench/reports/draft-choice-2026-12-07/):
# the first drafted token was the target's own 27% of the time after a 1-token match (319 drafts), 54% after 2 (140),
# 64% after 3 (84) and 79% after 4 (302), whose first four tokens all held 48% of the time (1-token matches: 8%). One
# record for all drafted 2-3 tokens on a 1-token match and too few on a 4-token one. Priors from those figures; 0.75
# otherwise.
PRIORS = {"ngram1": 0.3, "ngram2": 0.5}
# A completion's first verify pass has its own record per drafter. Right after the prompt, a keystroke's completion
# often ends within a token or two (" );" then the end), and prompt lookup replays the previous completion, which the
# user's typing has just departed from. Typing 30 keys into three files (2 threads), the first token of prompt
# lookup's opening drafts was accepted 9 times in 37-45, that of its later drafts 53-56 times in 135-152: one record
# for both drafted 2-3 tokens at the opening (3-4 rows, 1.5-1.9 steps) where the completion most often ended.
OPENING = "@opening"

# A draft model whose cache lacks much of the context must prefill it before it drafts (the default model's drafter:
# 350 ms for a 1,000-token prompt on 2 cores; a keystroke's re-evaluated 256-token suffix, 90 ms). Where that prefill
# would take over DEFER_SYNC_S at the drafter's measured prefill rate, it waits until the completion has produced its
# first tokens, which are what the editor shows first; the background fills the document's draft cache between
# keystrokes (engine/background.py). (The embedded pair's draft prefills ~10x faster: rarely deferred.)
DEFER_SYNC_S = 0.03
DEFER_UNTIL_PRODUCED = 16

# Under fed rounds (engine/fed_rounds.py, fimble serve on CUDA) a sequence's plain step is fed on the device and
# runs every round, while a draft's verify block leaves it out of the next round (its start depends on what the
# block accepts): a draft must then commit this many tokens on average to pay for the round it costs.
FED_DRAFT_TOKENS = 2.0


def fresh_acceptance() -> dict[str, Acceptance]:
    """Each drafter kind's acceptance at its prior, for a completion's opening pass and for the rest."""
    return {kind + phase: Acceptance(prior=PRIORS.get(kind, 0.75)) for kind in DRAFTER_KINDS for phase in ("", OPENING)}


def ngram_kind(match: int) -> str:
    """The record of a prompt-lookup draft that matched ``match`` tokens of the context."""
    return "ngram" if match >= 3 else f"ngram{max(1, match)}"


class AcceptanceBook:
    """Each drafter's running acceptance per (document, syntax context), carried from one request to the next.

    A keystroke's completion is short (1-16 tokens): one that started from the prior (0.75) drafted two or three
    tokens at its first steps whatever the document had shown. Typing into three files at 2 threads, prompt
    lookup's drafts were accepted 32% of the time, and its 3-row passes (1.5 steps each) made the median time to the
    first line 134 ms against 107 ms without drafting. Carried over, the record of the same document and context
    sizes the next completion's drafts from its first step. A document's first request starts from a copy of its
    session's latest record for the context (the user's typing carries over to the next file), else the prior. Keys
    are document ids, so one client session's record never times another's drafts; the least recently used are
    dropped beyond ``limit``."""

    def __init__(self, limit: int = 1024):
        self.limit = limit
        self._book: OrderedDict[tuple[str, str], dict[str, Acceptance]] = OrderedDict()
        self._latest: dict[tuple[str, str], tuple[str, str]] = {}  # (session, context) -> its latest key

    def get(self, document_id: str, context: str) -> dict[str, Acceptance]:
        key, latest = (document_id, context), (session_of(document_id), context)
        record = self._book.pop(key, None)
        if record is None:
            seed = self._book.get(self._latest.get(latest, key))
            record = copy.deepcopy(seed) if seed is not None else fresh_acceptance()
        self._book[key] = record  # most recently used last
        self._latest.pop(latest, None)
        self._latest[latest] = key  # (a key dropped from the book seeds nothing: get() finds no record)
        for table in (self._book, self._latest):
            while len(table) > self.limit:
                del table[next(iter(table))]
        return record

    def __len__(self) -> int:
        return len(self._book)


class DraftPlan:
    def __init__(
        self,
        runtime,
        options: DecodeOptions,
        model_drafter: ModelDrafter | None,
        ngram_drafter: NgramDrafter | None,
        acceptance: dict[str, Acceptance] | None = None,
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
        # Updated in place: an AcceptanceBook's record carries it to the document's next request.
        self.acceptance = acceptance if acceptance is not None else fresh_acceptance()
        self.kind = ""  # which drafter drafted this round
        self.record: Acceptance | None = None  # the acceptance record this round's draft is scored in
        self.shadow: list[int] = []  # an n-gram draft the policy chose not to verify
        self.shadow_record: Acceptance | None = None  # the record it is scored in against the next token
        self.opening = True  # no drafter consulted yet in this decode
        self.fed = False  # set by fed rounds: a draft must be worth FED_DRAFT_TOKENS

    def new_round(self) -> None:
        self.kind, self.record, self.shadow, self.shadow_record = "", None, [], None

    def _use(self, kind: str, opening: bool) -> Acceptance:
        """Make ``kind`` this round's drafter; its record for the opening pass or the rest."""
        self.kind = kind
        self.record = self.acceptance[kind + (OPENING if opening else "")]
        return self.record

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
        opening, self.opening = self.opening, False
        phase = OPENING if opening else ""
        model_ready = self.model_drafter is not None and not self._model_deferred(ids, produced)
        draft = self.ngram_drafter.propose(ids, k) if self.ngram_drafter is not None else Draft([])
        model_best: tuple[int, float] | None = None  # the draft model's (length, rate), where weighed against lookup's
        if draft.tokens:
            kind = ngram_kind(draft.match)
            # Where costs are unknown, prompt lookup drafts when it found two tokens or more, or when no draft model
            # can; where they are known, whichever of the two commits more tokens per unit of time.
            use_ngram = not model_ready or len(draft.tokens) >= 2
            if self.costs is not None and model_ready:
                ngram_g, ngram_rate = best_draft(self.costs, self.acceptance[kind + phase], len(draft.tokens))
                model_best = best_draft(self.costs, self.acceptance["model" + phase], k, self.draft_cost)
                use_ngram = ngram_rate >= model_best[1]
                if use_ngram:
                    self.acceptance["model" + phase].forget()  # skipped: drift back toward the prior
                    return self._ngram_draft(draft, kind, opening, ngram_g)
            elif use_ngram:
                return self._ngram_draft(draft, kind, opening)
            self.shadow, self.shadow_record = draft.tokens, self.acceptance[kind + phase]  # scored all the same
        if not model_ready:
            return Draft([])  # none, or its cache is cold: no prefill before the completion's first tokens are out
        record = self._use("model", opening)
        if model_best is not None:  # its length, weighed against the lookup draft's above
            k = model_best[0]
        elif self.costs is not None:
            k = choose_gamma(self.costs, record, k, self.draft_cost)
        if k and self.fed and record.expected_tokens(k) < FED_DRAFT_TOKENS:
            k = 0
        if k == 0:  # skipped: drift back toward the prior, so it is tried again later
            record.forget()
            return Draft([])
        return k

    def _model_deferred(self, ids: list[int], produced: int) -> bool:
        """Whether the draft model waits: its cache would take over DEFER_SYNC_S to catch up on ``ids`` and the
        completion has not produced its first DEFER_UNTIL_PRODUCED tokens yet."""
        return (
            self.draft_prefill_rate > 0
            and produced < DEFER_UNTIL_PRODUCED
            and self.model_drafter.missing(ids) > DEFER_SYNC_S * self.draft_prefill_rate
        )

    def _ngram_draft(self, draft: Draft, kind: str, opening: bool, g: int | None = None) -> Draft:
        """A prompt-lookup draft, cut to the length that pays (``g`` where already weighed; scored in ``kind``'s
        record)."""
        record = self._use(kind, opening)
        if self.costs is not None:
            if g is None:
                g = choose_gamma(self.costs, record, len(draft.tokens))
            if g == 0:  # not worth a verify row; still scored against the next token
                self.shadow, self.shadow_record = draft.tokens, record
            draft = Draft(draft.tokens[:g], match=draft.match)
        if self.fed and draft.tokens and record.expected_tokens(len(draft.tokens)) < FED_DRAFT_TOKENS:
            self.shadow, self.shadow_record = draft.tokens, record  # a fed step pays more; scored all the same
            draft = Draft([], match=draft.match)
        return draft

    def account(self, k: int, n_accepted: int, first: int) -> None:
        """Acceptance estimates and adaptive gamma after a verify pass of ``k`` drafts (``first``: its first
        committed token)."""
        if self.record is not None and k:
            self.record.update(k, n_accepted)
        if self.shadow and self.shadow_record is not None:
            self.shadow_record.update(1, int(self.shadow[0] == first))
        if self.opt.adaptive_gamma and k:
            self.gamma = min(self.opt.max_gamma, self.gamma + 2) if n_accepted == k else max(1, self.gamma - 1)

    def expected(self, k: int) -> list[float]:
        """Tokens a step commits on average with its first g of ``k`` drafts, for g = 0..k (this round's drafter's
        running acceptance, per draft position)."""
        curve = [1.0]
        if self.record is None:
            return curve * (k + 1)
        acceptance, survive = self.record, 1.0
        for i in range(k):
            survive *= acceptance.rate(i)
            curve.append(curve[-1] + survive)
        return curve
