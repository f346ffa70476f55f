"""Turn source chunks into training sequences: plain, PSM and SPM fill-in-the-middle.

The embedded models' FIM format (engine/fim.py reads the same tokens):
  PSM: <|fim_pre|> prefix <|fim_suf|> suffix <|fim_mid|> middle <|endoftext|>
  SPM: <|fim_suf|> suffix <|fim_pre|> prefix <|fim_mid|> middle <|endoftext|>
SPM puts the prefix last, right before the middle, so typing at the cursor only
appends to the prompt: the engine's KV cache keeps everything before it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_pre|>", "<|fim_suf|>", "<|fim_mid|>"
EOT, FILE_SEP = "<|endoftext|>", "<|file_sep|>"
SPECIAL_TOKENS = [EOT, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FILE_SEP]


@dataclass
class Sample:
    """Pieces to tokenise separately, then join: splitting at characters mid-token is realistic."""

    mode: str  # "plain" | "psm" | "spm"
    prefix: str
    middle: str
    suffix: str


def choose_span(text: str, rng: random.Random) -> tuple[int, int]:
    """A middle span: whole lines (like single-line infilling) or a random character span."""
    if rng.random() < 0.5:
        starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
        starts = [s for s in starts if s < len(text)]
        a = rng.randrange(len(starts))
        b = min(len(starts), a + rng.choice((1, 1, 1, 2, 3, 5)))
        start = starts[a]
        end = starts[b] if b < len(starts) else len(text)
        return start, end
    start = rng.randrange(len(text))
    length = int(rng.expovariate(1 / 120)) + 1
    return start, min(len(text), start + length)


def make_sample(chunk: str, rng: random.Random, fim_rate: float = 0.5) -> Sample:
    if rng.random() >= fim_rate or len(chunk) < 20:
        return Sample("plain", chunk, "", "")
    a, b = choose_span(chunk, rng)
    mode = "psm" if rng.random() < 0.5 else "spm"
    return Sample(mode, chunk[:a], chunk[a:b], chunk[b:])


def assemble(sample: Sample, ids: dict[str, list[int]], special: dict[str, int]) -> list[int]:
    """Join separately tokenised pieces (ids for 'prefix', 'middle', 'suffix') in the sample's order."""
    if sample.mode == "plain":
        return ids["prefix"] + [special[EOT]]
    pre = [special[FIM_PREFIX]] + ids["prefix"]
    suf = [special[FIM_SUFFIX]] + ids["suffix"]
    head = pre + suf if sample.mode == "psm" else suf + pre
    return head + [special[FIM_MIDDLE]] + ids["middle"] + [special[EOT]]
