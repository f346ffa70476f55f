"""The top-level definitions of an imported module's file (tree-sitter), each with the lines its chunk shows.

A definition's chunk is its first DEF_MAX_LINES lines, or for a longer one its first DEF_HEAD_LINES lines and
then its methods' signature lines. Go methods and Rust ``impl`` blocks join their type's chunk; JavaScript's
default export (``module.exports = X``) is named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lsp_server.context.imports import MAX_TOP_NODES, PY_FAMILY, node_text, top_nodes

DEF_MAX_LINES = 20  # a definition's chunk: its first lines, then its methods' signature lines
DEF_HEAD_LINES = 8


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

    for node in top_nodes(trees):
        if fam == PY_FAMILY:
            inner = node.child_by_field_name("definition") if node.type == "decorated_definition" else node
            if inner is not None and inner.type in ("function_definition", "class_definition"):
                add(node_text(inner.child_by_field_name("name")), node, _PY_NESTED)
            elif (
                node.type == "expression_statement"
                and node.named_children
                and node.named_children[0].type == "assignment"
            ):
                left = node.named_children[0].child_by_field_name("left")
                if left is not None and left.type == "identifier":
                    add(node_text(left), node, _PY_NESTED)
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
            return node_text(decl)
        if is_default:
            default = node_text(decl.child_by_field_name("name")) or None
    if decl.type in (
        "function_declaration",
        "generator_function_declaration",
        "class_declaration",
        "abstract_class_declaration",
        "interface_declaration",
        "type_alias_declaration",
        "enum_declaration",
    ):
        add(node_text(decl.child_by_field_name("name")), outer, _JS_NESTED)
    elif decl.type in ("lexical_declaration", "variable_declaration"):
        for d in decl.named_children:
            if (
                d.type == "variable_declarator"
                and (n := d.child_by_field_name("name")) is not None
                and n.type == "identifier"
            ):
                add(node_text(n), outer, _JS_NESTED)
    elif (
        decl.type == "expression_statement"
        and decl.named_children
        and decl.named_children[0].type == "assignment_expression"
    ):
        assign = decl.named_children[0]
        left, right = assign.child_by_field_name("left"), assign.child_by_field_name("right")
        target = node_text(left)
        if target == "module.exports" and right is not None and right.type == "identifier":
            return node_text(right)
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
    return node_text(node.child_by_field_name(field)) if node is not None else ""


def _go_definitions(node) -> list[tuple[str, object, tuple[str, ...]]]:
    if node.type == "function_declaration":
        return [(_name(node), node, _GO_NESTED)]
    if node.type == "method_declaration":  # joins its receiver type's chunk (_merge_methods)
        receiver = node.child_by_field_name("receiver")
        types = [t for t in _walk(receiver, 4) if t.type == "type_identifier"] if receiver is not None else []
        return [(f"{_IMPL}{node_text(types[0])}\x00fn {_name(node)}", node, ())] if types else []
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
        name = node_text(t.child_by_field_name("type") if t is not None and t.type == "generic_type" else t)
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
            return node_text(node)
        if node.type in ("qualified_identifier", "destructor_name", "operator_name"):
            return node_text(node).rsplit("::", 1)[-1]
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
