"""Fill-in-the-middle prompt templates, picked from a tokenizer's special tokens.

Each template knows its sentinel strings and its order. PSM puts the prefix
first; SPM puts the suffix first so the prefix, which grows as the user types,
sits at the end of the prompt and the KV cache keeps everything before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import FimbleError


@dataclass(frozen=True)
class FimTemplate:
    name: str
    prefix_token: str
    suffix_token: str
    middle_token: str
    order: str = "psm"  # "psm", "spm", or "prefix" (no FIM: PREFIX_ONLY)
    # Extra tokens that end a completion besides the tokenizer's EOS.
    stop_tokens: tuple[str, ...] = ()
    # CodeLlama's sentinels are followed by a space in its reference format.
    spaced: bool = False

    @property
    def prefix_only(self) -> bool:
        """No sentinels: the prompt is the text before the cursor, the suffix goes unused."""
        return self.order == "prefix"

    @property
    def sentinels(self) -> tuple[str, str, str]:
        return self.prefix_token, self.suffix_token, self.middle_token

    def build(self, prefix: str, suffix: str) -> str:
        if self.prefix_only:
            return prefix
        sp = " " if self.spaced else ""
        if self.order == "spm":
            return f"{self.suffix_token}{sp}{suffix}{self.prefix_token}{sp}{prefix}{self.middle_token}"
        return f"{self.prefix_token}{sp}{prefix}{self.suffix_token}{sp}{suffix}{self.middle_token}"

    def pieces(self, prefix: str, suffix: str) -> list[tuple[str, bool]]:
        """The prompt as (text, is_special) pieces, in order: tokenise each piece on its own."""
        if self.prefix_only:
            return [(prefix, False)]
        sp = " " if self.spaced else ""
        pre = [(self.prefix_token, True), (sp + prefix, False)]
        suf = [(self.suffix_token, True), (sp + suffix, False)]
        body = suf + pre if self.order == "spm" else pre + suf
        return [p for p in body if p[0]] + [(self.middle_token, True)]


TEMPLATES: dict[str, FimTemplate] = {
    # fimble's embedded models were trained on both orders; SPM is the cache-friendly one.
    "fimble": FimTemplate("fimble", "<|fim_pre|>", "<|fim_suf|>", "<|fim_mid|>", "spm", stop_tokens=("<|file_sep|>",)),
    "fimble-psm": FimTemplate(
        "fimble-psm", "<|fim_pre|>", "<|fim_suf|>", "<|fim_mid|>", "psm", stop_tokens=("<|file_sep|>",)
    ),
    "qwen2.5-coder": FimTemplate(
        "qwen2.5-coder",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        stop_tokens=("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>"),
    ),
    "starcoder2": FimTemplate(
        "starcoder2",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        stop_tokens=("<file_sep>", "<|endoftext|>", "<fim_pad>"),
    ),
    "deepseek-coder": FimTemplate(
        "deepseek-coder",
        "<｜fim▁begin｜>",
        "<｜fim▁hole｜>",
        "<｜fim▁end｜>",
        stop_tokens=("<｜end▁of▁sentence｜>", "<|EOT|>"),
    ),
    "codellama": FimTemplate("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", stop_tokens=("▁<EOT>",), spaced=True),
    # Codestral's reference order is suffix first: [SUFFIX] suffix [PREFIX] prefix.
    "codestral": FimTemplate("codestral", "[PREFIX]", "[SUFFIX]", "[MIDDLE]", "spm", stop_tokens=("</s>",)),
}


# A model without FIM sentinels completes from the text before the cursor alone.
PREFIX_ONLY = FimTemplate("prefix-only", "", "", "", "prefix")


def detect_template(vocab_tokens: set[str]) -> FimTemplate | None:
    """The first template whose three sentinels all exist in the tokenizer's vocabulary."""
    order = ["fimble", "qwen2.5-coder", "starcoder2", "deepseek-coder", "codestral", "codellama"]
    for name in order:
        t = TEMPLATES[name]
        if {t.prefix_token, t.suffix_token, t.middle_token} <= vocab_tokens:
            return t
    # CodeLlama's tokenizer lists its sentinels without the leading '▁'.
    if {"<PRE>", "<SUF>", "<MID>"} <= vocab_tokens:
        return FimTemplate("codellama", "<PRE>", "<SUF>", "<MID>", stop_tokens=("<EOT>",), spaced=True)
    return None


def template_by_name(name: str) -> FimTemplate:
    if name == PREFIX_ONLY.name:
        return PREFIX_ONLY
    try:
        return TEMPLATES[name]
    except KeyError:
        known = ", ".join([*sorted(TEMPLATES), PREFIX_ONLY.name])
        raise FimbleError(f"unknown FIM template {name!r}; known: {known}") from None


def missing_sentinels(template: FimTemplate, vocab_tokens: set[str]) -> list[str]:
    """The template's sentinel tokens that the tokenizer does not have (none for prefix-only)."""
    if template.prefix_only:
        return []
    return [t for t in template.sentinels if t not in vocab_tokens]


def fitting_templates(vocab_tokens: set[str]) -> list[str]:
    """Names of the templates whose sentinels the tokenizer has, prefix-only last."""
    fits = [name for name, t in TEMPLATES.items() if not missing_sentinels(t, vocab_tokens)]
    return [*fits, PREFIX_ONLY.name]
