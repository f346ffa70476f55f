"""Decoding policy: which DecodeOptions a completion gets, from the syntax context at the cursor.

    from lsp_server.shaping.policy import decide
    decision = decide(doc, cursor_byte, "python", overrides=None)   # -> PolicyDecision
    request = CompletionRequest(prefix, suffix, decision.to_options())

`decide` classifies the cursor (lsp_server.shaping.syntax.classify) and looks the context up in `DEFAULTS`,
a table keyed by `ContextKind.value` ("comment", "string", "import", "attribute_chain",
"call_args", "parameters", "block_start", "block_body", "mid_statement", "top_level"). Two
modifier rows then apply on top of the context's row:

- "mid_line":   the cursor has code after it on its line (CursorContext.at_line_end is False);
                in ONE_LINE_CONTEXTS (comment, string, import) MID_LINE_ONE_LINE applies instead.
- "plain_text": no grammar for the language (unknown language id, or the grammar is missing).

`overrides` (e.g. from editor settings) has the same keys plus "*" (every context), each mapping
to a dict of PolicyDecision field names -> values. Order of application, later wins:
DEFAULTS[kind] -> DEFAULTS["mid_line"] -> DEFAULTS["plain_text"] -> overrides["*"] ->
overrides[kind] -> overrides["mid_line"] -> overrides["plain_text"]. So a user's setting always
beats a built-in default, and a context-specific setting beats "*". Unknown keys or fields and
values of the wrong type raise ValueError (`check_overrides` reports them without raising).

API: `decide(doc, cursor_byte, language_id=None, overrides=None, context=None) -> PolicyDecision`;
`decide_for_context(kind, mid_line=False, plain_text=False, overrides=None)` (the table lookup
alone); `PolicyDecision` (frozen; fields temperature, top_p, gamma, max_gamma, confidence_gate,
multiline, max_lines, stop, max_tokens, plus context / mid_line / plain_text for logging) with
`.to_options(**extra) -> DecodeOptions` (extra: drafter, seed, adaptive_gamma, or a cap such as
max_tokens=...) and `.to_dict()`; `policy_table(overrides)` (every row, for display or logs);
`check_overrides(overrides) -> list[str]`. A user-wide line cap is `{"*": {"multiline": False}}`.

The defaults were chosen by measurement: `bench/quality.py --sweep` runs every candidate in
`bench/quality.py:CANDIDATES` per context on the HumanEval infilling sets and writes the table
to its JSON; the why-comments below quote what it showed for the embedded model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from engine.options import MAX_STOP_CHARS, MAX_STOPS, DecodeOptions  # not engine.decoding.speculative: torch
from lsp_server.shaping.syntax.context import ContextKind, CursorContext, classify
from lsp_server.shaping.syntax.document import SyntaxDocument
from lsp_server.shaping.syntax.languages import normalize_language_id

CONTEXT_NAMES: tuple[str, ...] = tuple(k.value for k in ContextKind)
MODIFIERS: tuple[str, ...] = ("mid_line", "plain_text")
OVERRIDE_KEYS: tuple[str, ...] = ("*", *CONTEXT_NAMES, *MODIFIERS)


@dataclass(frozen=True)
class PolicyDecision:
    """What one completion request is decoded with. Plain data: safe to log or send."""

    context: str = "mid_statement"  # the ContextKind value it was decided for
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    gamma: int = 4  # initial draft block length (adapts between 1 and max_gamma)
    max_gamma: int = 12
    confidence_gate: float = 0.3  # the draft model stops drafting below this top probability
    multiline: bool = False  # False: the completion ends at the first newline
    max_lines: int = 1  # lines allowed when multiline (0 = no limit)
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    max_tokens: int = 48
    mid_line: bool = False  # decided for a cursor with code after it on its line
    plain_text: bool = False  # decided without a grammar

    @property
    def line_limit(self) -> int:
        """The DecodeOptions.max_lines this decision means (1 when single-line, 0 = none)."""
        return self.max_lines if self.multiline else 1

    def to_options(self, **extra: Any) -> DecodeOptions:
        """DecodeOptions for the engine. `extra` sets the fields the policy does not decide
        (drafter, seed, adaptive_gamma) or replaces decided ones (e.g. max_tokens from a cap)."""
        opts = DecodeOptions(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            gamma=self.gamma,
            max_gamma=max(self.max_gamma, self.gamma, 1),
            confidence_gate=self.confidence_gate,
            # One line: the line limit cuts at the first newline, so a stop string holding one
            # can never match first; dropping it keeps equal decisions' options equal.
            stop=tuple(s for s in self.stop if self.line_limit != 1 or "\n" not in s),
            max_lines=self.line_limit,
            context=self.context + ("/mid_line" if self.mid_line else ""),
        )
        return replace(opts, **extra) if extra else opts

    def to_dict(self) -> dict:
        return asdict(self)


_FIELD_TYPES: dict[str, type] = {
    "temperature": float, "top_p": float, "gamma": int, "max_gamma": int, "confidence_gate": float,
    "multiline": bool, "max_lines": int, "stop": tuple, "max_tokens": int,
}  # fmt: skip

# -- the table ---------------------------------------------------------------------------------
# Every row starts from PolicyDecision's defaults (greedy, gamma 4, single line, 48 tokens).
# Figures quoted below are from `bench/quality.py --sweep` (1,916 problems: single-line 1,033,
# random-span 164, context-lines 719; embedded 26.75M model; one sample per problem).
#
# Greedy everywhere. Against greedy, pooled over each group's problems (pass@1 / exact):
#   prose (comment+string, 167):  greedy .994/.006  t0.2 .994/.006  t0.3 .994/.012  t0.7 .994/.000
#   code-line (657):              greedy .126/.085  t0.2 .132/.084  t0.3 .123/.084  t0.7 .094/.056
#   block (1,092):                greedy .043/.021  t0.2 .047/.023                  t0.7 .042/.014
# 0.7 loses clearly; 0.2/0.3 move by one to four problems either way, within sampling noise,
# while greedy is deterministic (the same context gives the same suggestion, so a completion
# the user types through stays valid) and decodes faster: a sampled draft token is kept with
# probability min(1, p/q), a greedy one whenever the target agrees (decode ms per token, code
# lines: greedy 13.8-14.9, t0.2 18.9, t0.7 20.4).
#
# gamma (initial draft block; adaptive_gamma then moves it): greedy output does not depend on
# it (lossless), only speed does. Decode ms per token, gamma 2 / 4 / 8 (mean accepted per step):
#   prose 15.4 / 16.6 / 18.4 (1.77 / 1.79 / 1.88), code lines 13.8 / 14.9 / 16.7
#   (1.98 / 2.05 / 2.21), blocks - / 13.0 / 14.3 (- / 2.43 / 2.69).
# Longer blocks are accepted a little more per step but cost more than they save: the draft
# model is not much cheaper than this small target on CPU, and a one-line completion is only
# a handful of steps, so the opening block dominates. Blocks (longer outputs, where the n-gram
# drafter finds runs to copy) keep 4. The confidence gate (0.5 vs 0.3 for prose) made no
# measurable difference; 0.5 stays for prose, where drafts are rejected early.
DEFAULTS: dict[str, dict[str, Any]] = {
    # Prose: one line, short. Drafts of prose are rejected early (1.8 tokens per step), so the
    # first block is short and the draft model stops at a lower confidence.
    "comment": {"max_tokens": 32, "gamma": 2, "confidence_gate": 0.5},
    # Inside a string (docstrings included): finish this line of it. The bracket guard ends
    # the completion where it closes the string, so the quote is never doubled.
    "string": {"max_tokens": 32, "gamma": 2, "confidence_gate": 0.5},
    # `import a.b` / `from x import y`: a module path or a name list, always one short line.
    "import": {"max_tokens": 24, "gamma": 2},
    # `obj.|`: an attribute (or a method call) of a chain. One line.
    "attribute_chain": {"max_tokens": 32, "gamma": 2},
    # `f(|`: the arguments; the guard stops at the `)` that closes the call.
    "call_args": {"max_tokens": 48, "gamma": 2},
    # `def f(|`: a parameter list, one line.
    "parameters": {"max_tokens": 32, "gamma": 2},
    # Mid-expression with nothing after the cursor: finish the line.
    "mid_statement": {"max_tokens": 48, "gamma": 2},
    # Right after a block opener (`def f():` / `{`): a body is expected, several lines. On the
    # random spans at block contexts (82), multi-line vs one line: edit similarity .151 vs
    # .045, shown 60% vs 24%, same pass@1 and parse-ok. Fewer lines (3) were no better and
    # slower. The default model ends the middle itself (end-of-middle where the suffix takes
    # over), so the rows allow what the settings do (8 lines, 128 tokens) and stop only at two
    # blank lines: a 4-6 line cap and a one-blank-line stop cut HumanEval multi-line middles
    # (2-6 lines, blank lines inside) short. The validator's scope cut ends it at the function's end.
    "block_start": {"multiline": True, "max_lines": 8, "max_tokens": 128, "stop": ("\n\n\n",)},
    # A statement start inside a block: the next statements.
    "block_body": {"multiline": True, "max_lines": 8, "max_tokens": 128, "stop": ("\n\n\n",)},
    # A statement start at module level: possibly a whole definition. Two blank lines
    # separate top-level definitions (PEP 8), so they end the completion.
    "top_level": {"multiline": True, "max_lines": 8, "max_tokens": 128, "stop": ("\n\n\n",)},
    # Code after the cursor on its line (closers alone count as line end): the gap may hold
    # lines, with the line's rest after the last one (`count = |    if s[i]...` wants `0` and a
    # loop header). One line here left 95 of 300 mid-line random spans with nothing shown
    # (the first line alone does not parse before the rest). The shaper checks the whole text
    # with the rest joined on; ONE_LINE_CONTEXTS keep MID_LINE_ONE_LINE.
    "mid_line": {"multiline": True, "max_lines": 8, "max_tokens": 96, "stop": ()},
    # No grammar: validation cannot syntax-check, so keep to one greedy line. (Not measured:
    # the sets are Python.)
    "plain_text": {"multiline": False, "temperature": 0.0, "max_tokens": 48},
}


# Contexts whose text ends with its line (a comment, a docstring's line, an import): mid-line,
# only the gap is wanted, and fit_to_line_rest covers the closers the editor auto-inserted.
ONE_LINE_CONTEXTS = frozenset({"comment", "string", "import"})
MID_LINE_ONE_LINE: dict[str, Any] = {"multiline": False, "max_tokens": 32}


# -- deciding -----------------------------------------------------------------------------------
def decide(
    doc: SyntaxDocument,
    cursor_byte: int,
    language_id: str | None = None,
    overrides: dict | None = None,
    context: CursorContext | None = None,
) -> PolicyDecision:
    """The decision for a completion at `cursor_byte` (UTF-8 bytes) in `doc`.

    `language_id` defaults to the document's; an id without a grammar selects the plain-text
    row. `context` skips the classification when the caller already has it for this cursor.
    """
    ctx = context if context is not None and context.byte_offset == cursor_byte else classify(doc, cursor_byte)
    lang = language_id if language_id is not None else doc.language_id
    plain = ctx.plain_text or normalize_language_id(lang) is None
    return decide_for_context(ctx.kind.value, mid_line=not ctx.at_line_end, plain_text=plain, overrides=overrides)


def decide_for_context(
    context: str, *, mid_line: bool = False, plain_text: bool = False, overrides: dict | None = None
) -> PolicyDecision:
    """The table lookup alone: `context` is a ContextKind value."""
    if context not in CONTEXT_NAMES:
        raise ValueError(f"unknown context {context!r}; known: {', '.join(CONTEXT_NAMES)}")
    over = _checked(overrides)
    keys = [context] + (["mid_line"] if mid_line else []) + (["plain_text"] if plain_text else [])
    values: dict[str, Any] = {}
    for key in keys:
        one_line = key == "mid_line" and context in ONE_LINE_CONTEXTS
        values.update(MID_LINE_ONE_LINE if one_line else DEFAULTS.get(key, {}))
    for key in ["*", *keys]:
        values.update(over.get(key, {}))
    return PolicyDecision(context=context, mid_line=mid_line, plain_text=plain_text, **values)


def cap_line_limit(limit: int, cap: int) -> int:
    """The smaller of two line limits where 0 means none (a decision's limit under a user's cap)."""
    if cap <= 0:
        return limit
    return cap if limit <= 0 else min(limit, cap)


def policy_table(overrides: dict | None = None) -> dict[str, dict]:
    """Every context's decision at line end (and the two modifiers applied to mid_statement)."""
    table = {name: decide_for_context(name, overrides=overrides).to_dict() for name in CONTEXT_NAMES}
    table["mid_line"] = decide_for_context("mid_statement", mid_line=True, overrides=overrides).to_dict()
    table["plain_text"] = decide_for_context("mid_statement", plain_text=True, overrides=overrides).to_dict()
    return table


def check_overrides(overrides: Any) -> list[str]:
    """Problems with an overrides dict, one line each (empty: fine)."""
    if overrides is None:
        return []
    if not isinstance(overrides, dict):
        return [f"overrides must be a dict, not {type(overrides).__name__}"]
    problems = []
    for key, row in overrides.items():
        if key not in OVERRIDE_KEYS:
            problems.append(f"unknown policy key {key!r}; known: {', '.join(OVERRIDE_KEYS)}")
            continue
        if not isinstance(row, dict):
            problems.append(f"{key}: expected a dict of settings, got {type(row).__name__}")
            continue
        for name, value in row.items():
            if name not in _FIELD_TYPES:
                problems.append(f"{key}.{name}: unknown setting; known: {', '.join(_FIELD_TYPES)}")
            elif _coerce(name, value) is None and _FIELD_TYPES[name] is tuple:  # the list is not echoed back
                problems.append(
                    f"{key}.{name}: bad value (expected at most {MAX_STOPS} non-empty strings of at most "
                    f"{MAX_STOP_CHARS} characters)"
                )
            elif _coerce(name, value) is None:
                shown = repr(value)  # short
                problems.append(f"{key}.{name}: bad value {shown if len(shown) <= 80 else shown[:77] + '...'}")
    return problems


def _checked(overrides: dict | None) -> dict[str, dict[str, Any]]:
    if not overrides:
        return {}
    problems = check_overrides(overrides)
    if problems:
        raise ValueError("; ".join(problems))
    return {key: {name: _coerce(name, v) for name, v in row.items()} for key, row in overrides.items()}


def _coerce(name: str, value: Any) -> Any:
    """The value as the field's type, or None when it does not fit (or is out of range)."""
    kind = _FIELD_TYPES[name]
    if kind is bool:
        return value if isinstance(value, bool) else None
    if kind is tuple:
        if isinstance(value, str):
            value = (value,)
        # Capped as DecodeOptions.validate caps them: each stop string costs every decoding step a check.
        if (
            isinstance(value, list | tuple)
            and len(value) <= MAX_STOPS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in value)
        ):
            return tuple(value)
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if kind is int:
        if value != int(value):
            return None
        value = int(value)
    else:
        value = float(value)
    ok = {
        "temperature": value >= 0,
        "top_p": 0 < value <= 1,
        "gamma": value >= 0,
        "max_gamma": value >= 1,
        "confidence_gate": 0 <= value <= 1,
        "max_lines": value >= 0,
        "max_tokens": value >= 1,
    }[name]
    return value if ok else None


__all__ = [
    "CONTEXT_NAMES",
    "DEFAULTS",
    "MID_LINE_ONE_LINE",
    "ONE_LINE_CONTEXTS",
    "OVERRIDE_KEYS",
    "PolicyDecision",
    "check_overrides",
    "decide",
    "decide_for_context",
    "policy_table",
]
