"""fimble serve's prompt builder: a keystroke's prompt built from the editor's previous one, not from scratch.

Under ``fimble serve`` every keystroke of every editor is a new request, and 32 editors typing in step bring 32 of
them into one round, each built while the others wait (issue 27: a 32-keystroke burst, chiefly its prompt builds,
was what was left of the slow rounds at 32 editors on the H200). A keystroke changes the prompt at the cursor: the
last piece or two of the text before it (suffix-first templates put the prefix last; prefix-first ones put the
cursor's line after the middle sentinel, engine/caching/prompt_plan.py). So:

- a part (prefix, suffix, the cursor's line) is remembered by its text, line numbering and segment lines, and a new
  one is made from the remembered part of its text up to its last cut point (``last_piece``) plus that last piece:
  the line split, the memo lookups and the segment count run over the one line that changed;
- the assembled prompt (ids, pieces, segment chain keys: ``Fold``) is remembered as it stood before each of its
  last ``CHECKPOINTS`` pieces, keyed by those pieces (token lists by identity: the builder's memo hands out the same
  list for the same text, and the entry holds them, so no other list can take an identity while it is remembered;
  one- and two-token pieces, the template's own tokens among them, by value); a prompt resumes from the latest
  such state its own pieces lead to and adds only the pieces after it;
- the text that is new at a keystroke is tokenised by the tokenizer's Rust backend directly, as transformers'
  ``encode(..., split_special_tokens=True)`` does it underneath (the wrapper's Python was most of that call), and
  healing's one-token decodes are remembered. Both are checked against the model's own at start on probe texts,
  and left as they were where anything differs.

The ids, pieces and segments are the same as ``PromptBuilder.build``'s, for every request
(tests/serve/test_prompt_memo.py checks it over typing traces, truncation, context and healing).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence

from engine.caching.prompt_plan import LINE_CUT, Breaks, Fold, PromptBuilder, PromptPlan, _Part, last_piece

PARTS_REMEMBERED = 512  # parts and their leads (a few a keystroke: prefix, suffix, the cursor's line), LRU
CHECKPOINTS = 3  # a prompt's fold remembered before each of its last this many pieces
FOLDS_REMEMBERED = 512  # fold states (up to CHECKPOINTS a prompt; 64 editors need ~200)


# Texts the direct tokenizer call must tokenise as the model does before it is used: code, blank lines and
# indentation, non-ASCII, and control tokens typed as text (which must stay text).
PROBES = (
    "def f(x):\n    return x  # done\n\n\n",
    "\t\tvalue = {'a': [1, 2.5e-3]}\r\n",
    "caf\u00e9 \u4e2d\u6587 \U0001f600 \u00a0end",
    "<|fim_prefix|>x<|fim_middle|><|endoftext|><|file_sep|>",
    "   ",
)


def direct_encoder(model) -> Callable[[str], list[int]] | None:
    """``model.encode`` as one call of its tokenizer's Rust backend (a copy of it, splitting control tokens as
    text), or None where the tokenizer has no such backend or any probe tokenises differently."""
    backend = getattr(model.tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(backend.to_str())
        tok.encode_special_tokens = True  # what split_special_tokens=True sets on transformers' own
    except Exception:  # noqa: BLE001 - any failure: the model's own encode stays
        return None

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids if text else []

    try:
        if any(encode(t) != model.encode(t) for t in PROBES):
            return None
    except Exception:  # noqa: BLE001
        return None
    return encode


class _DirectModel:
    """The model as PromptBuilder sees it, with ``encode`` the direct call and one-token decodes remembered."""

    def __init__(self, model, encode: Callable[[str], list[int]]):
        self._model, self.encode = model, encode
        self.tokenizer = _RememberedDecodes(model.tokenizer)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class _RememberedDecodes:
    """A tokenizer whose decodes of one token are remembered (healing decodes the prompt's last token)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._one: dict[tuple, str] = {}

    def decode(self, ids, **kwargs) -> str:
        if len(ids) != 1:
            return self._tokenizer.decode(ids, **kwargs)
        key = (int(ids[0]), *sorted(kwargs.items()))
        text = self._one.get(key)
        if text is None:
            text = self._one[key] = self._tokenizer.decode(ids, **kwargs)
        return text

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


class IncrementalPromptBuilder(PromptBuilder):
    """``PromptBuilder`` with its parts and assembled prompts remembered (see the module docstring)."""

    def __init__(self, model, **kwargs):
        encode = direct_encoder(model)
        super().__init__(_DirectModel(model, encode) if encode is not None else model, **kwargs)
        self.direct = encode is not None
        self._parts: OrderedDict[tuple, tuple[list[list[int]], list[bool]]] = OrderedDict()
        self._leads: OrderedDict[tuple, tuple[list[list[int]], list[bool], Breaks]] = OrderedDict()
        self._folds: OrderedDict[tuple, tuple] = OrderedDict()
        self.part_hits = self.lead_hits = self.fold_hits = 0

    def _part(self, text: str, first_line: int, lines: Sequence[int] | None) -> _Part:
        if not text:
            return _Part()
        lines_key = None if lines is None else tuple(lines)
        key = (text, first_line, lines_key)
        hit = self._parts.get(key)
        if hit is not None:
            self._parts.move_to_end(key)
            self.part_hits += 1
            return _Part(list(hit[0]), list(hit[1]))  # the caller may cut its lists (truncation)
        tail = last_piece(text)
        cut = len(text) - len(tail)
        if cut:  # the text up to its last cut point (remembered), then the last piece
            lead_key = (text[:cut], first_line, lines_key)
            lead = self._leads.get(lead_key)
            if lead is None:
                breaks, head = Breaks(first_line, lines), _Part()
                for piece in LINE_CUT.split(text[:cut]):
                    if piece:
                        head.add(self._encode(piece)[0], breaks.starts(piece))
                lead = (head.tokens, head.starts, breaks)
                _remember(self._leads, lead_key, lead, PARTS_REMEMBERED)
            else:
                self._leads.move_to_end(lead_key)
                self.lead_hits += 1
            breaks = copy.copy(lead[2])
            part = _Part(list(lead[0]), list(lead[1]))
            part.add(self._encode(tail)[0], breaks.starts(tail))
        else:
            part = super()._part(text, first_line, lines)
        _remember(self._parts, key, (list(part.tokens), list(part.starts)), PARTS_REMEMBERED)
        return part

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
        order = self._order(prefix, suffix, head, context)
        n = len(order)
        marks = [id(toks) if len(toks) > 2 else tuple(toks) for toks, _ in order]
        flags = [starts for _, starts in order]
        fold, at = None, 0
        for m in range(n - 1, max(n - CHECKPOINTS, 1) - 1, -1):  # the latest remembered state first
            entry = self._folds.get((tuple(marks[:m]), tuple(flags[:m])))
            if entry is not None:
                _, (ids, pieces, segments), (n_ids, n_pieces, n_segments), chain, seg_start, seg_hash = entry
                fold = Fold(list(ids[:n_ids]), list(pieces[:n_pieces]), list(segments[:n_segments]))
                fold.chain, fold.seg_start, fold.seg_hash = chain, seg_start, seg_hash
                at = m
                self.fold_hits += 1
                break
        if fold is None:
            fold = Fold()
        marked = []  # (m, the fold's state before order[m]: its lists' lengths, chain, open segment's start and hash)
        for m in range(at, n):
            if m >= max(n - CHECKPOINTS, 1) and m > at:
                lengths = (len(fold.ids), len(fold.pieces), len(fold.segments))
                marked.append((m, lengths, fold.chain, fold.seg_start, fold.seg_hash))
            fold.add(*order[m])
        ids, pieces, segments = fold.finish()
        if marked:
            refs = [toks for toks, _ in order]  # keeps every identity in the keys alive
            shared = (tuple(ids), tuple(pieces), tuple(fold.segments))
            for m, lengths, chain, seg_start, seg_hash in marked:
                key = (tuple(marks[:m]), tuple(flags[:m]))
                _remember(self._folds, key, (refs, shared, lengths, chain, seg_start, seg_hash), FOLDS_REMEMBERED)
        return PromptPlan(ids, pieces, segments, heal, constrained, dropped)


def _remember(memo: OrderedDict, key, value, limit: int) -> None:
    memo[key] = value
    if len(memo) > limit:
        memo.popitem(last=False)
