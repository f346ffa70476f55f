"""What a file imports (tree-sitter). Where those modules are: lsp_server/context/module_paths.py; the
definitions they hold: lsp_server/context/definitions.py.

Python: ``import a.b [as x]``, ``from .x import y [as z]``, ``from . import mod``.
JavaScript / TypeScript: ``import d, {a, b as c} from './x'``, ``import * as ns from './x'``,
``const {a} = require('./x')``, ``const x = require('./x')``. Only relative module specifiers are
resolved in JS (packages in node_modules are not the user's code); Python absolute imports are looked
for under the file's own ancestors and the workspace folders.
Go: ``import [alias] "path/to/pkg"``: a package is a folder, looked for as the path's trailing parts under
the file's ancestors and the workspace folders (the module path in go.mod is not read: its last parts are
the folders); names are used as ``pkg.Name``.
Rust: ``use crate::a::b::{C, d as e};``, ``use super::x::Y;``, ``use self::m::Z;``: ``crate`` is the
``src`` folder above the file, a module ``a::b`` is ``a/b.rs`` or ``a/b/mod.rs``; an imported name that is
itself a module (``use crate::store;``) is used as ``store::name``.
Java: ``import a.b.C;`` and ``import static a.b.C.m;``: ``a/b/C.java`` under the source root the file's own
``package`` line implies, its ancestors and the workspace folders; ``import a.b.*;`` is not followed.
C / C++: ``#include "x.h"`` relative to the file, then to the workspace folders; ``<...>`` is the system's.

Only top-level statements are read (the root's children: imports inside functions are skipped), at most
MAX_TOP_NODES of them, so a huge file costs a bounded walk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MAX_TOP_NODES = 2000
MAX_IMPORTS = 24
PY_FAMILY = "python"
_FAMILIES = {
    "python": "python",
    "py": "python",
    "javascript": "js",
    "javascriptreact": "js",
    "typescript": "js",
    "typescriptreact": "js",
    "js": "js",
    "jsx": "js",
    "ts": "js",
    "tsx": "js",
    "go": "go",
    "golang": "go",
    "rust": "rust",
    "rs": "rust",
    "java": "java",
    "c": "c",
    "cpp": "c",
    "c++": "c",
    "cuda": "c",
    "objective-c": "c",
    "objective-cpp": "c",
}


def family(language_id: str) -> str | None:
    """Languages whose files import each other: python, js (JavaScript and TypeScript, JSX included), go,
    rust, java, c (C and C++: headers are shared)."""
    return _FAMILIES.get((language_id or "").lower())


@dataclass(frozen=True)
class Import:
    module: str  # Python: dotted, leading dots for relative ("..pkg.mod", "."); JS: the specifier
    names: tuple[tuple[str, str], ...] = ()  # (name in the module, local name)
    binding: str | None = None  # the module as a whole, by this expression (``a.b``, ``ns``, ``mod``)
    default: str | None = None  # JS: the local name of the default export


def node_text(node) -> str:
    return node.text.decode("utf-8", errors="replace") if node is not None else ""


def top_nodes(trees):
    n = 0
    for tree in trees:
        for child in tree.root_node.children:
            yield child
            n += 1
            if n >= MAX_TOP_NODES:
                return


def extract_imports(fam: str | None, trees) -> list[Import]:
    """The imports among the top-level statements of a document's trees."""
    out: list[Import] = []
    for node in top_nodes(trees):
        if fam == PY_FAMILY:
            out.extend(_python_import(node))
        elif fam == "js":
            out.extend(_js_import(node))
        elif fam == "go":
            out.extend(_go_import(node))
        elif fam == "rust":
            out.extend(_rust_import(node))
        elif fam == "java":
            out.extend(_java_import(node))
        elif fam == "c":
            out.extend(_c_include(node))
        if len(out) >= MAX_IMPORTS:
            break
    return out[:MAX_IMPORTS]


def _python_import(node) -> list[Import]:
    if node.type == "import_statement":
        out = []
        for child in node.children_by_field_name("name"):
            if child.type == "aliased_import":
                out.append(
                    Import(
                        node_text(child.child_by_field_name("name")),
                        binding=node_text(child.child_by_field_name("alias")),
                    )
                )
            elif child.type == "dotted_name":
                out.append(Import(node_text(child), binding=node_text(child)))
        return out
    if node.type == "import_from_statement":
        module = node_text(node.child_by_field_name("module_name"))
        names = []
        for child in node.children_by_field_name("name"):
            if child.type == "aliased_import":
                names.append(
                    (node_text(child.child_by_field_name("name")), node_text(child.child_by_field_name("alias")))
                )
            elif child.type == "dotted_name":
                names.append((node_text(child), node_text(child)))
        return [Import(module, tuple(names))] if module and names else []
    return []


def _string_value(node) -> str | None:
    if node is None or node.type not in ("string", "template_string"):
        return None
    text = node_text(node)
    return text[1:-1] if len(text) >= 2 else None


def _js_import(node) -> list[Import]:
    if node.type == "import_statement":
        source = _string_value(node.child_by_field_name("source"))
        clause = next((c for c in node.children if c.type == "import_clause"), None)
        if source is None or clause is None:
            return []
        names, binding, default = [], None, None
        for child in clause.children:
            if child.type == "identifier":
                default = node_text(child)
            elif child.type == "namespace_import":
                binding = node_text(next((c for c in child.children if c.type == "identifier"), None)) or None
            elif child.type == "named_imports":
                for spec in child.children:
                    if spec.type == "import_specifier":
                        name = node_text(spec.child_by_field_name("name"))
                        alias = node_text(spec.child_by_field_name("alias")) or name
                        names.append((name, alias))
        return [Import(source, tuple(names), binding, default)]
    if node.type in ("lexical_declaration", "variable_declaration"):
        out = []
        for decl in node.children:
            if decl.type != "variable_declarator":
                continue
            value = decl.child_by_field_name("value")
            if (
                value is None
                or value.type != "call_expression"
                or node_text(value.child_by_field_name("function")) != "require"
            ):
                continue
            args = value.child_by_field_name("arguments")
            source = _string_value(args.named_children[0]) if args is not None and args.named_children else None
            target = decl.child_by_field_name("name")
            if source is None or target is None:
                continue
            if target.type == "identifier":
                out.append(Import(source, default=node_text(target), binding=node_text(target)))
            elif target.type == "object_pattern":
                names = []
                for prop in target.named_children:
                    if prop.type == "shorthand_property_identifier_pattern":
                        names.append((node_text(prop), node_text(prop)))
                    elif prop.type == "pair_pattern":
                        names.append(
                            (node_text(prop.child_by_field_name("key")), node_text(prop.child_by_field_name("value")))
                        )
                out.append(Import(source, tuple(names)))
        return out
    return []


def _go_import(node) -> list[Import]:
    if node.type != "import_declaration":
        return []
    specs = [c for c in node.children if c.type == "import_spec"]
    for lst in (c for c in node.children if c.type == "import_spec_list"):
        specs += [c for c in lst.children if c.type == "import_spec"]
    out = []
    for spec in specs:
        path = spec.child_by_field_name("path")
        module = node_text(path)[1:-1] if path is not None and len(node_text(path)) >= 2 else ""
        alias = node_text(spec.child_by_field_name("name"))
        if not module or alias in ("_", "."):  # side effects only, or dot-imported names: nothing to look up
            continue
        out.append(Import(module, binding=alias or module.rstrip("/").rsplit("/", 1)[-1]))
    return out


def _rust_path(node) -> list[str]:
    """``crate::a::b`` as ["crate", "a", "b"] (scoped identifiers nest to the left)."""
    if node is None:
        return []
    if node.type == "scoped_identifier":
        return _rust_path(node.child_by_field_name("path")) + [node_text(node.child_by_field_name("name"))]
    return [node_text(node)]


def _rust_import(node) -> list[Import]:
    if node.type != "use_declaration":
        return []
    arg = node.child_by_field_name("argument")
    out: list[Import] = []

    def leaf(path: list[str], alias: str | None) -> None:
        if len(path) >= 2 and path[-1] not in ("self", "*"):
            out.append(Import("::".join(path[:-1]), ((path[-1], alias or path[-1]),)))

    def walk(n, prefix: list[str]) -> None:
        if n is None:
            return
        if n.type in ("scoped_identifier", "identifier", "crate", "super", "self"):
            leaf(prefix + _rust_path(n), None)
        elif n.type == "use_as_clause":
            leaf(prefix + _rust_path(n.child_by_field_name("path")), node_text(n.child_by_field_name("alias")))
        elif n.type == "scoped_use_list":
            base = prefix + _rust_path(n.child_by_field_name("path"))
            walk(n.child_by_field_name("list"), base)
        elif n.type == "use_list":
            for c in n.named_children:
                walk(c, prefix)

    walk(arg, [])
    # one Import per module: its names together
    merged: dict[str, list[tuple[str, str]]] = {}
    for imp in out:
        merged.setdefault(imp.module, []).extend(imp.names)
    return [Import(m, tuple(names)) for m, names in merged.items()]


def _java_import(node) -> list[Import]:
    if node.type != "import_declaration" or any(c.type == "asterisk" for c in node.children):
        return []
    name = next((c for c in node.named_children if c.type in ("scoped_identifier", "identifier")), None)
    parts = node_text(name).split(".") if name is not None else []
    if len(parts) < 2:
        return []
    if any(c.type == "static" for c in node.children):  # ``import static a.b.C.m``: class C, used as m
        return [Import(".".join(parts[:-1]), ((parts[-2], parts[-1]),))] if len(parts) >= 3 else []
    return [Import(".".join(parts), ((parts[-1], parts[-1]),))]


def _c_include(node) -> list[Import]:
    if node.type != "preproc_include":
        return []
    path = node.child_by_field_name("path")
    if path is None or path.type != "string_literal":  # <stdio.h>: the system's, not the user's code
        return []
    module = node_text(path)[1:-1]
    return [Import(module, binding="*")] if module else []


def java_source_root(trees, doc_path: str) -> str | None:
    """The folder that holds the package folders of ``doc_path`` (from its ``package a.b;`` line)."""
    for node in top_nodes(trees):
        if node.type == "package_declaration":
            name = next((c for c in node.named_children if c.type in ("scoped_identifier", "identifier")), None)
            parts = node_text(name).split(".") if name is not None else []
            base = os.path.dirname(doc_path)
            for part in reversed(parts):
                if os.path.basename(base) != part:
                    return None
                base = os.path.dirname(base)
            return base
    return None
