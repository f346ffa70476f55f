"""Detokenisation, stop rules, FIM templates, healing and the n-gram drafter."""

from __future__ import annotations

import pytest
from conftest import TARGET_DIR
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.decoding.detok import IncrementalDetokenizer, StopRules
from engine.decoding.drafters import NgramDrafter
from engine.decoding.healing import split_heal, unheal
from engine.fim import TEMPLATES, detect_template


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET_DIR)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_streamed_text_round_trips_and_never_splits_a_character(tokenizer, text):
    # As the engine encodes document text (engine/loader.py): control-token strings stay text.
    ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces if "\ufffd" not in text)


@pytest.mark.parametrize("folder", ["fimble-target", "fimble-smollm2"])
def test_backend_decode_equals_the_tokenizers_decode(folder):
    """IncrementalDetokenizer decodes through the fast tokenizer's backend: the same text as ``decode``."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET_DIR.parent / folder)
    detok = IncrementalDetokenizer(tok)
    assert detok._backend is not None  # the fast path is the one taken
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))] + rng.sample(special, 1)
        rng.shuffle(ids)
        assert detok._decode(ids) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_control_token_strings_in_a_document_stay_text(embedded_target):
    """A file that mentions FIM tokens (a tokenizer's own source, say) must not steer the prompt."""
    from engine.api import CompletionRequest
    from engine.local import LocalEngine

    engine = LocalEngine(embedded_target, None, start_thread=False)
    names = [t for t in embedded_target.tokenizer.all_special_tokens if t.startswith("<|")]
    assert len(names) >= 4, names
    text = "MARKERS = " + repr(names) + "\n"
    ids, _, _ = engine.build_prompt(CompletionRequest(text, text))
    special = set(embedded_target.tokenizer.all_special_ids)
    template = [i for i in ids if i in special]
    assert len(template) == 3, template  # the template's suffix, prefix and middle markers, once each
    assert embedded_target.tokenizer.decode(ids, skip_special_tokens=True).count(repr(names)) == 2


def test_multibyte_character_split_across_tokens(tokenizer):
    text = "s = '😀✓é'"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) - 3, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer)
    out = [detok.add([i]) for i in ids]
    assert "".join(out) == text and not any("\ufffd" in p for p in out)


def test_stop_rules_cut_and_hold_back():
    rules = StopRules(stop=("\ndef ",), max_lines=2)
    assert rules.cut("a\nb\nc") == ("a\nb", True)
    assert rules.cut("x = 1\nde") == ("x = 1\nde", False)
    assert rules.cut("x = 1\ndef g():") == ("x = 1", True)
    assert rules.safe_length("x = 1\nde") == len("x = 1")


@pytest.mark.parametrize(
    "name,tokens",
    [
        ("fimble", ["<|fim_pre|>", "<|fim_suf|>", "<|fim_mid|>"]),
        ("qwen2.5-coder", ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]),
        ("starcoder2", ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]),
        ("deepseek-coder", ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"]),
        ("codestral", ["[PREFIX]", "[SUFFIX]", "[MIDDLE]"]),
        ("codellama", ["▁<PRE>", "▁<SUF>", "▁<MID>"]),
    ],
)
def test_template_detected_from_special_tokens(name, tokens):
    vocab = {"a", "b", *tokens}
    assert detect_template(vocab).name == name


def test_embedded_model_gets_suffix_first_template(tokenizer):
    t = detect_template(set(tokenizer.get_vocab()))
    assert t.name == "fimble" and t.order == "spm"
    assert t.build("PRE", "SUF") == "<|fim_suf|>SUF<|fim_pre|>PRE<|fim_mid|>"
    assert TEMPLATES["qwen2.5-coder"].build("P", "S") == "<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>"


def test_unknown_vocab_has_no_template():
    assert detect_template({"a", "b"}) is None


def test_healing_splits_indentation_and_ragged_words():
    # newline=False: the older rule (newline healing is tested in test_real_model_fixes.py).
    assert split_heal("if x:\n        ", "\n        ", newline=False) == ("if x:\n", "        ", False)
    assert split_heal("os.pa", "pa") == ("os.", "pa", True)
    # spaces after a word are re-typed too; spaces alone on a line are indentation, handled above
    assert split_heal("x = 1\n    def ", " ") == ("x = 1\n    def", " ", True)
    assert split_heal("    ", "    ") == ("    ", "", False)
    assert split_heal("x = 1\n", "\n", newline=False) == ("x = 1\n", "", False)
    assert unheal("        return x", "        ", False) == "return x"
    assert unheal("path)", "pa", True) == "th)"


def test_ngram_drafter_copies_from_context_and_history():
    d = NgramDrafter(max_ngram=3)
    ctx = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3]
    assert d.propose(ctx, 3).tokens == [4, 5, 6]
    assert d.propose([7, 8], 2).tokens == []
    d.remember([7, 8, 10, 11])
    assert d.propose([0, 7, 8], 2).tokens == [10, 11]


def _reference_ngram_draft(context, k, recent, max_ngram):
    """NgramDrafter's rule written plainly: the longest n-gram first; the context, then completions newest first."""
    for n in range(min(max_ngram, len(context)), 0, -1):
        tail = context[-n:]
        for source, limit in [(context, len(context) - 1)] + [(p, len(p) - 1) for p in reversed(recent)]:
            for start in range(limit - n, -1, -1):  # the last occurrence with a token after it
                if source[start : start + n] == tail:
                    return source[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), max_size=12), max_size=5),
    st.lists(st.integers(0, 5), min_size=1, max_size=30),
    st.lists(st.integers(0, 5), max_size=4),
    st.integers(1, 6),
)
def test_ngram_drafter_matches_the_plain_rule(history, context, grown, k):
    """Drafts equal the plain rule, also when the context list grows between calls (cached bytes)."""
    d = NgramDrafter(max_ngram=3, history=4)
    for past in history:
        d.remember(past)
    recent = [p for p in history if p][-4:]
    assert d.propose(context, k).tokens == _reference_ngram_draft(context, k, recent, 3)
    context.extend(grown)  # the same list, longer: the drafter extends its bytes
    assert d.propose(context, k).tokens == _reference_ngram_draft(context, k, recent, 3)
    d.recent.clear()  # forgotten by a caller: never drafted from again
    assert d.propose(list(context), k).tokens == _reference_ngram_draft(context, k, [], 3)


def test_ngram_drafter_ignores_misaligned_byte_matches():
    # 256 = bytes 00 01 00 00; a byte-level match straddling two tokens must not count.
    d = NgramDrafter(max_ngram=1)
    assert d.propose([65536, 1, 256], 2).tokens == []
