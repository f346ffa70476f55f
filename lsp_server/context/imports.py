"""What a file imports (tree-sitter), where those modules are, and the definitions they hold.

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
import re
from dataclasses import dataclass

MAX_TOP_NODES = 2000
MAX_IMPORTS = 24
MAX_ANCESTORS = 6  # Python absolute imports: package roots looked for this far up from the file
DEF_MAX_LINES = 20  # a definition's chunk: its first lines, then its methods' signature lines
DEF_HEAD_LINES = 8
JS_EXTENSIONS = (".js", ".ts", ".tsx", ".jsx", ".mjs", ".cjs")
MAX_PACKAGE_FILES = 12  # Go: files of a package folder read for its definitions
_PY_FAMILY = "python"
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


def _text(node) -> str:
    return node.text.decode("utf-8", errors="replace") if node is not None else ""


def _top_nodes(trees):
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
    for node in _top_nodes(trees):
        if fam == _PY_FAMILY:
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
                    Import(_text(child.child_by_field_name("name")), binding=_text(child.child_by_field_name("alias")))
                )
            elif child.type == "dotted_name":
                out.append(Import(_text(child), binding=_text(child)))
        return out
    if node.type == "import_from_statement":
        module = _text(node.child_by_field_name("module_name"))
        names = []
        for child in node.children_by_field_name("name"):
            if child.type == "aliased_import":
                names.append((_text(child.child_by_field_name("name")), _text(child.child_by_field_name("alias"))))
            elif child.type == "dotted_name":
                names.append((_text(child), _text(child)))
        return [Import(module, tuple(names))] if module and names else []
    return []


def _string_value(node) -> str | None:
    if node is None or node.type not in ("string", "template_string"):
        return None
    text = _text(node)
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
                default = _text(child)
            elif child.type == "namespace_import":
                binding = _text(next((c for c in child.children if c.type == "identifier"), None)) or None
            elif child.type == "named_imports":
                for spec in child.children:
                    if spec.type == "import_specifier":
                        name = _text(spec.child_by_field_name("name"))
                        alias = _text(spec.child_by_field_name("alias")) or name
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
                or _text(value.child_by_field_name("function")) != "require"
            ):
                continue
            args = value.child_by_field_name("arguments")
            source = _string_value(args.named_children[0]) if args is not None and args.named_children else None
            target = decl.child_by_field_name("name")
            if source is None or target is None:
                continue
            if target.type == "identifier":
                out.append(Import(source, default=_text(target), binding=_text(target)))
            elif target.type == "object_pattern":
                names = []
                for prop in target.named_children:
                    if prop.type == "shorthand_property_identifier_pattern":
                        names.append((_text(prop), _text(prop)))
                    elif prop.type == "pair_pattern":
                        names.append((_text(prop.child_by_field_name("key")), _text(prop.child_by_field_name("value"))))
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
        module = _text(path)[1:-1] if path is not None and len(_text(path)) >= 2 else ""
        alias = _text(spec.child_by_field_name("name"))
        if not module or alias in ("_", "."):  # side effects only, or dot-imported names: nothing to look up
            continue
        out.append(Import(module, binding=alias or module.rstrip("/").rsplit("/", 1)[-1]))
    return out


def _rust_path(node) -> list[str]:
    """``crate::a::b`` as ["crate", "a", "b"] (scoped identifiers nest to the left)."""
    if node is None:
        return []
    if node.type == "scoped_identifier":
        return _rust_path(node.child_by_field_name("path")) + [_text(node.child_by_field_name("name"))]
    return [_text(node)]


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
            leaf(prefix + _rust_path(n.child_by_field_name("path")), _text(n.child_by_field_name("alias")))
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
    parts = _text(name).split(".") if name is not None else []
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
    module = _text(path)[1:-1]
    return [Import(module, binding="*")] if module else []


def java_source_root(trees, doc_path: str) -> str | None:
    """The folder that holds the package folders of ``doc_path`` (from its ``package a.b;`` line)."""
    for node in _top_nodes(trees):
        if node.type == "package_declaration":
            name = next((c for c in node.named_children if c.type in ("scoped_identifier", "identifier")), None)
            parts = _text(name).split(".") if name is not None else []
            base = os.path.dirname(doc_path)
            for part in reversed(parts):
                if os.path.basename(base) != part:
                    return None
                base = os.path.dirname(base)
            return base
    return None


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


@dataclass(frozen=True)
class Definition:
    name: str
    rows: tuple[int, ...]  # the lines its chunk shows (its head, then its methods' signature lines)
    start: int
    end: int  # the line after its last


def _end_row(node) -> int:
    """The line after ``node``'s last (a ``#define`` ends at column 0 of the next line: not that one)."""
    row, col = node.end_point
    return row + 1 if col > 0 or row == node.start_point[0] else row


def _rows(node, nested_types: tuple[str, ...]) -> tuple[int, ...]:
    start, end = node.start_point[0], _end_row(node)
    if end - start <= DEF_MAX_LINES:
        return tuple(range(start, end))
    rows = list(range(start, start + DEF_HEAD_LINES))
    stack = list(node.children)
    sigs = []
    while stack and len(sigs) < 64:  # methods' first lines (signatures), in order
        n = stack.pop()
        if n.type in nested_types:
            sigs.append(n.start_point[0])
        elif n.type in (
            "block",
            "class_body",
            "decorated_definition",
            "statement_block",
            "declaration_list",
            "interface_body",
            "enum_body",
            "enum_body_declarations",
            "field_declaration_list",
        ):
            stack.extend(n.children)
    for r in sorted(set(sigs)):
        if r >= rows[-1] + 1 and len(rows) < DEF_MAX_LINES:
            rows.append(r)
    return tuple(rows)


_PY_NESTED = ("function_definition",)
_JS_NESTED = ("method_definition", "function_declaration")
_GO_NESTED = ("method_spec", "field_declaration")
_RUST_NESTED = ("function_item", "function_signature_item")
_JAVA_NESTED = ("method_declaration", "constructor_declaration")
_C_NESTED = ("function_definition", "field_declaration", "declaration")


def extract_definitions(fam: str | None, trees) -> tuple[dict[str, Definition], str | None]:
    """Top-level definitions by name, and (JS) the name of the default export (``module.exports = X``)."""
    defs: dict[str, Definition] = {}
    default: str | None = None

    def add(name: str, node, nested: tuple[str, ...]) -> None:
        if name and name not in defs:
            defs[name] = Definition(name, _rows(node, nested), node.start_point[0], _end_row(node))

    for node in _top_nodes(trees):
        if fam == _PY_FAMILY:
            inner = node.child_by_field_name("definition") if node.type == "decorated_definition" else node
            if inner is not None and inner.type in ("function_definition", "class_definition"):
                add(_text(inner.child_by_field_name("name")), node, _PY_NESTED)
            elif (
                node.type == "expression_statement"
                and node.named_children
                and node.named_children[0].type == "assignment"
            ):
                left = node.named_children[0].child_by_field_name("left")
                if left is not None and left.type == "identifier":
                    add(_text(left), node, _PY_NESTED)
        elif fam == "js":
            default = _js_definitions(node, add) or default
        elif fam in _OTHER_DEFS:
            for name, outer, nested in _OTHER_DEFS[fam](node):
                add(name, outer, nested)
    if fam in ("go", "rust"):
        _merge_methods(defs)
    return defs, default


def _merge_methods(defs: dict[str, Definition]) -> None:
    """Go methods and Rust ``impl`` blocks (kept as ``impl:T``) join their type's chunk: its head, then the
    methods' signature lines, up to DEF_MAX_LINES (a type alone says little of how it is used)."""
    for key in [k for k in defs if k.startswith(_IMPL)]:
        extra = defs.pop(key)
        name, _, member = key[len(_IMPL) :].partition("\x00")
        if member.startswith("fn "):  # a Go method: its signature line only
            extra = Definition(name, (extra.start,), extra.start, extra.end)
        base = defs.get(name)
        if base is None:
            defs[name] = Definition(name, extra.rows[:DEF_MAX_LINES], extra.start, extra.end)
            continue
        rows = list(base.rows)
        for r in extra.rows:
            if len(rows) >= DEF_MAX_LINES:
                break
            if r not in rows:
                rows.append(r)
        defs[name] = Definition(name, tuple(sorted(rows)), min(base.start, extra.start), max(base.end, extra.end))


def _js_definitions(node, add) -> str | None:
    """Adds ``node``'s definitions; returns the default export's name where ``node`` sets it."""
    decl, outer, default = node, node, None
    if node.type == "export_statement":
        decl = node.child_by_field_name("declaration") or node.child_by_field_name("value")
        is_default = any(c.type == "default" for c in node.children)
        if decl is None:
            return None
        if is_default and decl.type == "identifier":
            return _text(decl)
        if is_default:
            default = _text(decl.child_by_field_name("name")) or None
    if decl.type in (
        "function_declaration",
        "generator_function_declaration",
        "class_declaration",
        "abstract_class_declaration",
        "interface_declaration",
        "type_alias_declaration",
        "enum_declaration",
    ):
        add(_text(decl.child_by_field_name("name")), outer, _JS_NESTED)
    elif decl.type in ("lexical_declaration", "variable_declaration"):
        for d in decl.named_children:
            if (
                d.type == "variable_declarator"
                and (n := d.child_by_field_name("name")) is not None
                and n.type == "identifier"
            ):
                add(_text(n), outer, _JS_NESTED)
    elif (
        decl.type == "expression_statement"
        and decl.named_children
        and decl.named_children[0].type == "assignment_expression"
    ):
        assign = decl.named_children[0]
        left, right = assign.child_by_field_name("left"), assign.child_by_field_name("right")
        target = _text(left)
        if target == "module.exports" and right is not None and right.type == "identifier":
            return _text(right)
        m = re.fullmatch(r"(?:module\.)?exports\.([A-Za-z_$][\w$]*)", target)
        if m:
            add(m.group(1), outer, _JS_NESTED)
    return default


_IMPL = "impl:"


def _walk(node, depth: int):
    """``node`` and its descendants down to ``depth`` levels, depth first."""
    yield node
    if depth > 0:
        for c in node.children:
            yield from _walk(c, depth - 1)


def _name(node, field: str = "name") -> str:
    return _text(node.child_by_field_name(field)) if node is not None else ""


def _go_definitions(node) -> list[tuple[str, object, tuple[str, ...]]]:
    if node.type == "function_declaration":
        return [(_name(node), node, _GO_NESTED)]
    if node.type == "method_declaration":  # joins its receiver type's chunk (_merge_methods)
        receiver = node.child_by_field_name("receiver")
        types = [t for t in _walk(receiver, 4) if t.type == "type_identifier"] if receiver is not None else []
        return [(f"{_IMPL}{_text(types[0])}\x00fn {_name(node)}", node, ())] if types else []
    if node.type in ("type_declaration", "const_declaration", "var_declaration"):
        specs = [c for c in node.named_children if c.type in ("type_spec", "type_alias", "const_spec", "var_spec")]
        for group in (c for c in node.named_children if c.type in ("var_spec_list", "const_spec_list")):
            specs += [c for c in group.named_children if c.type in ("const_spec", "var_spec")]
        single = len(specs) == 1
        return [(_name(s), node if single else s, _GO_NESTED) for s in specs]
    return []


def _rust_definitions(node) -> list[tuple[str, object, tuple[str, ...]]]:
    if node.type == "impl_item":  # ``impl T`` / ``impl Trait for T``: joins T's chunk (_merge_methods)
        t = node.child_by_field_name("type")
        name = _text(t.child_by_field_name("type") if t is not None and t.type == "generic_type" else t)
        return [(f"{_IMPL}{name}\x00{node.start_point[0]}", node, _RUST_NESTED)] if name else []
    if node.type in (
        "function_item",
        "struct_item",
        "enum_item",
        "trait_item",
        "type_item",
        "const_item",
        "static_item",
        "union_item",
        "mod_item",
        "macro_definition",
    ):
        return [(_name(node), node, _RUST_NESTED)]
    return []


def _java_definitions(node) -> list[tuple[str, object, tuple[str, ...]]]:
    if node.type in (
        "class_declaration",
        "interface_declaration",
        "enum_declaration",
        "record_declaration",
        "annotation_type_declaration",
    ):
        return [(_name(node), node, _JAVA_NESTED)]
    return []


def _c_declarator_name(node) -> str:
    """The declared name under a (function, pointer, ...) declarator."""
    for _ in range(8):
        if node is None:
            return ""
        if node.type in ("identifier", "field_identifier", "type_identifier"):
            return _text(node)
        if node.type in ("qualified_identifier", "destructor_name", "operator_name"):
            return _text(node).rsplit("::", 1)[-1]
        node = node.child_by_field_name("declarator") or node.child_by_field_name("name")
    return ""


def _c_definitions(node) -> list[tuple[str, object, tuple[str, ...]]]:
    if node.type in ("function_definition", "declaration"):
        out = []
        for d in node.children_by_field_name("declarator"):
            name = _c_declarator_name(d)
            if name:
                out.append((name, node, _C_NESTED))
        spec = node.child_by_field_name("type")  # ``struct P {...} p;``: the struct too
        if (
            spec is not None
            and spec.type in ("struct_specifier", "union_specifier", "enum_specifier", "class_specifier")
            and spec.child_by_field_name("body") is not None
        ):
            out.append((_name(spec), node, _C_NESTED))
        return out
    if node.type in ("struct_specifier", "union_specifier", "enum_specifier", "class_specifier"):
        return [(_name(node), node, _C_NESTED)]
    if node.type == "type_definition":
        out = [(_c_declarator_name(d), node, _C_NESTED) for d in node.children_by_field_name("declarator")]
        spec = node.child_by_field_name("type")
        if spec is not None and spec.child_by_field_name("name") is not None:
            out.append((_name(spec), node, _C_NESTED))
        return out
    if node.type in ("preproc_def", "preproc_function_def"):
        return [(_name(node), node, ())]
    if node.type in ("namespace_definition", "linkage_specification", "preproc_ifdef", "preproc_if"):
        body = node.child_by_field_name("body")  # one level down: ``namespace ns { ... }``, header guards
        kids = body.named_children if body is not None else node.named_children
        return [d for k in kids[:MAX_TOP_NODES] if k.type != node.type for d in _c_definitions(k)]
    return []


_OTHER_DEFS = {"go": _go_definitions, "rust": _rust_definitions, "java": _java_definitions, "c": _c_definitions}
