"""Language ids -> tree-sitter grammars, loaded lazily from the per-language packages.

Grammar packages are imported only when a document of that language first appears, so a
server that only ever sees Python never pays for the C++ grammar. Unknown ids map to None and
the rest of the syntax layer falls back to plain-text heuristics.
"""

from __future__ import annotations

import importlib
from functools import cache

from tree_sitter import Language

# LSP languageId -> (grammar family, module, function returning the language pointer).
# The family names the lexical rules (lsp_server/shaping/syntax/lexer.py) and node-type tables.
_GRAMMARS: dict[str, tuple[str, str, str]] = {
    "python": ("python", "tree_sitter_python", "language"),
    # tree-sitter-javascript parses JSX as well, so React files share the grammar.
    "javascript": ("javascript", "tree_sitter_javascript", "language"),
    "javascriptreact": ("javascript", "tree_sitter_javascript", "language"),
    "typescript": ("typescript", "tree_sitter_typescript", "language_typescript"),
    # Plain TypeScript cannot parse JSX (`<T>x` is a cast there), so .tsx needs its own grammar.
    "typescriptreact": ("typescript", "tree_sitter_typescript", "language_tsx"),
    "go": ("go", "tree_sitter_go", "language"),
    "rust": ("rust", "tree_sitter_rust", "language"),
    "java": ("java", "tree_sitter_java", "language"),
    "c": ("c", "tree_sitter_c", "language"),
    "cpp": ("cpp", "tree_sitter_cpp", "language"),
}

# Editors disagree on a few ids; accept the common spellings rather than silently degrading.
_ALIASES: dict[str, str] = {
    "py": "python",
    "js": "javascript",
    "jsx": "javascriptreact",
    "ts": "typescript",
    "tsx": "typescriptreact",
    "golang": "go",
    "rs": "rust",
    "c++": "cpp",
    "cc": "cpp",
}

SUPPORTED_LANGUAGE_IDS: tuple[str, ...] = tuple(_GRAMMARS)


def normalize_language_id(language_id: str | None) -> str | None:
    """The canonical LSP id for `language_id`, or None when we have no grammar for it."""
    if not language_id:
        return None
    key = language_id.strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in _GRAMMARS else None


def language_family(language_id: str | None) -> str | None:
    """Grammar family ("python", "javascript", "typescript", "go", ...) or None if unknown."""
    key = normalize_language_id(language_id)
    return _GRAMMARS[key][0] if key else None


def is_indent_scoped(language_id: str | None) -> bool:
    """True where blocks end by dedent (Python) rather than by a closing brace."""
    return language_family(language_id) == "python"


def get_language(language_id: str | None) -> Language | None:
    """The tree-sitter Language for `language_id`, or None (plain-text fallback)."""
    key = normalize_language_id(language_id)
    if key is None:
        return None
    _, module, func = _GRAMMARS[key]
    return _load(module, func)


@cache
def _load(module: str, func: str) -> Language | None:
    # Cached per (module, function): javascript and javascriptreact share one Language object.
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None  # grammar package not installed: degrade to plain text, never crash.
    return Language(getattr(mod, func)())
