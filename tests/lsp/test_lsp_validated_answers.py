"""Clients without streaming (Helix, Emacs, Zed, ...) only ever see the answer: every answer is validated.

Real server over stdio, real model, no fimble/completionDelta. Cursors in real Python files that
this interpreter ships (its standard library stands in for held-out code): mid-line with the rest
of the line in place, and at the end of a line cut short (as while typing it). `earlyAnswerMs` is
0, so the server is always tempted to answer with part of a first line: an answer must never turn
a document that parses into one that does not (CPython's own parser decides). An explicitly
invoked request gets a complete, shaped completion: whole lines, or the whole decode.
"""

from __future__ import annotations

import ast
import asyncio
import random
import re
import sysconfig
import time
from pathlib import Path

import pytest
import pytest_lsp
from lsp_helpers import SERVER, change, init_params, inline, items_of, open_doc, stats
from pytest_lsp import LanguageClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = ["textwrap.py", "shlex.py", "fnmatch.py", "netrc.py", "colorsys.py", "bisect.py"]
CUT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?=[.(\[ ,:)])|[(\[,=] ")  # after a name, an opener, a comma or `= `


def parses(text: str) -> bool:
    try:
        ast.parse(text)
        return True
    except SyntaxError:
        return False


def cursors(seed: int = 13, per_file: int = 2) -> list[tuple[str, str, tuple[int, int]]]:
    """(name, document text, cursor): per file, mid-line cursors and cursors at the end of a cut line."""
    rng = random.Random(seed)
    out = []
    for name in FILES:
        path = STDLIB / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.split("\n")
        code = [
            i
            for i, ln in enumerate(lines)
            if len(ln.strip()) > 20 and ln.startswith("    ") and not ln.lstrip().startswith(("#", '"', "'"))
        ]
        rng.shuffle(code)
        mid, cut = [], []
        for i in code:
            spots = [m.end() for m in CUT.finditer(lines[i]) if len(lines[i][: m.end()].strip()) > 4]
            if not spots:
                continue
            col = rng.choice(spots)
            if col < len(lines[i]) and len(mid) < per_file:
                mid.append((name, text, (i, col)))
            elif len(cut) < per_file:
                short = "\n".join(lines[:i] + [lines[i][:col]] + lines[i + 1 :])
                if parses(short):  # as typed so far the file still parses: an answer must keep it so
                    cut.append((name + " (cut)", short, (i, col)))
            if len(mid) == len(cut) == per_file:
                break
        out += mid + cut
    return out


@pytest_lsp.fixture(config=SERVER, params=["emacs"], scope="module")
async def client(request, lsp_client: LanguageClient):
    await lsp_client.initialize_session(
        init_params(
            request.param,
            {
                "streaming": False,
                "earlyAnswerMs": 0,
                "maxTokens": 32,
                "maxLines": 4,
                "prefetch": False,
                "prefixChars": 2000,
                "suffixChars": 500,
            },
        )
    )
    yield
    await lsp_client.shutdown_session()


def apply(text: str, cursor: tuple[int, int], item) -> str:
    lines = text.split("\n")
    rng = item.range
    assert (rng.start.line, rng.start.character) == cursor
    assert rng.end.line == cursor[0] and rng.end.character >= cursor[1]  # (ASCII files: units are columns)
    line = lines[cursor[0]]
    lines[cursor[0]] = line[: cursor[1]] + item.insert_text + line[rng.end.character :]
    return "\n".join(lines)


async def _idle(client: LanguageClient) -> None:
    deadline = time.perf_counter() + 60
    while (await stats(client))["tables"]["active"]:
        assert time.perf_counter() < deadline, "the decode never ended"
        await asyncio.sleep(0.05)


# Cursors per file and kind (mid-line, cut line): 2, 24 cursors over the six files, in the heavy suite (tests/heavy.sh);
# the default suite takes 1, 12 cursors (about 10 s on 2 cores against 19 s).
PER_FILE = 2
DEFAULT_PER_FILE = 1


@pytest.mark.parametrize("per_file", [pytest.param(PER_FILE, marks=pytest.mark.heavy), DEFAULT_PER_FILE])
async def test_no_answer_adds_a_parse_error(client: LanguageClient, per_file: int):
    spots = cursors(per_file=per_file)
    assert len(spots) >= 12 * per_file, len(spots)
    answered, broken = 0, []
    for n, (name, text, cursor) in enumerate(spots):
        uri = f"file:///tmp/fimble-validated/{n}/{name.split()[0]}"
        assert parses(text)
        open_doc(client, uri, text)
        for invoked in (False, True) if n % 2 else (False,):  # (invoked: also the next test)
            items = items_of(await inline(client, uri, *cursor, invoked=invoked))
            if items:
                answered += 1
                if not parses(apply(text, cursor, items[0])):
                    broken.append((name, cursor, invoked, items[0].insert_text))
    assert not broken, f"{len(broken)} answers added a parse error: {broken[:5]}"
    assert answered >= len(spots) // 2, f"only {answered} answers: the check proves little"


async def test_invoked_waits_for_a_complete_shaped_completion(client: LanguageClient):
    """An invoked answer is whole lines of the decode's final shaped text, never part of a line."""
    checked = 0
    for n, (name, text, cursor) in enumerate(cursors(seed=29, per_file=1)[:8]):
        uri = f"file:///tmp/fimble-invoked/{n}/{name.split()[0]}"
        open_doc(client, uri, text)
        items = items_of(await inline(client, uri, *cursor, invoked=True))
        if not items:
            continue
        first = items[0].insert_text
        await _idle(client)
        # The decode has ended: the same request is served from its final shaped text (type-through).
        again = items_of(await inline(client, uri, *cursor, invoked=True))
        assert again, (name, cursor, first)
        final = again[0].insert_text
        rest = final[len(first) :]
        assert final.startswith(first) and (rest == "" or rest.lstrip(" \t").startswith("\n")), (
            name,
            cursor,
            first,
            final,
        )
        checked += 1
        # An edit invalidates nothing here: the next cursor is in another document.
        change(client, uri, 2, cursor, cursor, "")
    assert checked >= 4, checked
