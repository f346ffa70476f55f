"""Imports read from tree-sitter trees, module paths, definitions (lsp_server/context/: imports.py, module_paths.py,
definitions.py)."""

from __future__ import annotations

from lsp_server.context.definitions import DEF_MAX_LINES, extract_definitions
from lsp_server.context.imports import Import, extract_imports, java_source_root
from lsp_server.context.module_paths import module_candidates
from lsp_server.shaping.syntax.document import SyntaxDocument

PY = """import os.path as osp
import pkg.tools
from .shapes import scale_polygon as scale, area
from ..base import Model
from . import sibling
"""
JS = """import def1, {a, b as c} from './x';
import * as ns from "../y/z";
const {p, q: r} = require('./u');
const mod = require("./v");
const w = require('left-pad');
"""


def test_python_imports():
    imports = extract_imports("python", SyntaxDocument("python", PY).trees())
    assert imports == [
        Import("os.path", binding="osp"),
        Import("pkg.tools", binding="pkg.tools"),
        Import(".shapes", (("scale_polygon", "scale"), ("area", "area"))),
        Import("..base", (("Model", "Model"),)),
        Import(".", (("sibling", "sibling"),)),
    ]


def test_js_imports():
    imports = extract_imports("js", SyntaxDocument("javascript", JS).trees())
    assert imports == [
        Import("./x", (("a", "a"), ("b", "c")), None, "def1"),
        Import("../y/z", (), "ns", None),
        Import("./u", (("p", "p"), ("q", "r"))),
        Import("./v", (), "mod", "mod"),
        Import("left-pad", (), "w", "w"),
    ]


def test_module_candidates():
    doc = "/w/pkg/sub/main.py"
    assert module_candidates("python", ".shapes", doc, [])[:2] == [
        "/w/pkg/sub/shapes.py",
        "/w/pkg/sub/shapes/__init__.py",
    ]
    assert module_candidates("python", "..base", doc, [])[0] == "/w/pkg/base.py"
    assert "/w/pkg/tools.py" in module_candidates("python", "pkg.tools", doc, ["/w"])
    assert "/w/lib/x.js" in module_candidates("js", "../lib/x", "/w/src/a.js", [])
    assert module_candidates("js", "left-pad", "/w/src/a.js", ["/w"]) == []  # a package, not the user's code
    assert module_candidates("python", ".x", None, ["/w"]) == []


def test_definitions_and_class_skeletons():
    methods = "".join(f"    def method_{i}(self, arg):\n        return arg + {i}\n\n" for i in range(20))
    src = f"def small(a, b):\n    return a\n\nclass Big:\n    '''Doc.'''\n{methods}\nLIMIT = 3\n"
    defs, _ = extract_definitions("python", SyntaxDocument("python", src).trees())
    assert set(defs) == {"small", "Big", "LIMIT"}
    assert defs["small"].rows == (0, 1)
    big = defs["Big"]
    assert len(big.rows) == DEF_MAX_LINES and big.end - big.start > DEF_MAX_LINES
    lines = src.splitlines()
    assert all(lines[r].lstrip().startswith("def method_") for r in big.rows[8:])  # then signatures only


def test_js_definitions_and_default_export():
    src = (
        "export function f(a) { return a }\nclass K {}\nconst g = (x) => x;\n"
        "module.exports.k = function (a) {};\nmodule.exports = K;\n"
    )
    defs, default = extract_definitions("js", SyntaxDocument("javascript", src).trees())
    assert {"f", "K", "g", "k"} <= set(defs) and default == "K"


GO = """package main

import (
\tu "example.com/p/util"
\t"example.com/p/store"
\t_ "example.com/p/side"
)

type Store struct {
\titems map[string]int
}

func (s *Store) Get(key string) int {
\treturn s.items[key]
}

func New() *Store { return &Store{} }
"""
RUST = """use crate::a::b::{C, d as e};
use super::x::Y;
use std::collections::HashMap;

pub struct S { x: u8 }

impl S {
    pub fn get(&self) -> u8 { self.x }
}
"""
JAVA = """package com.x.app;
import com.x.util.Strings;
import static com.x.util.M.f;
import com.x.data.*;
public class A { void m() {} }
"""


def test_go_rust_java_c_imports():
    assert extract_imports("go", SyntaxDocument("go", GO).trees()) == [
        Import("example.com/p/util", binding="u"),
        Import("example.com/p/store", binding="store"),
    ]  # not "_"
    assert extract_imports("rust", SyntaxDocument("rust", RUST).trees()) == [
        Import("crate::a::b", (("C", "C"), ("d", "e"))),
        Import("super::x", (("Y", "Y"),)),
        Import("std::collections", (("HashMap", "HashMap"),)),
    ]
    java = SyntaxDocument("java", JAVA).trees()
    assert extract_imports("java", java) == [
        Import("com.x.util.Strings", (("Strings", "Strings"),)),
        Import("com.x.util.M", (("M", "f"),)),
    ]  # not the wildcard
    assert java_source_root(java, "/w/src/main/java/com/x/app/A.java") == "/w/src/main/java"
    assert java_source_root(java, "/w/elsewhere/A.java") is None
    c = SyntaxDocument("c", '#include "util/x.h"\n#include <stdio.h>\n').trees()
    assert extract_imports("c", c) == [Import("util/x.h", binding="*")]  # not the system header


def test_go_rust_java_c_candidates():
    assert "/w/p/util/" in module_candidates("go", "example.com/p/util", "/w/p/cmd/main.go", ["/w"])
    assert module_candidates("rust", "crate::a::b", "/w/src/x/y.rs", []) == ["/w/src/a/b.rs", "/w/src/a/b/mod.rs"]
    # x/y.rs is module x::y: its ``super`` is x (the folder x/), so super::z is x/z.rs
    assert module_candidates("rust", "super::z", "/w/src/x/y.rs", [])[0] == "/w/src/x/z.rs"
    assert module_candidates("rust", "super::z", "/w/src/x/mod.rs", [])[0] == "/w/src/z.rs"
    assert module_candidates("rust", "std::io", "/w/src/main.rs", []) == []  # another crate
    assert (
        module_candidates(
            "java", "com.x.util.Strings", "/w/src/main/java/com/x/app/A.java", ["/w"], "/w/src/main/java"
        )[0]
        == "/w/src/main/java/com/x/util/Strings.java"
    )
    assert module_candidates("c", "util/x.h", "/w/src/a.c", ["/w"]) == ["/w/src/util/x.h", "/w/util/x.h"]
    assert module_candidates("c", "../../etc/passwd", "/w/src/a.c", ["/w"]) == []


def test_go_methods_and_rust_impls_join_their_type():
    go, _ = extract_definitions("go", SyntaxDocument("go", GO).trees())
    assert set(go) == {"Store", "New"}
    assert go["Store"].rows == (8, 9, 10, 12)  # the struct, then the method's signature line only
    rust, _ = extract_definitions("rust", SyntaxDocument("rust", RUST).trees())
    assert set(rust) == {"S"} and rust["S"].rows == (4, 6, 7, 8)
    c, _ = extract_definitions(
        "c", SyntaxDocument("c", "#define M 3\ntypedef struct P { int x; } P;\nint add(int a, int b);\n").trees()
    )
    assert {k: v.rows for k, v in c.items()} == {"M": (0,), "P": (1,), "add": (2,)}
