"""The in-process engine: one worker thread runs the model; callers only see the API in engine/api.py.

The worker owns the models and their caches, so no locks guard the tensors.
Requests run one at a time in arrival order. Cancellation is a flag the decode
loop checks before every step, so a cancelled request stops within one step.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from pathlib import Path

import torch

from engine.api import CompletionRequest, CompletionResult, CompletionStream, Delta
from engine.detok import IncrementalDetokenizer, StopRules
from engine.drafters import ModelDrafter, NgramDrafter
from engine.errors import FimbleError, PromptError
from engine.healing import split_heal, unheal
from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, LoadedModel, load_model
from engine.speculative import SpeculativeDecoder

COUNTER_NAMES = ("submitted", "completed", "cancelled", "failed", "decode_steps", "tokens_generated",
                 "tokens_prefilled", "tokens_reused")


class LocalEngine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, threads: int | None = None,
                 start_thread: bool = True):
        if target.template is None:
            raise FimbleError(f"model {target.name} has no fill-in-the-middle tokens; pass a template name")
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise FimbleError(f"draft {draft.name} and target {target.name} do not share a tokenizer")
        self.target, self.draft = target, draft
        self._threads = threads
        self.cache = target.runtime.new_cache(target.max_len)
        self._cached_ids: list[int] = []  # tokens whose keys/values are in self.cache
        self.model_drafter = ModelDrafter(draft.runtime, draft.max_len) if draft else None
        self.ngram_drafter = NgramDrafter()
        _ = target.token_index  # build it now, not on the first keystroke
        self._ids = itertools.count(1)
        self._queue: queue.Queue[tuple[CompletionRequest, CompletionStream] | None] = queue.Queue()
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._lock = threading.Lock()
        # On CPU, torch runs small matmuls about 2x slower outside the main thread (its
        # OpenMP team there sleeps between ops). Latency-critical hosts therefore run the
        # engine in its own process and call serve_forever() from that main thread.
        self._worker: threading.Thread | None = None
        if start_thread:
            self._worker = threading.Thread(target=self._run, name="fimble-engine", daemon=True)
            self._worker.start()

    # -- public API -------------------------------------------------------------------
    def submit(self, request: CompletionRequest, on_delta=None) -> CompletionStream:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        stream = CompletionStream(next(self._ids), loop, on_delta)
        self._count("submitted")
        self._queue.put((request, stream))
        return stream

    def complete(self, request: CompletionRequest) -> CompletionResult:
        """Blocking convenience: run a request to the end (call from outside an event loop).

        Without a worker thread the request runs right here, in the caller's thread.
        """
        stream = self.submit(request)
        if self._worker is None:
            self._run_one(self._queue.get())
        stream.collect()
        assert stream.result is not None
        return stream.result

    def info(self) -> dict:
        t = self.target
        return {"model": t.name, "backend": t.backend, "template": t.template.name if t.template else None,
                "draft": self.draft.name if self.draft else None, "context": t.max_len, "vocab": t.vocab_size}

    def counters(self) -> dict:
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        self._queue.put(None)
        if self._worker is not None:
            self._worker.join(timeout=5)

    def serve_forever(self) -> None:
        """Run requests in the calling thread until close()."""
        self._run()

    # -- worker -------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _run(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run_one(item)

    def _run_one(self, item: tuple[CompletionRequest, CompletionStream] | None) -> None:
        if item is None:
            return
        request, stream = item
        try:
            self._serve(request, stream)
        except FimbleError as exc:
            self._count("failed")
            stream.push(Delta("", True, "error", str(exc), type(exc).__name__))
        except Exception as exc:  # never let one request kill the worker
            self._count("failed")
            stream.push(Delta("", True, "error", f"internal error: {type(exc).__name__}: {exc}"))

    def build_prompt(self, request: CompletionRequest) -> tuple[list[int], str, bool]:
        """Token ids of the FIM prompt (each piece tokenised on its own), and the healing (healing.py)."""
        if not request.prefix and not request.suffix:
            raise PromptError("empty prompt: both prefix and suffix are empty")
        t = self.target
        prefix = t.encode(request.prefix)
        heal, constrained = "", False
        if request.heal and prefix:
            last = t.tokenizer.decode(prefix[-1:], clean_up_tokenization_spaces=False)
            kept, heal, constrained = split_heal(request.prefix, last)
            if heal:
                prefix = t.encode(kept)
        suffix = t.encode(request.suffix)
        budget = t.max_len - request.options.max_tokens - 8
        if len(prefix) + len(suffix) > budget:
            if not request.truncate:
                raise PromptError(f"prompt of {len(prefix) + len(suffix)} tokens does not fit the model's "
                                  f"context of {t.max_len} with {request.options.max_tokens} new tokens")
            keep_suffix = min(len(suffix), budget // 4)
            suffix = suffix[:keep_suffix]
            prefix = prefix[len(prefix) - (budget - keep_suffix):] if budget > keep_suffix else []
        ids: list[int] = []
        if getattr(t.tokenizer, "add_bos_token", False) and t.tokenizer.bos_token_id is not None:
            ids.append(t.tokenizer.bos_token_id)
        assert t.template is not None
        for text, special in t.template.pieces("\0P", "\0S"):
            if special:
                ids.append(t.token_id(text))
            elif text.endswith("\0P"):
                ids.extend(t.encode(text[:-2]) + prefix)
            else:
                ids.extend(t.encode(text[:-2]) + suffix)
        return ids, heal, constrained

    def _reusable(self, prompt: list[int]) -> int:
        """Length of the longest cached prefix of ``prompt`` (at least one token is always re-run)."""
        cached = self._cached_ids
        n = min(len(cached), len(prompt) - 1)
        if cached[:n] == prompt[:n]:
            return n
        i = 0
        while i < n and cached[i] == prompt[i]:
            i += 1
        return i

    def _serve(self, request: CompletionRequest, stream: CompletionStream) -> None:
        t0 = time.perf_counter()
        if stream.cancelled:
            self._finish(stream, "", "cancelled", 0, {"queue_ms": 0.0})
            return
        opt = request.options
        opt.validate()
        prompt, heal, constrained = self.build_prompt(request)
        t_prompt = time.perf_counter()
        reuse = self._reusable(prompt)
        decoder = SpeculativeDecoder(self.target.runtime, self.cache, self.target.stop_ids, opt,
                                     self.model_drafter, self.ngram_drafter, heal if constrained else "",
                                     self.target.token_index if constrained else None)
        self._cached_ids = []  # the cache is about to change; valid again after prefill
        first = decoder.prefill(prompt, reuse)
        self._count("tokens_prefilled", len(prompt) - reuse)
        self._count("tokens_reused", reuse)
        t_first = time.perf_counter()
        detok = IncrementalDetokenizer(self.target.tokenizer)
        rules = StopRules(opt.stop, opt.max_lines)
        shown = 0
        new_tokens = first
        reason = None
        while True:
            self._count("tokens_generated", len(new_tokens))
            detok.add(new_tokens)
            text, hit = rules.cut(unheal(detok.text, heal, constrained))
            if hit:
                reason = "stop"
            safe = len(text) if (hit or decoder.done) else rules.safe_length(text)
            if safe > shown:
                stream.push(Delta(text[shown:safe]))
                shown = safe
            if reason or decoder.done:
                break
            if stream.cancelled:
                reason = "cancelled"
                break
            new_tokens = decoder.step()
            self._count("decode_steps")
        if decoder.done and not reason:
            detok.flush()
            text, _ = rules.cut(unheal(detok.text, heal, constrained))
            if len(text) > shown:
                stream.push(Delta(text[shown:]))
                shown = len(text)
            reason = "eos" if decoder.finish_reason == "stop" else decoder.finish_reason
        # Keys/values of prompt + accepted output stay valid for the next request.
        self._cached_ids = decoder.ids[: self.cache.length]
        if self.ngram_drafter is not None:
            self.ngram_drafter.remember(decoder.output)
        t_end = time.perf_counter()
        s = decoder.stats
        stats = {"prompt_tokens": len(prompt), "reused_tokens": reuse, "prompt_ms": (t_prompt - t0) * 1e3,
                 "first_token_ms": (t_first - t0) * 1e3, "total_ms": (t_end - t0) * 1e3,
                 "new_tokens": len(decoder.output), "steps": s.steps, "drafted": s.drafted,
                 "accepted": s.accepted, "mean_accepted": s.mean_accepted}
        self._finish(stream, text[:shown], reason or "stop", len(decoder.output), stats)

    def _finish(self, stream: CompletionStream, text: str, reason: str, tokens: int, stats: dict) -> None:
        self._count("cancelled" if reason == "cancelled" else "completed")
        stream.result = CompletionResult(text, reason, tokens, stats)
        stream.push(Delta("", True, reason))


def open_engine(model: str | Path | None = None, draft: str | Path | None = None, *, device: str = "cpu",
                template: str | None = None, trust_remote_code: bool = False,
                use_draft: bool = True, start_thread: bool = True) -> LocalEngine:
    """Load the target (default: the embedded model) and, where it shares the tokenizer, a draft."""
    target = load_model(model or DEFAULT_TARGET, device=device, template=template,
                        trust_remote_code=trust_remote_code)
    draft_model = None
    if use_draft:
        draft_path = draft or (DEFAULT_DRAFT if model is None else None)
        if draft_path is not None:
            draft_model = load_model(draft_path, device=device, trust_remote_code=trust_remote_code)
    return LocalEngine(target, draft_model, start_thread=start_thread)
