"""Helpers of the editor tests: the Neovim plugin against the real `fimble lsp`, the VS Code extension build.

They need tools outside Python (see tests/editors/README): `nvim` (Debian's neovim, 0.7.2 or newer),
`node` 20 and `npm`. A missing tool fails the test with the command that installs it; nothing is
installed from here.
"""

from __future__ import annotations

import shutil

import pytest


def require_tool(name: str, install: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not on PATH; CI installs it with: {install} (see tests/editors/README)")
    return path
