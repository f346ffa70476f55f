"""fimble serve's prompt builder: a keystroke's prompt built from the editor's previous one, not from scratch.

Under ``fimble serve`` every keystroke of every editor is a new request, and 32 editors typing in step bring 32 of
them into one round, each built while the others wait (issue 27: a 32-keystroke burst, chiefly its prompt builds,
was what was left of the slow rounds at 32 editors on the H200). Typing within a line changes only the text after
the middle sentinel (the cursor's line: engine/caching/prompt_plan.py puts it there for PSM templates); the text
before the cursor's line, the suffix and the cross-file context are the same as the previous keystroke's. So:

- each part (prefix, suffix, the cursor's line) is remembered by its text, line numbering and segment lines: a
  repeat costs one dictionary lookup instead of the line split and a memo lookup per line;
- the prompt without its head (everything up to and including the middle sentinel, ``PromptBuilder._assemble``
  with no head) is remembered by the identity of its pieces' token lists (the builder's memo hands out the same
  list for the same text; the entry holds them, so an identity cannot be reused while it is remembered), and the
  head's pieces are folded onto it: the head always begins a segment, so the body's segments are exactly those the
  whole prompt has before the head, and the head's chain starts from the body's last one.

- the text that is new at a keystroke (the cursor's line) is tokenised by the tokenizer's Rust backend directly,
  as transformers' ``encode(..., split_special_tokens=True)`` does it underneath (about a tenth of the time: the
  wrapper's Python was most of a keystroke's build), and healing's one-token decodes are remembered. Both are
  checked against the model's own at start on probe texts, and left as they were where anything differs.

The ids, pieces and segments are the same as ``PromptBuilder.build``'s, for every request
(tests/serve/test_prompt_memo.py checks it over typing traces, truncation, context and healing).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from engine.caching.prompt_plan import Piece, PromptBuilder, PromptPlan, Segment, _digest, _Part

PARTS_REMEMBERED = 1024  # parts (three a keystroke: prefix, suffix, the cursor's line), least recently used dropped
BODIES_REMEMBERED = 256  # prompts without their head (one per editor typing in a line)


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
    """``PromptBuilder`` with its parts and head-less prompts remembered (see the module docstring)."""

    def __init__(self, model, **kwargs):
        encode = direct_encoder(model)
        super().__init__(_DirectModel(model, encode) if encode is not None else model, **kwargs)
        self.direct = encode is not None
        self._parts: OrderedDict[tuple, tuple[list[list[int]], list[bool]]] = OrderedDict()
        self._bodies: OrderedDict[tuple, tuple[tuple, PromptPlan]] = OrderedDict()
        self.part_hits = self.body_hits = 0

    def _part(self, text: str, first_line: int, lines: Sequence[int] | None) -> _Part:
        if not text:
            return _Part()
        key = (text, first_line, None if lines is None else tuple(lines))
        hit = self._parts.get(key)
        if hit is not None:
            self._parts.move_to_end(key)
            self.part_hits += 1
            return _Part(list(hit[0]), list(hit[1]))  # the caller may cut its lists (truncation)
        part = super()._part(text, first_line, lines)
        self._parts[key] = (list(part.tokens), list(part.starts))
        if len(self._parts) > PARTS_REMEMBERED:
            self._parts.popitem(last=False)
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
        context = context if context is not None else _Part()
        key = tuple(
            (tuple(map(id, part.tokens)), tuple(part.starts)) for part in (prefix, suffix, context)
        )  # token lists by identity: the entry keeps them alive, so no other list takes an id while it is remembered
        entry = self._bodies.get(key)
        if entry is None:
            body = super()._assemble(prefix, suffix, _Part(), heal, constrained, dropped, context)
            refs = (list(prefix.tokens), list(suffix.tokens), list(context.tokens))
            self._bodies[key] = (refs, body)
            if len(self._bodies) > BODIES_REMEMBERED:
                self._bodies.popitem(last=False)
        else:
            self._bodies.move_to_end(key)
            self.body_hits += 1
            body = entry[1]
        ids = list(body.ids)
        pieces = list(body.pieces)
        segments = list(body.segments)
        if head.tokens:
            # The head's first piece begins a segment (``_Part.add``): the body's segments are closed as they are,
            # and the head's chain goes on from the body's last segment, as in PromptBuilder._assemble's loop.
            chain, seg_start, seg_hash = segments[-1].chain, len(ids), b""
            for toks, starts in zip(head.tokens, head.starts, strict=True):
                if starts and len(ids) > seg_start:
                    chain = _digest(seg_hash, chain)
                    segments.append(Segment(seg_start, len(ids) - seg_start, chain))
                    seg_start, seg_hash = len(ids), b""
                raw = array("i", toks).tobytes()
                seg_hash = _digest(raw, seg_hash)
                pieces.append(Piece(len(ids), len(toks), _digest(raw)))
                ids.extend(toks)
            segments.append(Segment(seg_start, len(ids) - seg_start, _digest(seg_hash, chain)))
        return PromptPlan(ids, pieces, segments, heal, constrained, dropped)
