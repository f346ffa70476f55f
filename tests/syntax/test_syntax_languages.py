from __future__ import annotations

import pytest
from tree_sitter import Language, Parser

from lsp_server.shaping.syntax.languages import (
    SUPPORTED_LANGUAGE_IDS,
    get_language,
    is_indent_scoped,
    language_family,
    normalize_language_id,
)

SAMPLES = {
    "python": "def f(x):\n    return x\n",
    "javascript": "function f(x) { return x; }\n",
    "javascriptreact": "const e = <div className='a'>{x}</div>;\n",
    "typescript": "function f<T>(x: T): T { return x; }\n",
    "typescriptreact": "const e = <div>{(x as number) + 1}</div>;\n",
    "go": "package main\n\nfunc f(x int) int { return x }\n",
    "rust": "fn f(x: i32) -> i32 { x }\n",
    "java": "class A { int f(int x) { return x; } }\n",
    "c": "int f(int x) { return x; }\n",
    "cpp": "template <typename T> T f(T x) { return x; }\n",
}


@pytest.mark.parametrize("lang", SUPPORTED_LANGUAGE_IDS)
def test_every_language_parses_its_sample(lang: str) -> None:
    language = get_language(lang)
    assert isinstance(language, Language)
    tree = Parser(language).parse(SAMPLES[lang].encode())
    assert not tree.root_node.has_error


def test_languages_are_cached_and_shared() -> None:
    assert get_language("python") is get_language("python")
    assert get_language("javascript") is get_language("javascriptreact")
    assert get_language("typescript") is not get_language("typescriptreact")


def test_unknown_and_aliases() -> None:
    assert get_language("cobol") is None
    assert get_language("") is None
    assert get_language(None) is None
    assert normalize_language_id("PY") == "python"
    assert normalize_language_id("tsx") == "typescriptreact"
    assert normalize_language_id("c++") == "cpp"
    assert language_family("javascriptreact") == "javascript"
    assert is_indent_scoped("python") and not is_indent_scoped("go")
