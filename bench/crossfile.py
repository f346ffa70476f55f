"""bench/crossfile.py: cross-file context through a real ``fimble lsp`` over stdio: does it raise exact match?

    python -m bench.crossfile --quick                  # under a minute: the embedded model, 1 case per language
    python -m bench.crossfile --json out.json          # the default model, the full run (~30-60 min on 2 cores)

Cases are built at run time from multi-file code installed on this machine, never copied into the
repository: Python packages in this interpreter's site-packages and standard library, JavaScript
from npm's own installation (``/usr/lib/node_modules/npm``, its lib and its bundled packages). A case is
a line of a module that calls a function or class imported from another module of the same package
(``from .x import name``, ``from pkg.x import name``, ``const {name} = require('./x')``): the cursor is put
just before the name, the rest of the line is what the model should write, and the line's rest is
removed from the document. The report names each source and its licence (read from its metadata).

Modes, each in the same server (documents closed between cases):
- ``alone``: the file by itself;
- ``neighbours``: the defining module and two unrelated modules of the package open as tabs first;
- ``unrelated``: only the two unrelated modules open;
- ``workspace`` (not in --quick): the file alone, but the client sent the package's folders as workspace
  folders, so its imports are read from disk.
Each answers one invoked inlineCompletion (``maxLines`` 1, cold window off: the full prompt, as after a
pre-warm) once the server's context work is done (fimble/stats ``tables.context_pending``). Exact match
and edit similarity (difflib) of the answer's first line against the rest of the line.

Then the keystroke cost (a second server, the editor defaults: prefetch, pre-warm, cold window): in
``--keystroke-cases`` cases with the neighbours open, the first completion, then the rest of the line
typed a key at a time with a request per key; per keystroke after the first completion, the prompt tokens
the engine evaluated (its ``tokens_prefilled`` counter) and the request's answer time, with
``crossFileContext`` off and on. Last, the event loop: 50 open documents of 1 MB, and how long the
server took to answer a cheap request while its context work ran (wall clock on a busy machine: a bench
figure, not a test).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import difflib
import functools
import importlib.metadata
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import lsp_typing
from bench.lsp_latency import RpcClient, percentile

REPO = Path(__file__).resolve().parent.parent

SITE = Path(sysconfig.get_paths()["purelib"])
STDLIB = Path(sysconfig.get_paths()["stdlib"])
NPM = Path("/usr/lib/node_modules/npm")
# Packages with many modules that import each other; the less famous first (a model has memorised less of them).
PY_PACKAGES = [
    "pygls",
    "pytest_lsp",
    "cattrs",
    "referencing",
    "jsonschema",
    "markdown_it",
    "python_discovery",
    "distlib",
    "gguf",
    "anyio",
    "h11",
    "httpx2",
    "hypothesis",
    "rich",
    "huggingface_hub",
    "pip/_internal",
    "packaging",
    "aiohttp",
]
STDLIB_PACKAGES = ["asyncio", "email", "importlib", "concurrent/futures", "logging", "json", "http", "xml/etree"]
MAX_FILE_CHARS = 60_000
MAX_LINE_CHARS = 110
PER_PACKAGE = 4  # cases per package at most (round-robin over packages: many codebases, not one)
MODES = ("alone", "neighbours", "unrelated", "workspace")
# languages ["*"]: JavaScript too with a model whose fimble.json lists Python only (the embedded one)
SETTINGS = {
    "prefetch": False,
    "prewarm": False,
    "maxLines": 1,
    "maxTokens": 48,
    "streaming": False,
    "engineThreads": 1,
    "debounceMs": 0,
    "languages": ["*"],
}


@dataclass
class Case:
    lang: str  # "python" | "javascript"
    source: str  # the package (for the report)
    target: str  # path of the file completed
    definer: str  # path of the module the name comes from
    unrelated: list[str]
    name: str
    line: int  # 0-based
    col: int  # code points: where the name starts
    expected: str  # the rest of the line
    roots: list[str] = field(default_factory=list)  # workspace folders for the workspace mode


# -- cases: Python ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _unrelated(files: list[Path], exclude: set[Path], name: str, rng: random.Random) -> list[str] | None:
    """Two other modules of the package that the file does not import and that do not mention ``name``
    (they cannot give the answer away)."""
    pat = re.compile(rf"(?<![\w$]){re.escape(name)}(?![\w$])")
    others = [p for p in files if p not in exclude]
    rng.shuffle(others)
    picked = [str(p) for p in others[:40] if 1000 < len(_read(p)) and not pat.search(_read(p))][:2]
    return picked if len(picked) == 2 else None


@functools.lru_cache(maxsize=4096)
def _py_defs(path: Path) -> frozenset[str] | None:
    try:
        text = _read(path)
        if len(text) > MAX_FILE_CHARS * 3:
            return None
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    return frozenset(n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef))


def _py_module_file(pkg_root: Path, pkg_name: str, importer: Path, module: str | None, level: int) -> Path | None:
    """The file of ``from <level dots><module> import ...`` inside the package, or None."""
    if level:
        base = importer.parent
        for _ in range(level - 1):
            base = base.parent
    else:
        if not module or not (module == pkg_name or module.startswith(pkg_name + ".")):
            return None
        base = pkg_root.parent
    parts = module.split(".") if module else []
    p = base.joinpath(*parts) if parts else base
    for cand in (p.with_suffix(".py") if parts else None, p / "__init__.py"):
        if cand is not None and cand.is_file() and (pkg_root in cand.parents or cand.parent == pkg_root):
            return cand
    return None


def _balanced_call(rest: str) -> bool:
    """``rest`` starts with ``name(``, has an argument, and closes that call on the line."""
    i = rest.index("(")
    if rest[i + 1 : i + 2] == ")":
        return False
    depth = 0
    for ch in rest[i:]:
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return True
    return False


def python_cases(package_dir: Path, source: str, rng: random.Random) -> list[Case]:
    pkg_root = package_dir
    while (pkg_root.parent / "__init__.py").is_file():
        pkg_root = pkg_root.parent
    pkg_name = pkg_root.name
    files = sorted(p for p in package_dir.rglob("*.py") if "test" not in p.name and p.stat().st_size < MAX_FILE_CHARS)
    out: list[Case] = []
    for f in files:
        try:
            text = _read(f)
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        imported: dict[str, Path] = {}
        modules: set[Path] = {f}  # every module of the package the file imports from
        last_import = 0
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                last_import = max(last_import, node.end_lineno or 0)
                mod_file = _py_module_file(pkg_root, pkg_name, f, node.module, node.level)
                if mod_file is None or mod_file == f:
                    continue
                modules.add(mod_file)
                defs = _py_defs(mod_file)
                for alias in node.names:
                    if defs and alias.name in defs and alias.asname is None and len(alias.name) > 3:
                        imported[alias.name] = mod_file
            elif isinstance(node, ast.Import):
                last_import = max(last_import, node.end_lineno or 0)
        calls: dict[str, list[tuple[int, int]]] = {}  # name -> (line, byte column) of its calls, in order
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in imported
                and node.lineno == node.end_lineno
                and node.args
            ):
                calls.setdefault(node.func.id, []).append((node.lineno - 1, node.col_offset))
        for name, mod_file in imported.items():
            for i, byte_col in sorted(calls.get(name, [])):
                line = lines[i]
                col = len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="replace"))
                if i < last_import or len(line) > MAX_LINE_CHARS or not line[col:].startswith(name + "("):
                    continue
                rest = line[col:]
                others = _unrelated(files, modules, name, rng)
                if others is None:
                    break
                out.append(
                    Case(
                        "python",
                        source,
                        str(f),
                        str(mod_file),
                        others,
                        name,
                        i,
                        col,
                        rest.rstrip(),
                        [str(pkg_root.parent)],
                    )
                )
                break  # the first use of each name in each file
    return out


# -- cases: JavaScript (npm's CommonJS modules) ----------------------------------------------------------
_REQUIRE = re.compile(r"^(?:const|let|var)\s*\{([^}]+)\}\s*=\s*require\(\s*['\"](\.\.?/[^'\"]+)['\"]\s*\)", re.M)


def _js_file(importer: Path, spec: str) -> Path | None:
    base = (importer.parent / spec).resolve()
    for cand in (base, base.with_name(base.name + ".js"), base / "index.js"):
        if cand.is_file():
            return cand
    return None


def _js_defines(text: str, name: str) -> bool:
    n = re.escape(name)
    pattern = (
        rf"(function\*?\s+{n}\s*\(|(const|let|var)\s+{n}\s*=|class\s+{n}\b"
        rf"|^\s*(async\s+)?{n}\s*\([^)]*\)\s*\{{)"
    )
    return re.search(pattern, text, re.M) is not None


def js_cases(lib_dir: Path, source: str, rng: random.Random) -> list[Case]:
    files = sorted(
        p
        for p in lib_dir.rglob("*.js")
        if p.stat().st_size < MAX_FILE_CHARS and "node_modules" not in p.relative_to(lib_dir).parts
    )
    out: list[Case] = []
    for f in files:
        text = _read(f)
        lines = text.splitlines()
        imported: dict[str, Path] = {}
        modules = {f} | {
            p for s in re.findall(r"require\(\s*['\"](\.\.?/[^'\"]+)['\"]", text) if (p := _js_file(f, s)) is not None
        }
        for m in _REQUIRE.finditer(text):
            mod_file = _js_file(f, m.group(2))
            if mod_file is None:
                continue
            mod_text = _read(mod_file)
            for part in m.group(1).split(","):
                name = part.strip()
                if re.fullmatch(r"[A-Za-z_$][\w$]{3,}", name) and _js_defines(mod_text, name):
                    imported[name] = mod_file
        for name, mod_file in imported.items():
            pat = re.compile(rf"(?<![\w.$]){re.escape(name)}\(")
            for i, line in enumerate(lines):
                m = pat.search(line)
                if (
                    m is None
                    or "require(" in line
                    or len(line) > MAX_LINE_CHARS
                    or line.lstrip().startswith(("//", "*"))
                ):
                    continue
                rest = line[m.start() :]
                if not _balanced_call(rest) or "`" in line or any(line.count(q) % 2 for q in "'\""):
                    continue  # (a template or string literal around it: not code)
                others = _unrelated(files, modules, name, rng)
                if others is None:
                    break
                out.append(
                    Case(
                        "javascript",
                        source,
                        str(f),
                        str(mod_file),
                        others,
                        name,
                        i,
                        m.start(),
                        rest.rstrip(),
                        [str(lib_dir)],
                    )
                )
                break
    return out


def licence_of(source: str) -> str:
    if source.startswith("stdlib:"):
        return "PSF-2.0 (Python standard library)"
    if source.startswith("npm:"):
        pkg = Path(source[4:])
        try:
            return str(json.loads((pkg / "package.json").read_text()).get("license", "?"))
        except (OSError, ValueError):
            return "?"
    top = source.split("/")[0]
    for dist in importlib.metadata.packages_distributions().get(top, [])[:1]:
        meta = importlib.metadata.metadata(dist)
        for key in ("License-Expression", "License"):
            value = meta.get(key)
            if value and len(value) < 80:
                return value
        classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License")]
        return ", ".join(classifiers) or "?"
    return "?"


def _python_dirs() -> list[tuple[Path, str]]:
    return [(SITE / n, n) for n in PY_PACKAGES if (SITE / n).is_dir()] + [
        (STDLIB / n, f"stdlib:{n}") for n in STDLIB_PACKAGES if (STDLIB / n).is_dir()
    ]


def _js_dirs() -> list[tuple[Path, str]]:
    if not NPM.is_dir():
        return []
    out = [(NPM / "lib", f"npm:{NPM}")]
    for pkg in sorted((NPM / "node_modules").glob("*/package.json")) + sorted(
        (NPM / "node_modules").glob("@*/*/package.json")
    ):
        if (pkg.parent / "lib").is_dir():
            out.append((pkg.parent / "lib", f"npm:{pkg.parent}"))
    return out


def build_cases(per_lang: int, seed: int, langs: list[str]) -> list[Case]:
    """``per_lang`` cases per language, at most PER_PACKAGE from one package; packages are scanned in order
    until there are enough (so --quick reads two or three)."""
    rng = random.Random(seed)
    out: list[Case] = []
    for lang, dirs, make in (("python", _python_dirs(), python_cases), ("javascript", _js_dirs(), js_cases)):
        if lang not in langs:
            continue
        pools: list[list[Case]] = []
        for d, source in dirs:
            if sum(min(len(p), PER_PACKAGE) for p in pools) >= per_lang:
                break
            pools.append(make(d, source, rng))
        out += _round_robin(pools, per_lang, rng)
    return out


def _round_robin(pools: list[list[Case]], n: int, rng: random.Random) -> list[Case]:
    pools = [rng.sample(p, min(len(p), PER_PACKAGE)) for p in pools if p]
    out: list[Case] = []
    while len(out) < n and any(pools):
        for p in pools:
            if p and len(out) < n:
                out.append(p.pop(0))
    return out


# -- the server ---------------------------------------------------------------------------------------
def language_id(lang: str) -> str:
    return "python" if lang == "python" else "javascript"


class Server:
    def __init__(self, env: dict, args: argparse.Namespace, debug: bool = True):
        self.env, self.args, self.debug = env, args, debug
        self.proc: Any = None
        self.rpc: Any = None
        self.threads: dict[int, int] = {}
        self.log = tempfile.NamedTemporaryFile(prefix="fimble-crossfile-", suffix=".log", delete=False)

    async def start(self, settings: dict, folders: list[str] | None = None) -> None:
        cmd = [sys.executable, "-m", "lsp_server", "lsp"] + (["--debug"] if self.debug else [])
        self.proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self.log,
            env=self.env,
            cwd=str(REPO),
            limit=1 << 26,
        )
        self.rpc = RpcClient(self.proc)
        await self.rpc.call(
            "initialize",
            {
                "processId": os.getpid(),
                "rootUri": None,
                "workspaceFolders": [{"uri": Path(f).as_uri(), "name": Path(f).name} for f in folders or []] or None,
                "capabilities": {
                    "general": {"positionEncodings": ["utf-16"]},
                    "textDocument": {"inlineCompletion": {"dynamicRegistration": True}},
                },
                "initializationOptions": settings,
            },
            timeout=120,
        )
        self.rpc.notify("initialized", {})
        t0 = time.perf_counter()
        while (await self.stats())["engine"].get("state") != "ready":  # the model loaded
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("the engine did not start")
            await asyncio.sleep(0.2)
        self.threads = lsp_typing.thread_counts(lsp_typing.tree_cpu(self.proc.pid)[1])  # {pid: OS threads} of its tree

    async def stats(self) -> dict:
        return await self.rpc.call("fimble/stats", None, timeout=120)

    def open(self, path: str, text: str, lang: str) -> str:
        uri = Path(path).as_uri()
        self.rpc.notify(
            "textDocument/didOpen",
            {"textDocument": {"uri": uri, "languageId": language_id(lang), "version": 1, "text": text}},
        )
        return uri

    def close(self, uri: str) -> None:
        self.rpc.notify("textDocument/didClose", {"textDocument": {"uri": uri}})

    def cursor(self, uri: str, line: int, char: int) -> None:
        self.rpc.notify("fimble/cursor", {"textDocument": {"uri": uri}, "position": {"line": line, "character": char}})

    async def settled(self) -> dict:
        while True:
            snap = await self.stats()
            if not snap["tables"].get("context_pending"):
                return snap
            await asyncio.sleep(0.05)

    async def complete(self, uri: str, line: int, char: int, invoked: bool = True) -> str:
        res = await self.rpc.call(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": uri},
                "position": {"line": line, "character": char},
                "context": {"triggerKind": 1 if invoked else 2},
            },
            timeout=600,
        )
        items = (res or {}).get("items") or []
        return items[0]["insertText"] if items else ""

    async def ring(self, uri: str) -> list[str]:
        if not self.debug:
            return []
        rings = await self.rpc.call("fimble/debug/context", {"uri": uri}, timeout=60)
        return next(
            (
                [f"{c} ({s:.2f})" for c, s in zip(r["chunks"], r["scores"], strict=True)]
                for r in rings or []
                if r["uri"] == uri
            ),
            [],
        )

    async def stop(self) -> None:
        if self.proc is None:
            return
        try:
            await self.rpc.call("shutdown", None, timeout=30)
            self.rpc.notify("exit", None)
            await asyncio.wait_for(self.proc.wait(), 30)
        except (TimeoutError, RuntimeError, ConnectionError):
            self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


def utf16(s: str) -> int:
    return len(s.encode("utf-16-le")) // 2


def case_document(case: Case) -> tuple[str, int, int]:
    """The target file with the line's rest removed, and the cursor (line, UTF-16 column)."""
    lines = Path(case.target).read_text(encoding="utf-8").split("\n")
    head = lines[case.line][: case.col]
    lines[case.line] = head
    return "\n".join(lines), case.line, utf16(head)


def first_line(text: str) -> str:
    return text.split("\n", 1)[0].strip()


def score(got: str, expected: str) -> dict:
    g, e = first_line(got), expected.strip()
    return {"exact": g == e, "edit": difflib.SequenceMatcher(None, g, e).ratio(), "got": g}


async def run_case(srv: Server, case: Case, mode: str) -> dict:
    text, line, char = case_document(case)
    uris = []
    opened = {"neighbours": [case.definer, *case.unrelated], "unrelated": case.unrelated}.get(mode, [])
    for p in opened:
        uris.append(srv.open(p, Path(p).read_text(encoding="utf-8", errors="replace"), case.lang))
    before = (await srv.stats())["engine"]["counters"]
    uri = srv.open(case.target, text, case.lang)
    uris.append(uri)
    srv.cursor(uri, line, char)
    await asyncio.sleep(0.05)
    await srv.settled()
    ring = await srv.ring(uri)
    t0 = time.perf_counter()
    got = await srv.complete(uri, line, char)
    ms = (time.perf_counter() - t0) * 1e3
    after = (await srv.stats())["engine"]["counters"]
    for u in uris:
        srv.close(u)
    definer = os.path.relpath(case.definer, os.path.commonpath([case.definer, case.target]))
    return {
        "mode": mode,
        **score(got, case.expected),
        "ms": ms,
        "ring": ring,
        "definer_in_ring": any(definer in c or Path(case.definer).name in c for c in ring),
        "context_tokens": after.get("context_tokens", 0) - before.get("context_tokens", 0),
        "prefilled": after.get("tokens_prefilled", 0) - before.get("tokens_prefilled", 0),
    }


async def quality(args: argparse.Namespace, env: dict, cases: list[Case], out: dict) -> None:
    modes = [m for m in args.modes if m != "workspace"]
    settings = {
        **SETTINGS,
        "crossFileBudget": args.budget,
        "prefixChars": args.prefix_chars,
        "suffixChars": args.suffix_chars,
    }
    env = {**env, "FIMBLE_COLD_WINDOW": "off", "FIMBLE_REQUEST_BUDGET_S": "300"}
    results: list[list[dict]] = [[] for _ in cases]
    if modes:
        srv = Server(env, args)
        await srv.start(settings)
        out["threads"] = "+".join(str(v) for v in srv.threads.values())
        try:
            for i, case in enumerate(cases):
                for mode in modes:
                    results[i].append(await run_case(srv, case, mode))
                _progress(i, cases, results[i])
        finally:
            await srv.stop()
    if "workspace" in args.modes:
        folders = sorted({r for c in cases for r in c.roots})
        srv = Server(env, args)
        await srv.start(settings, folders)
        try:
            for i, case in enumerate(cases):
                results[i].append(await run_case(srv, case, "workspace"))
        finally:
            await srv.stop()
    out["cases"] = [{**asdict(c), "results": r} for c, r in zip(cases, results, strict=True)]


def _progress(i: int, cases: list[Case], rs: list[dict]) -> None:
    c = cases[i]
    marks = " ".join(f"{r['mode'][:5]}={'Y' if r['exact'] else '.'}{r['edit']:.2f}" for r in rs)
    print(
        f"  [{i + 1}/{len(cases)}] {c.lang[:2]} {c.source[:40]:40s} {c.name[:24]:24s} {marks}",
        file=sys.stderr,
        flush=True,
    )


# -- keystroke cost -------------------------------------------------------------------------------------
async def keystrokes(args: argparse.Namespace, env: dict, cases: list[Case], out: dict) -> None:
    """Per keystroke after a session's first completion: prompt tokens evaluated, answer time; context off/on."""
    settings = {
        "prefetch": True,
        "prewarm": True,
        "maxLines": 1,
        "maxTokens": 48,
        "engineThreads": 1,
        "languages": ["*"],
        "crossFileBudget": args.budget,
        "prefixChars": args.prefix_chars,
        "suffixChars": args.suffix_chars,
    }
    rows: dict[str, dict] = {}
    srv = Server(env, args, debug=False)
    await srv.start(settings)
    try:
        for on in (False, True):
            await srv.rpc.call("fimble/stats", None)
            srv.rpc.notify("workspace/didChangeConfiguration", {"settings": {"crossFileContext": on}})
            row: dict = {"first_prefill": [], "first_ms": [], "key_prefill": [], "key_ms": [], "context_tokens": []}
            for case in cases:
                text, line, char = case_document(case)
                uris = [
                    srv.open(p, Path(p).read_text(encoding="utf-8", errors="replace"), case.lang)
                    for p in [case.definer, *case.unrelated]
                ]
                uri = srv.open(case.target, text, case.lang)
                uris.append(uri)
                srv.cursor(uri, line, char)
                await asyncio.sleep(0.3)
                await srv.settled()
                c0 = (await srv.stats())["engine"]["counters"]
                t0 = time.perf_counter()
                await srv.complete(uri, line, char)
                row["first_ms"].append((time.perf_counter() - t0) * 1e3)
                c1 = (await srv.stats())["engine"]["counters"]
                row["first_prefill"].append(c1.get("tokens_prefilled", 0) - c0.get("tokens_prefilled", 0))
                row["context_tokens"].append(c1.get("context_tokens", 0) - c0.get("context_tokens", 0))
                version, col = 1, char
                for ch in case.expected[: args.keys]:
                    version += 1
                    k0 = (await srv.stats())["engine"]["counters"]
                    srv.rpc.notify(
                        "textDocument/didChange",
                        {
                            "textDocument": {"uri": uri, "version": version},
                            "contentChanges": [
                                {
                                    "range": {
                                        "start": {"line": line, "character": col},
                                        "end": {"line": line, "character": col},
                                    },
                                    "text": ch,
                                }
                            ],
                        },
                    )
                    col += utf16(ch)
                    t0 = time.perf_counter()
                    await srv.complete(uri, line, col, invoked=False)
                    row["key_ms"].append((time.perf_counter() - t0) * 1e3)
                    k1 = (await srv.stats())["engine"]["counters"]
                    row["key_prefill"].append(k1.get("tokens_prefilled", 0) - k0.get("tokens_prefilled", 0))
                    await asyncio.sleep(0.12)
                for u in uris:
                    srv.close(u)
                await asyncio.sleep(0.5)
            rows["on" if on else "off"] = row
            print(
                f"  keystrokes, context {'on' if on else 'off'}: prefill/key {_mean(row['key_prefill']):.1f}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        await srv.stop()
    out["keystrokes"] = rows


# -- the event loop under 50 open files of 1 MB ------------------------------------------------------------
async def loop_blocking(args: argparse.Namespace, env: dict, out: dict) -> None:
    srv = Server({**env, "FIMBLE_DEFAULT_MODEL": "embedded"}, args, debug=False)  # (the engine is not the point)
    await srv.start({"preload": True, "prewarm": False, "prefetch": False})
    body = "".join(f"def function_{i}(alpha, beta):\n    return alpha * {i} + beta\n\n" for i in range(1000))
    big = (body * (1_000_100 // len(body) + 1))[:1_000_100]  # over 1M characters: no parse (documents.py)

    async def ping() -> float:
        t0 = time.perf_counter()
        await srv.rpc.call(
            "textDocument/inlineCompletion",
            {  # an unknown document: answered at once, empty
                "textDocument": {"uri": "file:///nowhere.py"},
                "position": {"line": 0, "character": 0},
                "context": {"triggerKind": 1},
            },
            timeout=120,
        )
        return (time.perf_counter() - t0) * 1e3

    try:
        base = [await ping() for _ in range(50)]
        for i in range(50):
            srv.open(f"/bench/crossfile/big/mod{i}.py", big, "python")
        await srv.stats()  # (the opens are handled)
        c0 = (await srv.stats())["counters"]
        srv.open("/bench/crossfile/big/focus.py", "def use(alpha, beta):\n    return function_3(alpha, ", "python")
        t0 = time.perf_counter()
        pings: list[float] = []
        await asyncio.sleep(0.3)
        while True:
            pings.append(await ping())
            if len(pings) % 20 == 0 and not (await srv.stats())["tables"].get("context_pending"):
                break
            await asyncio.sleep(0.005)
        work_s = time.perf_counter() - t0
        c1 = (await srv.stats())["counters"]
    finally:
        await srv.stop()
    out["loop"] = {
        "base_p50_ms": percentile(base, 0.5),
        "base_max_ms": max(base),
        "pings": len(pings),
        "p50_ms": percentile(pings, 0.5),
        "p99_ms": percentile(pings, 0.99),
        "max_ms": max(pings),
        "work_s": work_s,
        "slices": c1.get("context_yields", 0) - c0.get("context_yields", 0),
        "indexed_docs": c1.get("context_indexed_docs", 0),
        "slice_max_ms": c1.get("context_slice_max_us", 0) / 1e3,
    }


# -- the report ------------------------------------------------------------------------------------------
def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


def summarize(out: dict) -> dict:
    table: dict[str, dict[str, dict]] = {}
    for c in out.get("cases", []):
        for r in c["results"]:
            for lang in (c["lang"], "all"):
                row = table.setdefault(lang, {}).setdefault(
                    r["mode"], {"n": 0, "exact": 0, "edit": 0.0, "ctx": 0, "definer": 0, "with_ctx": 0}
                )
                row["n"] += 1
                row["with_ctx"] += r["context_tokens"] > 0
                row["exact"] += r["exact"]
                row["edit"] += r["edit"]
                row["ctx"] += r["context_tokens"]
                row["definer"] += r["definer_in_ring"]
    return {k: table[k] for k in sorted(table, key=lambda k: (k == "all", k))}


def print_report(out: dict, args: argparse.Namespace) -> None:
    table = summarize(out)
    print(
        f"bench/crossfile.py  model {out['model']}  commit {out['commit']}  budget {args.budget} tokens  "
        f"windows {args.prefix_chars}/{args.suffix_chars} chars"
    )
    print(
        f"engine threads 1 (engineThreads); server process tree: {out.get('threads', '-')} OS threads per process; "
        f"{os.cpu_count()} CPU cores; "
        f"load average {out['load_avg_start'][0]:.2f} at start, {out.get('load_avg_end', [float('nan')])[0]:.2f} "
        f"at end; wall {out.get('wall_s', 0):.0f} s"
    )
    print("sources (read at run time, not copied into the repository):")
    for src, lic in sorted(out.get("sources", {}).items()):
        print(f"  {src}: {lic}")
    print()
    print(
        "(exact: the answer's first line equals the rest of the line; edit sim: difflib ratio; ctx tok: the engine's "
        "context tokens per prompt; with ctx: share of prompts with any; def in ctx: share whose ring held the "
        "defining module's code)"
    )
    print(
        f"{'language':10s} {'mode':11s} {'n':>4s} {'exact':>7s} {'edit sim':>9s} {'ctx tok':>8s} {'with ctx':>9s} "
        f"{'def in ctx':>10s}"
    )
    for lang, modes in table.items():
        for mode in MODES:
            r = modes.get(mode)
            if r is None:
                continue
            n = r["n"]
            print(
                f"{lang:10s} {mode:11s} {n:4d} {r['exact'] / n:7.3f} {r['edit'] / n:9.3f} {r['ctx'] / n:8.0f} "
                f"{r['with_ctx'] / n:9.2f} {r['definer'] / n:10.2f}"
            )
    for lang, modes in table.items():
        a, nb, un = modes.get("alone"), modes.get("neighbours"), modes.get("unrelated")
        if a and nb:
            ratio = (nb["exact"] / a["exact"]) if a["exact"] else float("inf")
            print(
                f"gain {lang}: exact {a['exact']}/{a['n']} -> {nb['exact']}/{nb['n']} ({ratio:.2f}x), edit "
                f"{a['edit'] / a['n']:.3f} -> {nb['edit'] / nb['n']:.3f}"
                + (f"; unrelated only: exact {un['exact']}/{un['n']}, edit {un['edit'] / un['n']:.3f}" if un else "")
            )
    ks = out.get("keystrokes")
    if ks:
        print()
        print(
            f"keystrokes after the first completion ({len(ks['off']['key_prefill'])} keys, "
            f"{args.keystroke_cases} cases, neighbours open, editor defaults):"
        )
        print(
            f"{'context':8s} {'prefill/key mean':>17s} {'max':>5s} {'answer ms p50':>14s} {'p90':>7s} "
            f"{'first: prefill':>15s} {'first ms':>9s} {'ctx tok':>8s}"
        )
        for k in ("off", "on"):
            r = ks[k]
            print(
                f"{k:8s} {_mean(r['key_prefill']):17.1f} {max(r['key_prefill'] or [0]):5d} "
                f"{percentile(r['key_ms'], 0.5) or 0:14.0f} {percentile(r['key_ms'], 0.9) or 0:7.0f} "
                f"{_mean(r['first_prefill']):15.0f} {_mean(r['first_ms']):9.0f} {_mean(r['context_tokens']):8.0f}"
            )
    lp = out.get("loop")
    if lp:
        print()
        print(
            f"event loop, 50 open documents of 1 MB (embedded model): the context's work took {lp['work_s']:.1f} s "
            f"in "
            f"{lp['slices']} slices ({lp['indexed_docs']} documents indexed; longest slice "
            f"{lp.get('slice_max_ms', float('nan')):.1f} ms of CPU); a cheap request meanwhile was answered "
            f"in p50 {lp['p50_ms']:.1f} ms, p99 {lp['p99_ms']:.1f} ms, max {lp['max_ms']:.1f} ms over {lp['pings']} "
            f"requests (before: p50 {lp['base_p50_ms']:.1f} ms, max {lp['base_max_ms']:.1f} ms)"
        )
    print()
    heads = []
    for lang, modes in table.items():
        a, nb, un = modes.get("alone"), modes.get("neighbours"), modes.get("unrelated")
        if a and nb:
            ratio = f"{nb['exact'] / a['exact']:.2f}x" if a["exact"] else "inf"
            heads.append(
                f"{lang} exact {a['exact'] / a['n']:.3f} -> {nb['exact'] / nb['n']:.3f} ({ratio}), edit "
                f"{a['edit'] / a['n']:.3f} -> {nb['edit'] / nb['n']:.3f}"
                + (f", unrelated {un['exact'] / un['n']:.3f}/{un['edit'] / un['n']:.3f}" if un else "")
            )
    if ks:
        heads.append(f"prefill/key off {_mean(ks['off']['key_prefill']):.1f} on {_mean(ks['on']['key_prefill']):.1f}")
    print("HEADLINE: " + "; ".join(heads))


def git_commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "?"
        )
    except (OSError, subprocess.SubprocessError):
        return "?"


async def main_async(args: argparse.Namespace) -> dict:
    env, label = lsp_typing.server_env(args.model)
    out: dict = {"model": label, "commit": git_commit(), "load_avg_start": os.getloadavg(), "args": vars(args)}
    t0 = time.perf_counter()
    cases = build_cases(args.cases, args.seed, args.langs) if args.cases else []
    out["sources"] = {c.source: licence_of(c.source) for c in cases}
    print(
        f"{len(cases)} cases ({', '.join(f'{lang} {sum(c.lang == lang for c in cases)}' for lang in args.langs)})",
        file=sys.stderr,
        flush=True,
    )
    if cases:
        await quality(args, env, cases, out)
    if args.keystroke_cases:
        await keystrokes(args, env, cases[: args.keystroke_cases], out)
    if args.loop:
        await loop_blocking(args, env, out)
    out["wall_s"] = time.perf_counter() - t0
    out["load_avg_end"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default=None,
        help="default (what a user gets; the default without --quick), embedded (with --quick), or a path",
    )
    ap.add_argument("--cases", type=int, default=30, help="cases per language")
    ap.add_argument("--langs", nargs="+", default=["python", "javascript"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--budget", type=int, default=512, help="crossFileBudget (tokens)")
    ap.add_argument("--prefix-chars", type=int, default=2000)
    ap.add_argument("--suffix-chars", type=int, default=500)
    ap.add_argument("--keystroke-cases", type=int, default=4)
    ap.add_argument("--keys", type=int, default=10, help="keys typed per keystroke case")
    ap.add_argument("--no-loop", dest="loop", action="store_false", help="skip the 50 x 1 MB event-loop figure")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="1 case per language, 3 modes, 1 keystroke case")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, help="print the report of a saved --json run, run nothing")
    args = ap.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        print_report(saved, argparse.Namespace(**saved["args"]))
        return 0
    if args.model is None:
        args.model = "embedded" if args.quick else "default"
    if args.quick:
        args.cases, args.keystroke_cases, args.keys = 1, 1, 3
        args.modes = ["alone", "neighbours", "unrelated"]
        args.prefix_chars, args.suffix_chars = 1200, 300
    out = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    print_report(out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
