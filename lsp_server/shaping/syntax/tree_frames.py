"""What is open at a byte offset, read from the parse tree: brackets, strings, comments.

The walk goes top-down along the nodes that contain the offset and, at each level, looks only
at the siblings just before it, so its cost follows tree depth rather than file size. Subtrees
without parse errors are balanced, so only bracket tokens that are direct children and the
insides of ERROR subtrees can leave something open. Where the walk crosses parse errors, a
lexical scan of the cursor line catches strings and comments the tree could not delimit
(`x = "abc(` is an ERROR holding a lone `(`).
"""

from __future__ import annotations

from tree_sitter import Node

from lsp_server.shaping.syntax.document import SyntaxDocument
from lsp_server.shaping.syntax.lexer import PLAIN, Frame, FrameKind, LexSpec, Scanner, spec_for, string_frame

STRING_TYPES = frozenset(
    {
        "string",
        "template_string",
        "interpreted_string_literal",
        "raw_string_literal",
        "rune_literal",
        "string_literal",
        "char_literal",
        "character_literal",
    }
)
COMMENT_TYPES = frozenset({"comment", "line_comment", "block_comment", "html_comment"})
INTERP_TYPES = frozenset({"interpolation", "template_substitution"})
_OPEN_TOKENS = {"(": ")", "[": "]", "{": "}", "${": "}"}
_CLOSE_TOKENS = {")", "]", "}"}
_MAX_SIBLINGS = 64  # bound on siblings inspected per level where the tree has errors
_BIG_NODE = 24  # error-free nodes with more children: only their edges can hold open brackets
_PLAIN_WINDOW_LINES = 60  # plain-text fallback: how far back the lexical scan starts
# ... and at most this many bytes back: a 1 MB line above the cursor must not be scanned on
# every keystroke (the scan runs on the server's event loop).
_PLAIN_WINDOW_BYTES = 16384


def open_frames(doc: SyntaxDocument, offset: int) -> tuple[list[Frame], bool]:
    """Frames open at `offset`, outermost first, and whether the walk crossed parse errors.

    Brackets carry `close_pos` (byte of their matching closer after the offset, None if the
    document leaves them unclosed) and `container` (the node type that owns the opener).
    """
    offset = max(0, min(offset, len(doc.bytes)))
    root = doc.root_before(offset)
    if root is None:
        return _plain_frames(doc, offset), False
    spec = spec_for(doc.language_id)
    frames: list[Frame] = []
    node: Node = root
    had_error = node.has_error
    while True:
        child = _first_child_for_byte(node, offset)
        containing = child if child is not None and child.start_byte < offset else None
        after = containing.next_sibling if containing is not None else child
        level = len(frames)
        for sib in _siblings_before(node, containing if containing is not None else child):
            _scan_before(sib, node, frames)
        if len(frames) > level:
            _find_closers(node, after, frames[level:])
        if containing is None:
            break
        if containing.type in COMMENT_TYPES:
            frames.append(_comment_frame(containing, spec))
            return frames, had_error
        if containing.type in STRING_TYPES:
            frames.append(_string_frame_for(containing, spec))
        node = containing
        had_error = had_error or node.has_error
    if not frames or frames[-1].kind not in (FrameKind.STRING, FrameKind.LINE_COMMENT):
        touching = _touching_frame(doc, offset, spec)
        if touching is not None:
            frames.append(touching)
            return frames, had_error
    if had_error and (not frames or frames[-1].kind in (FrameKind.BRACKET, FrameKind.INTERP)):
        frames = _line_fixup(doc, offset, spec, frames)
    return frames, had_error


def _first_child_for_byte(node: Node, offset: int) -> Node | None:
    # Node.first_child_for_byte segfaults (py-tree-sitter 0.26.1) when no child qualifies;
    # the TreeCursor variant returns None instead.
    cursor = node.walk()
    return cursor.node if cursor.goto_first_child_for_byte(offset) is not None else None


def _last_child(node: Node) -> Node | None:
    return node.child(node.child_count - 1) if node.child_count else None


def _siblings_before(node: Node, boundary: Node | None) -> list[Node]:
    """Children of `node` that end at or before the offset (boundary = first one that doesn't)."""
    last = boundary.prev_sibling if boundary is not None else _last_child(node)
    limit = _MAX_SIBLINGS if node.has_error or node.child_count <= _BIG_NODE else 8
    out: list[Node] = []
    while last is not None and len(out) < limit:
        out.append(last)
        last = last.prev_sibling
    if last is not None and not node.has_error:
        # Big error-free node (a block, a long literal): its own opener is its first child.
        head = node.child(0)
        if head is not None and head.type in _OPEN_TOKENS:
            out.append(head)
    out.reverse()
    return out


def _scan_before(sib: Node, parent: Node, frames: list[Frame]) -> None:
    t = sib.type
    if sib.is_missing:
        return  # the user has not typed it: a MISSING `)` closes nothing
    if parent.type in STRING_TYPES and t != "${":
        return  # delimiters such as C++ R"( ... )" are part of the string, not brackets
    if t in _OPEN_TOKENS:
        kind = FrameKind.INTERP if parent.type in INTERP_TYPES else FrameKind.BRACKET
        frames.append(Frame(kind, t, _OPEN_TOKENS[t], sib.start_byte, seeded=True, container=parent.type))
    elif t in _CLOSE_TOKENS:
        if frames and frames[-1].close == t and frames[-1].kind in (FrameKind.BRACKET, FrameKind.INTERP):
            frames.pop()
    elif t in STRING_TYPES or t in COMMENT_TYPES:
        return
    elif sib.has_error and sib.child_count:
        # An ERROR (or a subtree holding one) can contain unbalanced brackets: look inside.
        for c in sib.children[:256]:
            _scan_before(c, sib, frames)


def _find_closers(node: Node, after: Node | None, pending: list[Frame]) -> None:
    """Set close_pos on frames opened at this level from the siblings after the offset."""
    todo = [f for f in pending if f.kind in (FrameKind.BRACKET, FrameKind.INTERP)]
    if not todo:
        return
    if not node.has_error and node.child_count > _BIG_NODE:
        last = _last_child(node)
        sibs = [last] if last is not None else []
    else:
        sibs = []
        while after is not None and len(sibs) < _MAX_SIBLINGS:
            sibs.append(after)
            after = after.next_sibling
    depth = 0
    for sib in sibs:
        if sib.is_missing:
            continue
        if sib.type in _OPEN_TOKENS:
            depth += 1
        elif sib.type in _CLOSE_TOKENS:
            if depth:
                depth -= 1
                continue
            frame = todo.pop()
            if frame.close != sib.type:
                return
            frame.close_pos = sib.start_byte
            if not todo:
                return


def _comment_frame(node: Node, spec: LexSpec) -> Frame:
    text = node.text or b""
    if spec.block_comment and text.startswith(spec.block_comment[0].encode()):
        return Frame(FrameKind.BLOCK_COMMENT, *spec.block_comment, node.start_byte, seeded=True)
    lead = next((c for c in spec.line_comments if text.startswith(c.encode())), "#")
    return Frame(FrameKind.LINE_COMMENT, lead, "\n", node.start_byte, seeded=True)


def _string_open_text(node: Node) -> str:
    text = (node.text or b"").decode("utf-8", errors="replace")
    if node.type == "raw_string_literal" and "(" in text[:20] and text.startswith(("R", "u8R", "uR", "LR", "UR")):
        return text[: text.index("(") + 1]  # C++ R"delim(
    head = node.child(0) if node.child_count else None
    if head is not None and (head.type == "string_start" or not head.is_named):
        return (head.text or b"").decode("utf-8", errors="replace")
    for i, ch in enumerate(text):
        if ch in "\"'`":
            return text[: i + 1]
    return text[:1]


def _string_frame_for(node: Node, spec: LexSpec) -> Frame:
    frame = string_frame(spec, _string_open_text(node), node.start_byte, seeded=True)
    if node.type in ("char_literal", "character_literal", "rune_literal"):
        frame.multiline = False
    return frame


def _terminated(node: Node, frame: Frame) -> bool:
    last = _last_child(node)
    if last is not None and last.is_missing:
        return False
    text = (node.text or b"").decode("utf-8", errors="replace")
    return len(text) >= len(frame.open) + len(frame.close) and text.endswith(frame.close)


def _touching_frame(doc: SyntaxDocument, offset: int, spec: LexSpec) -> Frame | None:
    """A line comment or unterminated string that ends exactly at the offset still holds it."""
    root = doc.root_before(offset)
    if offset == 0 or root is None:
        return None
    node: Node | None = root.descendant_for_byte_range(offset - 1, offset)
    for _ in range(4):
        if node is None or node.end_byte != offset:
            return None
        if node.type in COMMENT_TYPES:
            frame = _comment_frame(node, spec)
            text = node.text or b""
            if frame.kind is FrameKind.LINE_COMMENT or not text.endswith(frame.close.encode()):
                return frame
            return None
        if node.type in STRING_TYPES:
            frame = _string_frame_for(node, spec)
            return None if _terminated(node, frame) else frame
        node = node.parent
    return None


def _line_fixup(doc: SyntaxDocument, offset: int, spec: LexSpec, frames: list[Frame]) -> list[Frame]:
    """Lexically rescan the cursor line; an unterminated string/comment there wins over the tree."""
    line_start = _code_start(doc, doc.bytes.rfind(b"\n", 0, offset) + 1, offset)
    head = doc.bytes[line_start:offset].decode("utf-8", errors="replace")
    scanner = Scanner(spec, strict=False)
    scanner.feed(head, final=True)
    top = scanner.stack[-1] if scanner.stack else None
    if top is None or top.kind in (FrameKind.BRACKET, FrameKind.INTERP):
        return frames
    at = line_start + len(head[: top.start].encode("utf-8"))
    kept = [f for f in frames if f.start < at]
    top.start, top.seeded = at, True
    return kept + [top]


def _code_start(doc: SyntaxDocument, line_start: int, offset: int) -> int:
    """Where the cursor line's code starts: past a string/comment that began on an earlier line."""
    root = doc.root_at(line_start)
    node: Node | None = root.descendant_for_byte_range(line_start, line_start + 1) if root else None
    while node is not None:
        if node.type in STRING_TYPES or node.type in COMMENT_TYPES:
            if node.start_byte < line_start < node.end_byte <= offset:
                return node.end_byte
            break
        node = node.parent
    return line_start


def _plain_frames(doc: SyntaxDocument, offset: int) -> list[Frame]:
    """No grammar: scan a window of preceding lines for quotes and brackets."""
    data = doc.bytes
    start = offset
    for _ in range(_PLAIN_WINDOW_LINES):
        start = data.rfind(b"\n", 0, start)
        if start < 0:
            break
    start += 1
    if offset - start > _PLAIN_WINDOW_BYTES:  # a line start inside the cap, else a char boundary
        floor = offset - _PLAIN_WINDOW_BYTES
        nl = data.find(b"\n", floor, offset)
        start = nl + 1 if nl >= 0 else floor
        while start < offset and data[start] & 0xC0 == 0x80:  # not inside a UTF-8 sequence
            start += 1
    text = data[start:offset].decode("utf-8", errors="replace")
    scanner = Scanner(PLAIN, strict=False)
    scanner.feed(text, final=True)
    frames = []
    pos, byte = 0, start  # frames are in text order: convert their starts to bytes in one pass
    for f in scanner.stack:
        byte += len(text[pos : f.start].encode("utf-8"))
        pos = f.start
        f.start, f.seeded = byte, True
        frames.append(f)
    return frames
