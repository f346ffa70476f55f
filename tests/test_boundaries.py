"""The layers' boundaries, as checks: engine/ never imports lsp_server/, and the LSP process never
imports torch (its memory and start time stay small; the model lives in the engine process)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_engine_imports_nothing_from_the_lsp_server():
    offenders = {str(p.relative_to(REPO)): sorted(m for m in imported_modules(p) if m.split(".")[0] == "lsp_server")
                 for p in (REPO / "engine").rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


SESSION = r"""
import asyncio, json, sys
from lsp_server.server import create_server

sent = []
class Writer:
    def write(self, data):
        sent.append(json.loads(data.split(b"\r\n\r\n", 1)[-1]))
    def close(self):
        pass

async def main():
    ls = create_server()
    ls.protocol.set_writer(Writer())
    async def feed(m):
        ls.protocol.receive(json.dumps(m).encode())
        await ls.pacer.settle()
    await feed({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"processId": None, "rootUri": None,
                "capabilities": {}, "initializationOptions": {"streaming": False}}})
    await feed({"jsonrpc": "2.0", "method": "initialized", "params": {}})
    text = "def add(a, b):\n    return \n"
    await feed({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
        "uri": "file:///t.py", "languageId": "python", "version": 1, "text": text}}})
    await feed({"jsonrpc": "2.0", "id": 2, "method": "textDocument/inlineCompletion", "params": {
        "textDocument": {"uri": "file:///t.py"}, "position": {"line": 1, "character": 11},
        "context": {"triggerKind": 1}}})
    for _ in range(2400):
        if any(m.get("id") == 2 and "method" not in m for m in sent):
            break
        await asyncio.sleep(0.05)
    answer = next(m for m in sent if m.get("id") == 2 and "method" not in m)
    counters = await ls.host.counters()
    print(json.dumps({"items": len(answer["result"]["items"]), "completed": counters.get("completed", 0),
                      "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
    ls.close_session()
    await ls.host.close()

asyncio.run(main())
"""


def test_the_lsp_process_does_not_import_torch_while_serving_a_completion():
    out = subprocess.run([sys.executable, "-c", SESSION], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    got = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert got["completed"] >= 1 and got["items"] == 1  # the engine process did serve it
    assert got == {**got, "torch": False, "transformers": False}
