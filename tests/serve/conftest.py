"""One ``fimble serve`` daemon shared by the serve tests (a model load is the slow part)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_helpers import ServeProcess  # noqa: E402


@pytest.fixture(scope="session")
def daemon():
    proc = ServeProcess()
    try:
        yield proc
    finally:
        proc.stop()
