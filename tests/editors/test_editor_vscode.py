"""The VS Code extension (editors/vscode): install from package-lock.json, type-check, bundle, package, unit-test.

VS Code itself cannot run here (@vscode/test-electron downloads it), so the extension's behaviour is tested
by `node --test` with a stub `vscode` module (editors/vscode/test/); this runs that and the build steps, so
`.ci/run` (pytest) covers them. Needs `node` 20 and `npm` (tests/editors/README).
"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
from editor_tools import require_tool

EXT = Path(__file__).resolve().parents[2] / "editors" / "vscode"


def run(*cmd: str, timeout: float = 300) -> str:
    proc = subprocess.run(cmd, cwd=EXT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def installed():
    require_tool("node", "apt-get install -y nodejs (Node 20)")
    npm = require_tool("npm", "apt-get install -y npm")
    run(npm, "ci", "--no-audit", "--no-fund", "--prefer-offline")
    return npm


def test_typecheck(installed):
    run(installed, "run", "typecheck")


def test_bundle_and_package(installed):
    run(installed, "run", "bundle")
    assert (EXT / "dist" / "extension.js").is_file()
    run(installed, "run", "package")
    vsix = EXT / "dist" / "fimble.vsix"
    with zipfile.ZipFile(vsix) as z:
        names = set(z.namelist())
    assert {"extension/package.json", "extension/dist/extension.js"} <= names
    assert not any("node_modules" in n or n.endswith(".ts") for n in names), sorted(names)


def test_unit_tests(installed):
    out = run(installed, "test")
    assert "# fail 0" in out and "# pass" in out, out[-3000:]
