"""Every decision the policy makes reaches the decode loop: the real embedded model, no mocks.

gamma, temperature, top_p, confidence gate, max lines, stop strings and max tokens each get a test
that observes the engine's behaviour (output text, finish reason, decode statistics) or the
SpeculativeDecoder built from the decided options.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.api import CompletionRequest
from engine.decoding.speculative import SpeculativeDecoder
from lsp_server.shaping.policy import decide, decide_for_context
from lsp_server.shaping.shaper import CompletionShaper
from lsp_server.shaping.syntax import SyntaxDocument

# A prompt on which the embedded model writes several lines of code.
PREFIX = "import os\n\n\ndef list_python_files(root):\n    result = []\n    for name in os.listdir(root):\n"
SUFFIX = "\n    return result\n"


@pytest.fixture(scope="module")
def engine(embedded_engine):
    return embedded_engine


def run(engine, decision, prefix=PREFIX, suffix=SUFFIX, **extra):
    # Completions the n-gram drafter remembers change the drafts, and with them which random
    # numbers a sampled run draws: start each run without them so seeded runs repeat.
    request = CompletionRequest(prefix, suffix, decision.to_options(**extra))
    engine.drafters(request)[1].recent.clear()  # (model drafter, n-gram drafter) this request decodes with
    return engine.complete(request)


def test_max_lines_reach_the_decode_loop(engine):
    multi = decide_for_context("block_body", overrides={"block_body": {"max_lines": 2, "stop": (), "max_tokens": 48}})
    free = run(engine, replace(multi, max_lines=0))
    assert free.text.count("\n") >= 2, "the prompt must produce several lines for this test"
    two = run(engine, multi)
    assert two.text.count("\n") == 1 and free.text.startswith(two.text)
    one = run(engine, replace(multi, multiline=False))
    assert "\n" not in one.text and one.text == free.text.split("\n")[0]
    # The table's own single-line contexts.
    for kind in ("comment", "call_args", "mid_statement"):
        assert "\n" not in run(engine, decide_for_context(kind)).text


def test_stop_strings_reach_the_decode_loop(engine):
    base = decide_for_context("block_body", overrides={"block_body": {"stop": (), "max_tokens": 32}})
    free = run(engine, base).text
    stop = free.strip()[3:6]  # some text the model is known to produce
    i = free.index(stop)
    cut = run(engine, replace(base, stop=(stop,)))
    assert cut.text == free[:i] and cut.finish_reason == "stop"
    # The table's decisions carry their stops: a blank line ends a block body.
    blank = run(engine, replace(base, stop=("\n\n",)), suffix="")
    assert "\n\n" not in blank.text


def test_max_tokens_reach_the_decode_loop(engine):
    d = decide_for_context("block_body", overrides={"block_body": {"max_tokens": 5, "stop": ()}})
    res = run(engine, d)
    assert res.tokens == 5 and res.finish_reason == "length"


def test_gamma_reaches_the_speculative_decoder(engine, embedded_target):
    # Without adaptation and with the gate open, every step drafts exactly gamma tokens (the
    # draft model never stops early), so drafted/steps is gamma.
    for gamma in (1, 3, 6):
        d = decide_for_context(
            "block_body", overrides={"*": {"gamma": gamma, "confidence_gate": 0.0, "max_tokens": 40, "stop": ()}}
        )
        assert d.gamma == gamma
        s = run(engine, d, drafter="model", adaptive_gamma=False).stats
        assert s["steps"] > 1
        assert gamma * (s["steps"] - 1) < s["drafted"] <= gamma * s["steps"], (gamma, s)
    # gamma 0: no drafting at all, one token per step.
    d0 = decide_for_context("block_body", overrides={"*": {"gamma": 0, "max_tokens": 16}})
    s0 = run(engine, d0).stats
    assert s0["drafted"] == 0 and s0["accepted"] == 0 and s0["mean_accepted"] == 1.0
    # And the decoder built from a decision starts at the decided gamma.
    opts = decide_for_context("comment").to_options()
    dec = SpeculativeDecoder(
        embedded_target.runtime, embedded_target.runtime.new_cache(64), embedded_target.stop_ids, opts
    )
    assert dec.gamma == decide_for_context("comment").gamma == opts.gamma


def test_confidence_gate_reaches_the_draft_model(engine):
    # A gate of 1.0 stops the draft model after its first token of every block; 0.0 never does.
    over = {"*": {"gamma": 6, "max_tokens": 30, "stop": ()}}
    opened = run(
        engine,
        decide_for_context("block_body", overrides={"*": {**over["*"], "confidence_gate": 0.0}}),
        drafter="model",
        adaptive_gamma=False,
    ).stats
    closed = run(
        engine,
        decide_for_context("block_body", overrides={"*": {**over["*"], "confidence_gate": 1.0}}),
        drafter="model",
        adaptive_gamma=False,
    ).stats
    assert closed["drafted"] <= closed["steps"] < opened["drafted"]


def test_temperature_and_top_p_reach_the_sampler(engine):
    greedy = decide_for_context("block_body", overrides={"*": {"max_tokens": 16, "stop": ()}})
    assert greedy.temperature == 0.0
    g = run(engine, greedy, seed=1).text
    assert run(engine, greedy, seed=2).text == g  # greedy ignores the seed
    hot = replace(greedy, temperature=1.5)
    samples = {run(engine, hot, seed=s).text for s in range(3)}
    assert len(samples) > 1, "temperature 1.5 must sample"
    assert run(engine, hot, seed=7).text == run(engine, hot, seed=7).text  # seeded: reproducible
    # top_p that keeps only the top token turns sampling back into greedy decoding.
    assert run(engine, replace(hot, top_p=1e-6), seed=3).text == g


def test_decide_then_stream_then_shape_like_the_lsp_server(engine):
    """The flow the LSP server runs: classify + decide, stream into the shaper, finish."""
    code = "def total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return max(s, \n"
    cursor = code.index("max(s, ") + len("max(s, ")
    doc = SyntaxDocument("python", code)
    d = decide(doc, cursor, "python")
    assert d.context == "call_args" and not d.multiline
    stream = engine.submit(CompletionRequest(code[:cursor], code[cursor:], d.to_options()))
    shaper = CompletionShaper(doc, cursor)
    engine.run_pending()  # no worker thread: decode now, deltas are queued
    for delta in stream:
        if shaper.feed(delta.text) is not None:
            break
    shaped = shaper.finish()
    assert "\n" not in shaped.raw
    assert shaped.context == "call_args" and shaped.replace_start == cursor
    if shaped.text:  # whatever is shown leaves the document parseable by CPython's rules
        new = code[:cursor] + shaped.text + code[cursor:][shaped.replace_end - cursor :]
        compile(new, "<doc>", "exec")
