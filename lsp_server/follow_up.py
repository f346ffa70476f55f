"""Tab-Tab: the context of the completion that follows accepting a shown one, computed before the accept.

Once a decode's text has been shown and the decode has ended, the completer (lsp_server/completer.py)
decodes in the background at the cursor the editor will have after Tab: the document as it is, with
the shown text inserted at the cursor (replacing the closers it re-types). The accept's didChange then
types along that decode, and the request that follows finds it by the usual lookup (same window,
prefix and suffix), so the next suggestion shows from text already decoded.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from engine.options import DecodeOptions
from lsp_server.documents import Document
from lsp_server.generation import SETTLED, Generation
from lsp_server.positions import advance
from lsp_server.prompt import Context, suffix_text, typed_since
from lsp_server.shaping.policy import cap_line_limit

# A follow-up nobody may accept costs CPU: its decode stops after this many tokens (a line or two); a
# request after the accept that wants more starts from its text (type-through) or decodes afresh.
FOLLOW_UP_MAX_TOKENS = 24
# After an accept that completes its line: the rest of that line (nothing) and the next lines.
FOLLOW_UP_LINES = 3


class Accept(NamedTuple):
    """What accepting a shown completion does: the edit it makes, and the context at the cursor it leaves."""

    start: tuple[int, int]
    end: tuple[int, int]  # the closers the completion re-types are replaced
    text: str
    ctx: Context

    def document(self, doc: Document) -> Document:
        """``doc`` as the accept will leave it (a scratch copy): the follow-up is planned there, as the
        request after the accept will be (its syntax context, not the shown completion's)."""
        return doc.with_edit(self.start, self.end, self.text)


def follow_up_context(doc: Document, gen: Generation, prefix_chars: int, suffix_chars: int) -> Accept | None:
    """The accept of ``gen``'s shown text at the cursor ``doc`` now has, or None where its context cannot be
    known exactly (the user typed off the text, the prefix window would move, nothing is left)."""
    typed = typed_since(doc, gen.ctx)
    if typed is None or not gen.text.startswith(typed):
        return None
    text = gen.text[len(typed) :]
    if not text.strip() or gen.ctx.window != doc.window:
        return None
    line, col = advance(*gen.ctx.cursor, typed)
    prefix = gen.ctx.prefix + typed + text
    replaced = gen.replace_cols or 0
    if len(prefix) > prefix_chars or col + replaced > len(doc.line_text(line)):
        return None
    ctx = Context(
        uri=doc.uri,
        version=doc.version,
        doc_length=doc.length + len(text) - replaced,
        window=gen.ctx.window,
        cursor=advance(line, col, text),
        prefix=prefix,
        suffix=suffix_text(doc, line, col + replaced, suffix_chars),
    )
    return Accept((line, col), (line, col + replaced), text, ctx)


def follow_up_options(
    options: DecodeOptions, accepted: Document, cursor: tuple[int, int], max_lines: int
) -> DecodeOptions:
    """The follow-up's options: the plan's at the accepted cursor, a line or two of tokens. Where the accept
    completed its line (nothing after the cursor), the follow-up is the next lines, as llama.vim's Tab-Tab
    is: a single-line decision there (a finished statement reads as mid-statement) ends at the line break
    with nothing to show, so the next Tab would have nothing. ``max_lines`` is the user's cap."""
    options = replace(options, max_tokens=min(options.max_tokens, FOLLOW_UP_MAX_TOKENS))
    line, col = cursor
    if options.max_lines == 1 and not accepted.line_text(line)[col:].strip():
        options = replace(options, max_lines=cap_line_limit(FOLLOW_UP_LINES, max_lines))
    return options


def next_line_follows(gen: Generation, accepted: Document, cursor: tuple[int, int]) -> bool:
    """Whether the completion after accepting ``gen`` starts on a new line: the shown text ended by itself
    (the model's end, a line limit or the guard; not a token limit, which may stop mid-line) and the accept
    leaves nothing after the cursor on its line. There, a decode at the cursor itself is asked whether the
    middle goes on, and a model trained for the middle ends it at once when the file goes on below (the
    Tab-Tab misses of bench/lsp_typing.py: the follow-up decoded ``eos`` and nothing). A person who accepted a
    whole line wants the next one, as Copilot and llama.vim show it: so the follow-up is decoded after a line
    break (``after_lead``) and its text starts with it."""
    line, col = cursor
    return gen.finish_reason in SETTLED and not accepted.line_text(line)[col:].strip()


def after_lead(ctx: Context, lead: str) -> Context:
    """``ctx`` with ``lead`` typed at its cursor: the context the engine decodes a led completion in."""
    return Context(
        uri=ctx.uri,
        version=ctx.version,
        doc_length=ctx.doc_length + len(lead),
        window=ctx.window,
        cursor=advance(*ctx.cursor, lead),
        prefix=ctx.prefix + lead,
        suffix=ctx.suffix,
    )
