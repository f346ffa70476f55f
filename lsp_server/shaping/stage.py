"""The shaping stage: every CompletionShaper the LSP side builds is built here, and every text it shapes passes here.

A decode's text is shaped at three moments, all in this module:

- while it streams (``stream_text``): the decode's own shaper (built by the plan recipe through
  ``decode_shaper``) runs the bracket guard over each chunk; at a closer beyond the completion's scope,
  or where the text starts re-typing the lines after the cursor, the decode is cancelled and its text
  ends there (``Generation.cut``);
- when it ends (``finish_decode``): the shaper's ``finish`` (validation, scope end, the replace range
  over auto-paired closers) cuts the finished text to what an editor may show, so type-through serves
  only that, and records the code points after the anchor cursor the text replaces;
- when a request answers (``shape_answer``): any text other than the finished decode's whole shaped
  text (part of a first line, text after typing along) is validated at the answer's cursor like a
  whole completion. A delta's ``replaceEnd`` (``delta_replace_end``) reads the same ranges.

``fimble complete`` shapes its one decode's text with ``shape_whole``. The rules themselves live in
lsp_server/shaping/shaper.py (CompletionShaper) and lsp_server/shaping/syntax/.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from lsp_server.positions import from_codepoints
from lsp_server.shaping.shaper import CompletionShaper
from lsp_server.shaping.syntax.brackets import fit_to_line_rest

if TYPE_CHECKING:
    from lsp_server.documents import Document
    from lsp_server.generation import Generation
    from lsp_server.prompt import Context
    from lsp_server.shaping.syntax.context import CursorContext
    from lsp_server.stats import Stats

log = logging.getLogger(__name__)
# Cursor lines longer than this (minified code, data) skip the syntax policy and shaping:
# classifying such a line costs milliseconds per thousand characters and grows faster.
MAX_LINE = 4000


def _cols(data: bytes, start: int, end: int) -> int:
    """Code points in ``data[start:end]`` (a replace range in document bytes)."""
    return len(data[start:end].decode("utf-8", "replace"))


def decode_shaper(doc: Document, byte: int, cursor_ctx: CursorContext) -> CompletionShaper:
    """The shaper a decode at ``byte`` streams through (it snapshots ``doc``'s syntax copy now)."""
    return CompletionShaper(doc.syntax, byte, context=cursor_ctx)


def stream_text(gen: Generation, text: str, stats: Stats) -> None:
    """Add streamed text to ``gen`` up to the guard's stop; at a stop, cancel the decode."""
    if gen.shaper is not None:
        try:
            stop = gen.shaper.feed(text)
        except Exception:
            log.exception("completion guard failed: streaming unguarded")
            gen.shaper, stop = None, None
        if stop is not None:
            gen.cut = True
            stats.count("guard_stops")
            if gen.shaper.stop_reason == "suffix_overlap":  # it began re-typing the text after the cursor
                stats.count("suffix_overlap_stops")
            gen.cancel()  # generation goes no further than a closer beyond its scope
            full = gen.text + text
            gen.cut_to(stop)  # (a stop inside text already added: only after a lookahead)
            text = full[len(gen.text) : stop]
    if text:
        gen.add_text(text)


def finish_decode(gen: Generation, stats: Stats) -> None:
    """Shape a finished decode's text at its anchor; keep only the shaped text (type-through)."""
    shaper, gen.shaper = gen.shaper, None
    if shaper is None:
        return
    try:
        shaped = shaper.finish()
    except Exception:
        log.exception("completion shaping failed: keeping the text as generated")
        return
    if shaped.cut_reason:
        stats.count(f"shaped_{shaped.cut_reason}")
    if not gen.text.startswith(shaped.text):
        log.warning("shaped text is not a prefix of the generated text; keeping the generated text")
        return
    gen.cut_to(len(shaped.text))
    gen.replace_cols = _cols(shaper.doc.bytes, shaped.replace_start, shaped.replace_end)


def shape_answer(
    doc: Document, cursor: tuple[int, int], gen: Generation, start: int, text: str, stats: Stats
) -> tuple[str, int]:
    """(text to show, code points after the cursor it replaces) for ``text`` at ``cursor`` now.

    ``text`` is ``gen.text[start:]`` or a prefix of it. The finished decode's own shaping
    holds when the answer runs to its end: typing along a completion leaves the document
    prefix + typed + rest + suffix the same, and the rest of the line the same. Any other
    text, part of a first line (at earlyAnswerMs) included, is validated here like a whole
    completion: an answer never adds a parse error.
    """
    if not text.strip():
        return "", 0
    if len(doc.lines[cursor[0]]) > MAX_LINE:
        return text, 0  # see MAX_LINE
    to_end = gen.done and gen.text[start:].rstrip() == text
    if to_end and gen.replace_cols is not None:
        return text, gen.replace_cols
    try:
        byte = doc.byte_offset(*cursor)
        shaped = CompletionShaper(doc.syntax, byte, snapshot=False).finish(text)  # no await: doc can't change
    except Exception:
        log.exception("completion shaping failed: answering unshaped")
        return text, 0
    cols = _cols(doc.syntax.bytes, shaped.replace_start, shaped.replace_end)
    if shaped.text != text:
        stats.count(f"answer_shaped_{shaped.cut_reason}")
        if to_end and text.startswith(shaped.text):  # the cache must not serve what was cut
            gen.cut_to(start + len(shaped.text))
            gen.replace_cols = cols
    return shaped.text, cols


def delta_replace_end(
    doc: Document, ctx: Context, gen: Generation, offset: int, position: dict, encoding: str
) -> Callable[[str, bool], dict]:
    """For deltas: text -> the end of what it replaces at the request's cursor (its ``replaceEnd``).

    ``position`` is the request's cursor in the client's units (``encoding``). A subscription
    lives for one document version, so the rest of the cursor's line is read once, now. The
    finished decode's own shaped range holds for its whole text (see shape_answer); a text still
    streaming is fitted to the closers after the cursor, as a partial answer is.
    """
    line, col = ctx.cursor
    line_text = doc.line_text(line)
    rest = line_text[col:]
    language = doc.syntax.language_id if doc.syntax is not None else None

    def replace_end(text: str, done: bool) -> dict:
        cols = 0
        if text.strip() and rest.strip() and len(line_text) <= MAX_LINE:
            if done and gen.done and gen.replace_cols is not None and gen.text[offset:] == text:
                cols = gen.replace_cols
            else:
                try:
                    cols = fit_to_line_rest(text, rest, language)[1]
                except Exception:  # a syntax-layer bug costs the range, not the stream
                    log.exception("fitting a delta to the line's closers failed")
        return {
            "line": position["line"],
            "character": position["character"] + from_codepoints(rest, min(cols, len(rest)), encoding),
        }

    return replace_end


def shape_whole(shaper: CompletionShaper, text: str) -> tuple[str, str | None]:
    """(shown text, cut reason) for a decode's whole ``text``, as the editor would show it (``fimble complete``)."""
    shaped = shaper.finish(text)  # (fed whole: a guard stop inside it holds as it would while streaming)
    return shaped.text, shaped.cut_reason
