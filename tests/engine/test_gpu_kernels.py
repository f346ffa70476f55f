"""The fused CUDA-path kernels (engine/runtimes/gpu_kernels.py) against the torch ops they replace.

On a CUDA machine with Triton they run natively, in bf16 (the GPU tests: ``pytest tests/engine/test_gpu_kernels.py``
there). On a CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1`` and Triton installed), in
fp32; CI has no Triton, so there they are skipped.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not HAVE_TRITON or not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton, and CUDA or TRITON_INTERPRET=1",
)
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _assert_rounding_close(got: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> None:
    """``got`` within two rounding steps of the dtype (bf16 on the GPU: 2^-8 relative each) of ``exact``, relative to
    ``scale``, the size of the terms summed: a sum of rounded products errs by that much, however it rounds."""
    unit = 2**-8 if got.dtype == torch.bfloat16 else 2**-24
    diff = (got.double() - exact.double()).abs()
    bound = 2 * unit * scale.double() + 1e-30
    assert bool((diff <= bound).all()), f"{int((diff > bound).sum())} of {diff.numel()} beyond the bound"


def _rope_tables(length: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(torch.arange(length).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DTYPE).to(DEV), emb.sin().to(DTYPE).to(DEV)


def _reference_rope(qkv, cos, sin, positions, heads, kv_heads, hd):
    """cuda_graphs.forward_batch's rotation, op for op; and the same in float64 with the size of its terms."""
    half = hd // 2
    c, s = cos[positions], sin[positions]
    s = torch.cat((-s[:, :half], s[:, half:]), dim=-1)
    qk = qkv.view(qkv.shape[0], -1, hd)[:, : heads + kv_heads]
    swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    rot = qk * c[:, None] + swapped * s[:, None]
    a, b = qk.double() * c[:, None].double(), swapped.double() * s[:, None].double()
    v = qkv.view(qkv.shape[0], -1, hd)[:, heads + kv_heads :]
    return rot, a + b, a.abs() + b.abs(), v


@pytest.mark.parametrize("seqs,t,heads,kv_heads,hd", [(1, 1, 14, 2, 64), (3, 4, 8, 2, 64), (2, 2, 12, 2, 128)])
def test_rope_store_equals_torch_ops(seqs, t, heads, kv_heads, hd):
    from engine.runtimes.gpu_kernels import rope_store

    torch.manual_seed(0)
    max_len = 300
    cos, sin = _rope_tables(max_len, hd)
    qkv = torch.randn(seqs * t, (heads + 2 * kv_heads) * hd).to(DTYPE).to(DEV)
    starts = torch.tensor([5, 100, 250][:seqs])
    positions = (starts[:, None] + torch.arange(t)[None, :]).reshape(-1).to(DEV)
    keys = torch.zeros(seqs, kv_heads, max_len, hd, dtype=DTYPE, device=DEV)
    values = torch.zeros_like(keys)
    q = rope_store(qkv, keys, values, cos, sin, positions, seqs, heads, kv_heads)
    torch_rot, exact, scale, rv = _reference_rope(qkv, cos, sin, positions, heads, kv_heads, hd)
    rows = torch.arange(seqs).repeat_interleave(t).to(DEV)
    got = torch.cat((q.view(-1, heads, hd), keys[rows, :, positions]), dim=1)
    # The kernel rounds once in fp32, torch's ops three times: both are the exact rotation up to rounding (on the
    # H200 they differ in ~1 element in 9, by about one bf16 step; under the CPU interpreter, in fp32, not at all).
    _assert_rounding_close(got, exact, scale)
    _assert_rounding_close(torch_rot, exact, scale)
    assert torch.equal(values[rows, :, positions], rv)  # values are copied, not computed
    written = torch.zeros(seqs, max_len, dtype=torch.bool)
    written[rows.cpu(), positions.cpu()] = True
    assert not keys.abs().sum((1, 3)).cpu()[~written].any()  # nothing else in the cache was touched


def _reference_attention(q, keys, values, positions, keys_len, seqs, kv_heads):
    rows, width = q.shape
    hd = keys.shape[-1]
    heads = width // hd
    group, t = heads // kv_heads, rows // seqs
    out = torch.empty(rows, heads, hd, dtype=torch.float64)
    for r in range(rows):
        s, pos = r // t, int(positions[r])
        for h in range(heads):
            k = keys[s, h // group, : min(pos + 1, keys_len)].double()
            v = values[s, h // group, : min(pos + 1, keys_len)].double()
            w = torch.softmax(k @ q[r, h * hd : (h + 1) * hd].double() / math.sqrt(hd), dim=0)
            out[r, h] = w @ v
    return out.view(rows, width)


@pytest.mark.parametrize(
    "seqs,t,heads,kv_heads,hd,keys_len,starts",
    [
        (1, 1, 8, 2, 64, 256, [40]),  # one split, written directly
        (1, 4, 14, 2, 64, 1024, [700]),  # four splits, the last ones past the rows: skipped
        (3, 2, 12, 2, 128, 512, [3, 300, 509]),  # batch of three at different depths
    ],
)
def test_attention_matches_masked_softmax(seqs, t, heads, kv_heads, hd, keys_len, starts):
    from engine.runtimes.gpu_kernels import attention

    torch.manual_seed(1)
    max_len = keys_len + 64
    q = torch.randn(seqs * t, heads * hd).to(DTYPE).to(DEV)
    keys = torch.randn(seqs, kv_heads, max_len, hd).to(DTYPE).to(DEV)
    values = torch.randn(seqs, kv_heads, max_len, hd).to(DTYPE).to(DEV)
    positions = (torch.tensor(starts)[:, None] + torch.arange(t)[None, :]).reshape(-1).to(DEV)
    got = attention(q, keys, values, positions, keys_len, seqs, kv_heads)
    want = _reference_attention(q.cpu(), keys.cpu(), values.cpu(), positions.cpu(), keys_len, seqs, kv_heads)
    tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
    assert torch.allclose(got.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("keys_len,starts", [(1024, [700, 1000]), (512, [3, 300])])
def test_ordered_combine_in_the_split_kernel_equals_the_combine_kernel(monkeypatch, keys_len, starts):
    """Ordered attention combined by each block's last split (one launch) gives the separate ordered combine
    kernel's bits, including splits past a row's position, and leaves every arrival counter at 0."""
    from engine.runtimes import gpu_kernels, gpu_linear
    from engine.runtimes.gpu_kernels import attention

    q, keys, values, positions = _two_sequences(9, keys_len, starts)
    fused = attention(q, keys, values, positions, keys_len, 2, 2, ordered=True)
    assert int(gpu_linear._LOCKS[fused.device].count_nonzero()) == 0
    monkeypatch.setattr(gpu_kernels, "COMBINE_IN_SPLIT", False)
    apart = attention(q, keys, values, positions, keys_len, 2, 2, ordered=True)
    _assert_same_bits(fused, apart)
    want = _reference_attention(q.cpu(), keys.cpu(), values.cpu(), positions.cpu(), keys_len, 2, 2)
    assert torch.allclose(fused.cpu().double(), want, atol=2e-2, rtol=2e-2)


def test_ordered_attention_combined_in_the_split_kernel_launches_no_other_combine(monkeypatch):
    """With the splits combined in the split kernel, no combine kernel runs after it. (From 2026-12-05 to 12-07 the
    unordered combine ran too and overwrote the result: 28 wasted launches a pass, 0.2-0.55 ms of a 32-sequence
    round of the 1.5B shape on an H100, bench/reports/gpu-round-context-h100-2026-12-07/.)"""
    from engine.runtimes import gpu_kernels
    from engine.runtimes.gpu_kernels import attention

    rope, split, combine, ordered = gpu_kernels._kernels()
    launched = []

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return combine[grid]

    monkeypatch.setattr(gpu_kernels, "_kernels", lambda: (rope, split, Spy(), Spy()))
    q, keys, values, positions = _two_sequences(9, 1024, [700, 1000])
    attention(q, keys, values, positions, 1024, 2, 2, ordered=True)
    assert launched == []
    attention(q, keys, values, positions, 1024, 2, 2, ordered=False)
    assert len(launched) == 1  # (the unordered mode still combines apart)


def _two_sequences(seed: int, keys_len: int, starts: list[int]) -> tuple:
    """Queries, caches and positions of 2 sequences x 3 rows (14 heads over 2 kv heads of 64) starting at ``starts``."""
    torch.manual_seed(seed)
    seqs, t, heads, kv_heads, hd = 2, 3, 14, 2, 64
    q = torch.randn(seqs * t, heads * hd).to(DTYPE).to(DEV)
    keys = torch.randn(seqs, kv_heads, keys_len + 64, hd).to(DTYPE).to(DEV)
    values = torch.randn(seqs, kv_heads, keys_len + 64, hd).to(DTYPE).to(DEV)
    positions = (torch.tensor(starts)[:, None] + torch.arange(t)[None, :]).reshape(-1).clamp(max=keys_len - 1)
    return q, keys, values, positions.to(DEV)


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    if CUDA:
        assert torch.equal(a, b)
    else:  # numpy's vectorised exp rounds by an element's place in its array: not a property of the kernel
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("keys_len,starts", [(1024, [700, 1000]), (512, [3, 300]), (256, [40, 255])])
def test_attention_fixed_trips_equal_the_bounded_loop(monkeypatch, keys_len, starts):
    """The split's key loop at a fixed trip count (tiles past the last visible key masked) gives the bounded while
    loop's bits, ordered and not, splits past a row's position included."""
    from engine.runtimes import gpu_kernels
    from engine.runtimes.gpu_kernels import attention

    q, keys, values, positions = _two_sequences(12, keys_len, starts)
    for ordered in (True, False):
        monkeypatch.setattr(gpu_kernels, "FIXED_TRIPS", True)
        fixed = attention(q, keys, values, positions, keys_len, 2, 2, ordered=ordered)
        monkeypatch.setattr(gpu_kernels, "FIXED_TRIPS", False)
        bounded = attention(q, keys, values, positions, keys_len, 2, 2, ordered=ordered)
        _assert_same_bits(fixed, bounded)
    want = _reference_attention(q.cpu(), keys.cpu(), values.cpu(), positions.cpu(), keys_len, 2, 2)
    assert torch.allclose(fixed.cpu().double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("split,tile", [(256, 64), (64, 64), (64, 32)])
def test_ordered_attention_row_does_not_depend_on_the_bucket_or_its_pass(monkeypatch, split, tile):
    """Ordered attention (the batch-invariant sets'), at each split geometry: a row's bits are the same over its exact
    keys and over a longer key bucket (splits past every row do no work, and add nothing), alone and in a block of
    two sequences; every arrival counter is back at 0."""
    from engine.runtimes import gpu_kernels, gpu_linear
    from engine.runtimes.gpu_kernels import attention

    monkeypatch.setattr(gpu_kernels, "SPLIT_KEYS", split)
    monkeypatch.setattr(gpu_kernels, "BLOCK_N", tile)
    q, keys, values, positions = _two_sequences(21, 1024, [40, 700])
    exact = attention(q, keys, values, positions, int(positions.max()) + 1, 2, 2, ordered=True)
    bucket = attention(q, keys, values, positions, 1024, 2, 2, ordered=True)
    _assert_same_bits(exact, bucket)
    assert int(gpu_linear._LOCKS[exact.device].count_nonzero()) == 0
    for r in (0, 2, 4):
        s = r // 3
        p = positions[r : r + 1]
        alone = attention(q[r : r + 1], keys[s : s + 1], values[s : s + 1], p, int(p) + 1, 1, 2, ordered=True)
        _assert_same_bits(alone[0], bucket[r])
    want = _reference_attention(q.cpu(), keys.cpu(), values.cpu(), positions.cpu(), 1024, 2, 2)
    assert torch.allclose(bucket.cpu().double(), want, atol=2e-2, rtol=2e-2)


def test_attention_row_does_not_depend_on_its_pass():
    """A query row's result is the same alone (a 1-token step) and in a block or batch (batch invariance)."""
    from engine.runtimes.gpu_kernels import attention

    torch.manual_seed(2)
    heads, kv_heads, hd, keys_len, t = 8, 2, 64, 512, 4
    keys = torch.randn(2, kv_heads, keys_len, hd).to(DTYPE).to(DEV)
    values = torch.randn(2, kv_heads, keys_len, hd).to(DTYPE).to(DEV)
    q = torch.randn(2 * t, heads * hd).to(DTYPE).to(DEV)
    positions = torch.tensor([300, 301, 302, 303, 10, 11, 12, 13], device=DEV)
    block = attention(q, keys, values, positions, keys_len, 2, kv_heads)
    for r in (0, 3, 5):
        s = r // t
        alone = attention(q[r : r + 1], keys[s : s + 1], values[s : s + 1], positions[r : r + 1], keys_len, 1, kv_heads)
        if CUDA:
            assert torch.equal(alone[0], block[r])
        else:  # numpy's vectorised exp rounds by an element's place in its array: not a property of the kernel
            assert torch.allclose(alone[0], block[r], atol=1e-6, rtol=0)


def test_fused_forward_equals_torch_forward():
    """cuda_graphs.forward_batch with attention="fused" against its torch attention, on a small random model."""
    from engine.runtimes.compact import CompactConfig, CompactTransformer
    from engine.runtimes.cuda_graphs import forward_batch

    cfg = CompactConfig.from_hf_dict(
        dict(model_type="qwen2", hidden_act="silu", rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=2048,
             vocab_size=500, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True)
    )  # fmt: skip
    torch.manual_seed(3)
    model = CompactTransformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.05)
    model = model.to(DEV).to(DTYPE).eval()
    model.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=DEV).float() / cfg.head_dim))
    model._ensure_rope(1024)
    seqs, t, keys_len = 3, 4, 512
    shape = (cfg.num_layers, seqs, cfg.num_kv_heads, keys_len + 64, cfg.head_dim)
    history = torch.randn(shape).to(DTYPE).to(DEV)
    tokens = torch.randint(0, 500, (seqs, t), device=DEV)
    starts = torch.tensor([0, 37, 400], device=DEV)
    outs = {}
    for attention in ("sdpa", "fused"):
        keys, values = history.clone(), history.clone() * 0.5
        with torch.inference_mode():
            logits = forward_batch(model, keys, values, tokens, starts, keys_len, attention=attention)
        outs[attention] = (logits, keys, values)
    (a, ka, va), (b, kb, vb) = outs["sdpa"], outs["fused"]
    # layer 0's values are the torch path's, in the same places (its rotated keys differ by RoPE's rounding, which
    # test_rope_store_equals_torch_ops bounds; later layers take attention's output, summed in another order)
    assert torch.equal(va[0], vb[0])
    tol = 5e-2 if DTYPE == torch.bfloat16 else 1e-4
    assert torch.allclose(ka, kb, atol=tol, rtol=tol) and torch.allclose(va, vb, atol=tol, rtol=tol)
    assert torch.allclose(a, b, atol=tol, rtol=tol)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def _reference_linear(x, w, bias=None, residual=None, norm=None, eps=0.0, gated=False):
    """``gpu_kernels.linear``'s function in float64: (RMSNorm or silu-gate) then x @ w.T + bias + residual."""
    x = x.double()
    if gated:
        k = w.shape[1]
        x = torch.nn.functional.silu(x[:, :k]) * x[:, k:]
    if norm is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.double()
    y = x @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    return y + residual.double() if residual is not None else y


@pytest.mark.parametrize("m,n,k", [(1, 40, 200), (5, 64, 256), (37, 33, 300)])
@pytest.mark.parametrize("kind", ["plain", "bias+residual", "norm", "gated"])
def test_linear_matches_its_function(m, n, k, kind):
    """The batch-invariant projection (tiles past N and K masked) computes x @ W.T with its fused prologue/epilogue."""
    from engine.runtimes.gpu_kernels import linear

    torch.manual_seed(4)
    w = (torch.randn(n, k) * 0.1).to(DTYPE).to(DEV)
    x = torch.randn(m, 2 * k if kind == "gated" else k).to(DTYPE).to(DEV)
    kw = {}
    if kind in ("bias+residual", "gated"):
        kw["residual"] = torch.randn(m, n).to(DTYPE).to(DEV)
    if kind == "bias+residual":
        kw["bias"] = torch.randn(n).to(DTYPE).to(DEV)
    if kind == "norm":
        kw["norm"], kw["eps"] = (torch.rand(k) + 0.5).to(DTYPE).to(DEV), 1e-6
    got = linear(x, w, gated=kind == "gated", **kw)
    want = _reference_linear(x.cpu(), w.cpu(), gated=kind == "gated", **{a: b.cpu() if torch.is_tensor(b) else b
                                                                          for a, b in kw.items()})  # fmt: skip
    tol = 3e-2 if DTYPE == torch.bfloat16 else 1e-4
    assert torch.allclose(got.cpu().double(), want, atol=tol, rtol=tol)


def test_linear_row_does_not_depend_on_its_pass():
    """A row's projection is the same alone, among 16 rows, or in a pass of 100 (every M one kernel, one order)."""
    from engine.runtimes.gpu_kernels import linear

    torch.manual_seed(5)
    w = (torch.randn(96, 320) * 0.1).to(DTYPE).to(DEV)
    norm = (torch.rand(320) + 0.5).to(DTYPE).to(DEV)
    x = torch.randn(100, 320).to(DTYPE).to(DEV)
    full = linear(x, w, norm=norm, eps=1e-6, out_dtype=torch.float32)
    for lo, hi in ((0, 1), (7, 8), (3, 19), (90, 100), (40, 72)):
        part = linear(x[lo:hi], w, norm=norm, eps=1e-6, out_dtype=torch.float32)
        if CUDA:
            assert torch.equal(part, full[lo:hi])
        else:  # numpy's kernels under the interpreter: the same function, not a property of the GPU kernel
            assert torch.allclose(part, full[lo:hi], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["plain", "norm", "gated"])
def test_long_pass_takes_the_wide_tile_only_with_the_decode_tiles_bits(monkeypatch, kind):
    """A pass of more than WIDE_ROWS rows on a swap config: the wide tile runs where the probe found its
    bits equal to the 16-row tile's (on a Hopper GPU), the 16-row tile otherwise (the interpreter's numpy products
    differ by shape); either way every row equals the row in a short pass, and the split counters end at 0."""
    from engine.runtimes import gpu_linear
    from engine.runtimes.gpu_kernels import linear

    monkeypatch.setattr(gpu_linear, "_WIDE_KNOWN", {})
    config = gpu_linear.LinearConfig(64, 128, 4, 2, 2, 16, True)
    monkeypatch.setattr(gpu_linear, "linear_config", lambda n, k: config)
    torch.manual_seed(8)
    n, k = 160, 512
    w = (torch.randn(n, k) * 0.1).to(DTYPE).to(DEV)
    x = torch.randn(100, 2 * k if kind == "gated" else k).to(DTYPE).to(DEV)
    kw = {"norm": (torch.rand(k) + 0.5).to(DTYPE).to(DEV), "eps": 1e-6} if kind == "norm" else {}
    before = dict(gpu_linear._wide_checks)
    full = linear(x, w, gated=kind == "gated", **kw)
    probes = sum(gpu_linear._wide_checks[c] - before[c] for c in ("equal", "unequal"))
    taken = gpu_linear._wide_checks["taken"] - before["taken"]
    assert probes == 1 and taken == (1 if gpu_linear._wide_checks["equal"] > before["equal"] else 0)
    if CUDA and torch.cuda.get_device_capability() == (9, 0):
        assert taken == 1  # measured on H100s: a wider swap tile keeps the 16-row tile's bits
    for lo, hi in ((0, 1), (30, 46), (84, 100)):
        part = linear(x[lo:hi], w, gated=kind == "gated", **kw)
        if CUDA:
            assert torch.equal(part, full[lo:hi])
        else:
            assert torch.allclose(part, full[lo:hi], atol=1e-5, rtol=0)
    assert int(gpu_linear._LOCKS[full.device].count_nonzero()) == 0


@pytest.mark.parametrize("bm", [16, 1, 4, "swap"])
@pytest.mark.parametrize("kind", ["plain", "bias+residual", "norm", "gated"])
def test_split_k_linear_matches_its_function_and_keeps_rows(kind, bm):
    """Split-K (the tile's last program sums the splits in order): the same function, a row's bits the same in any
    pass, and every arrival counter back at 0 afterwards (the next product counts from there)."""
    from engine.runtimes import gpu_linear
    from engine.runtimes.gpu_kernels import linear

    torch.manual_seed(7)
    n, k = 40, 700  # 3 column tiles; K in 6 slabs of 128 (the last partial), 3 splits of 2 slabs
    w = (torch.randn(n, k) * 0.1).to(DTYPE).to(DEV)
    x = torch.randn(37, 2 * k if kind == "gated" else k).to(DTYPE).to(DEV)
    kw = {}
    if kind in ("bias+residual", "gated"):
        kw["residual"] = torch.randn(37, n).to(DTYPE).to(DEV)
    if kind == "bias+residual":
        kw["bias"] = torch.randn(n).to(DTYPE).to(DEV)
    if kind == "norm":
        kw["norm"], kw["eps"] = (torch.rand(k) + 0.5).to(DTYPE).to(DEV), 1e-6
    tail = (16, True) if bm == "swap" else (bm,)  # swap: 16 rows, the weight tile as the MMA's wide side
    split = (16, 128, 4, 2, 3, *tail)
    # K in 5 whole slabs over 2 splits: the second split's third slab lies past K and must be masked
    x640 = torch.cat((x[:, :640], x[:, k : k + 640]), 1) if kind == "gated" else x[:, :640].contiguous()
    w640 = w[:, :640].contiguous()
    uneven = linear(x640, w640, config=(16, 128, 4, 2, 2, *tail), gated=kind == "gated")
    want_uneven = _reference_linear(x640.cpu(), w640.cpu(), gated=kind == "gated")
    assert torch.allclose(uneven.cpu().double(), want_uneven, atol=3e-2, rtol=3e-2)
    full = linear(x, w, gated=kind == "gated", config=split, out_dtype=torch.float32, **kw)
    want = _reference_linear(x.cpu(), w.cpu(), gated=kind == "gated", **{a: b.cpu() if torch.is_tensor(b) else b
                                                                          for a, b in kw.items()})  # fmt: skip
    tol = 3e-2 if DTYPE == torch.bfloat16 else 1e-4
    assert torch.allclose(full.cpu().double(), want, atol=tol, rtol=tol)
    for lo, hi in ((0, 1), (5, 6), (3, 19), (20, 37)):
        part_kw = {a: (b[lo:hi] if a == "residual" else b) for a, b in kw.items()}
        part = linear(x[lo:hi], w, gated=kind == "gated", config=split, out_dtype=torch.float32, **part_kw)
        if CUDA:
            assert torch.equal(part, full[lo:hi])
        else:
            assert torch.allclose(part, full[lo:hi], atol=1e-5, rtol=0)
    assert int(gpu_linear._LOCKS[full.device].count_nonzero()) == 0


@pytest.mark.parametrize("bm", [16, 1, 4, "swap"])
@pytest.mark.parametrize("seqs,t,heads,kv_heads,hd", [(1, 1, 14, 2, 64), (2, 3, 12, 2, 128)])
def test_qkv_with_rope_epilogue_equals_linear_then_rope_store(seqs, t, heads, kv_heads, hd, bm):
    """The qkv product with its RoPE epilogue (one launch, K split) gives the queries, keys and values that the
    product followed by rope_store gives, and writes nothing else into the cache."""
    from engine.runtimes.gpu_kernels import RopeStore, linear, rope_store

    torch.manual_seed(10)
    k, max_len = 320, 300
    cos, sin = _rope_tables(max_len, hd)
    w = (torch.randn((heads + 2 * kv_heads) * hd, k) * 0.1).to(DTYPE).to(DEV)
    bias = torch.randn(w.shape[0]).to(DTYPE).to(DEV)
    norm = (torch.rand(k) + 0.5).to(DTYPE).to(DEV)
    x = torch.randn(seqs * t, k).to(DTYPE).to(DEV)
    positions = (torch.tensor([7, 120][:seqs])[:, None] + torch.arange(t)[None, :]).reshape(-1).to(DEV)
    caches = [torch.zeros(seqs, kv_heads, max_len, hd, dtype=DTYPE, device=DEV) for _ in range(4)]
    cfg = (hd, 128, 4, 2, 3, *((16, True) if bm == "swap" else (bm,)))
    qkv = linear(x, w, bias=bias, norm=norm, eps=1e-6, config=cfg)
    q_apart = rope_store(qkv, caches[0], caches[1], cos, sin, positions, seqs, heads, kv_heads)
    rope = RopeStore(caches[2], caches[3], cos, sin, positions, seqs, heads, kv_heads)
    q = linear(x, w, bias=bias, norm=norm, eps=1e-6, config=cfg, rope=rope)
    same = torch.equal if CUDA else lambda a, b: torch.allclose(a.float(), b.float(), atol=1e-2, rtol=0)
    assert same(q, q_apart) and same(caches[2], caches[0]) and same(caches[3], caches[1])
    assert caches[2].abs().sum() > 0 and caches[3].abs().sum() > 0
    with pytest.raises(ValueError):
        linear(x, w[:-hd].contiguous(), rope=rope)  # not (heads + 2 kv_heads) heads


def _small_model(vocab=300, hidden=128, inter=256, layers=2, heads=4, kv=2):
    from engine.runtimes.compact import CompactConfig, CompactTransformer

    cfg = CompactConfig.from_hf_dict(
        dict(model_type="qwen2", hidden_act="silu", rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=2048,
             vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
             num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True)
    )  # fmt: skip
    torch.manual_seed(6)
    model = CompactTransformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.08)
    model = model.to(DEV).to(DTYPE).eval()
    model.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=DEV).float() / cfg.head_dim))
    return model


def test_invariant_verify_block_equals_steps():
    """Batch-invariant mode: a k-token verify pass gives each row the logits k 1-token steps give it, eagerly and
    through the static (graph) forward at another key bucket, and both match the torch forward."""
    from engine.runtimes.cuda_graphs import GraphRuntime

    model = _small_model()
    torch.manual_seed(7)
    context, k = 270, 5  # past one 256-key split: the combine runs
    prompt = torch.randint(0, 300, (context,), device=DEV)
    block = torch.randint(0, 300, (k,), device=DEV)
    model.invariant = False
    ref_cache = model.new_cache(512)
    model(prompt, ref_cache, 0, 1)
    reference = model(block, ref_cache, context, k)  # torch's kernels
    model.invariant = "invariant"  # this file's kernels: every projection in gpu_kernels.linear
    cache = model.new_cache(512)
    model(prompt, cache, 0, 1)
    eager_block = model(block, cache, context, k).clone()
    steps = torch.cat([model(block[i : i + 1], cache, context + i, 1) for i in range(k)])
    graph = GraphRuntime(model, attention="invariant")  # uncaptured on a CPU; captured on CUDA
    graph_block = graph(block, cache, context, k).clone()  # block bucket 8, key bucket 512
    tol = 5e-2 if DTYPE == torch.bfloat16 else 1e-3
    assert torch.allclose(eager_block, reference, atol=tol, rtol=tol)
    if CUDA:
        assert torch.equal(eager_block, steps) and torch.equal(graph_block, steps)
    else:
        assert torch.allclose(eager_block, steps, atol=1e-4, rtol=0)
        assert torch.allclose(graph_block, steps, atol=1e-4, rtol=0)


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs Hopper or later")
def test_dependent_launch_keeps_every_bit(monkeypatch):
    """Programmatic dependent launch (gpu_linear.use_pdl) changes when a kernel starts, never what it reads or
    computes: graphs of both kernel sets captured with it on give the bits of the same graphs captured with it off, for
    steps and verify blocks across layers, and eager steps too (a kernel reading its predecessor's output early, or
    writing a buffer the predecessor still reads, would differ)."""
    from engine.runtimes import gpu_linear
    from engine.runtimes.cuda_graphs import GraphRuntime

    model = _small_model()
    torch.manual_seed(9)
    context, k = 300, 6
    prompt = torch.randint(0, 300, (context,), device=DEV)
    block = torch.randint(0, 300, (k,), device=DEV)
    for kernels in ("invariant", "invariant-cublas"):
        model.invariant = kernels
        got = {}
        for on in (False, True):
            monkeypatch.setenv(gpu_linear.PDL_ENV, "1" if on else "0")
            gpu_linear.use_pdl.cache_clear()
            assert gpu_linear.use_pdl(torch.device(DEV), model.cfg.hidden_size) is on  # forced: any width
            cache = model.new_cache(512)
            model(prompt, cache, 0, 1)
            graph = GraphRuntime(model, attention=kernels)
            outs = [graph(block, cache, context, k).clone()]
            outs += [graph(block[i : i + 1], cache, context + i, 1).clone() for i in range(k)]
            outs += [model(block[i : i + 1], cache, context + i, 1).clone() for i in range(k)]
            got[on] = torch.cat(outs)
        assert torch.equal(got[False], got[True]), kernels
    gpu_linear.use_pdl.cache_clear()


def test_triton_set_batched_pass_runs_each_product_as_the_sequence_alone(monkeypatch):
    """fimble serve's eager batched pass (Triton projections) calls every product in the variant the sequence's own
    forward uses: the same weight, the same fused prologue/epilogue (RoPE included), the same config, so each row's
    bits are the ones it gets alone (on the H200 the qkv product once ran unfused there: 14 of 29 rows differed).
    Under the interpreter rows are compared with a tolerance; the variants must match exactly."""
    from engine.runtimes import gpu_kernels
    from engine.serve.batched import Forward, _batched_invariant

    model = _small_model()
    model.invariant = "invariant"
    seen: list[tuple] = []
    real = gpu_kernels.linear

    def recording(x, weight, **kw):
        kinds = tuple(sorted(k for k, v in kw.items() if v is not None and v is not False))
        seen.append((weight.data_ptr(), kinds, kw.get("config")))
        return real(x, weight, **kw)

    monkeypatch.setattr(gpu_kernels, "linear", recording)
    torch.manual_seed(12)
    depths, blocks = (37, 120), (3, 1)
    bases = []
    for d in depths:
        c = model.new_cache(256)
        model(torch.randint(0, 300, (d,), device=DEV), c, 0, 1)
        bases.append(c)
    toks = [torch.randint(0, 300, (k,), device=DEV) for k in blocks]

    def fresh(c):
        tmp = model.new_cache(256)
        tmp.keys.copy_(c.keys)
        tmp.values.copy_(c.values)
        tmp.length = c.length
        return tmp

    seen.clear()
    alone = [model(t, fresh(c), d, len(t)).clone() for c, d, t in zip(bases, depths, toks, strict=True)]
    alone_calls = set(seen)
    seen.clear()
    spans = [(0, blocks[0]), (blocks[0], blocks[0] + blocks[1])]
    calls = [Forward(t, fresh(c), d, len(t)) for c, d, t in zip(bases, depths, toks, strict=True)]
    batched = _batched_invariant(model, calls, spans)
    assert set(seen) == alone_calls
    assert any("rope" in kinds for _, kinds, _ in seen)
    for a, b in zip(alone, batched, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=0)
