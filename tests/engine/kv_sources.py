"""Real Python source of a given token length, from this interpreter's standard library."""

from __future__ import annotations

import re
import sysconfig
from functools import cache
from pathlib import Path

TOP_LEVEL_DEF = re.compile(r"^(?:def |class |async def |@)", re.M)
STDLIB_FILES = ("textwrap.py", "shlex.py", "calendar.py", "argparse.py")


@cache
def stdlib_source(encode, tokens: int) -> str:
    """The first ``tokens`` or so tokens of a real stdlib module, cut at a line end."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_FILES:
        text = (stdlib / name).read_text()
        if len(encode(text)) < tokens:
            continue
        ends = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        lo, hi = 0, len(ends) - 1  # the first line end with at least ``tokens`` tokens before it
        while lo < hi:
            mid = (lo + hi) // 2
            if len(encode(text[: ends[mid]])) >= tokens:
                hi = mid
            else:
                lo = mid + 1
        return text[: ends[lo]]
    raise RuntimeError(f"no stdlib file has {tokens} tokens")


def definition_lines(text: str) -> list[int]:
    """Lines where a top-level definition starts (what the server gets from tree-sitter)."""
    return [text.count("\n", 0, m.start()) for m in TOP_LEVEL_DEF.finditer(text)]
