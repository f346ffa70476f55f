"""fimble's own compact transformer for the Llama / Qwen2 / Mistral family.

In the spirit of gpt-fast: plain tensors, no per-call framework overhead, and a
KV cache preallocated once and addressed by absolute position. Writing position
``p`` overwrites slot ``p``; rolling back is only a change of ``KVCache.length``
(a pointer move, never a copy). Shapes inside one step depend only on the number
of new tokens, so a later CUDA-graph decode path can capture the one-token step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import ModelLoadError
from engine.runtimes.model_config import SUPPORTED_MODEL_TYPES, CompactConfig


def row_attention(q: Tensor, keys: Tensor, values: Tensor, start: int, gqa: bool) -> Tensor:
    """Attention of each query row alone, exactly as a 1-token step at its position (``start + i``) computes it."""
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, i : i + 1].unsqueeze(0),
                keys[:, : start + i + 1].unsqueeze(0),
                values[:, : start + i + 1].unsqueeze(0),
                enable_gqa=gqa,
            )[0]
            for i in range(q.shape[1])
        ],
        dim=1,
    )


class KVCache:
    """Preallocated keys/values for one sequence, addressed by absolute position.

    ``length`` is the number of valid positions. Rollback lowers it; the stale
    slots are simply overwritten by the next forward pass.
    """

    def __init__(self, cfg: CompactConfig, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (cfg.num_layers, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}, cache holds {self.length}")
        self.length = length

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply rotary embedding in HF's half-split layout. x: [heads, T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, cfg: CompactConfig):
        super().__init__()
        self.cfg = cfg
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections fused into one matmul: fewer kernel launches per step.
        self.qkv = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.splits = (q_dim, kv_dim, kv_dim)
        self.row_attention_max = 0  # > 0: blocks up to this many tokens attend row by row (batch-invariant)

    def forward(
        self,
        x: Tensor,
        layer: int,
        cache: KVCache,
        start: int,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        slots: Tensor | slice,
    ) -> Tensor:
        cfg = self.cfg
        t = x.shape[0]
        q, k, v = self.qkv(self.attn_norm(x)).split(self.splits, dim=-1)
        q = rotate(q.view(t, cfg.num_heads, cfg.head_dim).transpose(0, 1), cos, sin)
        k = rotate(k.view(t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1), cos, sin)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        end = start + t
        cache.keys[layer, :, slots] = k
        cache.values[layer, :, slots] = v
        keys, values = cache.keys[layer, :, :end], cache.values[layer, :, :end]
        gqa = cfg.num_kv_heads != cfg.num_heads
        if 1 < t <= self.row_attention_max and start > 0 and isinstance(slots, slice):
            # Batch-invariant mode (int8, engine/runtimes/quant.py): each query row attends exactly as a
            # 1-token step at its position would, so a verify block's rows are bit-identical to
            # plain decoding's; int8 activation rounding would otherwise amplify fp32 noise.
            attn = row_attention(q, keys, values, start, gqa)
        else:
            attn = F.scaled_dot_product_attention(
                q.unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=mask,
                # A fresh prefill is plainly causal: the fused kernel needs no mask tensor.
                is_causal=mask is None and t > 1,
                enable_gqa=gqa,
            )[0]
        x = x + self.o_proj(attn.transpose(0, 1).reshape(t, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class CompactTransformer(nn.Module):
    """Decoder-only transformer over one sequence at a time (batch 1)."""

    # capabilities (engine/runtimes/protocol.py)
    numpy_rows = False
    greedy_drafts = False
    cost_aware_drafting = False
    shift_reuse = True

    def __init__(self, cfg: CompactConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope_len = 0
        # Batch-invariant kernels (engine/runtimes/gpu_kernels.py): every pass runs through
        # graph_forward.invariant_forward, so a row's logits are the same bits in a 1-token step, a verify block or a
        # graph replay. A kernel set's name ("invariant-cublas": cuBLAS projections on fixed 16-row passes;
        # "invariant": Triton projections) or True (the default set) turns them on, False off; None (default)
        # decides at the first CUDA pass (gpu_kernels.invariant_default: on where Triton runs, unless
        # FIMBLE_CUDA_INVARIANT=0). A CPU pass uses them only when set (tests).
        self.invariant: str | bool | None = None

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, max_len: int | None = None) -> KVCache:
        max_len = max_len or self.cfg.max_position_embeddings
        self._ensure_rope(max_len)
        return KVCache(self.cfg, max_len, self.dtype, self.device)

    def _ensure_rope(self, length: int) -> None:
        # One cos/sin table for every position, built once: no trig in the step.
        if length <= self._rope_len:
            return
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos, self.rope_sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        self._rope_len = length

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: KVCache, start: int | None = None, num_logits: int = 1) -> Tensor:
        """Run ``tokens`` (1-D) at positions ``start..``; return logits of the last ``num_logits``.

        ``start`` defaults to ``cache.length``: appending. The cache's length becomes
        ``start + len(tokens)``. Returns float32 logits, shape [num_logits, vocab].
        """
        start = cache.length if start is None else start
        t = tokens.shape[0]
        end = start + t
        if start > cache.length:
            raise ValueError(f"position {start} leaves a gap after cache length {cache.length}")
        if end > cache.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache's {cache.max_len}")
        if self._use_invariant(tokens):
            from engine.runtimes.graph_forward import invariant_forward

            return invariant_forward(self, tokens, cache, start, num_logits)
        cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]
        mask = None
        if t > 1 and start > 0:
            # Query i (at position start+i) sees keys 0..start+i.
            mask = torch.ones(t, end, dtype=torch.bool, device=self.device).tril(diagonal=start)
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, i, cache, start, cos, sin, mask, slice(start, end))
        cache.length = end
        num_logits = min(num_logits, t)
        return self.lm_head(self.norm(x[t - num_logits :])).float()

    def _use_invariant(self, tokens: Tensor) -> bool:
        if self.invariant is None:
            if not tokens.is_cuda:
                return False
            from engine.runtimes.gpu_kernels import invariant_default

            self.invariant = invariant_default()
        return bool(self.invariant)

    @torch.inference_mode()
    def forward_at(self, tokens: Tensor, positions: list[int], cache: KVCache) -> Tensor:
        """Run ``tokens`` at ascending, possibly scattered ``positions``; return the last token's logits.

        Positions in between must already hold keys/values (shift reuse placed them): one
        pass computes several edited stretches at once. The cache's length becomes the last
        position + 1.
        """
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        end = positions[-1] + 1
        if end > cache.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache's {cache.max_len}")
        # Query i (at positions[i]) sees keys 0..positions[i]; a bare slice when contiguous.
        mask = pos[:, None] >= torch.arange(end, device=self.device)[None, :]
        start = end - tokens.shape[0]  # sizes the attended key range (start + t == end)
        slots = slice(start, end) if positions[0] == start else pos  # where the new keys/values go
        x = self.embed(tokens)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        for i, layer in enumerate(self.layers):
            x = layer(x, i, cache, start, cos, sin, mask, slots)
        cache.length = end
        return self.lm_head(self.norm(x[-1:])).float()


# HF parameter names -> ours. q/k/v and gate/up are fused after loading.
def _convert_hf_state(hf: dict[str, Tensor], cfg: CompactConfig) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    out["lm_head.weight"] = (
        hf["model.embed_tokens.weight"]
        if cfg.tie_word_embeddings
        else hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    )
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.qkv.weight"] = torch.cat(
            [hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]]
        )
        if cfg.attention_bias:
            out[f"layers.{i}.qkv.bias"] = torch.cat(
                [hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"]]
            )
        out[f"layers.{i}.o_proj.weight"] = hf[a + "o_proj.weight"]
        m = p + "mlp."
        out[f"layers.{i}.gate_up.weight"] = torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
        out[f"layers.{i}.down.weight"] = hf[m + "down_proj.weight"]
        out[f"layers.{i}.attn_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.mlp_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
    return out


def _read_safetensors(folder: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {folder}")
    state: dict[str, Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # corrupt or truncated file
            raise ModelLoadError(f"cannot read weights {f.name}: {exc}") from None
    return state


def load_compact(
    folder: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CompactTransformer:
    cfg_dict = json.loads((folder / "config.json").read_text())
    cfg = CompactConfig.from_hf_dict(cfg_dict)
    return compact_from_hf_state(cfg, _read_safetensors(folder), folder, dtype, device)


def compact_from_hf_state(
    cfg: CompactConfig,
    state: dict[str, Tensor],
    source: object,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> CompactTransformer:
    """Build the runtime from HF-named tensors (a safetensors folder, or a GGUF mapped to HF names)."""
    folder = source
    try:
        converted = _convert_hf_state(state, cfg)
    except KeyError as exc:
        raise ModelLoadError(f"weights in {folder} lack tensor {exc.args[0]}") from None
    with torch.device("meta"):
        model = CompactTransformer(cfg)
    model = model.to_empty(device=device)
    try:
        model.load_state_dict({k: v.to(dtype) for k, v in converted.items()}, strict=False)
    except RuntimeError as exc:
        raise ModelLoadError(f"weights in {folder} do not match config.json: {str(exc).splitlines()[0]}") from None
    model = model.to(dtype)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    model.inv_freq = inv_freq
    model.eval()
    return model


def param_count(cfg: CompactConfig) -> int:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer = qkv + cfg.num_heads * cfg.head_dim * d + 3 * d * f + 2 * d
    head = 0 if cfg.tie_word_embeddings else v * d
    return v * d + cfg.num_layers * per_layer + d + head


__all__ = [
    "CompactConfig",
    "CompactTransformer",
    "KVCache",
    "compact_from_hf_state",
    "load_compact",
    "param_count",
    "SUPPORTED_MODEL_TYPES",
]
