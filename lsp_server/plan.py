"""The plan recipe: what a decode at a cursor is asked for, and the engine request that carries it.

One recipe for every decode the LSP side starts (a request's, a keystroke's prefetch, Tab-Tab's
follow-up), for every pre-warm (which decodes nothing, but must send the very prompt the next
completion there will send), and for ``fimble complete`` (lsp_server/cli.py):

- options (``plan_at``): the syntax policy's decision for the cursor's context
  (lsp_server/shaping/policy.py), capped by the settings maxTokens / maxLines, ``policy`` overriding
  the table. A cursor line over lsp_server/shaping/stage.py's MAX_LINE, or a syntax-layer failure,
  gets the fixed settings instead: a syntax bug must not cost the user the completion;
- shaper: the CompletionShaper the decode's text streams through (built by the shaping stage);
- segment lines: where the document's top-level definitions start (lsp_server/segments.py), the
  engine's KV-cache segment boundaries;
- the request (``Planner.request``): the windows, options, segment lines, healing, reuse, and the
  document's cross-file context ring as it is (lsp_server/context/).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.options import DecodeOptions  # plain data: no torch here
from lsp_server.documents import Document, DocumentStore
from lsp_server.prompt import Context, clean
from lsp_server.segments import segment_lines
from lsp_server.settings import Settings
from lsp_server.shaping import stage
from lsp_server.shaping.policy import PolicyDecision, cap_line_limit, decide
from lsp_server.shaping.shaper import CompletionShaper
from lsp_server.shaping.syntax.context import classify
from lsp_server.stats import Stats

if TYPE_CHECKING:
    from lsp_server.context import CrossFileContext

log = logging.getLogger(__name__)


class Plan(NamedTuple):
    """What a decode at a cursor needs besides its windows."""

    options: DecodeOptions
    shaper: CompletionShaper | None
    segment_lines: list[int] | None  # CompletionRequest.segment_lines (None: the engine's fixed blocks)
    decision: PolicyDecision | None = None  # the syntax policy's (None: the fixed settings)


class PolicySkipped(Exception):
    """The syntax policy does not apply here (see lsp_server/shaping/stage.py MAX_LINE)."""


def fixed_options(settings: Settings) -> DecodeOptions:
    """The options without the syntax policy: the settings alone."""
    return DecodeOptions(max_tokens=max(1, settings.max_tokens), drafter=settings.drafter, max_lines=settings.max_lines)


def plan_at(doc: Document, cursor: tuple[int, int], settings: Settings, *, shaped: bool = True) -> Plan:
    """The syntax policy's options at ``cursor`` capped by ``settings``, and (``shaped``) the decode's shaper.

    Call it while ``doc`` is at the version the decode reads (the shaper snapshots the document).
    No segment lines (the engine request's business: see Planner). Raises PolicySkipped on a cursor
    line over MAX_LINE; a syntax-layer error propagates.
    """
    if len(doc.lines[cursor[0]]) > stage.MAX_LINE:
        raise PolicySkipped
    byte = doc.byte_offset(*cursor)
    cursor_ctx = classify(doc.syntax, byte)
    decision = decide(doc.syntax, byte, doc.language_id, settings.policy, context=cursor_ctx)
    opts = decision.to_options(
        drafter=settings.drafter,
        max_tokens=min(decision.max_tokens, max(1, settings.max_tokens)),
        max_lines=cap_line_limit(decision.line_limit, settings.max_lines),
    )
    line = doc.lines[cursor[0]]
    if not line[: cursor[1]].strip() and not line[cursor[1] :].strip():
        # A blank line the user is on (after Enter and its indentation): an empty middle shows nothing, which is
        # never what they wait for. The FIM-tuned default ended at once on 9-10 of 21 such pauses of
        # bench/lsp_typing.py (an ``eos`` and no text); with this it writes its best line, which the shaper
        # still cuts where it re-types what follows.
        opts = dataclasses.replace(opts, no_empty=True)
    shaper = stage.decode_shaper(doc, byte, cursor_ctx) if shaped else None
    return Plan(opts, shaper, None, decision)


class Planner:
    """A session's plan recipe: its segment lines, its counters and ``last_policy``, its engine requests."""

    def __init__(self, docs: DocumentStore, stats: Stats, context: CrossFileContext):
        self.docs, self.stats, self.context = docs, stats, context
        self.engine_ns = ""  # the session's id where sessions share the engine (FimbleServer)
        self.last_policy: dict | None = None  # the latest decode's decision, for fimble/stats

    def engine_doc_id(self, uri: str) -> str:
        """The document's key in the engine: its URI, under the session's namespace when shared."""
        return f"{self.engine_ns}\x00{uri}" if self.engine_ns else uri

    def plan(
        self,
        doc: Document,
        ctx: Context,
        settings: Settings,
        *,
        prefetch: bool = False,
        prewarm: bool = False,
        follow_up: bool = False,
    ) -> Plan:
        """The plan for a decode at ``ctx``'s cursor: options, shaper, segment lines.

        Call it while ``doc`` is at ``ctx.version``. A ``prewarm`` plan has no shaper and is not
        recorded (lastPolicy, policy counters): nothing is decoded. A ``follow_up`` plan (``doc`` is the
        document an accept will leave) is not recorded either: the request after the accept records its own.
        """
        lines = self._segment_lines(doc, ctx)
        try:
            plan = plan_at(doc, ctx.cursor, settings, shaped=not prewarm)
        except Exception as exc:  # a syntax-layer bug must not cost the user the completion
            if prewarm:
                pass  # the completion that follows counts (and logs) it
            elif isinstance(exc, PolicySkipped):
                self.stats.count("policy_skipped_long_line")
            else:
                log.exception("syntax policy failed: decoding with the fixed settings")
                self.stats.count("policy_errors")
            if not (prewarm or follow_up):
                self.last_policy = None
            return Plan(fixed_options(settings), None, lines)
        plan = plan._replace(segment_lines=lines)
        if prewarm or follow_up:
            return plan
        decision = plan.decision
        assert decision is not None
        self.last_policy = {
            "uri": ctx.uri,
            "version": ctx.version,
            "cursor": list(ctx.cursor),
            "language": doc.syntax.language_id,
            "context": decision.context,
            "midLine": decision.mid_line,
            "plainText": decision.plain_text,
            "prefetch": prefetch,
            "options": dataclasses.asdict(plan.options),
        }
        self.stats.count(f"policy_{decision.context}")
        return plan

    def _segment_lines(self, doc: Document, ctx: Context) -> list[int] | None:
        try:
            return segment_lines(doc, ctx.window, ctx.cursor[0], ctx.suffix)
        except Exception:  # only an optimisation: the engine cuts fixed blocks instead
            log.exception("segment lines failed")
            self.stats.count("segment_lines_errors")
            return None

    def request(self, ctx: Context, plan: Plan, settings: Settings, background: bool = False) -> Any:
        """The engine request for ``ctx``: one code path for completions, prefetches, follow-ups and pre-warms."""
        from engine.api import CompletionRequest  # loaded by the engine host already

        return CompletionRequest(
            clean(ctx.prefix),
            clean(ctx.suffix),
            options=plan.options,
            document_id=self.engine_doc_id(ctx.uri),
            segment_lines=plan.segment_lines,
            reuse=settings.reuse,
            truncate=True,
            heal=settings.token_healing,
            cold_window=True,
            background=background,
            context=self.context.for_request(ctx.uri, self.docs.get(ctx.uri), settings),
        )
