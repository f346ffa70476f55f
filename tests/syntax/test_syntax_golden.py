"""Table-driven golden suite: raw model output -> shown text + replace range (golden_cases.py)."""

from __future__ import annotations

import pytest

from .golden_cases import CASES
from .util import finalize


@pytest.mark.parametrize("c", CASES, ids=[c["id"] for c in CASES])
def test_golden(c: dict) -> None:
    res, applied, replaced = finalize(c["lang"], c["code"], c["raw"])
    assert res.text == c["shown"]
    assert replaced == c["replace"]
    assert (res.cut_reason.value if res.cut_reason else None) == c["reason"]
    if c["result"] is not None:
        assert applied == c["result"]


def test_golden_covers_every_language() -> None:
    langs = {c["lang"] for c in CASES}
    assert {
        "python",
        "javascript",
        "javascriptreact",
        "typescript",
        "typescriptreact",
        "go",
        "rust",
        "java",
        "c",
        "cpp",
    } <= langs
    ids = [c["id"] for c in CASES]
    assert len(ids) == len(set(ids))
