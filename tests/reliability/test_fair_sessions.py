"""No session stalls another on a real --tcp listener: heavy messages run in slices.

Before: one ``didChange`` of 20,000 edits held the shared event loop 36 s, a 5 MB insertion
8 s, 5,000 requests in one write 17 s; another connection's request waited all that time.
Asserted here on order and content, never on time: a second session's request, sent just
after the attacker's heavy message, is answered before the attacker's own next request, and
the attacker's document ends exactly as the edits say. (The wait itself is measured by
bench/session_fairness.py, with a pinger in its own process.)
"""

from __future__ import annotations

import asyncio
import json

import pytest
from rel_helpers import Listener, TcpClient, did_open, frame, msg

BASE = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(1000))


@pytest.fixture
def tcp_debug():
    server = Listener("--tcp", "--debug")
    yield server
    server.close()


def change(uri: str, version: int, edits: list[tuple[int, int, str]]) -> dict:
    return msg(
        None,
        "textDocument/didChange",
        {
            "textDocument": {"uri": uri, "version": version},
            "contentChanges": [
                {"range": {"start": {"line": ln, "character": ch}, "end": {"line": ln, "character": ch}}, "text": t}
                for ln, ch, t in edits
            ],
        },
    )


async def heavy_then_probe(attacker: TcpClient, other: TcpClient, heavy: bytes, tag: str) -> None:
    """Write the heavy bytes and a request after them; the other session asks at once. The
    other session's answer must come first."""
    attacker.send_raw(heavy + frame(msg(f"after-{tag}", "fimble/stats")))
    other.send(msg(f"probe-{tag}", "fimble/stats"))
    probe = asyncio.ensure_future(other.response(f"probe-{tag}"))
    after = asyncio.ensure_future(attacker.response(f"after-{tag}"))
    done, _ = await asyncio.wait({probe, after}, return_when=asyncio.FIRST_COMPLETED)
    assert probe in done and after not in done, f"{tag}: the other session waited for the attacker's work"
    await after


async def test_heavy_messages_of_one_session_do_not_hold_back_another(tcp_debug):
    attacker = await TcpClient.connect(tcp_debug.port)
    other = await TcpClient.connect(tcp_debug.port)
    await attacker.initialize()
    await other.initialize()
    attacker.send(did_open("file:///w/base.py", BASE))

    edits = [(i % 1000, 0, "x") for i in range(20_000)]
    await heavy_then_probe(attacker, other, frame(change("file:///w/base.py", 2, edits)), "edits")
    lines = BASE.splitlines(keepends=True)
    for i in range(1000):
        lines[i] = "x" * 20 + lines[i]
    got = await attacker.call("fimble/debug/document", {"uri": "file:///w/base.py"})
    assert got["result"]["text"] == "".join(lines) and got["result"]["version"] == 2

    big = "y = 2\n" * 900_000  # 5.4 MB in one insertion
    await heavy_then_probe(attacker, other, frame(change("file:///w/base.py", 3, [(5, 0, big)])), "insert")
    got = await attacker.call("fimble/debug/document", {"uri": "file:///w/base.py"})
    assert got["result"]["text"] == "".join(lines[:5]) + big + "".join(lines[5:])

    burst = b"".join(frame(msg(f"s{i}", "fimble/stats")) for i in range(3000))
    await heavy_then_probe(attacker, other, burst, "burst")
    stats = (await attacker.call("fimble/stats"))["result"]
    assert stats["pacing"]["deferred"] == 2  # the two heavy changes ran in slices
    answered = {m.get("id") for m in attacker.seen if isinstance(m, dict)}
    assert all(f"s{i}" in answered for i in range(3000))  # nothing of the burst was lost

    # A message over the size limit is refused, and the frame after it is still found.
    attacker.send_raw(frame(json.dumps(did_open("file:///w/huge.py", "z = 1\n" * 3_000_000)).encode()))
    assert (await attacker.call("fimble/debug/document", {"uri": "file:///w/huge.py"}))["result"] is None
    assert (await other.call("fimble/stats"))["result"]["server"]["sessions"] == 2
    await attacker.close()
    await other.close()
    assert tcp_debug.alive()
