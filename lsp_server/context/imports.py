"""What a file imports (tree-sitter), where those modules are, and the definitions they hold.

Python: ``import a.b [as x]``, ``from .x import y [as z]``, ``from . import mod``.
JavaScript / TypeScript: ``import d, {a, b as c} from './x'``, ``import * as ns from './x'``,
``const {a} = require('./x')``, ``const x = require('./x')``. Only relative module specifiers are
resolved in JS (packages in node_modules are not the user's code); Python absolute imports are looked
for under the file's own ancestors and the workspace folders.

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
_PY_FAMILY = "python"
_JS_FAMILIES = ("javascript", "typescript")


def family(language_id: str) -> str | None:
    """Languages whose files import each other: python, or js (JavaScript and TypeScript, JSX included)."""
    lid = (language_id or "").lower()
    if lid in ("python", "py"):
        return _PY_FAMILY
    if lid in ("javascript", "javascriptreact", "typescript", "typescriptreact", "js", "jsx", "ts", "tsx"):
        return "js"
    return None


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
        if len(out) >= MAX_IMPORTS:
            break
    return out[:MAX_IMPORTS]


def _python_import(node) -> list[Import]:
    if node.type == "import_statement":
        out = []
        for child in node.children_by_field_name("name"):
            if child.type == "aliased_import":
                out.append(Import(_text(child.child_by_field_name("name")),
                                  binding=_text(child.child_by_field_name("alias"))))
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
            if value is None or value.type != "call_expression" \
                    or _text(value.child_by_field_name("function")) != "require":
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


def module_candidates(fam: str | None, module: str, doc_path: str | None, roots: list[str]) -> list[str]:
    """Paths the module may be at, most likely first (nothing is read here)."""
    if doc_path is None:
        return []
    here = os.path.dirname(doc_path)
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


@dataclass(frozen=True)
class Definition:
    name: str
    rows: tuple[int, ...]  # the lines its chunk shows (its head, then its methods' signature lines)
    start: int
    end: int  # the line after its last


def _rows(node, nested_types: tuple[str, ...]) -> tuple[int, ...]:
    start, end = node.start_point[0], node.end_point[0] + 1
    if end - start <= DEF_MAX_LINES:
        return tuple(range(start, end))
    rows = list(range(start, start + DEF_HEAD_LINES))
    stack = list(node.children)
    sigs = []
    while stack and len(sigs) < 64:  # methods' first lines (signatures), in order
        n = stack.pop()
        if n.type in nested_types:
            sigs.append(n.start_point[0])
        elif n.type in ("block", "class_body", "decorated_definition", "statement_block", "declaration_list"):
            stack.extend(n.children)
    for r in sorted(set(sigs)):
        if r >= rows[-1] + 1 and len(rows) < DEF_MAX_LINES:
            rows.append(r)
    return tuple(rows)


_PY_NESTED = ("function_definition",)
_JS_NESTED = ("method_definition", "function_declaration")


def extract_definitions(fam: str | None, trees) -> tuple[dict[str, Definition], str | None]:
    """Top-level definitions by name, and (JS) the name of the default export (``module.exports = X``)."""
    defs: dict[str, Definition] = {}
    default: str | None = None

    def add(name: str, node, nested: tuple[str, ...]) -> None:
        if name and name not in defs:
            defs[name] = Definition(name, _rows(node, nested), node.start_point[0], node.end_point[0] + 1)

    for node in _top_nodes(trees):
        if fam == _PY_FAMILY:
            inner = node.child_by_field_name("definition") if node.type == "decorated_definition" else node
            if inner is not None and inner.type in ("function_definition", "class_definition"):
                add(_text(inner.child_by_field_name("name")), node, _PY_NESTED)
            elif node.type == "expression_statement" and node.named_children \
                    and node.named_children[0].type == "assignment":
                left = node.named_children[0].child_by_field_name("left")
                if left is not None and left.type == "identifier":
                    add(_text(left), node, _PY_NESTED)
        elif fam == "js":
            default = _js_definitions(node, add) or default
    return defs, default


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
    if decl.type in ("function_declaration", "generator_function_declaration", "class_declaration",
                     "abstract_class_declaration", "interface_declaration", "type_alias_declaration",
                     "enum_declaration"):
        add(_text(decl.child_by_field_name("name")), outer, _JS_NESTED)
    elif decl.type in ("lexical_declaration", "variable_declaration"):
        for d in decl.named_children:
            if d.type == "variable_declarator" and (n := d.child_by_field_name("name")) is not None \
                    and n.type == "identifier":
                add(_text(n), outer, _JS_NESTED)
    elif decl.type == "expression_statement" and decl.named_children \
            and decl.named_children[0].type == "assignment_expression":
        assign = decl.named_children[0]
        left, right = assign.child_by_field_name("left"), assign.child_by_field_name("right")
        target = _text(left)
        if target == "module.exports" and right is not None and right.type == "identifier":
            return _text(right)
        m = re.fullmatch(r"(?:module\.)?exports\.([A-Za-z_$][\w$]*)", target)
        if m:
            add(m.group(1), outer, _JS_NESTED)
    return default
