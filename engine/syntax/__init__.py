"""Syntax layer: tree-sitter documents, cursor context, bracket rules, completion validation."""

from engine.syntax.brackets import BracketGuard, closers_after_cursor, fit_to_line_rest, open_brackets_before
from engine.syntax.context import ContextKind, CursorContext, classify
from engine.syntax.document import SyntaxDocument
from engine.syntax.languages import SUPPORTED_LANGUAGE_IDS, get_language, normalize_language_id
from engine.syntax.validate import CutReason, ValidationResult, validate_completion

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
