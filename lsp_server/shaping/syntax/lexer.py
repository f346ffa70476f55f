"""Heuristic per-language lexer for text that has no parse tree yet (generated completions).

It tracks only what bracket matching needs: which characters are code, and which sit inside a
string, comment, regex literal or interpolation. A stack of `Frame`s carries that state, so a
scan can be seeded with the state the parse tree reports at the cursor and then continue over
the model's output one chunk at a time.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from lsp_server.shaping.syntax.languages import language_family

OPENERS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = {")": "(", "]": "[", "}": "{"}


class FrameKind(enum.Enum):
    BRACKET = "bracket"  # ( [ {
    INTERP = "interp"  # code inside a string: f"{...}" or `${...}`
    STRING = "string"
    REGEX = "regex"  # JS regex literal
    LINE_COMMENT = "line_comment"
    BLOCK_COMMENT = "block_comment"


CODE_KINDS = (FrameKind.BRACKET, FrameKind.INTERP)


@dataclass
class Frame:
    """One open construct. `start` is a doc byte for seeded frames, else a completion index."""

    kind: FrameKind
    open: str
    close: str
    start: int = 0
    seeded: bool = False
    # Seeded brackets only: may the completion close it? (see brackets.BracketGuard)
    closable: bool = True
    close_pos: int | None = None  # doc byte of the matching closer after the cursor, if any
    container: str | None = None  # parse-tree type of the node the opener belongs to
    raw: bool = False  # strings without backslash escapes
    multiline: bool = False  # strings that may span lines
    interp: str | None = None  # opener of code inside this string ("{" or "${")
    in_class: bool = field(default=False, compare=False)  # regex: inside [...]


@dataclass(frozen=True)
class LexSpec:
    line_comments: tuple[str, ...] = ()
    block_comment: tuple[str, str] | None = None
    nested_block_comments: bool = False
    quotes: tuple[str, ...] = ('"', "'")  # longest first
    multiline: frozenset[str] = frozenset()
    raw: frozenset[str] = frozenset()
    interp: tuple[tuple[str, str], ...] = ()  # (quote, interpolation opener)
    python_prefixes: bool = False
    rust_chars: bool = False  # `'` starts a char literal or a lifetime
    rust_raw: bool = False  # r#"..."#
    cpp_raw: bool = False  # R"d(...)d"
    regex_literals: bool = False


_C_LIKE = {"line_comments": ("//",), "block_comment": ("/*", "*/")}
SPECS: dict[str, LexSpec] = {
    "python": LexSpec(
        line_comments=("#",),
        quotes=('"""', "'''", '"', "'"),
        multiline=frozenset({'"""', "'''"}),
        python_prefixes=True,
    ),
    "javascript": LexSpec(
        **_C_LIKE,
        quotes=('"', "'", "`"),
        multiline=frozenset({"`"}),
        interp=(("`", "${"),),
        regex_literals=True,
    ),
    "go": LexSpec(**_C_LIKE, quotes=('"', "'", "`"), multiline=frozenset({"`"}), raw=frozenset({"`"})),
    "rust": LexSpec(
        **_C_LIKE,
        nested_block_comments=True,
        quotes=('"',),
        multiline=frozenset({'"'}),  # Rust string literals may contain newlines
        rust_chars=True,
        rust_raw=True,
    ),
    "java": LexSpec(**_C_LIKE, quotes=('"""', '"', "'"), multiline=frozenset({'"""'})),
    "c": LexSpec(**_C_LIKE),
    "cpp": LexSpec(**_C_LIKE, cpp_raw=True),
}
SPECS["typescript"] = SPECS["javascript"]
PLAIN = LexSpec(quotes=('"', "'"))  # unknown language: quotes only, no comment syntax guessed


def spec_for(language_id: str | None) -> LexSpec:
    family = language_family(language_id)
    return SPECS[family] if family else PLAIN


_PY_PREFIX = re.compile(r"(?<![\w])([rRbBuUfFtT]{1,2})$")
_RUST_RAW = re.compile(r"(?<![\w])[bc]?r(#*)$")
_CPP_RAW = re.compile(r"(?<![\w])(?:u8|u|U|L)?R$")
# After these, `/` starts a regex literal rather than a division.
_REGEX_PRECEDERS = set("(,=:[!&|?{};+-*%<>~^")
_REGEX_KEYWORDS = re.compile(r"(?<![\w$])(return|typeof|case|do|else|in|of|void|yield|await)$")


def string_frame(spec: LexSpec, open_text: str, start: int = 0, seeded: bool = False) -> Frame:
    """Frame for a string whose opening delimiter (prefix included) is `open_text`."""
    prefix = open_text.rstrip("\"'`#(").lower() if spec.python_prefixes else ""
    quote = open_text[len(prefix) :] if spec.python_prefixes else open_text
    close, raw = quote, quote in spec.raw
    m = re.fullmatch(r"[bc]?r(#*)\"", open_text) if spec.rust_raw else None
    if m:
        close, raw = '"' + m.group(1), True
    m = re.fullmatch(r'(?:u8|u|U|L)?R"([^(]*)\(', open_text) if spec.cpp_raw else None
    if m:
        close, raw = ")" + m.group(1) + '"', True
    # Python raw strings still let a backslash escape the quote (r'\'' is one string), so for
    # finding the string's end they behave like ordinary strings.
    interp = dict(spec.interp).get(quote)
    if spec.python_prefixes and ("f" in prefix or "t" in prefix):
        interp = "{"
    multiline = quote in spec.multiline or m is not None or (spec.rust_raw and quote.endswith('"'))
    return Frame(FrameKind.STRING, open_text, close, start, seeded, raw=raw, multiline=multiline, interp=interp)


class Scanner:
    """Streams text through the lexical state machine, keeping a frame stack.

    strict=True: a closer that does not match the top frame (or hits a seeded bracket that is
    not closable) stops the scan; `stopped_at` is its index. strict=False ignores such closers.
    Chars that need lookahead ("\"" may start '\"\"\"', "/" may start "//") wait for more text
    unless `final`, so chunk boundaries never change the result.
    """

    def __init__(
        self,
        spec: LexSpec,
        frames: list[Frame] | None = None,
        strict: bool = True,
        on_newline: Callable[[int], None] | None = None,
    ) -> None:
        self.spec = spec
        self.stack: list[Frame] = list(frames or [])
        self.strict = strict
        self.on_newline = on_newline
        self.buf = ""
        self.pos = 0
        self.stopped_at: int | None = None
        self.seeded_pops: list[tuple[Frame, int]] = []  # (seeded frame, index of its closer)

    @property
    def in_code(self) -> bool:
        return not self.stack or self.stack[-1].kind in CODE_KINDS

    def own_depth(self) -> int:
        """Frames opened by the scanned text itself (not seeded) still open."""
        return sum(1 for f in self.stack if not f.seeded)

    def feed(self, text: str, final: bool = False) -> int | None:
        self.buf += text
        if self.stopped_at is not None:
            return self.stopped_at
        buf, n = self.buf, len(self.buf)
        while self.pos < n:
            step = self._step(buf, self.pos, final)
            if step is None:  # needs lookahead
                break
            if self.stopped_at is not None:
                return self.stopped_at
            if buf[self.pos] == "\n" and self.on_newline is not None and step == 1:
                self.pos += 1
                self.on_newline(self.pos)
                continue
            self.pos += step
        return self.stopped_at

    def finish(self) -> int | None:
        return self.feed("", final=True)

    # -- state machine ---------------------------------------------------------------------------
    def _step(self, buf: str, p: int, final: bool) -> int | None:
        """Consume at p; return chars consumed (>= 1) or None to wait for more text."""
        top = self.stack[-1] if self.stack else None
        if top is None or top.kind in CODE_KINDS:
            return self._code(buf, p, final, top)
        c = buf[p]
        if top.kind is FrameKind.LINE_COMMENT:
            if c == "\n":
                self.stack.pop()
            return 1
        if top.kind is FrameKind.BLOCK_COMMENT:
            return self._block_comment(buf, p, final, top)
        if top.kind is FrameKind.REGEX:
            return self._regex(buf, p, final, top)
        return self._string(buf, p, final, top)

    def _wait(self, buf: str, p: int, final: bool, tokens: tuple[str, ...]) -> bool:
        # A proper prefix of a multi-char token at the end of the buffer: wait for the rest.
        # Only the few chars a token could span are sliced: copying the whole rest of the
        # buffer here, once per char, made a scan O(n^2) (a 1 MB line took minutes).
        if final:
            return False
        left = len(buf) - p
        return any(left < len(t) and t.startswith(buf[p:]) for t in tokens)

    def _code(self, buf: str, p: int, final: bool, top: Frame | None) -> int | None:
        c, spec = buf[p], self.spec
        if c in OPENERS:
            self.stack.append(Frame(FrameKind.BRACKET, c, OPENERS[c], p))
            return 1
        if c in CLOSERS:
            self._close(c, p, top)
            return 1
        lookahead = spec.line_comments + (spec.block_comment[:1] if spec.block_comment else ())
        if self._wait(buf, p, final, lookahead + spec.quotes):
            return None
        for lc in spec.line_comments:
            if buf.startswith(lc, p):
                self.stack.append(Frame(FrameKind.LINE_COMMENT, lc, "\n", p))
                return len(lc)
        if spec.block_comment and buf.startswith(spec.block_comment[0], p):
            self.stack.append(Frame(FrameKind.BLOCK_COMMENT, *spec.block_comment, p))
            return len(spec.block_comment[0])
        if spec.rust_chars and c == "'":
            return self._rust_quote(buf, p, final)
        for q in spec.quotes:
            if buf.startswith(q, p):
                return self._open_string(buf, p, final, q)
        if spec.regex_literals and c == "/" and self._regex_allowed(buf, p):
            self.stack.append(Frame(FrameKind.REGEX, "/", "/", p))
        return 1

    def _close(self, c: str, p: int, top: Frame | None) -> None:
        ok = top is not None and top.close == c and (not top.seeded or top.closable)
        if ok and top is not None:
            self.stack.pop()
            if top.seeded:
                self.seeded_pops.append((top, p))
        elif self.strict:
            self.stopped_at = p

    def _open_string(self, buf: str, p: int, final: bool, q: str) -> int | None:
        open_text = q  # prefixes are read from a few chars before p (never a copy of all of buf[:p])
        if self.spec.python_prefixes:
            m = _PY_PREFIX.search(buf[max(0, p - 3) : p])
            open_text = (m.group(1) if m else "") + q
        elif self.spec.rust_raw and q == '"':
            m = _RUST_RAW.search(buf[max(0, p - 12) : p])
            if m:
                open_text = "r" + m.group(1) + q
        elif self.spec.cpp_raw and q == '"' and _CPP_RAW.search(buf[max(0, p - 3) : p]):
            lp = buf.find("(", p + 1, p + 18)
            if lp < 0:
                if not final and len(buf) - p < 18:
                    return None
            else:
                open_text = "R" + buf[p : lp + 1]
                frame = string_frame(self.spec, open_text, p)
                self.stack.append(frame)
                return lp + 1 - p
        self.stack.append(string_frame(self.spec, open_text, p))
        return len(q)

    def _rust_quote(self, buf: str, p: int, final: bool) -> int | None:
        # 'x' and '\n' are char literals; 'a in `&'a str` is a lifetime (no closing quote).
        if len(buf) - p < 3 and not final:
            return None
        if buf[p + 1 : p + 2] == "\\" or buf[p + 2 : p + 3] == "'":
            self.stack.append(Frame(FrameKind.STRING, "'", "'", p))
        return 1

    def _regex_allowed(self, buf: str, p: int) -> bool:
        if buf.startswith("//", p) or buf.startswith("/*", p):
            return False
        if buf[p - 1 : p] == "<" or buf.startswith("/>", p):
            return False  # JSX closing tag `</div>` or self-closing `<br />`
        end = p  # end of buf[:p].rstrip(), found without copying buf[:p]
        while end > 0 and buf[end - 1].isspace():
            end -= 1
        if not end:
            return True
        return buf[end - 1] in _REGEX_PRECEDERS or bool(_REGEX_KEYWORDS.search(buf[max(0, end - 8) : end]))

    def _regex(self, buf: str, p: int, final: bool, top: Frame) -> int | None:
        c = buf[p]
        if c == "\\":
            if p + 1 >= len(buf):
                return None if not final else 1
            return 2
        if c == "\n":
            self.stack.pop()  # unterminated: a regex never spans lines
        elif c == "[":
            top.in_class = True
        elif c == "]":
            top.in_class = False
        elif c == "/" and not top.in_class:
            self.stack.pop()
        return 1

    def _block_comment(self, buf: str, p: int, final: bool, top: Frame) -> int | None:
        if self._wait(buf, p, final, (top.close, top.open)):
            return None
        if buf.startswith(top.close, p):
            self.stack.pop()
            return len(top.close)
        if self.spec.nested_block_comments and buf.startswith(top.open, p):
            self.stack.append(Frame(FrameKind.BLOCK_COMMENT, top.open, top.close, p))
            return len(top.open)
        return 1

    def _string(self, buf: str, p: int, final: bool, top: Frame) -> int | None:
        c = buf[p]
        if c == "\\" and not top.raw:
            if p + 1 >= len(buf) and not final:
                return None
            return 2 if p + 1 < len(buf) else 1
        tokens = (top.close,) + ((top.interp,) if top.interp else ()) + (("{{",) if top.interp == "{" else ())
        if self._wait(buf, p, final, tokens):
            return None
        if buf.startswith(top.close, p):
            self.stack.pop()
            if top.seeded:
                self.seeded_pops.append((top, p))
            return len(top.close)
        if top.interp and buf.startswith(top.interp, p):
            if top.interp == "{" and buf.startswith("{{", p):
                return 2  # f-string escape for a literal brace
            self.stack.append(Frame(FrameKind.INTERP, top.interp, "}", p))
            return len(top.interp)
        if c == "\n" and not top.multiline:
            self.stack.pop()  # unterminated single-line string: recover at the line end
        return 1
