"""Shared helpers: documents with a `<|>` cursor marker, and applying a validated completion."""

from __future__ import annotations

from lsp_server.shaping.syntax.document import SyntaxDocument
from lsp_server.shaping.syntax.validate import ValidationResult, validate_completion

MARKER = "<|>"


def doc_at(lang: str, code: str) -> tuple[SyntaxDocument, int]:
    """Document without the marker, and the marker's byte offset."""
    i = code.index(MARKER)
    text = code.replace(MARKER, "", 1)
    return SyntaxDocument(lang, text), len(text[:i].encode("utf-8"))


def finalize(lang: str, code: str, raw: str) -> tuple[ValidationResult, str, int]:
    """Validate `raw` at the marker; return (result, document after applying it, replaced chars)."""
    doc, cursor = doc_at(lang, code)
    res = validate_completion(doc, cursor, raw)
    data = doc.bytes
    applied = (data[: res.replace_start] + res.text.encode("utf-8") + data[res.replace_end :]).decode("utf-8")
    replaced = len(data[res.replace_start : res.replace_end].decode("utf-8"))
    return res, applied, replaced
