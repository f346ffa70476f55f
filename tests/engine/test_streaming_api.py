"""The narrow engine API: submit, stream deltas, cancel, in-process and across a process boundary."""

from __future__ import annotations

import asyncio

import pytest

from engine.api import CompletionRequest, DecodeOptions
from engine.errors import PromptError
from engine.local import LocalEngine
from engine.process import EngineProcess

PREFIX = "import os\n\n\ndef list_python_files(root):\n    result = []\n    for name in os.listdir(root):\n"
LONG = DecodeOptions(max_tokens=400, drafter="none")


@pytest.fixture(scope="module")
def local_engine(embedded_target, embedded_draft):
    engine = LocalEngine(embedded_target, embedded_draft)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def process_engine():
    engine = EngineProcess()
    yield engine
    engine.close()


@pytest.fixture(params=["local", "process"])
def engine(request, local_engine, process_engine):
    return local_engine if request.param == "local" else process_engine


async def test_deltas_stream_and_add_up_to_the_result(engine):
    stream = engine.submit(CompletionRequest(PREFIX, "\n    return result\n", DecodeOptions(max_tokens=40)))
    deltas = [d async for d in stream]
    assert deltas[-1].finished and deltas[-1].finish_reason in ("length", "eos", "stop")
    assert len(deltas) >= 2 and all(not d.finished for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == stream.result.text != ""


async def test_cancel_stops_within_one_step(engine):
    before = engine.counters()
    stream = engine.submit(CompletionRequest(PREFIX, "", LONG))
    deltas = []
    async for delta in stream:
        deltas.append(delta)
        if len(deltas) == 2:
            stream.cancel()
    after = engine.counters()
    assert deltas[-1].finish_reason == "cancelled"
    assert after["cancelled"] == before["cancelled"] + 1
    # Decoding stopped long before the 400-token budget: a few steps at most after the cancel.
    steps = after["decode_steps"] - before["decode_steps"]
    assert steps < 20, f"{steps} decode steps ran"
    assert stream.result.tokens < 30


async def test_errors_arrive_as_exceptions_with_their_kind(engine):
    stream = engine.submit(CompletionRequest("", ""))
    with pytest.raises(PromptError, match="empty prompt"):
        async for _ in stream:
            pass


async def test_queued_request_cancelled_before_it_starts(engine):
    first = engine.submit(CompletionRequest(PREFIX, "", DecodeOptions(max_tokens=30, drafter="none")))
    second = engine.submit(CompletionRequest(PREFIX, "", LONG))
    second.cancel()
    results = await asyncio.gather(_drain(first), _drain(second))
    assert results[1] == "cancelled"
    assert second.result.tokens == 0


async def _drain(stream) -> str:
    deltas = [d async for d in stream]
    return deltas[-1].finish_reason


def test_blocking_iteration_outside_an_event_loop(local_engine):
    stream = local_engine.submit(CompletionRequest(PREFIX, "", DecodeOptions(max_tokens=10)))
    assert stream.collect() == stream.result.text
