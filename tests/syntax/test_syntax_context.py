from __future__ import annotations

import pytest

from lsp_server.shaping.syntax.context import ContextKind, classify

from .util import doc_at

K = ContextKind

# (language, code with <|>, expected kind)
KIND_TABLE = [
    # Python
    ("python", "x = 1  # note (<|>\n", K.COMMENT),
    ("python", "# top comment<|>\nx = 1\n", K.COMMENT),
    ("python", 'x = "ab<|>c"\n', K.STRING),
    ("python", 'x = "ab(<|>\n', K.STRING),  # unterminated: the lexical line fix-up
    ("python", "x = f'{a} and <|>'\n", K.STRING),
    ("python", "import os.pa<|>\n", K.IMPORT),
    ("python", "from collections import Ord<|>\n", K.IMPORT),
    ("python", "from typing import (\n    Any,\n    <|>\n)\n", K.IMPORT),
    ("python", "x = self.items.ap<|>\n", K.ATTRIBUTE_CHAIN),
    ("python", "y = foo(a).bar.<|>\n", K.ATTRIBUTE_CHAIN),
    ("python", "foo(a, <|>)\n", K.CALL_ARGS),
    ("python", "a.b.c(<|>\n", K.CALL_ARGS),
    ("python", "x = f'{foo(<|>)}'\n", K.CALL_ARGS),
    ("python", "def foo(a, <|>):\n    pass\n", K.PARAMETERS),
    ("python", "def foo(a, <|>\n", K.PARAMETERS),
    ("python", "f = lambda a, <|>: 1\n", K.PARAMETERS),
    ("python", "def foo():<|>\n", K.BLOCK_START),
    ("python", "if x:\n    <|>\n", K.BLOCK_START),
    ("python", "def foo():\n    x = 1\n    <|>\n", K.BLOCK_BODY),
    ("python", "x = 1\n<|>\n", K.TOP_LEVEL),
    ("python", "x = <|>\n", K.MID_STATEMENT),
    ("python", "x = [\n    1,\n    <|>\n]\n", K.MID_STATEMENT),
    ("python", "if (a and <|>):\n    pass\n", K.MID_STATEMENT),
    # JavaScript / TypeScript / JSX
    ("javascript", "foo(); // call (<|>\n", K.COMMENT),
    ("javascript", "/* block <|> */\n", K.COMMENT),
    ("javascript", "const s = `a ${b} <|>`;\n", K.STRING),
    ("javascript", "const s = `a ${b.<|>}`;\n", K.ATTRIBUTE_CHAIN),
    ("javascript", "import { a, <|> } from 'm';\n", K.IMPORT),
    ("javascript", "obj?.first.<|>\n", K.ATTRIBUTE_CHAIN),
    ("javascript", "console.log(<|>);\n", K.CALL_ARGS),
    ("javascript", "function f(a, <|>) {}\n", K.PARAMETERS),
    ("javascript", "const g = (a, <|>) => a;\n", K.PARAMETERS),
    ("javascript", "function f() {<|>}\n", K.BLOCK_START),
    ("javascript", "function f() {\n  <|>\n}\n", K.BLOCK_START),
    ("javascript", "function f() {\n  a();\n  <|>\n}\n", K.BLOCK_BODY),
    ("javascript", "a();\n<|>\n", K.TOP_LEVEL),
    ("javascript", "const x = <|>;\n", K.MID_STATEMENT),
    ("javascriptreact", "const e = <div>{items.map(<|>)}</div>;\n", K.CALL_ARGS),
    ("typescript", "function f<T>(a: T, <|>): T {}\n", K.PARAMETERS),
    ("typescriptreact", 'const e = <div className="a<|>" />;\n', K.STRING),
    # Go
    ("go", 'package main\n\nimport (\n\t"fmt"\n\t<|>\n)\n', K.IMPORT),
    ("go", "package main\n\nfunc main() {\n\tfmt.Pri<|>\n}\n", K.ATTRIBUTE_CHAIN),
    ("go", "package main\n\nfunc main() {\n\tfmt.Println(<|>)\n}\n", K.CALL_ARGS),
    ("go", "package main\n\nfunc add(a int, <|>) int {\n\treturn a\n}\n", K.PARAMETERS),
    ("go", "package main\n\nfunc main() {\n\tx := 1 // c<|>\n}\n", K.COMMENT),
    ("go", "package main\n\nfunc main() {\n\tx := 1\n\t<|>\n}\n", K.BLOCK_BODY),
    # Rust
    ("rust", "use std::collections::<|>;\n", K.IMPORT),
    ("rust", "fn main() {\n    let v = Vec::wi<|>\n}\n", K.ATTRIBUTE_CHAIN),
    ("rust", "fn main() {\n    println!(<|>);\n}\n", K.CALL_ARGS),
    ("rust", "fn f(a: i32, <|>) {}\n", K.PARAMETERS),
    ("rust", 'fn f() {\n    let s = "x<|>";\n}\n', K.STRING),
    ("rust", "/// docs <|>\nfn f() {}\n", K.COMMENT),
    # Java
    ("java", "import java.util.<|>;\n", K.IMPORT),
    ("java", "class A {\n  void f() {\n    System.out.<|>\n  }\n}\n", K.ATTRIBUTE_CHAIN),
    ("java", "class A {\n  void f(int a, <|>) {}\n}\n", K.PARAMETERS),
    ("java", "class A {\n  void f() {\n    g(<|>);\n  }\n}\n", K.CALL_ARGS),
    ("java", "class A {\n  void f() {\n    g();\n    <|>\n  }\n}\n", K.BLOCK_BODY),
    # C / C++
    ("c", "#include <std<|>\n", K.IMPORT),
    ("c", "int main() {\n  printf(<|>);\n}\n", K.CALL_ARGS),
    ("c", "int add(int a, <|>) { return a; }\n", K.PARAMETERS),
    ("c", "int main() {\n  p-><|>\n}\n", K.ATTRIBUTE_CHAIN),
    ("cpp", "int main() {\n  std::vec<|>\n}\n", K.ATTRIBUTE_CHAIN),
    ("cpp", 'int main() {\n  auto s = R"(a <|>)";\n}\n', K.STRING),
    ("cpp", "int main() {\n  int x = 1;\n  <|>\n}\n", K.BLOCK_BODY),
    # plain text
    ("plaintext", "call(a, <|>)\n", K.CALL_ARGS),
    ("plaintext", "section:<|>\n", K.BLOCK_START),
    ("plaintext", "hello <|>\n", K.MID_STATEMENT),
]


@pytest.mark.parametrize(("lang", "code", "kind"), KIND_TABLE, ids=[f"{t[0]}:{t[1]!r}" for t in KIND_TABLE])
def test_kind(lang: str, code: str, kind: ContextKind) -> None:
    doc, cursor = doc_at(lang, code)
    assert classify(doc, cursor).kind is kind


def test_docstring_flag() -> None:
    doc, cur = doc_at("python", 'def f():\n    """Doc<|>."""\n    x = "no<|>t"\n'.replace("no<|>t", "not"))
    assert classify(doc, cur).in_docstring
    doc, cur = doc_at("python", 'def f():\n    x = 1\n    y = "no<|>t"\n')
    ctx = classify(doc, cur)
    assert ctx.kind is K.STRING and not ctx.in_docstring
    doc, cur = doc_at("python", '"""Module <|>doc."""\nimport os\n')
    assert classify(doc, cur).in_docstring


def test_line_end_and_indents_python() -> None:
    code = "class A:\n    def m(self):\n        if x:\n            y = 1\n        foo(<|>)\n"
    doc, cur = doc_at("python", code)
    ctx = classify(doc, cur)
    assert ctx.kind is K.CALL_ARGS and ctx.chain == "foo"
    assert ctx.at_line_end and not ctx.mid_line
    assert ctx.closers_after == ")"
    assert ctx.line_indent == " " * 8 and ctx.block_indent == " " * 4
    start, end = ctx.block_range
    assert doc.bytes[start:end].decode().startswith("    def m(self):")
    assert end == len(doc.bytes) - 1
    doc, cur = doc_at("python", "x = foo(<|>a, b)\n")
    assert classify(doc, cur).mid_line


def test_block_range_braces() -> None:
    code = "function f() {\n  if (a) {\n    b();\n    <|>\n  }\n  c();\n}\n"
    doc, cur = doc_at("javascript", code)
    ctx = classify(doc, cur)
    assert ctx.kind is K.BLOCK_BODY
    assert ctx.block_indent == "  " and ctx.line_indent == "    "
    start, end = ctx.block_range
    assert doc.bytes[start:end].decode() == "  if (a) {\n    b();\n    \n  }"


def test_top_level_python_block_is_module() -> None:
    doc, cur = doc_at("python", "x = 1\n<|>\n")
    ctx = classify(doc, cur)
    assert not ctx.has_block_header and ctx.block_range == (0, len(doc.bytes)) and ctx.block_indent == ""


def test_non_ascii_cursor_offsets() -> None:
    doc, cur = doc_at("python", "名前 = ñ(<|>)  # ünïcode\n")
    ctx = classify(doc, cur)
    assert ctx.kind is K.CALL_ARGS and ctx.chain == "ñ"
    assert ctx.line_prefix == "名前 = ñ(" and ctx.line_suffix == ")  # ünïcode"
    assert ctx.mid_line  # a comment follows the closer


def test_cursor_bounds_clamped() -> None:
    doc, _ = doc_at("python", "x = 1\n<|>")
    assert classify(doc, 10_000).byte_offset == len(doc.bytes)
    assert classify(doc, -5).byte_offset == 0
