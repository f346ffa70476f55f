"""Where an imported module may be: candidate paths per language, most likely first (nothing is read here).

The rules per language are in lsp_server/context/imports.py's module doc: Python relative and absolute
imports (the file's ancestors, then the workspace folders), relative JS specifiers, Go package folders,
Rust ``crate``/``super``/``self`` paths, Java classes under the source root, C ``#include "x.h"``.
"""

from __future__ import annotations

import os

MAX_ANCESTORS = 6  # Python absolute imports: package roots looked for this far up from the file
JS_EXTENSIONS = (".js", ".ts", ".tsx", ".jsx", ".mjs", ".cjs")
MAX_PACKAGE_FILES = 12  # Go: files of a package folder read for its definitions


def module_candidates(
    fam: str | None, module: str, doc_path: str | None, roots: list[str], java_root: str | None = None
) -> list[str]:
    """Paths the module may be at, most likely first (nothing is read here). Go: package folders, each
    ending in ``/`` (its files are listed where it is read)."""
    if doc_path is None:
        return []
    here = os.path.dirname(doc_path)
    if fam == "go":
        return _go_candidates(module, here, roots)
    if fam == "rust":
        return _rust_candidates(module, doc_path)
    if fam == "java":
        return _java_candidates(module, here, roots, java_root)
    if fam == "c":
        if module.startswith("/") or ".." in module.split("/"):
            return []
        return [os.path.normpath(os.path.join(b, module)) for b in [here, *roots]]
    if fam == "js":
        if not module.startswith(("./", "../")):
            return []
        base = os.path.normpath(os.path.join(here, module))
        out = [base] if os.path.splitext(base)[1] else []  # './x.js' as written
        return out + [base + e for e in JS_EXTENSIONS] + [os.path.join(base, "index" + e) for e in JS_EXTENSIONS[:2]]
    level = len(module) - len(module.lstrip("."))
    parts = [p for p in module[level:].split(".") if p]
    if level:
        base = here
        for _ in range(level - 1):
            base = os.path.dirname(base)
        bases = [base]
    else:
        bases, d = [], here
        for _ in range(MAX_ANCESTORS):
            bases.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        bases += [r for r in roots if r not in bases]
    out = []
    for b in bases:
        p = os.path.join(b, *parts)
        out += [p + ".py", os.path.join(p, "__init__.py")] if parts else [os.path.join(p, "__init__.py")]
    return out


def _ancestors(here: str, roots: list[str]) -> list[str]:
    bases, d = [], here
    for _ in range(MAX_ANCESTORS):
        bases.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return bases + [r for r in roots if r not in bases]


def _go_candidates(module: str, here: str, roots: list[str]) -> list[str]:
    parts = [p for p in module.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        return []
    out: list[str] = []
    for k in range(min(len(parts), 4), 0, -1):  # the longest trailing part first: "p/util" before "util"
        for base in _ancestors(here, roots):
            path = os.path.join(base, *parts[-k:]) + "/"
            if path not in out:
                out.append(path)
    return out[:48]


def _rust_candidates(module: str, doc_path: str) -> list[str]:
    parts = module.split("::")
    here = os.path.dirname(doc_path)
    if parts[0] == "crate":
        base = here
        for _ in range(MAX_ANCESTORS):  # the crate's root: the ``src`` folder above the file
            if os.path.basename(base) == "src":
                break
            parent = os.path.dirname(base)
            if parent == base:
                return []
            base = parent
        else:
            return []
        rest = parts[1:]
    elif parts[0] in ("self", "super"):
        # the folder of this file's own submodules: ``x/y.rs`` is module ``x::y``, whose are in ``x/y/``
        stem = os.path.splitext(os.path.basename(doc_path))[0]
        base = here if stem in ("mod", "lib", "main") else os.path.join(here, stem)
        rest = list(parts)
        while rest and rest[0] in ("self", "super"):
            if rest.pop(0) == "super":
                base = os.path.dirname(base)
    else:
        return []  # another crate (or std): not the user's code here
    if not rest:
        return [os.path.join(base, "lib.rs"), os.path.join(base, "main.rs"), os.path.join(base, "mod.rs")]
    p = os.path.join(base, *rest)
    return [p + ".rs", os.path.join(p, "mod.rs")]


def _java_candidates(module: str, here: str, roots: list[str], java_root: str | None) -> list[str]:
    parts = module.split(".")
    rel = os.path.join(*parts) + ".java"
    bases = ([java_root] if java_root else []) + _ancestors(here, roots)
    out = []
    for b in bases:
        for sub in ("", os.path.join("src", "main", "java"), "src"):
            path = os.path.join(b, sub, rel) if sub else os.path.join(b, rel)
            if path not in out:
                out.append(path)
    return out[:48]
