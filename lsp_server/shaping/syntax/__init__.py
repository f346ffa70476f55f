"""Syntax layer: tree-sitter documents, cursor context, bracket rules, completion validation."""

from lsp_server.shaping.syntax.brackets import (
    BracketGuard,
    closers_after_cursor,
    fit_to_line_rest,
    open_brackets_before,
)
from lsp_server.shaping.syntax.context import ContextKind, CursorContext, classify
from lsp_server.shaping.syntax.document import SyntaxDocument
from lsp_server.shaping.syntax.languages import SUPPORTED_LANGUAGE_IDS, get_language, normalize_language_id
from lsp_server.shaping.syntax.validate import CutReason, ValidationResult, validate_completion

__all__ = [
    "SUPPORTED_LANGUAGE_IDS",
    "BracketGuard",
    "ContextKind",
    "CursorContext",
    "CutReason",
    "SyntaxDocument",
    "ValidationResult",
    "classify",
    "closers_after_cursor",
    "fit_to_line_rest",
    "get_language",
    "normalize_language_id",
    "open_brackets_before",
    "validate_completion",
]
