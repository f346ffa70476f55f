"""Drafters' acceptance carried from one request to the next (engine/decoding/draft_plan.py AcceptanceBook), and a
completion's opening pass scored in its own record: the records, the plan's use of them, and the engine's."""

from __future__ import annotations

import pytest

from engine.api import CompletionRequest
from engine.decoding.draft_plan import OPENING, AcceptanceBook, DraftPlan, fresh_acceptance
from engine.decoding.drafters import NgramDrafter
from engine.decoding.spec_policy import VerifyCosts
from engine.errors import PromptError
from engine.options import MAX_CONTEXT_CHARS, DecodeOptions
from engine.wire import request_from_dict
from lsp_server.shaping.policy import decide_for_context

# Costs where a verify row costs 0.15 of a step: a draft of one token pays from about 20% acceptance.
COSTS = VerifyCosts((1, 2, 3, 4), (1.0, 1.15, 1.5, 1.85), 0.03)


def trials(record: dict) -> dict[str, float]:
    return {kind: a.trials[0] for kind, a in record.items()}


def test_a_document_and_context_keep_one_record():
    book = AcceptanceBook()
    a = book.get("s1\x00a.py", "block_body")
    a["ngram"].update(2, 0)
    assert book.get("s1\x00a.py", "block_body") is a
    other_context = book.get("s1\x00a.py", "comment")
    assert other_context is not a and trials(other_context) == trials(fresh_acceptance())


def test_a_new_document_starts_from_a_copy_of_its_sessions_latest_record():
    book = AcceptanceBook()
    a = book.get("s1\x00a.py", "block_body")
    for _ in range(5):
        a["ngram" + OPENING].update(3, 0)
    b = book.get("s1\x00b.py", "block_body")
    assert b is not a and b["ngram" + OPENING] is not a["ngram" + OPENING]
    assert b["ngram" + OPENING].rate(0) == a["ngram" + OPENING].rate(0) < 0.3
    b["ngram"].update(1, 1)  # the copy moves alone
    assert a["ngram"].trials[0] != b["ngram"].trials[0]
    # Another client session's document never starts from this session's record.
    assert trials(book.get("s2\x00a.py", "block_body")) == trials(fresh_acceptance())


def test_the_book_drops_the_least_recently_used_beyond_its_limit():
    book = AcceptanceBook(limit=2)
    first = book.get("a", "")
    book.get("b", "")
    book.get("a", "")  # used again: "b" is now the oldest
    book.get("c", "")
    assert len(book) == 2
    assert book.get("a", "") is first


def test_the_opening_pass_and_the_rest_are_scored_in_their_own_records():
    record = fresh_acceptance()
    opts = DecodeOptions(max_tokens=32, drafter="ngram")
    ngram = NgramDrafter()

    class Runtime:
        cost_aware_drafting = False

    plan = DraftPlan(Runtime(), opts, None, ngram, record)
    plan.costs = COSTS
    ids = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # "1 2 3" seen before: prompt lookup drafts "4 5 6"
    before = trials(record)
    plan.new_round()
    draft = plan.choose(ids, 1, 100)
    assert draft.tokens and plan.record is record["ngram" + OPENING]
    plan.account(len(draft.tokens), 0, 9)
    after = trials(record)
    assert after["ngram" + OPENING] > before["ngram" + OPENING] and after["ngram"] == before["ngram"]
    plan.new_round()
    draft = plan.choose(ids, 2, 100)
    assert plan.record is record["ngram"]
    plan.account(len(draft.tokens), len(draft.tokens), 4)
    assert trials(record)["ngram"] > after["ngram"]


def test_an_opening_record_that_keeps_failing_stops_the_opening_drafts():
    record = fresh_acceptance()
    for _ in range(8):
        record["ngram" + OPENING].update(3, 0)

    class Runtime:
        cost_aware_drafting = False

    plan = DraftPlan(Runtime(), DecodeOptions(max_tokens=32, drafter="ngram"), None, NgramDrafter(), record)
    plan.costs = COSTS
    ids = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    plan.new_round()
    assert plan.choose(ids, 1, 100).tokens == []  # not worth a row at the opening
    assert plan.shadow  # still scored against the next token
    plan.new_round()
    assert plan.choose(ids, 2, 100).tokens  # the rest's record is still the prior's


def test_the_context_is_checked_and_crosses_the_wire():
    with pytest.raises(PromptError):
        DecodeOptions(context="x" * (MAX_CONTEXT_CHARS + 1)).validate()
    opts = decide_for_context("call_args", mid_line=True).to_options()
    assert opts.context == "call_args/mid_line"
    request = request_from_dict(CompletionRequest("a", "b", opts, document_id="d").to_dict())
    assert request.options.context == "call_args/mid_line"


PREFIX = "import os\n\n\ndef list_python_files(root):\n    result = []\n    for name in os.listdir(root):\n"
SUFFIX = "\n    return result\n"


@pytest.fixture(scope="module")
def engine(embedded_engine):
    return embedded_engine


def test_the_engine_carries_a_documents_record_and_its_output_stays_plain(engine):
    opts = DecodeOptions(max_tokens=24, context="block_body")
    request = CompletionRequest(PREFIX, SUFFIX, opts, document_id="s1\x00list.py")
    record = engine.drafter_set.acceptance_for(request)
    before = sum(trials(record).values())
    first = engine.complete(request)
    assert engine.drafter_set.acceptance_for(request) is record
    assert sum(trials(record).values()) > before  # the decode's drafts were scored in the document's record
    again = engine.complete(CompletionRequest(PREFIX, SUFFIX, opts, document_id="s1\x00list.py"))
    plain = engine.complete(
        CompletionRequest(PREFIX, SUFFIX, DecodeOptions(max_tokens=24, drafter="none"), document_id="s1\x00plain.py")
    )
    assert first.text == again.text == plain.text  # timing only: the committed tokens are the target's


def test_a_seeded_sampled_request_starts_from_the_prior(engine):
    sampled = CompletionRequest(PREFIX, SUFFIX, DecodeOptions(temperature=0.8, seed=3), document_id="s1\x00list.py")
    assert engine.drafter_set.acceptance_for(sampled) is None
    unseeded = CompletionRequest(PREFIX, SUFFIX, DecodeOptions(temperature=0.8), document_id="s1\x00list.py")
    assert engine.drafter_set.acceptance_for(unseeded) is not None


def test_fimble_serve_takes_a_context_and_refuses_a_long_one():
    from engine.serve.protocol import ProtocolError, parse_request

    opts = decide_for_context("block_body").to_options()
    data = CompletionRequest("a", "b", opts, document_id="d").to_dict()
    assert parse_request(data, "s1").options.context == "block_body"
    data["options"]["context"] = "x" * (MAX_CONTEXT_CHARS + 1)
    with pytest.raises(ProtocolError):
        parse_request(data, "s1")
    data["options"]["context"] = 3
    with pytest.raises(ProtocolError):
        parse_request(data, "s1")
