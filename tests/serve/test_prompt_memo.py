"""fimble serve's incremental prompt builder (engine/serve/prompt_memo.py) gives PromptBuilder's plan, always."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from bench.harness.llama_server_cuda import tokenizer_only
from engine.api import CompletionRequest
from engine.caching.prompt_plan import LINE_CUT, PromptBuilder, last_piece
from engine.errors import PromptError
from engine.fim import TEMPLATES
from engine.options import DecodeOptions
from engine.serve.prompt_memo import IncrementalPromptBuilder, direct_encoder

CORPUS = Path(__file__).resolve().parents[1] / "data" / "lossless_corpus"


@pytest.fixture(scope="module", params=["fimble", "fimble-psm"])
def model(request):
    """The embedded target's tokenizer (no weights read) with its own template (suffix first: a keystroke changes the
    prompt's last pieces) and the prefix-first one (the cursor's line after the middle sentinel)."""
    return dataclasses.replace(tokenizer_only(), template=TEMPLATES[request.param])


def outcome(builder: PromptBuilder, request: CompletionRequest, anchor: int | None):
    try:
        return builder.build(request, anchor)
    except PromptError as exc:  # (a prompt past the context, without truncate: the same refusal)
        return str(exc)


def same(memo: IncrementalPromptBuilder, model, request: CompletionRequest, anchor: int | None = None) -> None:
    fresh = PromptBuilder(model)  # no memo of any kind carried over
    assert outcome(memo, request, anchor) == outcome(fresh, request, anchor)


def typing(text: str, rng: random.Random, keys: int) -> list[tuple[str, str]]:
    """(prefix, suffix) per keystroke: type a line at a random spot, with a backspace, a new line and a jump."""
    lines = text.split("\n")
    i = rng.randrange(5, len(lines) - 5)
    before, after = "\n".join(lines[:i]) + "\n", "\n" + "\n".join(lines[i + 1 :])
    line = lines[i] or "x = 1"
    out, typed = [], ""
    for k in range(keys):
        if k == keys // 3 and typed:
            typed = typed[:-1]  # a backspace
        elif k == keys // 2:
            typed += "\n    "  # a new line: the text before the cursor's line changes
        else:
            typed += line[k % len(line)]
        out.append((before + typed, after))
    j = rng.randrange(1, len(text) - 1)
    out.append((text[:j], text[j:]))  # the cursor jumps elsewhere (a long file: past the context)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_typing_builds_the_same_prompts(model, seed):
    rng = random.Random(seed)
    files = sorted(CORPUS.glob("*.py.txt"))
    memo = IncrementalPromptBuilder(model)
    for f in rng.sample(files, 3):
        text = f.read_text()
        lines = sorted(rng.sample(range(text.count("\n")), 6)) if seed % 2 else None  # with and without a parse
        for prefix, suffix in typing(text, rng, 14):
            for truncate in (False, True):
                request = CompletionRequest(prefix, suffix, document_id=f.name, segment_lines=lines, truncate=truncate)
                same(memo, model, request)
    assert memo.fold_hits > 20 and memo.part_hits + memo.lead_hits > 20  # the memos were used, not only filled


def test_two_editors_interleaved_and_healing_off(model):
    texts = [f.read_text() for f in sorted(CORPUS.glob("*.py.txt"))[:2]]
    memo = IncrementalPromptBuilder(model)
    for k in range(1, 12):
        for n, text in enumerate(texts):
            cut = text.index("\n", len(text) // 2) + 1
            for heal in (True, False):
                prefix = text[:cut] + "    value = compute("[:k]
                same(memo, model, CompletionRequest(prefix, text[cut:], document_id=str(n), heal=heal))


def test_truncation_context_and_anchor(model):
    text = (CORPUS / sorted(p.name for p in CORPUS.glob("*.py.txt"))[0]).read_text() * 6
    cut = text.index("\n", len(text) - 4000) + 1
    memo = IncrementalPromptBuilder(model)
    context = {
        "repo": "proj",
        "path": "pkg/main.py",
        "comment": "#",
        "budget": 300,
        "chunks": [{"path": "pkg/util.py", "text": "def scale(p, f):\n    return p * f\n"}],
    }
    for k in range(1, 10):
        prefix = text[:cut] + "result = scale("[:k]
        long = CompletionRequest(prefix, text[cut:], truncate=True, options=DecodeOptions(max_tokens=64))
        same(memo, model, long)  # past the context: the prefix and suffix are cut
        same(memo, model, CompletionRequest(prefix[-3000:], text[cut : cut + 500], context=context))
        anchor = prefix.rfind("\n", 0, prefix.rfind("\n"))  # a line break above the cursor's line
        same(memo, model, CompletionRequest(prefix[-3000:], "\n", document_id="a"), anchor - len(prefix) + 3000)


def test_the_direct_tokenizer_call_tokenises_as_the_model(model):
    encode = direct_encoder(model)
    assert encode is not None  # the embedded tokenizer has a Rust backend: the fast path is the one tested above
    assert IncrementalPromptBuilder(model).direct
    for f in sorted(CORPUS.glob("*.py.txt")):
        for piece in LINE_CUT.split(f.read_text())[:400]:
            assert encode(piece) == model.encode(piece)
    typed = "x = '<|fim_middle|>'  # <|endoftext|> caf\u00e9\n"
    assert encode(typed) == model.encode(typed) and model.token_id("<|fim_middle|>") not in encode(typed)


def test_a_tokenizer_that_differs_keeps_the_models_encode(model):
    class Odd:
        def __init__(self, inner):
            self.inner, self.tokenizer = inner, inner.tokenizer

        def encode(self, text):
            return self.inner.encode(text)[::-1]  # not what the backend gives

    assert direct_encoder(Odd(model)) is None


def test_last_piece_is_the_line_splits_last():
    texts = [f.read_text() for f in sorted(CORPUS.glob("*.py.txt"))[:4]]
    rng = random.Random(5)
    odd = ["", "\n", "x", "\n\n", " \n", "a\n", "a \n \n", "a\u00a0\nb", "a\x1c\nb", "\t\n\tx", "a\nb\n\n  "]
    cuts = [t[: rng.randrange(len(t) + 1)] for t in texts for _ in range(200)]
    for text in odd + cuts:
        assert last_piece(text) == (LINE_CUT.split(text)[-1] or text)
