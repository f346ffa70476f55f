"""The shape of a Llama / Qwen2 / Mistral model, read from a Hugging Face config or a GGUF header.

Its own module, without torch: the ggml runtime and the GGUF loader describe a model with it, and the
ggml path never imports torch (engine/runtimes/compact.py, the torch runtime, re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ModelLoadError

# model_type values whose HF config and weight names this module understands.
SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "mistral"}


@dataclass(frozen=True)
class CompactConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> CompactConfig:
        """Read a Hugging Face ``config.json`` dict; raise if it needs features we lack."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(f"compact runtime does not support model_type {model_type!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"compact runtime needs hidden_act 'silu', got {cfg.get('hidden_act')!r}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rope_type not in ("default", None):
            raise ModelLoadError(f"compact runtime does not support rope type {rope_type!r}")
        theta = rope.get("rope_theta") if rope else None
        theta = theta or cfg.get("rope_theta") or 10000.0
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama may via attention_bias.
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        )
