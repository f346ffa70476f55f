"""int8 weights for the compact runtime on CPU (q8_0-class), batch-invariant so speculation stays lossless.

Each linear layer's weight is stored as int8 with one scale per output channel and multiplied by
fbgemm's int8 kernels (``torch.ops.quantized.linear_dynamic``): activations are quantised to 8 bits
on the fly and products accumulate in int32. This CPU (AVX2, no AVX-512/VNNI) has no fast int8
weight-only kernel in torch: ``aten._weight_int8pack_mm`` and ``torch._int_mm`` measured 6-10x
slower than the fp32 matmul, fbgemm 1.5-9x faster (numbers in docs/architecture.md).

fbgemm quantises the whole activation matrix with one scale, so a row's result would depend on
the other rows of the pass: a 1-token step and an 8-token verify would round differently, far
beyond fp32 noise, and speculative output would drift from plain output. So each row is divided by
its own absolute maximum and padded with a +1 and a -1 column (whose weights are zero): every row
then spans exactly [-1, 1], the chosen quantisation parameters are the same for any batch, and
each row is quantised on its own (per-row scales, like llama.cpp's per-block q8_0 activations).
Integer accumulation is exact, so results do not depend on the pass's shape at all.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

QUANT_MODES = ("none", "int8")
# Longest block that attends row by row in int8 mode: a verify block (gamma <= 12, plus one), or
# a keystroke's few new tokens. Longer prefills attend in one pass.
ROW_ATTENTION_MAX = 16


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x int8 per row (both dynamic-range, symmetric W)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        w = weight.detach().float().cpu()
        n, k = w.shape
        w = torch.cat([w, torch.zeros(n, 2)], dim=1)  # the two pin columns contribute nothing
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        with warnings.catch_warnings():  # quantized tensor creation is deprecated but still the fbgemm entry
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.bias = None if bias is None else bias.detach().float().cpu()
        self.in_features, self.out_features = k, n
        self.register_buffer("pins", torch.tensor([[1.0, -1.0]]), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        a = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
        xn = torch.cat([x / a, self.pins.expand(x.shape[0], 2)], dim=-1)
        # reduce_range: 7-bit activations, so AVX2's 16-bit pair sums in vpmaddubsw never saturate.
        y = torch.ops.quantized.linear_dynamic(xn, self.packed, True) * a
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        return self.out_features * (self.in_features + 2) + 4 * self.out_features


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace the compact transformer's projection and LM-head linears by ``Int8Linear`` (in place).

    The embedding table stays float: a lookup reads one row a token, not the whole matrix.
    """
    if not int8_available():
        raise RuntimeError("this torch build has no fbgemm int8 kernels")
    for layer in model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            lin = getattr(layer, name)
            setattr(layer, name, Int8Linear(lin.weight, lin.bias))
    model.lm_head = Int8Linear(model.lm_head.weight, None)
    for layer in model.layers:  # verify blocks (<= max_gamma + 1 tokens) attend row by row
        layer.row_attention_max = ROW_ATTENTION_MAX
    model.quant = "int8"
    return model
