"""Qwen2.5-Coder-shaped models with random weights, built from their configs on the GPU (no download).

Random weights make acceptance rates meaningless but cost exactly what the real model costs per pass: the GPU
benchmarks (bench/gpu.py, bench/gpu_invariant.py, bench/gpu_profile.py, bench/serve_load.py ``--shape``) time
passes on them, and the GPU tests (tests/gpu) compare graph and eager passes on them.
"""

from __future__ import annotations

import torch

from engine.runtimes.compact import CompactConfig, CompactTransformer

QWEN = dict(model_type="qwen2", hidden_act="silu", rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768)
SHAPES = {
    "0.5B": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "1.5B": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "7B": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}


def random_model(name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> CompactTransformer:
    """The ``SHAPES[name]`` model: norms 1, every other weight N(0, 0.02) from a fixed seed."""
    cfg = CompactConfig.from_hf_dict({**QWEN, **SHAPES[name]})
    with torch.device("meta"):
        model = CompactTransformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    return model.eval()


def weight_bytes(model: CompactTransformer) -> int:
    """Bytes one decode step reads: every weight but the embedding table (one row of it is read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - model.embed.weight.numel() * model.embed.weight.element_size()
