"""Per-document segmented KV caches (engine/caching/kv_store.py): exactness, recompute bounds, memory, pre-warm.

Every comparison is against the same engine recomputing the prompt from scratch
(reuse="none"), with the embedded models, greedy.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import CompletionRequest
from engine.caching.kv_shift import rerotate
from engine.errors import FimbleError
from engine.local import LocalEngine
from engine.options import DecodeOptions
from engine.runtimes.compact import rotate
from tests.engine.kv_sources import definition_lines, stdlib_source

OPTS = DecodeOptions(max_tokens=8)


@pytest.fixture(scope="module")
def engine(embedded_target, embedded_draft):
    return LocalEngine(embedded_target, embedded_draft, start_thread=False)


@pytest.fixture(scope="module")
def compact_engine(compact_target, compact_draft):
    """Shift reuse re-rotates keys in place: the compact runtime's caches (on ggml, shift falls back to exact)."""
    return LocalEngine(compact_target, compact_draft, start_thread=False)


def request(
    prefix: str, suffix: str, doc: str, reuse: str = "exact", lines: list[int] | None = None, opts: DecodeOptions = OPTS
) -> CompletionRequest:
    return CompletionRequest(
        prefix, suffix, options=opts, document_id=doc, reuse=reuse, truncate=True, segment_lines=lines
    )


def scratch(engine: LocalEngine, prefix: str, suffix: str, lines=None, opts: DecodeOptions = OPTS):
    return engine.complete(request(prefix, suffix, "scratch", "none", lines, opts))


def source(engine: LocalEngine, tokens: int) -> str:
    return stdlib_source(engine.target.encode, tokens)


def test_pieces_tokenise_like_the_whole_text(engine):
    text = source(engine, 1000)
    plan = engine.prompts.build(CompletionRequest(text, "", heal=False))
    whole = engine.target.encode(text)
    body = plan.ids[2:-1]  # <suf> <pre> ... <mid> with an empty suffix
    assert body == whole
    assert sum(p.length for p in plan.pieces) == len(plan.ids)
    assert len({s.chain for s in plan.segments}) == len(plan.segments)


def test_segments_follow_definition_lines(engine):
    text = source(engine, 1000)
    lines = definition_lines(text)
    plan = engine.prompts.build(CompletionRequest(text, "", heal=False, segment_lines=lines))
    decode = engine.target.tokenizer.decode
    firsts = {decode(plan.ids[s.start : s.end]).lstrip("\n").split("\n")[0] for s in plan.segments}
    source_lines = text.splitlines()
    assert {source_lines[n] for n in lines} <= firsts


def test_typing_prefills_a_few_tokens_per_keystroke(engine):
    text = source(engine, 1000)
    cursor = text.index("\n", len(text) * 3 // 4) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    lines = definition_lines(text)
    engine.complete(request(prefix, suffix, "typing", lines=lines))  # warm-up
    typed = "    result = compute_value(x, y)"
    counts = []
    for i in range(1, len(typed) + 1):
        r = engine.complete(request(prefix + typed[:i], suffix, "typing", lines=lines))
        counts.append(r.stats["prefilled_tokens"])
        if i % 8 == 0:
            assert r.text == scratch(engine, prefix + typed[:i], suffix, lines).text
    assert sum(counts) / len(counts) <= 4, counts


def _edit_middle(text: str) -> tuple[str, int, int]:
    """Change one line in the middle of ``text``; returns the new text, edit offset and size change."""
    at = text.index("\n", len(text) // 2) + 1
    end = text.index("\n", at)
    line = text[at:end]
    new_line = line + "  # checked" if line.strip() else "# checked"
    return text[:at] + new_line + text[end:], at, len(new_line) - len(line)


def test_mid_file_edit_recompute_bounds(compact_engine):
    engine = compact_engine
    text = source(engine, 3600)
    lines = definition_lines(text)
    cursor = text.index("\n", len(text) * 9 // 10) + 1
    edited, at, grow = _edit_middle(text)
    new_prefix, suffix = edited[: cursor + grow], edited[cursor + grow :]
    plan = engine.prompts.build(request(new_prefix, suffix, "x", lines=definition_lines(edited)))
    old_plan = engine.prompts.build(request(text[:cursor], suffix, "x", lines=lines))
    first_diff = next(i for i, (a, b) in enumerate(zip(plan.ids, old_plan.ids, strict=False)) if a != b)
    seg = next(s for s in plan.segments if s.start <= first_diff < s.end)
    bound = len(plan.ids) - seg.start  # the edited segment's start to the cursor (and <mid>)
    results = {}
    for mode in ("exact", "shift"):
        engine.complete(request(text[:cursor], suffix, "edit-" + mode, lines=lines))
        results[mode] = engine.complete(request(new_prefix, suffix, "edit-" + mode, mode, definition_lines(edited)))
    ref = scratch(engine, new_prefix, suffix, definition_lines(edited))
    assert results["exact"].text == ref.text
    assert results["exact"].stats["prefilled_tokens"] <= bound
    assert bound > 500  # the test means something: the edit is far above the cursor
    # Shift: about the edited line plus the cursor's tail; at most one segment and a few tokens.
    assert results["shift"].stats["prefilled_tokens"] <= seg.length + 8
    assert results["shift"].stats["shifted_tokens"] > 0


@st.composite
def edit_sequences(draw):
    events = []
    for _ in range(draw(st.integers(3, 6))):
        kind = draw(st.sampled_from(["type", "type", "edit", "move", "delete"]))
        events.append(
            (
                draw(st.integers(0, 2)),
                kind,
                draw(st.floats(0.05, 0.95)),
                draw(st.text("abc_ ()\n:", min_size=1, max_size=6)),
                draw(st.booleans()),
            )
        )
    return events


# Examples of random edits: 12 in the heavy suite (tests/heavy.sh), the default suite the first 4 of them (each
# costs about 4 s on 2 cores, every event a recompute from scratch beside the cached answer).
RANDOM_EDIT_EXAMPLES = 12
DEFAULT_RANDOM_EDIT_EXAMPLES = 4


def _random_edits_test(examples: int):
    """The property test with ``examples`` examples. Both sizes share one source, so one derandomized seed: the
    same examples on every run (no database either). A random search found the one below, which fails, and a test
    that fails on some runs only would stall CI at random; that example stays in the suite as a known failure."""

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(events=edit_sequences())
    def test(engine, events):
        _replay_edits(engine, events)

    return test


test_exact_reuse_equals_recompute_under_random_edits = _random_edits_test(DEFAULT_RANDOM_EDIT_EXAMPLES)
test_exact_reuse_equals_recompute_under_more_random_edits = pytest.mark.heavy(_random_edits_test(RANDOM_EDIT_EXAMPLES))


# An edit above the cursor: 360 of 517 prompt tokens reused, 157 recomputed, and the answer differs from a recompute
# at a near-tie. ggml sums a product in one order in passes of up to 32 rows and in another from 33 (tinyBLAS), so a
# cached position's keys/values depend on the pass that computed them. A fix (positions shaped into pass classes)
# exists on the kvexact branch but cost the keystroke path too much to merge yet (typing shutil.py: CPU 54 against
# 29 s per typing minute, new-line p50 271 against 130 ms): issue 23's note, 2026-12-04.
EDIT_ABOVE_THE_CURSOR = [
    (1, "type", 0.05, "(a\n__c", False),
    (1, "edit", 0.13056152159374418, " a", False),
    (1, "move", 0.45323330668395345, ":", False),
    (1, "type", 0.844014295550398, "ab", False),
    (1, "edit", 0.15721801602163582, ":(cbac", False),
    (0, "type", 0.5, ":", False),
]


@pytest.mark.xfail(strict=True, reason="exact reuse across pass shapes is not bit-identical on ggml (see above)")
def test_exact_reuse_equals_recompute_after_an_edit_above_the_cursor(embedded_target, embedded_draft):
    _replay_edits(LocalEngine(embedded_target, embedded_draft, start_thread=False), EDIT_ABOVE_THE_CURSOR)


def _replay_edits(engine: LocalEngine, events: list) -> None:
    files = [source(engine, n) for n in (300, 500, 700)]
    cursors = [len(f) * 2 // 3 for f in files]
    for doc, kind, where, text, shift_first in events:
        body, cur = files[doc], cursors[doc]
        if kind == "type":
            body = body[:cur] + text + body[cur:]
            cur += len(text)
        elif kind == "edit":  # elsewhere in the file, the cursor stays
            at = int(len(body) * where)
            body = body[:at] + text + body[at:]
            cur += len(text) if at <= cur else 0
        elif kind == "delete":
            at = int(len(body) * where)
            n = min(len(text), len(body) - at)
            body = body[:at] + body[at + n :]
            cur = cur - min(n, max(0, cur - at)) if at < cur else cur
        else:
            cur = int(len(body) * where)
        files[doc], cursors[doc] = body, cur
        prefix, suffix = body[:cur], body[cur:]
        lines = definition_lines(body)
        if shift_first:  # approximate keys/values left behind must never leak into exact answers
            engine.complete(request(prefix, suffix, f"doc{doc}", "shift", lines))
        got = engine.complete(request(prefix, suffix, f"doc{doc}", "exact", lines))
        assert got.text == scratch(engine, prefix, suffix, lines).text


# Files opened under a budget of one context window and a half (6,144 tokens; each file about 260): 50 in the heavy
# suite (tests/heavy.sh), 30 in the default one (about 7,900 tokens: files are still evicted; 19 s against 25 s).
FILES = 50
DEFAULT_FILES = 30


@pytest.mark.parametrize("files", [pytest.param(FILES, marks=pytest.mark.heavy), DEFAULT_FILES])
def test_memory_budget_holds_with_many_files(embedded_target, embedded_draft, files):
    probe = LocalEngine(embedded_target, embedded_draft, start_thread=False)
    budget = embedded_target.max_len * probe.store.bpt * 3 // 2  # one context window and a half
    engine = LocalEngine(embedded_target, embedded_draft, start_thread=False, kv_budget_bytes=budget)
    base = source(engine, 250)
    for i in range(files):
        body = f"# file {i}\n" + base
        engine.complete(request(body, "", f"file{i}"))
        c = engine.counters()
        assert c["kv_bytes"] <= budget
        assert c["kv_bytes"] == sum(d.capacity for d in engine.store.docs.values()) * engine.store.bpt
    c = engine.counters()
    assert c["kv_evictions"] > 0 and c["kv_documents"] < files
    # The most recent file is still whole: asking again prefills only the last token.
    again = engine.complete(request(f"# file {files - 1}\n" + base, "", f"file{files - 1}"))
    assert again.stats["prefilled_tokens"] == 1
    # A file that needs the whole budget evicts the others, never itself, and stays exact.
    big = source(engine, 3000)
    got = engine.complete(request(big, "", "big"))
    assert engine.counters()["kv_bytes"] <= budget
    assert got.text == scratch(engine, big, "").text


def test_budget_below_one_window_is_refused(embedded_target):
    with pytest.raises(FimbleError, match="below one context window"):
        LocalEngine(embedded_target, None, start_thread=False, kv_budget_bytes=1 << 20)


def test_another_document_with_the_same_leading_text_borrows_it(engine):
    text = source(engine, 1200)
    engine.complete(request(text, "", "original"))
    copy = engine.complete(request(text + "\n", "", "copy"))
    assert copy.stats["reused_tokens"] > 1000
    assert copy.text == scratch(engine, text + "\n", "").text


def test_prewarm_fills_the_cache_and_yields_to_completions(embedded_target, embedded_draft):
    engine = LocalEngine(embedded_target, embedded_draft)  # with its worker thread
    try:
        text = source(engine, 3000)
        small = source(engine, 300)
        engine.prewarm(request(text, "", "big"))
        time.sleep(0.2)  # the pre-warm is running now
        engine.complete(request(small, "", "small"))
        # The keystroke was answered while the 3k-token pre-warm was still unfinished: it waited for one chunk, not
        # the whole prefill (a count, not a time: a busy machine made the old 250 ms bound fail, 2026-12-07).
        assert engine.counters()["prewarms_done"] == 0
        deadline = time.time() + 60
        while engine.counters()["prewarms_done"] < 1 and time.time() < deadline:
            time.sleep(0.05)
        c = engine.counters()
        assert c["prewarms_preempted"] >= 1 and c["prewarms_done"] >= 1
        r = engine.complete(request(text, "", "big"))
        assert r.stats["prefilled_tokens"] == 1
    finally:
        engine.close()


def test_rerotating_keys_equals_rotating_at_the_new_position(compact_target):
    rt = compact_target.runtime
    rt._ensure_rope(600)
    keys = torch.randn(2, 5, rt.cfg.head_dim)
    at_100 = rotate(keys, rt.rope_cos[100:105], rt.rope_sin[100:105])
    at_530 = rotate(keys, rt.rope_cos[530:535], rt.rope_sin[530:535])
    assert torch.allclose(rerotate(at_100, 430, rt.inv_freq), at_530, atol=1e-4)
    assert torch.allclose(rerotate(at_530, -430, rt.inv_freq), at_100, atol=1e-4)


def test_transformers_backend_keeps_per_document_caches(tmp_path):
    """Architectures outside the compact runtime reuse exactly too, with a bounded number of documents."""
    from engine.caching.kv_store import UNSIZED_DOCUMENTS
    from engine.loader import load_model
    from tests.conftest import build_tiny_model

    folder = build_tiny_model(
        tmp_path / "sc2",
        model_type="starcoder2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = load_model(folder)
    assert model.backend != "compact"
    engine = LocalEngine(model, None, start_thread=False)
    text = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n" * 4
    first = engine.complete(request(text, "", "doc"))
    typed = engine.complete(request(text + "de", "", "doc"))
    assert typed.stats["reused_tokens"] >= first.stats["prompt_tokens"] - 2
    assert typed.text == engine.complete(request(text + "de", "", "other", "none")).text
    for i in range(UNSIZED_DOCUMENTS + 3):
        engine.complete(request(f"# {i}\n" + text, "", f"file{i}"))
    assert engine.counters()["kv_documents"] <= UNSIZED_DOCUMENTS
