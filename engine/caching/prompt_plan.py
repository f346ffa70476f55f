"""The FIM prompt as line pieces grouped into segments, so a KV cache can reuse it piece by piece.

Text is cut just before every newline that follows a non-blank character. Under the
byte-level (GPT-2 style) pre-tokeniser that is always a token boundary, so tokenising
piece by piece gives the same ids as tokenising the whole text (38/38 stdlib files
checked) while an edit re-tokenises only its own line. Pieces are memoised by text:
a 4k-token file costs dictionary lookups, not tokeniser calls.

Pieces group into segments: the document's logical blocks (the lines where the
language server saw a top-level definition start), or fixed blocks of lines where
there is no parse. Each segment carries a prefix-hash chain key (its tokens and
everything before it, as vLLM hashes blocks); each piece a content key (its tokens
alone), which shift reuse matches after an edit (engine/caching/kv_shift.py).

For prefix-first (PSM) templates the text of the cursor's line, from the line break before it,
goes after the middle sentinel: ``[PRE] lines before [SUF] suffix [MID] \n current line``. The
model reads it as the start of the middle it is filling, which is how FIM training splits a file
anyway (at any character). Without it every keystroke moves the end of the prefix, and the whole
suffix behind it must be recomputed: 256 suffix tokens cost seconds on a 2-core CPU. With it, keys
within a line re-evaluate the line's last tokens. A cursor at a line start or on indentation is healed
back to the line break, so it keeps the plain layout.

Anchored layout (``build(request, anchor=...)``): a new line would move the prefix's end too, so the
caller may keep the head's start at an earlier line break, the *anchor* of the prompt its cache holds:
``[PRE] lines before the anchor [SUF] suffix [MID] \n every line typed since``. Typing new lines below
the anchor then appends to the prompt like typing within a line (engine/local.py picks the layout that
reuses more of the cache, and moves the anchor to the cursor in the background once the user is idle).

Truncation keeps the prompt stable while the user types: the suffix keeps whole
leading pieces, and the prefix drops whole leading segments in steps of
``TRUNCATE_STRIDE`` tokens, so its start moves only in jumps.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.api import CompletionRequest
from engine.caching.context_prompt import Context, RepoFormat, context_from_wire, header_texts, repo_format
from engine.decoding.healing import split_heal
from engine.errors import PromptError

LINE_CUT = re.compile(r"(?<=\S)(?=\n)")
FALLBACK_BLOCK_LINES = 32  # segment size where the caller gave no parse
MAX_SEGMENT_LINES = 64  # a longer logical block is cut into blocks of this many lines
PSM_SUFFIX_TOKENS = 256  # PSM puts the suffix after the moving cursor: keep its recompute bounded
# PSM only: the cursor's line goes after the middle sentinel, so typing on a line appends to the prompt
# instead of moving the prefix's end in front of the suffix. A longer line (minified code) stays in the prefix.
MAX_LINE_HEAD_CHARS = 512
# Anchored layout: at most this much text (and these many lines) after the middle sentinel. Past it the
# prompt takes the canonical layout, which costs one recompute of the suffix.
MAX_ANCHOR_HEAD_CHARS = 2048
MAX_ANCHOR_HEAD_LINES = 32
MEMO_PIECES = 65536


def _digest(data: bytes, prev: bytes = b"") -> bytes:
    return hashlib.blake2b(prev + data, digest_size=16).digest()


@dataclass(frozen=True)
class Piece:
    start: int  # position of its first token in the prompt
    length: int
    key: bytes  # hash of its tokens alone


@dataclass(frozen=True)
class Segment:
    start: int
    length: int
    chain: bytes  # hash of its tokens and of every token before it

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class PromptPlan:
    ids: list[int]
    pieces: list[Piece]
    segments: list[Segment]
    heal: str = ""
    constrained: bool = False
    truncated: int = 0  # prompt tokens dropped to fit the context
    # Where the text after the middle sentinel starts in the request's prefix (a line break), or None where
    # nothing follows the sentinel; ``anchor_at`` of the next request may keep it (the anchored layout).
    anchor: int | None = None
    head_lines: int = 0  # line breaks in the text after the middle sentinel
    context_tokens: int = 0  # cross-file context at the head (engine/caching/context_prompt.py)
    context_chunks: int = 0


@dataclass
class _Part:
    """A run of pieces: token lists and whether each begins a segment."""

    tokens: list[list[int]] = field(default_factory=list)
    starts: list[bool] = field(default_factory=list)

    def add(self, ids: list[int], segment_start: bool) -> None:
        if ids:
            self.tokens.append(ids)
            self.starts.append(segment_start or not self.starts)

    @property
    def size(self) -> int:
        return sum(map(len, self.tokens))


def segment_breaks(text: str, first_line: int, lines: Sequence[int] | None) -> list[tuple[str, bool]]:
    """Cut ``text`` into (piece, starts_a_segment). Line numbers count from ``first_line``.

    ``lines``: document lines (same numbering) where a logical block starts; None means
    no parse, so blocks of FALLBACK_BLOCK_LINES lines counted from the text's own start.
    """
    breaks = Breaks(first_line, lines)
    return [(piece, breaks.starts(piece)) for piece in LINE_CUT.split(text) if piece]


class Breaks:
    """``segment_breaks``' count, piece after piece: where the pieces of a text (in order) start segments."""

    def __init__(self, first_line: int, lines: Sequence[int] | None):
        self.wanted = set(lines) if lines is not None else None
        self.block = FALLBACK_BLOCK_LINES if self.wanted is None else MAX_SEGMENT_LINES
        self.line = first_line
        self.since = 0  # lines since the current segment began

    def starts(self, piece: str) -> bool:
        """Whether ``piece``, the next one, starts a segment."""
        n = piece.count("\n")
        started = range(self.line + 1, self.line + n + 1)  # lines whose first character is in this piece
        self.line += n
        self.since += n
        starts = bool(self.wanted) and any(x in self.wanted for x in started)
        if starts or self.since >= self.block:
            self.since = 0
        return starts or self.since == 0


def last_piece(text: str) -> str:
    """``LINE_CUT.split(text)[-1] or text``, found from the end: the text from its last cut point (a line break after
    a non-blank character), or all of it."""
    end = len(text)
    while (cut := text.rfind("\n", 0, end)) > 0:
        if not text[cut - 1].isspace():
            return text[cut:]
        end = cut
    return text


class PromptBuilder:
    """Builds PromptPlans for one model; remembers piece tokenisations."""

    def __init__(self, model, psm_suffix_tokens: int = PSM_SUFFIX_TOKENS):
        self.model = model
        self.psm_suffix_tokens = psm_suffix_tokens
        # Newline healing (engine/decoding/healing.py); off only to measure the older rule (bench/quality.py).
        self.newline_healing = True
        # The cursor's line after the middle sentinel (PSM only, see the module doc); off only to measure.
        self.line_in_middle = True
        # Only to measure the anchored layout's quality (bench/quality.py --anchor-lines): every prompt
        # anchored this many lines above the cursor's line, as if they had been typed since the anchor.
        self.anchor_lines = 0
        self._memo: OrderedDict[str, tuple[list[int], bytes]] = OrderedDict()
        self._repo_format: RepoFormat | None = None
        # The last context's pieces: the same chunks come with every keystroke (the ring changes rarely).
        self._context_memo: tuple[Context, _Part, int] | None = None

    @property
    def repo_format(self) -> RepoFormat:
        if self._repo_format is None:
            self._repo_format = repo_format(lambda tok: self.model.token_id(tok) is not None)
        return self._repo_format

    def _encode(self, text: str) -> tuple[list[int], bytes]:
        hit = self._memo.get(text)
        if hit is not None:
            self._memo.move_to_end(text)
            return hit
        ids = self.model.encode(text)
        value = (ids, _digest(array("i", ids).tobytes()))
        self._memo[text] = value
        if len(self._memo) > MEMO_PIECES:
            self._memo.popitem(last=False)
        return value

    def _part(self, text: str, first_line: int, lines: Sequence[int] | None) -> _Part:
        part = _Part()
        for piece, starts in segment_breaks(text, first_line, lines):
            part.add(self._encode(piece)[0], starts)
        return part

    def build(self, request: CompletionRequest, anchor: int | None = None) -> PromptPlan:
        """The request's prompt. ``anchor``: the offset in ``request.prefix`` of a line break where the text
        after the middle sentinel starts (PSM only; see ``anchor_at``), instead of the cursor line's break."""
        if not request.prefix and not request.suffix:
            raise PromptError("empty prompt: both prefix and suffix are empty")
        m = self.model
        template = m.template
        assert template is not None
        lines = request.segment_lines
        prefix_text, heal, constrained = request.prefix, "", False
        if request.heal and prefix_text:
            ids = self._encode(last_piece(prefix_text))[0]
            if ids:
                last = m.tokenizer.decode(ids[-1:], clean_up_tokenization_spaces=False)
                prefix_text, heal, constrained = split_heal(prefix_text, last, self.newline_healing)
        head_text = ""
        if anchor is None and self.anchor_lines:
            anchor = _lines_up(request.prefix, self.anchor_lines)
        if template.order == "psm" and self.line_in_middle:
            prefix_text, head_text = split_line_head(request.prefix, prefix_text, anchor)
        prefix = self._part(prefix_text, 0, lines)
        head = self._part(head_text, prefix_text.count("\n"), lines)
        if template.prefix_only:  # no FIM tokens (engine/fim.py PREFIX_ONLY): the suffix goes unused
            if not prefix.size:
                raise PromptError(
                    "empty prompt: this model completes from the text before the cursor only, and there is none"
                )
            suffix = _Part()
        else:
            suffix = self._part(request.suffix, request.prefix.count("\n"), lines)
        psm = template.order != "spm"
        if psm and suffix.size > self.psm_suffix_tokens:
            _keep_leading(suffix, self.psm_suffix_tokens)
        budget = m.max_len - request.options.max_tokens - 8 - head.size
        context, chunks = self._context_part(request.context)
        if context.size > budget // 4:  # a small model's window: the file's own text comes first
            context, chunks = _Part(), 0
        budget -= context.size
        total = prefix.size + suffix.size
        if total > budget:
            if not request.truncate:
                raise PromptError(
                    f"prompt of {total + head.size} tokens does not fit the model's context of "
                    f"{m.max_len} with {request.options.max_tokens} new tokens"
                )
            _keep_leading(suffix, min(suffix.size, budget // 4))
            _drop_leading(prefix, prefix.size - (budget - suffix.size), stride=max(256, budget // 8))
        plan = self._assemble(prefix, suffix, head, heal, constrained, total - prefix.size - suffix.size, context)
        plan.context_tokens, plan.context_chunks = context.size, chunks
        if head_text:
            plan.anchor, plan.head_lines = len(prefix_text), head_text.count("\n")
        elif psm and self.line_in_middle and request.prefix.startswith("\n", len(prefix_text)):
            plan.anchor = len(prefix_text)  # the prompt stops at a line break: the next line may anchor there
        return plan

    def _context_part(self, data) -> tuple[_Part, int]:
        """The cross-file context's pieces (each chunk starts a segment) and how many chunks fit its budget."""
        try:
            ctx = context_from_wire(data)
        except ValueError as exc:
            raise PromptError(str(exc)) from None
        if ctx is None or not ctx.chunks or ctx.budget <= 0:
            return _Part(), 0
        memo = self._context_memo
        if memo is not None and memo[0] == ctx:
            return _Part(list(memo[1].tokens), list(memo[1].starts)), memo[2]
        fmt = self.repo_format
        groups: list[list[list[int]]] = []  # per header_texts entry: its pieces' tokens
        for token, header, body in header_texts(fmt, ctx):
            group = [[self.model.token_id(token)]] if token is not None else []
            groups.append(group + [self._encode(p)[0] for p in LINE_CUT.split(header + body) if p])
        part, used, chunks = _Part(), 0, 0
        trailer = groups[-1] if fmt.file_token is not None else []
        trailer_size = sum(len(t) for t in trailer)
        body_groups = groups[:-1] if fmt.file_token is not None else groups
        if fmt.repo_token is not None:  # the repository's name joins the first chunk's segment
            body_groups = [body_groups[0] + body_groups[1], *body_groups[2:]]
        for group in body_groups:
            size = sum(len(t) for t in group)
            if used + size + trailer_size > ctx.budget:
                break  # the first that does not fit ends it: what was taken stays put when the ring appends
            for i, toks in enumerate(group):
                part.add(toks, i == 0)
            used += size
            chunks += 1
        if chunks:
            for i, toks in enumerate(trailer):
                part.add(toks, i == 0)
        self._context_memo = (ctx, _Part(list(part.tokens), list(part.starts)), chunks)
        return part, chunks

    def _assemble(
        self,
        prefix: _Part,
        suffix: _Part,
        head: _Part,
        heal: str,
        constrained: bool,
        dropped: int,
        context: _Part | None = None,
    ) -> PromptPlan:
        fold = Fold()
        for toks, starts in self._order(prefix, suffix, head, context):
            fold.add(toks, starts)
        return PromptPlan(*fold.finish(), heal, constrained, dropped)

    def _order(
        self, prefix: _Part, suffix: _Part, head: _Part, context: _Part | None = None
    ) -> list[tuple[list[int], bool]]:
        """The prompt's pieces in order: (piece tokens, starts a segment)."""
        m = self.model
        order: list[tuple[list[int], bool]] = []
        if getattr(m.tokenizer, "add_bos_token", False) and m.tokenizer.bos_token_id is not None:
            order.append(([m.tokenizer.bos_token_id], True))
        if context is not None:  # other files first: the prompt's stable, leading segments
            order.extend(zip(context.tokens, context.starts, strict=True))
        for text, special in m.template.pieces("\0P", "\0S"):
            if special:
                order.append(([m.token_id(text)], True))
                continue
            lead = self._encode(text[:-2])[0] if text[:-2] else []  # CodeLlama's space
            part = prefix if text.endswith("\0P") else suffix
            if lead:
                order.append((lead, False))
            order.extend(zip(part.tokens, part.starts, strict=True))
        order.extend(zip(head.tokens, head.starts, strict=True))  # after the middle sentinel
        return order


@dataclass
class Fold:
    """A prompt's ids, pieces and segments, made piece by piece (``add``); ``finish`` closes the last segment."""

    ids: list[int] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    chain: bytes = b""  # the last closed segment's chain key
    seg_start: int = 0
    seg_hash: bytes = b""  # the open segment's tokens so far

    def add(self, toks: list[int], starts: bool) -> None:
        ids = self.ids
        if starts and ids and len(ids) > self.seg_start:
            self.chain = _digest(self.seg_hash, self.chain)
            self.segments.append(Segment(self.seg_start, len(ids) - self.seg_start, self.chain))
            self.seg_start, self.seg_hash = len(ids), b""
        raw = array("i", toks).tobytes()
        self.seg_hash = _digest(raw, self.seg_hash)
        self.pieces.append(Piece(len(ids), len(toks), _digest(raw)))
        ids.extend(toks)

    def finish(self) -> tuple[list[int], list[Piece], list[Segment]]:
        """(ids, pieces, segments) with the open segment closed; the fold itself is left as it was."""
        last = Segment(self.seg_start, len(self.ids) - self.seg_start, _digest(self.seg_hash, self.chain))
        return self.ids, self.pieces, [*self.segments, last]


def split_line_head(prefix: str, healed: str, anchor: int | None = None) -> tuple[str, str]:
    """(prefix text, line head) for a PSM prompt: ``healed`` (the prefix after token healing) cut at
    the last line break of ``prefix``, or at ``anchor`` (an earlier one), the break going to the head.
    No head when the cursor's line is the document's first, when healing already took the line back to
    its break (cursor at a line start or on indentation), or when the line is longer than
    MAX_LINE_HEAD_CHARS. An anchor that is no line break, or leaves too long a head, is ignored."""
    cut = prefix.rfind("\n")
    if anchor is not None and anchor_fits(prefix, anchor) and anchor < cut:
        if len(healed) <= anchor + 1:
            return healed, ""
        return healed[:anchor], healed[anchor:]
    if cut < 0 or len(healed) <= cut + 1 or len(healed) - cut > MAX_LINE_HEAD_CHARS:
        return healed, ""
    return healed[:cut], healed[cut:]


def _lines_up(prefix: str, lines: int) -> int | None:
    """The line break ``lines`` lines above the cursor line's own (None: the text has fewer)."""
    cut = len(prefix)
    for _ in range(lines + 1):
        cut = prefix.rfind("\n", 0, cut)
        if cut < 0:
            return None
    return cut


def anchor_fits(prefix: str, anchor: int) -> bool:
    """Whether ``anchor`` (an offset in ``prefix``) can start the text after the middle sentinel: a line
    break, with at most MAX_ANCHOR_HEAD_CHARS and MAX_ANCHOR_HEAD_LINES after it."""
    return (
        0 <= anchor < len(prefix)
        and prefix[anchor] == "\n"
        and len(prefix) - anchor <= MAX_ANCHOR_HEAD_CHARS
        and prefix.count("\n", anchor) <= MAX_ANCHOR_HEAD_LINES
    )


def anchor_at(prefix: str, suffix: str, held: tuple[str, str] | None) -> int | None:
    """The anchor a request with ``prefix`` and ``suffix`` can keep from ``held``, the (text before the
    anchor, suffix) of the prompt a cache holds: only while the text after the cursor is unchanged and
    everything before the anchor too (the user typed on below it). None: take the canonical layout."""
    if held is None:
        return None
    before, held_suffix = held
    anchor = len(before)
    if suffix != held_suffix or not prefix.startswith(before) or not anchor_fits(prefix, anchor):
        return None
    return anchor if anchor < prefix.rfind("\n") else None  # the cursor line's own break: canonical


def _keep_leading(part: _Part, limit: int) -> None:
    """Keep whole leading pieces up to ``limit`` tokens (a first piece longer than that is cut)."""
    total = 0
    for i, toks in enumerate(part.tokens):
        if total + len(toks) > limit:
            if i == 0:
                part.tokens, part.starts = [toks[:limit]], [True]
            else:
                del part.tokens[i:], part.starts[i:]
            return
        total += len(toks)


def _drop_leading(part: _Part, excess: int, stride: int) -> None:
    """Drop leading pieces (at a segment start where possible) totalling at least ``excess`` tokens.

    The cut is rounded up to a multiple of ``stride`` so that, as the prefix grows at its
    end, its start moves only once every ``stride`` tokens: between jumps the cache holds.
    """
    if excess <= 0:
        return
    target = -(-excess // stride) * stride
    offsets, total = [], 0
    for toks in part.tokens:
        offsets.append(total)
        total += len(toks)
    if target >= total:
        target = excess
    # A segment start just past the target keeps whole blocks; further than a quarter stride
    # would waste context, so then the first line past it.
    cut = next((i for i, off in enumerate(offsets) if off >= target), len(offsets))
    near = next((i for i in range(cut, len(offsets)) if part.starts[i]), None)
    if near is not None and offsets[near] - target <= stride // 4:
        cut = near
    del part.tokens[:cut], part.starts[:cut]
    if part.starts:
        part.starts[0] = True
