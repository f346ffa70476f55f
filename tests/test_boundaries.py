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
    offenders = {
        str(p.relative_to(REPO)): sorted(m for m in imported_modules(p) if m.split(".")[0] == "lsp_server")
        for p in (REPO / "engine").rglob("*.py")
    }
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


# -- import graphs -------------------------------------------------------------------------------
def _modules(package: str, root: Path) -> dict[str, Path]:
    out = {}
    for p in (root / package).rglob("*.py"):
        parts = list(p.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph(package: str, root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth (a function's lazy import counts too: it is still
    a dependency, and moved to the top it would be a cycle at import time). ``from a.b import c`` names a.b.c
    when that is a module, else a.b (a package means its __init__)."""
    mods = _modules(package, root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        # An import under ``if TYPE_CHECKING:`` is for annotations only: it runs nothing.
        guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
        skipped = {id(n) for g in guarded for n in ast.walk(g)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package
                    pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            graph[m].update(t for n in names if n.split(".")[0] == package and (t := resolve(n)) and t != m)
    return graph


def import_cycles(package: str, root: Path = REPO) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is at least one cycle."""
    graph, index, low, stack, on, out = import_graph(package, root), {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_import_cycles_are_found(tmp_path):
    """The check itself: modules that import each other through a package's __init__, one of them lazily and
    one relatively, are reported; a module that only imports into the cycle is not part of it."""
    pkg = tmp_path / "cyc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from cyc.sub.b import B\n")
    (pkg / "a.py").write_text("def f():\n    from cyc.sub import B\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nB = 1\n")
    (pkg / "c.py").write_text("import cyc.a\n")
    assert import_cycles("cyc", tmp_path) == [["cyc.a", "cyc.sub", "cyc.sub.b"]]
    (pkg / "a.py").write_text("def f():\n    pass\n")
    assert import_cycles("cyc", tmp_path) == []
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyc.sub import B\n")
    assert import_cycles("cyc", tmp_path) == []  # (annotations only)


def test_lsp_server_has_no_import_cycle():
    assert import_cycles("lsp_server") == []


def test_engine_has_no_import_cycle():
    assert "engine.local" in import_graph("engine")["engine.process"]  # (imports inside functions count)
    assert import_cycles("engine") == []


def _python_files(folder: str) -> list[Path]:
    return [p for p in (REPO / folder).rglob("*.py") if "data" not in p.relative_to(REPO).parts]


def _reaches_around_imports(path: Path) -> list[str]:
    """What hides an import from ``imported_modules``: ``sys.path`` edits and loading a module by file path."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            found.add("uses sys.path")
        if getattr(node, "attr", getattr(node, "id", None)) == "spec_from_file_location":
            found.add("loads a module by file path")
    return sorted(found)


def test_bench_and_tests_do_not_import_each_other():
    """bench/ and tests/ share code only through bench/harness/, which imports neither tests/ nor any benchmark
    (the repository's top-level layout is fixed: the harness is the benchmarks' kit, which the tests reuse). A test
    helper is imported by bare name once a test puts its folder on sys.path, so those names count as tests/ too. A
    sys.path edit or a module loaded by file path would hide an import from this check: bench/ has neither, and no
    test loads a module by path or puts bench/ on sys.path."""
    test_names = {"tests"} | {p.stem for p in _python_files("tests")}

    def forbidden(folder: str, path: Path, module: str) -> bool:
        top, kit = module.split(".")[0], module.startswith("bench.harness")
        if folder == "bench":  # a benchmark never imports tests; the harness imports no benchmark either
            return top in test_names or (path.parts[:2] == ("bench", "harness") and top == "bench" and not kit)
        return top == "bench" and not kit  # a test: the harness only

    found = []
    for folder in ("bench", "tests"):
        for p in _python_files(folder):
            path = p.relative_to(REPO)
            found += [f"{path}: imports {m}" for m in sorted(imported_modules(p)) if forbidden(folder, path, m)]
            for what in _reaches_around_imports(p):
                if folder != "tests" or what != "uses sys.path":
                    found.append(f"{path}: {what}")
                elif any("sys.path" in line and "bench" in line for line in p.read_text().splitlines()):
                    found.append(f"{path}: puts bench/ on sys.path")
    assert found == []


# A newcomer reads a module in one sitting and a class on a few screens; past these, split by concern.
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def sizes(path: Path) -> tuple[int, dict[str, int]]:
    """The module's line count, and each class's (nested ones too) by qualified name."""
    text = path.read_text()
    classes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                classes[prefix + child.name] = child.end_lineno - child.lineno + 1
                visit(child, prefix + child.name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, prefix + child.name + ".")

    visit(ast.parse(text, str(path)), "")
    return len(text.splitlines()), classes


def test_size_check_measures_modules_and_nested_classes(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("class A:\n    class B:\n        x = 1\n\n    y = 2\n\n\ndef f():\n    class C:\n        pass\n")
    assert sizes(module) == (10, {"A": 5, "A.B": 2, "f.C": 2})


def test_no_module_or_class_in_the_product_packages_is_oversized():
    oversized = []
    for package in ("engine", "lsp_server"):
        for path in sorted((REPO / package).rglob("*.py")):
            lines, classes = sizes(path)
            name = str(path.relative_to(REPO))
            if lines > MAX_MODULE_LINES:
                oversized.append(f"{name}: {lines} lines")
            oversized += [f"{name}: class {c} {n} lines" for c, n in classes.items() if n > MAX_CLASS_LINES]
    assert oversized == []
