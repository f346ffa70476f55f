"""Limits on what one request may ask for (issue 29): stop strings.

100,000 stop strings in an editor's ``policy`` setting were accepted and made every completion about 10x
slower; DecodeOptions.validate, the policy's own check and the settings merge now refuse them.
"""

from __future__ import annotations

import pytest

from engine.api import DecodeOptions
from engine.errors import PromptError
from engine.options import MAX_STOP_CHARS, MAX_STOPS
from engine.policy import check_overrides
from lsp_server.settings import Settings

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
