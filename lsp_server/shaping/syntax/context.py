"""Classify where the cursor sits (comment, string, call arguments, block start, ...).

The decoding policy uses this to pick stop rules and prompt shapes. Everything is derived from
the frames open at the cursor (lsp_server/shaping/syntax/tree_frames.py) plus the cursor line's text, so a
half-typed line that the parser could not make sense of still classifies sensibly.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from tree_sitter import Node

from lsp_server.shaping.syntax.brackets import closers_after_cursor
from lsp_server.shaping.syntax.document import SyntaxDocument
from lsp_server.shaping.syntax.languages import is_indent_scoped
from lsp_server.shaping.syntax.lexer import Frame, FrameKind
from lsp_server.shaping.syntax.tree_frames import COMMENT_TYPES, STRING_TYPES, open_frames


class ContextKind(enum.Enum):
    COMMENT = "comment"
    STRING = "string"
    IMPORT = "import"
    ATTRIBUTE_CHAIN = "attribute_chain"  # right after `a.b.` / `a.b.c` (also -> and ::)
    CALL_ARGS = "call_args"  # innermost open bracket is a call's `(`
    PARAMETERS = "parameters"  # innermost open bracket is a definition's parameter list
    BLOCK_START = "block_start"  # only whitespace since a block-opening `:` / `{`
    BLOCK_BODY = "block_body"  # at a statement start inside a block
    MID_STATEMENT = "mid_statement"
    TOP_LEVEL = "top_level"  # at a statement start at module level


@dataclass(frozen=True)
class CursorContext:
    kind: ContextKind
    byte_offset: int
    language_id: str
    plain_text: bool  # no grammar: everything below is heuristic
    in_docstring: bool
    at_line_end: bool  # only whitespace / closers (and ; , :) after the cursor on its line
    line_indent: str  # leading whitespace of the cursor line
    block_indent: str  # leading whitespace of the enclosing block's header line ("" at top)
    block_range: tuple[int, int]  # bytes of the enclosing block (header line .. end)
    has_block_header: bool  # False at module level
    line_prefix: str  # cursor line before the cursor
    line_suffix: str  # cursor line after the cursor
    closers_after: str  # auto-paired closers right after the cursor
    frames: tuple[Frame, ...]  # open at the cursor, outermost first
    chain: str | None  # `a.b.c` being completed (ATTRIBUTE_CHAIN) or the callee (CALL_ARGS)

    @property
    def mid_line(self) -> bool:
        return not self.at_line_end

    @property
    def open_brackets(self) -> tuple[Frame, ...]:
        return tuple(f for f in self.frames if f.kind in (FrameKind.BRACKET, FrameKind.INTERP))


_LINE_END_CHARS = set(")]}\"'`;,:")
_IDENT = r"(?:[^\W\d]|\$)[\w$]*"  # Unicode-aware: `ñ(` and `名前.` are identifiers too
_CHAIN = re.compile(rf"(?<![\w$.])((?:{_IDENT}(?:\([^()\n]*\)|\[[^\[\]\n]*\])*\s*(?:\?\.|\.|->|::)\s*)+(?:{_IDENT})?)$")
_CALLEE = re.compile(rf"({_IDENT}(?:\s*(?:\?\.|\.|->|::)\s*{_IDENT})*)\s*(?:<[^<>()]*>)?\s*!?$")
_DEF_BEFORE = re.compile(r"(?:\bdef|\bfunction\*?|\bfn|\bfunc)\s+[\w$]*\s*(?:<[^()]*>)?\s*$")
_NOT_CALLEES = {
    "if", "elif", "while", "for", "switch", "return", "and", "or", "not", "in", "is", "catch",
    "with", "assert", "yield", "await", "print", "sizeof", "typeof", "match", "case", "except",
}  # fmt: skip
_IMPORT_TYPES = frozenset(
    {
        "import_statement",
        "import_from_statement",
        "future_import_statement",
        "import_declaration",
        "use_declaration",
        "preproc_include",
    }
)
_IMPORT_LINE = re.compile(r"^\s*(?:import\s|from\s+\S+|use\s|#\s*include|extern crate\s)")
_ARG_TYPES = frozenset({"argument_list", "arguments", "token_tree"})  # token_tree: Rust macro args
_PARAM_TYPES = frozenset(
    {"parameters", "formal_parameters", "parameter_list", "lambda_parameters", "closure_parameters"}
)
_PY_BLOCKS = frozenset({"block", "module"})
_MAX_HEADER_SCAN = 4000  # lines scanned upwards for a Python block header


def classify(doc: SyntaxDocument, byte_offset: int) -> CursorContext:
    """Describe the cursor at `byte_offset` (UTF-8 bytes) in `doc`."""
    offset = max(0, min(byte_offset, len(doc.bytes)))
    frames, _ = open_frames(doc, offset)
    data = doc.bytes
    line_start, line_end = doc.line_bounds(offset)
    prefix = data[line_start:offset].decode("utf-8", errors="replace")
    suffix = data[offset:line_end].decode("utf-8", errors="replace")
    full_line = prefix + suffix
    line_indent = full_line[: len(full_line) - len(full_line.lstrip(" \t"))]
    closers = closers_after_cursor(suffix)
    at_end = all(ch in _LINE_END_CHARS for ch in suffix.strip())
    top = frames[-1] if frames else None
    brackets = [f for f in frames if f.kind in (FrameKind.BRACKET, FrameKind.INTERP)]

    if is_indent_scoped(doc.language_id) or (not doc.has_tree and not any(f.open == "{" for f in brackets)):
        header, block_range = _indent_block(doc, offset, line_start, prefix, line_indent, bool(brackets))
        block_indent = _indent_of(data, header) if header is not None else ""
        opener_ok = header is not None and _only_space_since(data, _line_end(data, header), offset, ":")
    else:
        brace = next((f for f in reversed(brackets) if f.open == "{" and f.kind is FrameKind.BRACKET), None)
        header = brace.start if brace is not None else None
        end = brace.close_pos + 1 if brace is not None and brace.close_pos is not None else len(data)
        block_range = (data.rfind(b"\n", 0, header) + 1, end) if header is not None else (0, len(data))
        block_indent = _indent_of(data, header) if header is not None else ""
        opener_ok = brace is not None and top is brace and not data[header + 1 : offset].strip()

    kind, chain, docstring = _kind(doc, offset, prefix, top, opener_ok and at_end, header is not None)
    return CursorContext(
        kind=kind,
        byte_offset=offset,
        language_id=doc.language_id,
        plain_text=not doc.has_tree,
        in_docstring=docstring,
        at_line_end=at_end,
        line_indent=line_indent,
        block_indent=block_indent,
        block_range=block_range,
        has_block_header=header is not None,
        line_prefix=prefix,
        line_suffix=suffix,
        closers_after=closers,
        frames=tuple(frames),
        chain=chain,
    )


def _kind(
    doc: SyntaxDocument, offset: int, prefix: str, top: Frame | None, block_start: bool, in_block: bool
) -> tuple[ContextKind, str | None, bool]:
    if top is not None and top.kind in (FrameKind.LINE_COMMENT, FrameKind.BLOCK_COMMENT):
        return ContextKind.COMMENT, None, False
    if top is not None and top.kind in (FrameKind.STRING, FrameKind.REGEX):
        return ContextKind.STRING, None, _is_docstring(doc, top)
    if _in_import(doc, offset, prefix):
        return ContextKind.IMPORT, None, False
    m = _CHAIN.search(prefix[-120:]) if prefix[-1:].isalnum() or prefix[-1:] in "._$>:" else None
    if m:
        return ContextKind.ATTRIBUTE_CHAIN, re.sub(r"\s+", "", m.group(1)), False
    if top is not None and top.kind is FrameKind.BRACKET and top.open == "(":
        kind, callee = _paren_kind(doc, top)
        if kind is not None:
            return kind, callee, False
    if _in_bare_parameters(doc, offset):
        return ContextKind.PARAMETERS, None, False
    if block_start:
        return ContextKind.BLOCK_START, None, False
    at_statement_start = not prefix.strip() and (
        top is None or (top.kind is FrameKind.BRACKET and top.open == "{" and not is_indent_scoped(doc.language_id))
    )
    if at_statement_start:
        return (ContextKind.BLOCK_BODY if in_block else ContextKind.TOP_LEVEL), None, False
    return ContextKind.MID_STATEMENT, None, False


def _paren_kind(doc: SyntaxDocument, paren: Frame) -> tuple[ContextKind | None, str | None]:
    # Only the opener's own line, and its tail: the regexes below scan every start position.
    raw = doc.bytes[max(0, paren.start - 120) : paren.start]
    before = raw[raw.rfind(b"\n") + 1 :].decode("utf-8", errors="replace")
    m = _CALLEE.search(before)
    callee = re.sub(r"\s+", "", m.group(1)) if m else None
    if paren.container in _PARAM_TYPES:
        return ContextKind.PARAMETERS, None
    if paren.container in _ARG_TYPES:
        return ContextKind.CALL_ARGS, callee
    if paren.container not in (None, "ERROR"):
        return None, None  # parenthesized expression, condition, tuple, ...
    # The tree could not say (ERROR): guess from the text before the `(`.
    if _DEF_BEFORE.search(before) or callee in ("function", "func", "fn"):
        return ContextKind.PARAMETERS, None
    if callee and callee.split(".")[-1] not in _NOT_CALLEES:
        return ContextKind.CALL_ARGS, callee
    return None, None


def _in_bare_parameters(doc: SyntaxDocument, offset: int) -> bool:
    """Parameters without parentheses: Python `lambda a, |: ...`."""
    root = doc.root_before(offset)
    if root is None or offset == 0:
        return False
    node: Node | None = root.descendant_for_byte_range(offset - 1, offset)
    for _ in range(6):
        if node is None:
            return False
        if node.type == "lambda":
            colon = next((c for c in node.children if c.type == ":"), None)
            return colon is None or offset <= colon.start_byte
        node = node.parent
    return False


def _in_import(doc: SyntaxDocument, offset: int, prefix: str) -> bool:
    if _IMPORT_LINE.match(prefix):
        return True
    root = doc.root_before(offset)
    if root is None:
        return False
    for lo, hi in ((offset, offset), (max(0, offset - 1), offset)):
        node: Node | None = root.descendant_for_byte_range(lo, hi)
        for _ in range(8):
            if node is None:
                break
            if node.type in _IMPORT_TYPES:
                return True
            node = node.parent
    return False


def _is_docstring(doc: SyntaxDocument, frame: Frame) -> bool:
    """A Python string that is the first statement of a module, class or function body."""
    root = doc.root_at(frame.start)
    if not is_indent_scoped(doc.language_id) or root is None:
        return False
    node: Node | None = root.descendant_for_byte_range(frame.start, frame.start + 1)
    while node is not None and not (node.type == "string" and node.start_byte == frame.start):
        node = node.parent
    stmt = node.parent if node is not None else None
    if stmt is None or stmt.type != "expression_statement" or stmt.named_child_count != 1:
        return False
    if stmt.parent is None or stmt.parent.type not in _PY_BLOCKS:
        return False
    prev = stmt.prev_named_sibling
    while prev is not None and prev.type in COMMENT_TYPES:
        prev = prev.prev_named_sibling
    return prev is None


# -- indentation-scoped blocks (Python, and the plain-text fallback) -----------------------------
def _indent_block(
    doc: SyntaxDocument, offset: int, line_start: int, prefix: str, line_indent: str, in_brackets: bool
) -> tuple[int | None, tuple[int, int]]:
    """(byte where the header line's text starts, block byte range); header None at top level."""
    data = doc.bytes
    if not in_brackets and prefix.rstrip().endswith(":") and prefix.strip():
        header = line_start + len(line_indent.encode())
    else:
        effective = prefix if not prefix.strip() else line_indent
        header = _find_header(doc, line_start, _width(effective))
    if header is None:
        return None, (0, len(data))
    end = _line_end(data, offset)
    root = doc.root_at(header)
    if root is not None:
        stmt = _statement_at(root, header)
        if stmt is not None:
            end = max(end, stmt.end_byte)
    return header, (data.rfind(b"\n", 0, header) + 1, end)


def _find_header(doc: SyntaxDocument, line_start: int, width: int) -> int | None:
    """First byte of the nearest statement line above with indentation narrower than `width`."""
    if width == 0:
        return None
    data = doc.bytes
    end = line_start - 1  # the newline ending the previous line
    for _ in range(_MAX_HEADER_SCAN):
        if end < 0:
            return None
        start = data.rfind(b"\n", 0, end) + 1
        line = data[start:end]
        stripped = line.lstrip(b" \t")
        indent = line[: len(line) - len(stripped)]
        if stripped.strip() and _width(indent.decode()) < width and _is_statement_line(doc, start, start + len(indent)):
            return start + len(indent)
        end = start - 1
    return None


_SCOPE_HEADER = re.compile(rb"(?:async\s+)?(?:def|class)\b")


def scope_indent_width(doc: SyntaxDocument, header_line_start: int) -> int:
    """Indentation width of the scope a Python block belongs to: the innermost `def`/`class` header
    at or above the block header starting the line at `header_line_start`, else the outermost header
    (a module-level compound statement)."""
    data = doc.bytes
    start = header_line_start
    while True:
        line = data[start : _line_end(data, start)]
        stripped = line.lstrip(b" \t")
        width = _width(line[: len(line) - len(stripped)].decode())
        if _SCOPE_HEADER.match(stripped):
            return width
        outer = _find_header(doc, start, width)
        if outer is None:
            return width
        start = data.rfind(b"\n", 0, outer) + 1


def _is_statement_line(doc: SyntaxDocument, line_start: int, first: int) -> bool:
    """False for comment lines, lines inside multi-line strings and bracket continuations."""
    data = doc.bytes
    if line_start >= 2 and data[line_start - 2 : line_start - 1] == b"\\":
        return False
    root = doc.root_at(first)
    if root is None:
        return not data[first:].startswith((b"#", b"//"))
    node: Node | None = root.descendant_for_byte_range(first, first + 1)
    if node is not None and node.type in COMMENT_TYPES:
        return False
    while node is not None and node.type not in _PY_BLOCKS:
        if node.start_byte < line_start:
            if node.type in STRING_TYPES:
                return False
            head = node.child(0) if node.child_count else None
            if head is not None and head.type in ("(", "[", "{"):
                return False
        node = node.parent
    return True


def _statement_at(root: Node, first: int) -> Node | None:
    node: Node | None = root.descendant_for_byte_range(first, first + 1)
    while node is not None and node.parent is not None and node.parent.start_byte == first:
        if node.parent.type in _PY_BLOCKS:
            break
        node = node.parent
    return node


# -- small text helpers ----------------------------------------------------------------------------
def _width(indent: str) -> int:
    return len(indent.expandtabs(8))


def _indent_of(data: bytes, byte: int) -> str:
    start = data.rfind(b"\n", 0, byte) + 1
    line = data[start:byte]
    return line[: len(line) - len(line.lstrip(b" \t"))].decode()


def _line_end(data: bytes, byte: int) -> int:
    end = data.find(b"\n", byte)
    return len(data) if end < 0 else end


def _only_space_since(data: bytes, header_line_end: int, offset: int, opener: str) -> bool:
    """The header line ends with `opener` and only whitespace lies between it and the cursor."""
    line = data[data.rfind(b"\n", 0, header_line_end) + 1 : header_line_end].rstrip()
    if not line.endswith(opener.encode()):
        return False
    return header_line_end <= offset and not data[header_line_end:offset].strip()
