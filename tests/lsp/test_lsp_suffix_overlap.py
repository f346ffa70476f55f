"""No shown completion re-types the text after the cursor.

Real server over stdio, real (embedded) model, streaming on as the VS Code extension has it. At an
empty line right above `return result` the embedded model writes `return result` (greedy): the
stream is stopped once that line is complete, the final delta and the answer are cut to nothing,
and `fimble/stats` counts the cut (`suffix_overlap_stops`, `shaped_suffix_overlap`).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_lsp
from lsp_helpers import SERVER, Deltas, init_params, inline, items_of, open_doc, stats
from pytest_lsp import LanguageClient

from lsp_server.shaping.syntax.suffix_overlap import suffix_overlap_cut

pytestmark = pytest.mark.asyncio(loop_scope="module")

# (document, cursor): empty, indented lines just above text the model tends to write again.
SPOTS = [
    (
        "def area(w, h):\n    if w < 0 or h < 0:\n        raise ValueError('negative size')\n    result = w * h\n"
        "    \n    return result\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n",
        (4, 4),
    ),
    ("def total(xs):\n    result = 0\n    for x in xs:\n        result += x\n    \n    return result\n", (4, 4)),
]


@pytest_lsp.fixture(config=SERVER, params=["visual-studio-code"], scope="module")
async def client(request, lsp_client: LanguageClient):
    await lsp_client.initialize_session(
        init_params(
            request.param, {"streaming": True, "maxTokens": 32, "maxLines": 4, "prefetch": False, "prewarm": False}
        )
    )
    yield
    await lsp_client.shutdown_session()


def retypes(doc: str, cursor: tuple[int, int], text: str) -> bool:
    lines = doc.split("\n")
    line = lines[cursor[0]]
    after = line[cursor[1] :] + "\n" + "\n".join(lines[cursor[0] + 1 :])
    return bool(text.strip()) and suffix_overlap_cut(text, line[: cursor[1]], after) is not None


async def _idle(client: LanguageClient) -> dict:
    deadline = time.perf_counter() + 60
    while (s := await stats(client))["tables"]["active"]:
        assert time.perf_counter() < deadline, "the decode never ended"
        await asyncio.sleep(0.05)
    return s


async def test_no_answer_or_final_delta_retypes_the_suffix(client: LanguageClient):
    deltas = Deltas(client)
    streamed_retype = 0
    for n, (doc, cursor) in enumerate(SPOTS):
        uri = f"file:///tmp/fimble-suffix-overlap/{n}/spot.py"
        open_doc(client, uri, doc)
        rid = 7100 + n
        result = items_of(await inline(client, uri, *cursor, msg_id=rid))
        mine = await deltas.wait(lambda p, rid=rid: p["requestId"] == rid and p["done"])
        mine = [p for p in mine if p["requestId"] == rid]
        final = mine[-1]
        assert not retypes(doc, cursor, final["text"]), final
        if result:
            assert not retypes(doc, cursor, result[0].insert_text), result[0].insert_text
        # What streamed before the stop (the model's own text): did it start re-typing?
        streamed_retype += any(retypes(doc, cursor, p["text"] + "\n") for p in mine[:-1])
        await _idle(client)
    counters = (await stats(client))["counters"]
    cuts = counters.get("shaped_suffix_overlap", 0) + counters.get("answer_shaped_suffix_overlap", 0)
    if not streamed_retype and not cuts:
        pytest.skip("the model wrote nothing that re-types the suffix at these spots: nothing to count")
    assert cuts >= 1, counters
    if streamed_retype:
        assert counters.get("suffix_overlap_stops", 0) >= 1, counters
