"""Low-rank adapters on a Llama base, and merging them (plus trained FIM embedding rows) into it.

What ships is small: for each adapted linear layer W (out x in), A (r x in) and B (out x r)
in bf16, and the FIM sentinels' embedding rows in fp32. The install step merges
``W + (alpha / r) * B @ A`` into the dequantised base (training/assemble.py); fimble's
runtime then loads a plain Llama folder, with no adapter code on the decoding path.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_FILE, ADAPTER_META = "adapter.safetensors", "adapter.json"
FULL_PREFIX = "full."  # whole tensors that replace the base's (RMSNorm weights)


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / r) * x A^T B^T, with B starting at zero (the base's output at step 0)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=torch.float32, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=torch.float32, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = self.base(x)
        low = x @ self.lora_a.to(dtype).t()
        # One GEMM with the add and the scale in its epilogue: the separate "low * scale" and
        # "y + ..." passes each moved a full (tokens x out) tensor, for 210 layers, in training.
        out = torch.addmm(
            y.reshape(-1, y.shape[-1]), low.reshape(-1, low.shape[-1]), self.lora_b.to(y.dtype).t(), alpha=self.scale
        )
        return out.view(y.shape)


def attach(model: nn.Module, rank: int, alpha: float) -> dict[str, LoRALinear]:
    """Wrap every target linear in place; the base weights are frozen. Returns name -> module."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in TARGETS and isinstance(child, nn.Linear):
                lora = LoRALinear(child, rank, alpha)
                setattr(module, child_name, lora)
                wrapped[f"{name}.{child_name}" if name else child_name] = lora
    return wrapped


def export(
    wrapped: dict[str, LoRALinear],
    embed_rows: dict[int, torch.Tensor],
    rank: int,
    alpha: float,
    folder: Path,
    meta: dict,
    full: dict[str, torch.Tensor] | None = None,
) -> None:
    """Save adapter.safetensors (A, B in bf16; FIM rows in fp32) and adapter.json.

    ``full``: small base tensors trained whole (the RMSNorm weights), stored in fp32 as
    ``full.<state-dict key>`` and written over the base's at merge time.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for key, value in (full or {}).items():
        tensors[f"{FULL_PREFIX}{key}"] = value.detach().float().cpu().contiguous()
    for name, m in wrapped.items():
        tensors[f"{name}.lora_a"] = m.lora_a.detach().to(torch.bfloat16).cpu().contiguous()
        tensors[f"{name}.lora_b"] = m.lora_b.detach().to(torch.bfloat16).cpu().contiguous()
    ids = sorted(embed_rows)
    if ids:
        tensors["embed_rows"] = torch.stack([embed_rows[i].detach().float().cpu() for i in ids]).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (ADAPTER_FILE + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(folder / ADAPTER_FILE)
    (folder / ADAPTER_META).write_text(
        json.dumps({**meta, "rank": rank, "alpha": alpha, "targets": TARGETS, "embed_row_ids": ids}, indent=1)
    )


def merge_state_dict(state: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """The base's state dict with the adapter in ``folder`` merged in (fp32 arithmetic)."""
    from safetensors.torch import load_file

    meta = json.loads((folder / ADAPTER_META).read_text())
    tensors = load_file(str(folder / ADAPTER_FILE))
    scale = meta["alpha"] / meta["rank"]
    out = dict(state)
    merged = 0
    for key in [k for k in tensors if k.endswith(".lora_a")]:
        name = key[: -len(".lora_a")]
        weight_key = f"{name}.weight"
        if weight_key not in out:
            raise ValueError(f"adapter layer {name} is not in the base")
        a, b = tensors[key].float(), tensors[f"{name}.lora_b"].float()
        w = out[weight_key]
        out[weight_key] = (w.float() + scale * (b @ a)).to(w.dtype)
        merged += 1
    for key in [k for k in tensors if k.startswith(FULL_PREFIX)]:
        name = key[len(FULL_PREFIX) :]
        if name not in out or out[name].shape != tensors[key].shape:
            raise ValueError(f"adapter tensor {name} does not match the base")
        out[name] = tensors[key].to(out[name].dtype)
    if "embed_rows" in tensors:
        emb = out["model.embed_tokens.weight"].clone()
        ids = torch.tensor(meta["embed_row_ids"])
        emb[ids] = tensors["embed_rows"].to(emb.dtype)
        out["model.embed_tokens.weight"] = emb
        if "lm_head.weight" in out:  # an untied head shares the rows too
            head = out["lm_head.weight"].clone()
            head[ids] = tensors["embed_rows"].to(head.dtype)
            out["lm_head.weight"] = head
    if merged != len(meta["targets"]) * _count_layers(state):
        raise ValueError(f"adapter merged {merged} layers, expected {len(meta['targets'])} per base layer")
    return out


def _count_layers(state: dict[str, torch.Tensor]) -> int:
    return len({k.split(".")[2] for k in state if k.startswith("model.layers.")})


def load_into(wrapped: dict[str, LoRALinear], folder: Path, model: nn.Module | None = None) -> dict:
    """Start from a trained adapter: its A and B fill the first ranks of each wrapped layer (a
    larger new rank keeps the extra B columns at zero, so the model computes what the old adapter
    did), with the scale kept; its FIM rows and whole tensors go into ``model``. Returns its meta."""
    from safetensors.torch import load_file

    meta = json.loads((folder / ADAPTER_META).read_text())
    tensors = load_file(str(folder / ADAPTER_FILE))
    old_scale = meta["alpha"] / meta["rank"]
    with torch.no_grad():
        for name, m in wrapped.items():
            a, b = tensors[f"{name}.lora_a"].float(), tensors[f"{name}.lora_b"].float()
            r = a.shape[0]
            if r > m.lora_a.shape[0]:
                raise ValueError(f"adapter rank {r} is above the new rank {m.lora_a.shape[0]}")
            m.lora_a[:r] = a.to(m.lora_a.device)
            m.lora_b.zero_()
            m.lora_b[:, :r] = b.to(m.lora_b.device) * (old_scale / m.scale)
        if model is not None:
            state = dict(model.named_parameters())
            if "embed_rows" in tensors:
                emb = model.get_input_embeddings().weight
                ids = torch.tensor(meta["embed_row_ids"], device=emb.device)
                emb[ids] = tensors["embed_rows"].to(emb.device, emb.dtype)
            for key in [k for k in tensors if k.startswith(FULL_PREFIX)]:
                state[key[len(FULL_PREFIX) :]].copy_(tensors[key])
    return meta
