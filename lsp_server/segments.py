"""Logical-block lines for the engine's segmented KV cache (``CompletionRequest.segment_lines``).

The engine groups the prompt's lines into segments and keys its per-document KV cache by
them (engine/caching/prompt_plan.py): a segment is the unit that is kept, evicted, shared across
documents and moved by shift reuse. Cutting at top-level definitions makes those units the
document's own blocks (a function, a class), which is what stays put while the user edits
elsewhere. Without a parse the engine falls back to fixed blocks of lines.

The rows come from the tree-sitter trees the document already keeps (``Document.syntax``):
nothing is reparsed here. Only the root's children at column 0 are looked at, so the cost is
one pass over the top-level statements, and it is cached per document edit.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

# A top-level node starts a logical block when its type names a definition ...
_BLOCK_WORDS = (
    "function",
    "class",
    "method",
    "definition",
    "impl",
    "struct",
    "interface",
    "enum",
    "module",
    "declaration",
    "trait",
    "namespace",
)
# ... and is not one of these (imports and comments belong to whatever follows them).
_NOT_BLOCK_WORDS = ("import", "comment", "expression", "package")
_NOT_BLOCK_TYPES = frozenset({"use_declaration", "using_declaration"})  # Rust / C++ imports
_EXTRA_BLOCK_TYPES = frozenset({"mod_item"})  # Rust modules
# Wrappers that are a block when what they wrap is one (JS/TS ``export function f``).
_WRAPPERS = frozenset({"export_statement"})
# Attribute lines attached to the definition after them (Rust ``#[derive(...)]``): the block
# starts at the first of them, as a Python decorated_definition starts at its decorator.
_ATTRIBUTES = frozenset({"attribute_item"})


def is_block_type(node_type: str) -> bool:
    """Whether a top-level node of this tree-sitter type starts a logical block (a definition)."""
    if node_type in _NOT_BLOCK_TYPES:
        return False
    if node_type in _EXTRA_BLOCK_TYPES:
        return True
    return any(w in node_type for w in _BLOCK_WORDS) and not any(w in node_type for w in _NOT_BLOCK_WORDS)


def _starts_block(node) -> bool:
    if node.type in _WRAPPERS:
        return any(is_block_type(c.type) for c in node.named_children)
    return is_block_type(node.type)


def block_start_rows(trees: Iterable, first_row: int = 0, last_row: int | None = None) -> list[int]:
    """Sorted rows where a top-level definition starts, over tree-sitter trees of one document.

    A definition counts when it is a child of its tree's root that starts at column 0;
    a decorated definition starts at its decorator (the decorated node spans it), and Rust
    attribute lines right above a definition belong to it. Trees wholly outside
    [``first_row``, ``last_row``] are skipped (rows outside it may still be returned).
    """
    rows: list[int] = []
    for tree in trees:
        root = tree.root_node
        if root.end_point[0] < first_row or (last_row is not None and root.start_point[0] > last_row):
            continue
        attr_row: int | None = None  # first row of a run of attribute lines just above
        prev_end = -2
        for child in tree.root_node.children:
            row, col = child.start_point
            if child.type in _ATTRIBUTES:
                if attr_row is None or row > prev_end + 1:
                    attr_row = row
                prev_end = child.end_point[0]
                continue
            if col == 0 and _starts_block(child):
                start = attr_row if attr_row is not None and row <= prev_end + 1 else row
                if not rows or start > rows[-1]:
                    rows.append(start)
            attr_row = None
    return rows


def window_lines(rows: list[int], first_row: int, last_row: int) -> list[int]:
    """``rows`` between ``first_row`` and ``last_row`` (inclusive), numbered from ``first_row`` = 0."""
    lo, hi = bisect_left(rows, first_row), bisect_right(rows, last_row)
    return [r - first_row for r in rows[lo:hi]]


def segment_lines(doc, window: tuple[int, int], cursor_line: int, suffix: str) -> list[int] | None:
    """``CompletionRequest.segment_lines`` for a prompt: block starts numbered from its prefix's first line.

    ``doc`` is an lsp_server.documents.Document at the prompt's version, ``window`` where the
    prefix starts (lsp_server/prompt.py), ``suffix`` the suffix text. None (the engine's fixed
    blocks) where there is no parse, or where the prefix starts mid-line (a very long line):
    its line 0 would not be a document line.
    """
    if window[1] != 0:
        return None
    last = cursor_line + suffix.count("\n")
    rows = doc.block_rows(window[0], last)
    return None if rows is None else window_lines(rows, window[0], last)
