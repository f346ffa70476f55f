"""Limits on what one request may ask for: stop strings, JSON bodies, prompts that cannot fit.

100,000 stop strings in an editor's ``policy`` setting were accepted and made every completion about 10x
slower; DecodeOptions.validate, the policy's own check and the settings merge now refuse them. JSON bodies are
read with limits (engine/serve/json_body.py). The prompt bound (engine/serve/prompt_bound.py) must never
exceed what the prompt builder counts, or fimble serve would refuse prompts that fit.
"""

from __future__ import annotations

import json
import random

import pytest

from engine.api import CompletionRequest, DecodeOptions
from engine.caching.prompt_plan import PromptBuilder
from engine.errors import PromptError
from engine.options import MAX_STOP_CHARS, MAX_STOPS
from engine.serve import json_body, prompt_bound
from lsp_server.settings import Settings
from lsp_server.shaping.policy import check_overrides

MANY_STOPS = ["x"] * 100_000


def test_decode_options_refuse_too_many_or_too_long_stop_strings():
    DecodeOptions(stop=("\n",) * MAX_STOPS).validate()
    for stop in (tuple(MANY_STOPS), ("x" * (MAX_STOP_CHARS + 1),)):
        with pytest.raises(PromptError, match="stop"):
            DecodeOptions(stop=stop).validate()


def test_policy_overrides_refuse_100000_stop_strings():
    problems = check_overrides({"comment": {"stop": MANY_STOPS}})
    assert len(problems) == 1 and problems[0].startswith("comment.stop: bad value") and len(problems[0]) < 200
    before = Settings().merged({"policy": {"comment": {"max_tokens": 8}}})
    after, problems = before.merge({"policy": {"*": {"stop": MANY_STOPS}}})
    assert after.policy == before.policy
    assert len(problems) == 1 and problems[0].startswith("policy: ") and "stop" in problems[0]
    assert not check_overrides({"comment": {"stop": ["\n\n"] * MAX_STOPS}})


@pytest.mark.parametrize(
    "body,message",
    [
        (b"[" * 100_000 + b"]" * 100_000, "JSON body"),
        (b'{"a": ' + b"[" * 17 + b"]" * 17 + b"}", "nested deeper"),
        (b"[" + b"{}," * 30_000 + b"{}]", "outside its strings"),  # 90 KB of dicts: hundreds of MB at 16 MiB
        (b"[" + b'"a",' * 5000 + b'"a"]', "strings"),
        (b'{"n": 1' + b"0" * 400 + b"}", "longer than"),
        (b'{"n": 1e400}', "out of range"),
        (b'{"n": NaN}', "NaN"),
        (b'{"n": -Infinity}', "Infinity"),
        (b'{"p": "\xff"}', "UTF-8"),
        (b'{"p": "unterminated', "not valid JSON"),
    ],
)
def test_json_bodies_over_a_limit_are_refused(body, message):
    with pytest.raises(json_body.JSONLimitError, match=message):
        json_body.loads(body)


def test_json_bodies_within_the_limits_parse_as_json_does():
    body = {
        "prompt": 'def f():\n    return "a\\"b" + \'[{\' ' * 2000,  # brackets and escapes in strings do not count
        "suffix": "\\" * 7 + '"',
        "stop": ["\n\n", "]"],
        "max_tokens": 16,
        "temperature": 0.25,
        "seed": 2**63 - 1,
        "nested": [[[[{"a": [1, -2.5e-3, None, True]}]]]],
    }
    data = json.dumps(body).encode()
    assert json_body.loads(data) == json.loads(data)


@pytest.fixture(scope="module")
def builder(embedded_target):
    return PromptBuilder(embedded_target)


def _counted(builder: PromptBuilder, request: CompletionRequest) -> int:
    """The tokens of the prefix and the cursor's line that the builder checks against the context."""
    seen = {}
    assemble = builder._assemble

    def spy(prefix, suffix, head, *rest):
        seen["tokens"] = prefix.size + head.size
        return assemble(prefix, suffix, head, *rest)

    builder._assemble = spy
    try:
        builder.build(request)
    finally:
        del builder._assemble
    return seen["tokens"]


def test_the_prompt_bound_never_exceeds_what_the_builder_counts(builder, embedded_target, monkeypatch):
    monkeypatch.setattr(embedded_target, "max_len", 10**9)  # nothing refused: every prompt is counted
    span = prompt_bound.token_span(embedded_target.tokenizer)
    assert span.max_bytes and not span.nfc  # a byte-level BPE: the spelling bound applies
    rng = random.Random(7)
    line = "    value = compute(item, other)  # a comment\n"
    texts = [
        "import os\n\n" + "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(2000)),
        "x = [" + "1, " * 20_000 + "]\n" + line * 200,  # a line longer than LONG_PIECE_CHARS
        "a = 1 \n" * 5000,  # no cut point: every line ends in a space
        "é\u0301" * 20_000 + "\nq\n" * 500,
        "def g():\n" + line * 3000 + " " * 5000 + "\n\n\n    ",
    ]
    encode = lambda text: builder._encode(text)[0]  # noqa: E731
    for text in texts:
        for _ in range(6):
            prefix = text[: rng.randint(1, len(text))] + rng.choice(["", " ", "    ", "\n", "\n    ", "\n\n\n", "pri"])
            request = CompletionRequest(prefix, "\nrest()\n", options=DecodeOptions(max_tokens=16), document_id="d")
            assert prompt_bound.prefix_tokens_at_least(prefix, encode, 10**9, span) <= _counted(builder, request)
    # And it is close enough to refuse early: most of a long prompt is counted.
    long_prompt = texts[0]
    request = CompletionRequest(long_prompt, "", options=DecodeOptions(max_tokens=16), document_id="d")
    assert prompt_bound.prefix_tokens_at_least(long_prompt, encode, 10**9, span) > 0.9 * _counted(builder, request)
