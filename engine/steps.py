"""The one request loop: a completion request, from its prompt to its last delta, as a generator of passes.

Every request runs here, whichever engine holds it: ``fimble lsp``'s in-process engine (engine/local.py: a
scheduler with one active sequence) and ``fimble serve``'s (engine/serve/scheduler.py: many sequences, their
passes batched). ``request_steps`` yields what it needs next and is sent the answer:

- a ``Forward`` (engine/decoding/passes.py: a prefill chunk, then one verify block per step), answered
  ``STREAM_NOW`` (the pass is launched, or about to be: the text of the previous step may go out meanwhile;
  the generator then yields ``AWAIT``) and then the pass's logits;
- a ``DraftNeed`` (greedy draft-model tokens), answered with the tokens.

The scheduler (engine/scheduler.py) decides how the passes run; this module decides what a request does:
prompt choice (engine/documents.py), KV reuse, a prefill a chunk per pass that stops between chunks once the
request is cancelled, speculative steps (engine/decoding/speculative.py), healing, stop rules, streaming,
counters and stats.
"""

from __future__ import annotations

import time
from collections.abc import Generator

from engine.api import CompletionRequest, CompletionStream, Delta
from engine.background import PREWARM_CHUNK
from engine.decoding.detok import IncrementalDetokenizer, StopRules
from engine.decoding.drafters import Draft
from engine.decoding.healing import unheal
from engine.decoding.passes import DraftNeed, Forward
from engine.decoding.speculative import SpeculativeDecoder
from engine.documents import REUSE_MODES
from engine.errors import PromptError

# A round's two-phase handshake with each sequence's generator: having yielded its pass, the generator is sent
# STREAM_NOW and streams the text of its previous step (it then yields AWAIT); the logits come with the next
# send. With overlap (fimble serve on CUDA) STREAM_NOW is sent once the round's passes are launched, so that work
# runs while the GPU does; without, a step's text is streamed as soon as its tokens are committed.
STREAM_NOW = object()
AWAIT = object()
# A prompt is prefilled a chunk per pass (the scheduler's ``prefill_chunk``) while more than this many tokens are
# left; the rest is the answer's own pass (which computes the logits it needs and carries the heal draft): as in
# llama.cpp's own prefill, its rows take the many-row kernels (engine/runtimes/ggml_runtime.py ``_blocks``).
PREFILL_TAIL = 128
# A slotted round's cap on a keystroke's last pass (FIMBLE_SERVE_TAIL_ROWS) applies where at most this many prompt
# tokens are left; a longer tail (a paste) runs as one pass, rather than a round per few tokens.
MAX_CAPPED_TAIL = 4
# A background request (Tab-Tab's follow-up: nobody waits on it yet) prefills in passes no longer than a pre-warm's
# (engine/background.py PREWARM_CHUNK), its last one included: the host's quiet stop (lsp_server/decodes.py) lands
# between passes, and one pass of PREFILL_TAIL tokens is over a second on a 2-core CPU. A follow-up of a cold answer
# prefilled 117 tokens in one pass, from 1.4 s to 2.6 s after the user's last key: the CPU was still busy 2-3 s
# after it (bench/reports/typing-default-follow-up-quiet-2026-12-05.txt).
BACKGROUND_PREFILL_CHUNK = PREWARM_CHUNK


def request_steps(eng, request: CompletionRequest, stream: CompletionStream) -> Generator[object, object, None]:
    """Run ``request`` to its end, streaming to ``stream``; ``eng`` is the scheduler (engine/scheduler.py) whose
    documents, drafters, counters and background work it uses."""
    t0 = time.perf_counter()
    docs, counts = eng.documents, eng.counts
    plan = eng.built_ahead(request)
    if stream.cancelled:
        eng.finish(stream, "", "cancelled", 0, {"queue_ms": 0.0})
        return
    opt = request.options
    opt.validate()
    if request.reuse not in REUSE_MODES:
        raise PromptError(f"unknown reuse mode {request.reuse!r}: use {', '.join(REUSE_MODES)}")
    if plan is None:
        eng.refuse_unfit(request)
        plan = docs.prompts.build(request)
    doc = docs.open(request, plan)
    served, plan, doc = docs.choose(request, plan, doc)
    if served is not request and not request.background:
        # The full prompt (with its cross-file context) fills when the user leaves the engine a moment (a
        # pre-warm). A chunk of it before each cold answer was tried: it filled a spot within ~40 keystrokes,
        # but the chunk's time on every answer cut the pauses with text within 1 s from 66% to 38%
        # (bench/lsp_typing.py, default model).
        eng.background.later(request)
    request = served
    prompt, heal, constrained = plan.ids, plan.heal, plan.constrained
    if plan.context_chunks:  # cross-file context at the prompt's head (engine/caching/context_prompt.py)
        counts.add("context_prompts")
        counts.add("context_tokens", plan.context_tokens)
    t_prompt = time.perf_counter()
    target = docs.target
    drafter, ngram = eng.drafters(request)
    reuse = 0
    own = None  # the document's own target cache while a slot holds it (fimble serve's slotted rounds)
    try:
        reuse, runs, shifted = docs.reuse(doc, plan, request.reuse)
        own = eng.passes.take_slot(doc)
        prefilled = sum(b - a for a, b in runs) if runs is not None else len(prompt) - reuse
        decoder = SpeculativeDecoder(
            target.runtime,
            doc.target,
            target.stop_ids,
            opt,
            drafter,
            ngram,
            heal if constrained else "",
            target.token_index if constrained else None,
            acceptance=eng.drafter_set.acceptance_for(request),
        )
        decoder.host_tokens = own is not None  # slotted: blocks go to the device once per round
        if drafter is not None:
            drafter.bind(doc.draft, doc.draft_ids)
        doc.ids = []  # the cache is about to change; valid again after prefill
        if eng.progress is not None:
            eng.progress("prefill", 0, prefilled)
        if runs:  # shift reuse: scattered positions, its own pass (compact runtime)
            first = decoder.prefill(prompt, reuse, runs)
        else:
            chunk, tail = eng.prefill_chunk, PREFILL_TAIL
            if request.background:
                chunk, tail = min(chunk, BACKGROUND_PREFILL_CHUNK), BACKGROUND_PREFILL_CHUNK
            first = yield from _prefill(eng, decoder, doc, prompt, reuse, own is not None, stream, chunk, tail)
            if first is None:  # cancelled between chunks: the cache keeps what was filled for the next keystroke
                counts.add("tokens_prefilled", doc.exact_len - reuse)
                eng.finish(stream, "", "cancelled", 0, {"queue_ms": 0.0, "prompt_tokens": len(prompt)})
                return
        counts.add("tokens_prefilled", prefilled)
        counts.add("tokens_reused", len(prompt) - prefilled)
        counts.add("tokens_shifted", shifted)
        t_first = time.perf_counter()
        docs.time_prefill(prefilled, t_first - t_prompt)
        text, shown, reason = yield from _decode(eng, decoder, stream, first, heal, constrained)
        # Keys/values of prompt + accepted output stay valid for the next request.
        doc.ids = decoder.ids[: doc.target.length]
        doc.exact_len = len(doc.ids) if runs is None or not shifted else reuse
        if docs.hold(doc, request, plan) and not request.background:  # (a follow-up's cache is a scratch one)
            eng.background.reanchor_later(request)
    finally:
        eng.passes.give_slot(doc, own)
        if drafter is not None:
            doc.draft_ids = drafter.ids if doc.ids else []
            drafter.bind(None, [])
        docs.store.release(doc, plan, reuse)
    if ngram is not None:
        ngram.remember(decoder.output)
    t_end = time.perf_counter()
    s = decoder.stats
    stats = {
        "prompt_tokens": len(prompt),
        "reused_tokens": len(prompt) - prefilled,
        "prefilled_tokens": prefilled,
        "shifted_tokens": shifted,
        "truncated_tokens": plan.truncated,
        "prompt_ms": (t_prompt - t0) * 1e3,
        "first_token_ms": (t_first - t0) * 1e3,
        "total_ms": (t_end - t0) * 1e3,
        "new_tokens": len(decoder.output),
        "steps": s.steps,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "mean_accepted": s.mean_accepted,
        "context_tokens": plan.context_tokens,
        "context_chunks": plan.context_chunks,
    }
    eng.finish(stream, text[:shown], reason or "stop", len(decoder.output), stats)


def _prefill(
    eng,
    decoder: SpeculativeDecoder,
    doc,
    prompt: list[int],
    pos: int,
    slotted: bool,
    stream: CompletionStream,
    chunk_len: int,
    tail: int,
) -> Generator[object, object, list[int] | None]:
    """The prompt from ``pos`` on, ``chunk_len`` tokens per pass while more than ``tail`` tokens are left, then the
    rest in the answer's own pass with the heal draft; its first tokens. None once ``stream`` is cancelled
    between two chunks (``doc`` then says what the cache holds)."""
    cache, device = doc.target, decoder.runtime.device
    if pos < cache.length:
        cache.rollback(pos)
    cap = eng.passes.tail_rows() if slotted else 0
    while True:
        last = len(prompt) - pos <= tail
        end = len(prompt) if last else pos + chunk_len
        draft = []
        if last:  # the last pass carries the heal draft, where it stays a short pass
            draft = decoder.prefill_draft(len(prompt))
            if slotted and not eng.passes.fits_heal_draft(end - pos + len(draft)):
                draft = []  # slotted: a longer chunk runs in SlotGraphs.prefill, last logits only
            if cap and end - pos <= MAX_CAPPED_TAIL:
                # A slotted round pads every slot to its longest pass: a keystroke's few new tokens and heal draft
                # go in passes of at most ``cap`` rows (a shorter heal draft: the rest is healed step by step).
                draft = draft[: cap - 1]
                if end - pos + len(draft) > cap:
                    last, draft = False, []
                    end = min(pos + cap, len(prompt) - 1)
        chunk = prompt[pos:end] + draft
        numpy = not slotted and decoder.numpy_ok  # host ids in, numpy rows out: the ggml runtime, no torch
        if not (slotted or numpy):  # (slotted: host ids, staged with the round's others)
            import torch  # a torch runtime's pass

            chunk = torch.tensor(chunk, dtype=torch.long, device=device)
        fwd = Forward(chunk, cache, pos, 1 + len(draft), numpy=numpy, reads_logits=last and decoder.reads_logits)
        yield fwd  # answered STREAM_NOW: nothing to stream yet
        logits = yield AWAIT
        if last:
            return decoder.prefill_done(prompt, logits, fwd.best, draft)
        pos = end
        doc.ids, doc.exact_len = prompt[:pos], pos
        if stream.cancelled:  # typed on: keep what is computed for the next keystroke
            return None


def _decode(
    eng, decoder: SpeculativeDecoder, stream: CompletionStream, first: list[int], heal: str, constrained: bool
) -> Generator[object, object, tuple[str, int, str | None]]:
    """Stream text until a stop, the end of decoding or a cancel; (text, shown, reason).

    With the scheduler's ``overlap``, a step's text is streamed while the next step's pass runs (at STREAM_NOW; the
    first text at once, as the editor waits for it); if that text hits a stop string or the line limit, the pass in
    flight is dropped (``abandon_step``): one wasted row, never a wrong token. Without, it is streamed as soon as its
    tokens are committed."""
    out = TextOut(eng, decoder, stream, heal, constrained)
    pending = first  # committed tokens whose text is not streamed yet
    reason = None
    opening = True  # the first text goes out at once, even with overlap: it is what the editor waits for
    while True:
        if (opening or not eng.overlap) and pending:
            hit, pending = out.emit(pending), []
            if hit:
                reason = "stop"
                break
        opening = False
        if decoder.done or stream.cancelled:
            if pending and out.emit(pending):
                reason = "stop"
            elif not decoder.done:
                reason = "cancelled"
            break
        draft = decoder.next_draft()
        if draft is None:  # decoding is over (the context is full): loop to stream the rest
            continue
        if isinstance(draft, DraftNeed):  # the scheduler drafts for every sequence at once
            draft = Draft((yield draft))
        yield decoder.begin_step(draft)  # answered STREAM_NOW (the pass is launched, or about to be)
        hit = bool(pending) and out.emit(pending)
        if eng.overlap and not hit and stream.cancelled:
            # Cancelled (the editor typed on) while the pass ran: drop it and end here, while the round's passes run,
            # rather than in the round's critical path after them (one wasted row; fimble serve's rounds overlap).
            decoder.abandon_step()
            eng.counts.add("sched_cancel_overlapped")
            reason = "cancelled"
            break
        logits = yield AWAIT
        if hit:
            decoder.abandon_step()
            reason = "stop"
            break
        pending = decoder.end_step(logits)
        eng.counts.add("decode_steps")
    if decoder.done and not reason:
        reason = out.finish()
    return out.text, out.shown, reason


class TextOut:
    """A sequence's streamed text: detokeniser, stop rules, what was shown."""

    clock = staticmethod(time.monotonic)  # the pacing's clock (a test sets its own)

    def __init__(self, eng, decoder: SpeculativeDecoder, stream: CompletionStream, heal: str, constrained: bool):
        self.counts, self.decoder, self.stream = eng.counts, decoder, stream
        self.heal, self.constrained = heal, constrained
        self.interval = eng.stream_interval
        self.detok = IncrementalDetokenizer(eng.documents.target.tokenizer)
        self.rules = StopRules(decoder.opt.stop, decoder.opt.max_lines)
        self.text, self.shown = "", 0
        self._pushed_at: float | None = None

    def emit(self, tokens: list[int]) -> bool:
        """Stream the text of ``tokens``; True when it hit a stop string or the line limit.

        The first text goes out at once; later text at most every ``interval`` seconds (the scheduler's
        ``stream_interval``; held text joins the next delta, and the last one always goes): an editor cannot
        show 400 updates a second, and every delta costs fimble serve's websocket thread the interpreter the
        decode loop needs."""
        self.counts.add("tokens_generated", len(tokens))
        self.detok.add(tokens)
        self.text, hit = self.rules.cut(unheal(self.detok.text, self.heal, self.constrained))
        final = hit or self.decoder.done
        safe = len(self.text) if final else self.rules.safe_length(self.text)
        if safe > self.shown:
            now = self.clock() if self.interval else 0.0
            if final or self._pushed_at is None or now - self._pushed_at >= self.interval:
                self.stream.push(Delta(self.text[self.shown : safe]))
                self.shown, self._pushed_at = safe, now
        return hit

    def finish(self) -> str:
        """The decoder is done: stream what the detokeniser held back; the finish reason."""
        self.detok.flush()
        self.text, _ = self.rules.cut(unheal(self.detok.text, self.heal, self.constrained))
        if len(self.text) > self.shown:
            self.stream.push(Delta(self.text[self.shown :]))
            self.shown = len(self.text)
        return "eos" if self.decoder.finish_reason == "stop" else self.decoder.finish_reason
