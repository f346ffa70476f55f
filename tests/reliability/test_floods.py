"""Floods of invalid messages and oversized settings through a real ``fimble lsp`` (issue 29, minor findings).

Before: 2,000 invalid ``didChange`` notifications wrote 6,000 log lines (a warning per message, and pygls'
two-line deserialisation error for params that do not fit the LSP types); and 100,000 stop strings in the
``policy`` setting were accepted, making every completion about 10x slower. Now dropped messages are
counted (``dropped_messages``) and logged a few times per kind and session; the policy is refused with one
message naming it, and the previous one stays.
"""

from __future__ import annotations

import collections
import json

from rel_helpers import StdioServer, did_open, frame, msg

URI = "file:///flood/a.py"
FLOOD = 2000


def _range(line: int) -> dict:
    return {"start": {"line": line, "character": 0}, "end": {"line": 0, "character": 0}}


# Each breaks a different rule, through a different path (lsp_server/change_params.py, protocol.py, server.py).
BAD_CHANGES = [
    {"textDocument": {"uri": URI, "version": 2}, "contentChanges": [{"range": _range(-1), "text": "y"}]},
    {"textDocument": {"uri": "file:///flood/not-open.py", "version": 2}, "contentChanges": [{"text": "y"}]},
    {"textDocument": {"uri": URI, "version": "2"}, "contentChanges": [{"text": "y"}]},
    {"textDocument": {"uri": URI, "version": 2}, "contentChanges": [{"text": None}]},
    "a string",
    5,
]


def _log_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


async def test_2000_invalid_notifications_are_counted_not_each_logged():
    s = await StdioServer.start()
    try:
        await s.initialize()
        s.send(did_open(URI, "x = 1\n"))
        await s.call("fimble/stats")
        lines_before = len(_log_lines(s.stderr()))
        for i in range(FLOOD):
            s.send(msg(None, "textDocument/didChange", BAD_CHANGES[i % len(BAD_CHANGES)]))
        for _ in range(FLOOD // 10):  # and other notifications whose params do not fit
            s.send(msg(None, "textDocument/didOpen", {"textDocument": 5}))
            s.send(msg(None, "fimble/cursor", {"textDocument": {"uri": URI}, "position": {"line": -1, "character": 0}}))
        stats = (await s.call("fimble/stats"))["result"]
        counters = stats["counters"]
        assert counters["dropped_messages"] == FLOOD + 2 * (FLOOD // 10), counters
        assert counters["changes_unknown_document"] == FLOOD // len(BAD_CHANGES) + (FLOOD % len(BAD_CHANGES) > 1)
        # The document is untouched: every one of those changes was dropped whole.
        assert stats["tables"]["documents"] == 1
        log = _log_lines(s.stderr())[lines_before:]
        kinds = collections.Counter(line.split(" WARNING ", 1)[-1][:60] for line in log)
        assert len(log) <= 40, (len(log), kinds.most_common(8))  # was 3 lines per message: 6,000 for 2,000
        assert all(n <= 3 + 3 for n in kinds.values()), kinds  # a few in full, then at 10, 100, 1000
        assert not any("Traceback" in line or "Unable to deserialize" in line for line in log), log
        assert s.proc.returncode is None
    finally:
        await s.stop()


async def test_100000_stop_strings_in_policy_are_refused_with_one_message():
    s = await StdioServer.start()
    try:
        await s.initialize({"policy": {"comment": {"max_tokens": 8}}})
        s.send(msg(None, "workspace/didChangeConfiguration",
                   {"settings": {"fimble": {"policy": {"*": {"stop": ["x"] * 100_000}}}}}))
        settings = (await s.call("fimble/stats"))["result"]["settings"]
        assert settings["policy"] == {"comment": {"max_tokens": 8}}  # the previous overrides stay
        shown = [m["params"]["message"] for m in s.seen if isinstance(m, dict)
                 and m.get("method") == "window/showMessage"]
        assert len(shown) == 1 and shown[0].startswith("fimble: setting policy: ") and "stop" in shown[0], shown
        assert len(shown[0]) < 600 and "x', 'x" not in shown[0]  # one line, not the list echoed back
        # A stop list within the limits is taken.
        s.send(msg(None, "workspace/didChangeConfiguration",
                   {"settings": {"fimble": {"policy": {"*": {"stop": ["\n\n", "#"]}}}}}))
        settings = (await s.call("fimble/stats"))["result"]["settings"]
        assert settings["policy"] == {"*": {"stop": ["\n\n", "#"]}}
    finally:
        await s.stop()


async def test_the_request_after_a_body_over_the_limit_is_answered():
    """Before: after a body over the (then 64 MiB) limit, the next well-formed request on that connection was
    never answered. The body is skipped unread (lsp_server/framing.py) and the stream resyncs on the next frame;
    here over stdio with a 1 MiB limit (over TCP: test_fair_sessions.py, at the default 16 MiB)."""
    s = await StdioServer.start("--max-message-mb", "1")
    try:
        await s.initialize()
        big = json.dumps(did_open("file:///flood/big.py", "z = 1\n" * 400_000)).encode()  # 2.4 MB
        s.send_raw(frame(big) + frame(msg(41, "fimble/stats")))
        reply = await s.response(41)
        assert reply["result"]["tables"]["documents"] == 0  # the oversized open was not taken
        errors = [m for m in s.seen if isinstance(m, dict) and m.get("error", {}).get("code") == -32700]
        assert len(errors) == 1 and "over the limit" in errors[0]["error"]["message"], errors
        s.send(did_open(URI, "x = 1\n"))
        assert (await s.call("fimble/stats"))["result"]["tables"]["documents"] == 1  # and it serves on
    finally:
        await s.stop()
