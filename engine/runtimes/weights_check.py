"""Refuse corrupt weights at load time, with a one-line reason, instead of serving empty completions.

Two checks, both cheap next to the load itself:
1. every weight tensor is finite and of a plausible size. Why the size bound: random bytes
   read as floats are NaN or Inf only 1 time in 256 (float32), but their exponents are
   uniform, so about 4 in 10 exceed 1e6, a magnitude no trained weight of a float
   checkpoint has (fp16 cannot even hold it);
2. one short forward pass (a few tokens) gives finite logits: corruption that the first
   check lets through (a broken norm, values that overflow only in combination) shows there.

What stays undetectable: corruption that leaves values finite and small (a flipped low
mantissa bit, a swapped row, plausible-looking noise) in a part the probe does not reach,
such as the embedding rows of tokens it does not use. Such a model loads and answers badly.
Header corruption never gets here: safetensors refuses the file (engine/runtimes/compact.py).
"""

from __future__ import annotations

import torch

from engine.errors import ModelLoadError

MAX_ABS_WEIGHT = 1e6
PROBE_TOKENS = 8


def _module(runtime: object) -> torch.nn.Module:
    """The torch module behind a runtime: CompactTransformer is one, HFModel wraps one."""
    inner = getattr(runtime, "model", runtime)
    if not isinstance(inner, torch.nn.Module):
        raise TypeError(f"cannot check weights of {type(runtime).__name__}")
    return inner


@torch.inference_mode()
def bad_weight(runtime: object) -> str | None:
    """A one-line reason if some weight is NaN, Inf or implausibly large; None if all look sane."""
    for name, tensor in _module(runtime).state_dict().items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        peak = tensor.detach().abs().amax().float().item()  # NaN anywhere makes this NaN
        if peak != peak:
            return f"tensor {name} holds NaN"
        if peak == float("inf"):
            return f"tensor {name} holds Inf"
        if peak > MAX_ABS_WEIGHT:
            return f"tensor {name} holds a value of {peak:.3g} (implausible for a weight)"
    return None


def _vocab_size(runtime: object) -> int:
    cfg = getattr(runtime, "cfg", None)  # CompactTransformer
    if cfg is not None:
        return int(cfg.vocab_size)
    return int(_module(runtime).config.vocab_size)  # a transformers model


@torch.inference_mode()
def bad_probe(runtime: object) -> str | None:
    """A one-line reason if a short forward pass gives NaN or Inf logits; None if they are finite."""
    vocab_size = _vocab_size(runtime)
    n = max(1, min(PROBE_TOKENS, vocab_size))
    device = getattr(runtime, "device", torch.device("cpu"))
    tokens = (torch.arange(n, device=device) * 7919 + 1) % vocab_size  # spread over the vocabulary
    cache = runtime.new_cache(n)  # type: ignore[attr-defined]
    logits = runtime(tokens, cache, 0, n)  # type: ignore[operator]
    if not torch.isfinite(logits).all():
        return "a probe forward pass gives NaN or Inf logits"
    return None


def check_weights(runtime: object, folder: object) -> None:
    """Raise ModelLoadError("weights in FOLDER are corrupt: REASON") if either check fails."""
    reason = bad_weight(runtime) or bad_probe(runtime)
    if reason:
        raise ModelLoadError(f"weights in {folder} are corrupt: {reason}")


__all__ = ["check_weights", "bad_weight", "bad_probe", "MAX_ABS_WEIGHT"]
