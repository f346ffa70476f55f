"""engine/wire.py's messages between the LSP process and the engine."""

from __future__ import annotations


def test_result_message_carries_every_field_and_its_own_stats():
    """engine/wire.py builds the result message by hand (asdict's deep copy cost a serve round ~0.1 ms a request):
    every field of CompletionResult must still travel, and the stats be the message's own copy."""
    from dataclasses import fields

    import msgpack

    from engine.api import CompletionResult
    from engine.wire import result_message

    stats = {"tokens": 3, "first_token_ms": 1.5, "drafter": "ngram"}
    result = CompletionResult("abc", "stop", 3, stats)
    msg = result_message(7, result)
    assert set(msg["result"]) == {f.name for f in fields(CompletionResult)}
    assert msg["result"] == {"text": "abc", "finish_reason": "stop", "tokens": 3, "stats": stats}
    assert msg["result"]["stats"] is not stats
    assert msgpack.unpackb(msgpack.packb(msg)) == msg
