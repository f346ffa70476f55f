"""Every setting is range-checked, and each bad one is named to the user.

Before: earlyAnswerMs, max_gamma or debounceMs at 10**400 broke every request with an
OverflowError (traceback included) until changed; debounceMs at 10**12 left automatic
requests unanswered; temperature 1e308 gave empty completions without a word; and a
client's ``model`` got distinct messages ("does not exist", "is not a folder", "has no
config.json"): an oracle of which paths exist on the server's machine.
"""

from __future__ import annotations

import asyncio

import pytest
from rel_helpers import StdioServer, did_open, msg

from lsp_server.settings import _RANGES, _WIRE, Settings

HUGE = 10**400
INT_KEYS = [k for k, attr in _WIRE.items() if attr in _RANGES]


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", [HUGE, -1, 10**12])
def test_out_of_range_integers_are_clamped_and_named(key, value):
    s, problems = Settings().merge({key: value})
    low, high = _RANGES[_WIRE[key]]
    assert getattr(s, _WIRE[key]) == (high if value > 0 else low)
    assert len(problems) == 1 and problems[0].startswith(f"{key}: ") and "using" in problems[0]


@pytest.mark.parametrize(
    "key,value",
    [
        ("maxLines", "8"),
        ("debounceMs", 1.5),
        ("streaming", "yes"),
        ("model", 5),
        ("device", "gpu"),
        ("drafter", "magic"),
        ("enable", {"python": "on"}),
        ("earlyAnswerMs", True),
        ("prefixChars", None),
        ("model", "x" * 5000),
    ],
)
def test_wrong_types_keep_the_previous_value_and_are_named(key, value):
    before = Settings().merged({"maxLines": 3})
    s, problems = before.merge({key: value})
    assert s == before
    assert len(problems) == 1 and problems[0].startswith(f"{key}: ") and "keeping" in problems[0]


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 1e308),
        ("temperature", float("inf")),
        ("max_gamma", HUGE),
        ("gamma", HUGE),
        ("top_p", HUGE),
        ("max_tokens", HUGE),
        ("temperature", HUGE),
    ],
)
def test_policy_values_that_would_break_decoding_are_refused(field, value):
    before = Settings().merged({"policy": {"comment": {"max_tokens": 8}}})
    s, problems = before.merge({"policy": {"*": {field: value}}})
    assert s.policy == before.policy
    assert len(problems) == 1 and problems[0].startswith("policy: ") and field in problems[0]


async def _messages(s: StdioServer) -> list[str]:
    await s.call("fimble/stats")  # a round trip: notifications sent before it have arrived
    return [m["params"]["message"] for m in s.seen if isinstance(m, dict) and m.get("method") == "window/showMessage"]


async def test_huge_settings_are_named_and_requests_still_answered():
    s = await StdioServer.start()
    try:
        await s.initialize({"maxTokens": 8, "maxLines": 1})
        s.send(
            msg(
                None,
                "workspace/didChangeConfiguration",
                {
                    "settings": {
                        "fimble": {"earlyAnswerMs": HUGE, "debounceMs": 10**12, "policy": {"*": {"max_gamma": HUGE}}}
                    }
                },
            )
        )
        s.send(
            msg(
                None,
                "workspace/didChangeConfiguration",
                {"settings": {"fimble": {"policy": {"*": {"temperature": 1e308}}}}},
            )
        )
        shown = await _messages(s)
        for name in ("earlyAnswerMs", "debounceMs", "max_gamma", "temperature"):
            assert any(name in m for m in shown), (name, shown)
        settings = (await s.call("fimble/stats"))["result"]["settings"]
        assert settings["policy"] is None  # both overrides refused
        uri = "file:///s/huge.py"
        s.send(did_open(uri, "def add(a, b):\n    return a + b\n\n\nprint(add(1, "))
        # An automatic request (the debounce applies): answered, not an OverflowError, not left hanging.
        r = await s.call(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": uri},
                "position": {"line": 4, "character": len("print(add(1, ")},
                "context": {"triggerKind": 2},
            },
        )
        assert "result" in r, r
        assert "Traceback" not in s.stderr() or "OverflowError" not in s.stderr()
    finally:
        await s.stop()


async def test_model_path_oracle_is_closed(tmp_path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty-dir").mkdir()
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    s = await StdioServer.start()
    try:
        await s.initialize()
        for path in (tmp_path / "no-such", tmp_path / "a-file", tmp_path / "empty-dir"):
            s.seen.clear()
            s.send(msg(None, "workspace/didChangeConfiguration", {"settings": {"fimble": {"model": str(path)}}}))
            shown = await _messages(s)
            assert shown == ["fimble: setting model: model not found or not usable"], shown
        stats = (await s.call("fimble/stats"))["result"]
        assert stats["engine"]["state"] == "stopped" and stats["engine"]["error"] is None

        # A folder that passes the first check but does not load: the engine's own reason stays in the log.
        s.seen.clear()
        s.send(
            msg(
                None,
                "workspace/didChangeConfiguration",
                {"settings": {"fimble": {"model": str(broken), "preload": True}}},
            )
        )
        for _ in range(600):
            stats = (await s.call("fimble/stats"))["result"]
            if stats["engine"]["state"] == "error":
                break
            await asyncio.sleep(0.1)
        assert stats["engine"]["error"] == "model not found or not usable"
        s.send(did_open("file:///s/m.py", "x = "))
        await s.call(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": "file:///s/m.py"},
                "position": {"line": 0, "character": 4},
                "context": {"triggerKind": 1},
            },
        )
        shown = await _messages(s)
        errors = [m for m in shown if "model" in m]
        assert errors and all("model not found or not usable" in m for m in errors), shown
        assert "config.json" not in " ".join(shown) and str(broken) not in " ".join(shown)
    finally:
        await s.stop()
