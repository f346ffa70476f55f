"""Tests import shared constants with ``from conftest import ...``. pytest imports every conftest.py as the
module ``conftest``, so a second one under tests/ shadows the root one for files collected after it (CI once
failed at collection that way): shared fixtures belong in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path


def test_tests_have_one_conftest():
    tests = Path(__file__).parent
    found = sorted(p.relative_to(tests).as_posix() for p in tests.rglob("conftest.py") if "data" not in p.parts)
    assert found == ["conftest.py"], found
