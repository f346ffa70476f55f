"""Imports read from tree-sitter trees, module paths, definitions (lsp_server/context/imports.py)."""

from __future__ import annotations

from engine.syntax.document import SyntaxDocument
from lsp_server.context.imports import (
    DEF_MAX_LINES,
    Import,
    extract_definitions,
    extract_imports,
    module_candidates,
)

PY = '''import os.path as osp
import pkg.tools
from .shapes import scale_polygon as scale, area
from ..base import Model
from . import sibling
'''
JS = '''import def1, {a, b as c} from './x';
import * as ns from "../y/z";
const {p, q: r} = require('./u');
const mod = require("./v");
const w = require('left-pad');
'''


def test_python_imports():
    imports = extract_imports("python", SyntaxDocument("python", PY).trees())
    assert imports == [Import("os.path", binding="osp"), Import("pkg.tools", binding="pkg.tools"),
                       Import(".shapes", (("scale_polygon", "scale"), ("area", "area"))),
                       Import("..base", (("Model", "Model"),)), Import(".", (("sibling", "sibling"),))]


def test_js_imports():
    imports = extract_imports("js", SyntaxDocument("javascript", JS).trees())
    assert imports == [Import("./x", (("a", "a"), ("b", "c")), None, "def1"), Import("../y/z", (), "ns", None),
                       Import("./u", (("p", "p"), ("q", "r"))), Import("./v", (), "mod", "mod"),
                       Import("left-pad", (), "w", "w")]


def test_module_candidates():
    doc = "/w/pkg/sub/main.py"
    assert module_candidates("python", ".shapes", doc, [])[:2] == ["/w/pkg/sub/shapes.py",
                                                                   "/w/pkg/sub/shapes/__init__.py"]
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
    src = ("export function f(a) { return a }\nclass K {}\nconst g = (x) => x;\n"
           "module.exports.k = function (a) {};\nmodule.exports = K;\n")
    defs, default = extract_definitions("js", SyntaxDocument("javascript", src).trees())
    assert {"f", "K", "g", "k"} <= set(defs) and default == "K"
