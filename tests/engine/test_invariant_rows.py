"""The batch-invariant CUDA path's shape logic (engine/runtimes/cuda_graphs.py ``invariant_layers``), on a
CPU.

On CUDA the "invariant-cublas" kernel set pads every projection to a multiple of ``CUBLAS_ROWS`` rows (graph
blocks are raised to it, eager passes get zero rows), so one cuBLAS kernel serves a 1-token step, a verify block
and a batched round; the attention (Triton) computes each row alone. Here the same plumbing runs on the CPU, with
torch stand-ins for the two Triton kernels (RoPE + cache store, attention) and MKL for the products on one thread:
padded to 16 rows, MKL too meets one shape per weight, so a verify block's rows equal 1-token steps bit for bit,
eager equals the static (graph) path, and a slotted round or a batched pass equals each sequence alone. Without
padding they need not (that is what the padding is for). The GPU tests (tests/gpu/test_batch_invariance.py)
check the real kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.runtimes import gpu_kernels
from engine.runtimes.compact import CompactConfig, CompactTransformer
from engine.runtimes.cuda_graphs import BLOCKS, GraphRuntime, SlotGraphs, _min_block, block_bucket
from engine.serve.batched import Forward, batched_forward


def _rope_store(qkv, keys, values, cos, sin, positions, seqs, heads, kv_heads):
    rows, hd = qkv.shape[0], keys.shape[-1]
    half = hd // 2
    x = qkv.view(rows, -1, hd)
    c, s = cos[positions][:, None], sin[positions][:, None]
    s = torch.cat((-s[..., :half], s[..., half:]), -1)
    qk = x[:, : heads + kv_heads]
    rotated = qk * c + torch.cat((qk[..., half:], qk[..., :half]), -1) * s
    seq = torch.arange(rows) // (rows // seqs)
    keys[seq, :, positions] = rotated[:, heads:]
    values[seq, :, positions] = x[:, heads + kv_heads :]
    return rotated[:, :heads].reshape(rows, heads * hd).contiguous()


def _attention(q, keys, values, positions, keys_len, seqs, kv_heads, scratch=None, ordered=False):
    """Each row alone, over the keys up to its position: row-invariant by construction."""
    rows, width = q.shape
    hd = keys.shape[-1]
    heads = width // hd
    group, t = heads // kv_heads, rows // seqs
    out = torch.empty_like(q)
    for r in range(rows):
        s, pos = r // t, int(positions[r])
        for h in range(heads):
            k, v = keys[s, h // group, : pos + 1], values[s, h // group, : pos + 1]
            w = torch.softmax(k @ q[r, h * hd : (h + 1) * hd] / math.sqrt(hd), 0)
            out[r, h * hd : (h + 1) * hd] = w @ v
    return out


@pytest.fixture
def cpu_kernels(monkeypatch):
    monkeypatch.setattr(gpu_kernels, "rope_store", _rope_store)
    monkeypatch.setattr(gpu_kernels, "attention", _attention)
    monkeypatch.setattr(gpu_kernels, "attention_scratch", lambda *a, **k: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # MKL splits rows between threads otherwise (engine/serve/batched.py)
    yield
    torch.set_num_threads(threads)


def _model():
    cfg = CompactConfig.from_hf_dict(
        dict(model_type="qwen2", hidden_act="silu", rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=512,
             vocab_size=200, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True)
    )  # fmt: skip
    torch.manual_seed(0)
    model = CompactTransformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.1)
    model.invariant = "invariant-cublas"
    return model


def _copy(dst, src):
    dst.keys.copy_(src.keys)
    dst.values.copy_(src.values)
    dst.length = src.length


def test_blocks_are_raised_to_the_row_multiple(monkeypatch):
    monkeypatch.setattr(gpu_kernels, "CUBLAS_ROWS", 16)
    assert [_min_block(block_bucket(t), "invariant-cublas") for t in (1, 2, 5, 16)] == [16, 16, 16, 16]
    assert _min_block(block_bucket(17), "invariant-cublas") is None  # a prefill: eager
    assert [_min_block(block_bucket(t), "invariant") for t in (1, 3, 9)] == [1, 4, 16]  # Triton: any row count
    assert [_min_block(block_bucket(t), "fused") for t in (1, 3)] == [1, 4]
    monkeypatch.setattr(gpu_kernels, "CUBLAS_ROWS", 1)
    assert [_min_block(block_bucket(t), "invariant-cublas") for t in (1, 3)] == [1, 4]
    assert max(BLOCKS) == 16


def test_linear_config_depends_on_the_weight_alone():
    import inspect

    assert list(inspect.signature(gpu_kernels.linear_config).parameters) == ["n", "k"]  # no row count to depend on
    for n, k in ((1152, 896), (896, 4864), (9728, 896), (151936, 896), (2048, 1536), (1536, 8960), (37888, 3584),
                 (3584, 18944), (640, 100)):  # fmt: skip
        bn, bk, warps, stages, splits, bm, swap = gpu_kernels.linear_config(n, k)
        assert bm in (1, gpu_kernels.LINEAR_ROWS) and (not swap or bm == gpu_kernels.LINEAR_ROWS)
        assert bn in (8, 16, 32, 64, 128) and bk in (64, 128, 256, 512) and warps >= 1 and stages >= 1
        assert splits >= 1 and splits * bk <= -(-k // bk) * bk  # every split holds at least one slab of K


def test_swept_configs_override_and_are_range_checked(tmp_path, monkeypatch):
    from engine.runtimes import gpu_linear

    sweep = tmp_path / "sweep.json"
    sweep.write_text('{"sweep": [{"n": 9728, "k": 896, "best": [64, 128, 4, 3, 1, 16, true]}]}')
    monkeypatch.setenv(gpu_linear.CONFIGS_ENV, str(sweep))
    gpu_linear.swept_configs.cache_clear()
    try:
        assert gpu_linear.linear_config(9728, 896) == (64, 128, 4, 3, 1, 16, True)  # the file's, ahead of the code's
        assert gpu_linear.linear_config(896, 896) == gpu_linear.LinearConfig.of(gpu_linear.MEASURED_CONFIGS[(896, 896)])
        sweep.write_text(
            '{"sweep": [{"n": 9728, "k": 896, "best": [64, 128, 4, 3, 1, 16, true], "best_rows_equal": false}]}'
        )
        gpu_linear.swept_configs.cache_clear()  # a config whose rows differed in its sweep is not taken
        assert gpu_linear.linear_config(9728, 896) == gpu_linear.LinearConfig.of(
            gpu_linear.MEASURED_CONFIGS[(9728, 896)]
        )
        row = '{"sweep": [{"n": 9728, "k": 896, "best": %s}]}'
        bad_files = [
            "[64, 128, 4, 3, 1, 16, true]",  # not a sweep's json
            row % "[64, 100, 4, 3, 1, 16, true]",  # BK not a power of two
            row % "[64, 128, 4, 3, 0]",  # no splits
            row % "[64, 128, 4, 3, 1, 1, true]",  # swap with one row a program
            row % '[64, "128", 4, 3, 1]',  # a string
            '{"sweep": [{"n": 9728, "best": [64, 128, 4, 3, 1]}]}',  # no k
        ]
        for text in bad_files:
            sweep.write_text(text)
            gpu_linear.swept_configs.cache_clear()
            with pytest.raises(ValueError, match=gpu_linear.CONFIGS_ENV):
                gpu_linear.linear_config(9728, 896)
    finally:
        gpu_linear.swept_configs.cache_clear()


def test_prefill_tile_widens_only_swap_tiles_and_keeps_the_k_chain(monkeypatch):
    from engine.runtimes import gpu_linear

    cfg = gpu_linear.LinearConfig(64, 128, 4, 3, 10, 16, True)
    wide = gpu_linear.wide_config(cfg, rope=False)
    assert (wide.bk, wide.splits, wide.swap) == (cfg.bk, cfg.splits, True)  # the same K slabs, splits, split order
    assert wide.bm > gpu_linear.LINEAR_ROWS and wide.bn >= cfg.bn
    assert (wide.bn + wide.bm) * wide.bk * 2 * wide.stages <= gpu_linear.WIDE_SMEM
    assert gpu_linear.wide_config(cfg._replace(bk=256, bn=128), rope=False).stages >= 1
    assert gpu_linear.wide_config(cfg, rope=True).bn == cfg.bn  # a RoPE tile stays one head wide
    assert gpu_linear.wide_config(gpu_linear.LinearConfig(8, 512, 4, 4, 1, 1), rope=False) is None  # a GEMV
    monkeypatch.setenv(gpu_linear.WIDE_ENV, "0")
    assert gpu_linear.wide_config(cfg, rope=False) is None


def test_prefill_tile_is_taken_only_where_checked_equal(monkeypatch):
    from engine.runtimes import gpu_linear

    calls = []
    outputs = {}

    def launch(x, weight, cfg):
        calls.append(cfg)
        if outputs.get("raise"):
            raise RuntimeError("out of resource: shared memory")
        return torch.zeros(2) if cfg.bm == 16 or outputs["equal"] else torch.ones(2)

    monkeypatch.setattr(gpu_linear, "_launch", launch)
    monkeypatch.setattr(gpu_linear, "_WIDE_KNOWN", {})
    cfg = gpu_linear.LinearConfig(64, 128, 4, 3, 1, 16, True)
    wide = gpu_linear.wide_config(cfg, rope=False)
    for equal, weight in ((True, torch.zeros(64, 32)), (False, torch.zeros(128, 32))):
        outputs["equal"] = equal
        assert gpu_linear._wide_equal(weight, cfg, wide) is equal
        assert gpu_linear._wide_equal(weight, cfg, wide) is equal  # remembered: probed once per shape
    assert len(calls) == 4
    outputs["raise"] = True
    assert gpu_linear._wide_equal(torch.zeros(256, 32), cfg, wide) is False  # a tile this GPU cannot build


def test_invariant_default_reads_the_switch(monkeypatch):
    monkeypatch.setattr(gpu_kernels, "available", lambda: True)
    for value, want in (("0", False), ("off", False), ("cublas", "invariant-cublas"), ("triton", "invariant")):
        monkeypatch.setenv("FIMBLE_CUDA_INVARIANT", value)
        assert gpu_kernels.invariant_default() == want
    monkeypatch.delenv("FIMBLE_CUDA_INVARIANT")
    assert gpu_kernels.invariant_default() == gpu_kernels.DEFAULT_INVARIANT == "invariant"
    for typo in ("tritn", "cuBLAS-set", "2"):  # a setting out of range is an error, never a silent pick
        monkeypatch.setenv("FIMBLE_CUDA_INVARIANT", typo)
        with pytest.raises(ValueError, match="FIMBLE_CUDA_INVARIANT"):
            gpu_kernels.invariant_default()
    monkeypatch.setattr(gpu_kernels, "available", lambda: False)
    assert gpu_kernels.invariant_default() is False


def test_dependent_launch_reads_its_setting_and_takes_wide_layers_by_default(monkeypatch):
    from engine.runtimes import gpu_linear

    for value, want in (("0", "off"), ("off", "off"), ("1", "on"), ("on", "on"), ("auto", "auto"), ("", "auto")):
        monkeypatch.setenv(gpu_linear.PDL_ENV, value)
        assert gpu_linear.pdl_mode() == want
    for typo in ("2", "pdl", "enable"):  # out of range: an error, never a silent pick
        monkeypatch.setenv(gpu_linear.PDL_ENV, typo)
        with pytest.raises(ValueError, match=gpu_linear.PDL_ENV):
            gpu_linear.pdl_mode()
    hopper = torch.device("cuda")
    capability = (9, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    wide, narrow = gpu_linear.PDL_MIN_WIDTH, gpu_linear.PDL_MIN_WIDTH - 640  # Qwen2.5 1.5B's 1,536 and 0.5B's 896
    cases = {"auto": (True, False), "on": (True, True), "off": (False, False)}
    for mode, (want_wide, want_narrow) in cases.items():
        monkeypatch.setenv(gpu_linear.PDL_ENV, mode)
        gpu_linear.use_pdl.cache_clear()
        assert (gpu_linear.use_pdl(hopper, wide), gpu_linear.use_pdl(hopper, narrow)) == (want_wide, want_narrow)
    monkeypatch.setenv(gpu_linear.PDL_ENV, "on")
    capability = (8, 0)  # before Hopper: no dependent launch, whatever the setting
    gpu_linear.use_pdl.cache_clear()
    assert gpu_linear.use_pdl(hopper, wide) is False
    assert gpu_linear.use_pdl(torch.device("cpu"), wide) is False
    gpu_linear.use_pdl.cache_clear()


def test_a_serve_engine_defaults_to_the_cublas_set_and_a_users_choice_wins(monkeypatch):
    """One editor's engine runs the Triton set (the faster step); fimble serve's batched rounds the cuBLAS set."""
    from engine.serve.scheduler import open_serve_engine

    monkeypatch.setattr(gpu_kernels, "available", lambda: True)
    monkeypatch.setenv("FIMBLE_CUDA_INVARIANT", "")  # (so that teardown restores the variable as it was)
    monkeypatch.delenv("FIMBLE_CUDA_INVARIANT")
    assert gpu_kernels.invariant_default() == "invariant"
    open_serve_engine(None, None, use_draft=False)  # the embedded model, on the CPU
    assert gpu_kernels.invariant_default() == "invariant-cublas"
    monkeypatch.setenv("FIMBLE_CUDA_INVARIANT", "triton")
    open_serve_engine(None, None, use_draft=False)
    assert gpu_kernels.invariant_default() == "invariant"


@torch.inference_mode()
def test_padded_rows_make_verify_equal_steps(cpu_kernels, monkeypatch):
    monkeypatch.setattr(gpu_kernels, "CUBLAS_ROWS", 16)
    model = _model()
    graph = GraphRuntime(model, attention="invariant-cublas")  # no graphs on a CPU: the same static passes
    gen = torch.Generator().manual_seed(1)
    base, cv, cs = (model.new_cache(128) for _ in range(3))
    model(torch.randint(0, 200, (40,), generator=gen), base, 0, 1)
    for k in (1, 2, 5, 16):
        block = torch.randint(0, 200, (k,), generator=gen)
        got = {}
        for name, rt in (("eager", model), ("graph", graph)):
            _copy(cv, base)
            verify = rt(block, cv, 40, k).clone()
            _copy(cs, base)
            steps = torch.cat([rt(block[i : i + 1], cs, 40 + i, 1).clone() for i in range(k)])
            assert torch.equal(verify, steps), (name, k)
            got[name] = verify
        assert torch.equal(got["eager"], got["graph"]), k


@torch.inference_mode()
def test_padded_rows_make_batches_equal_alone(cpu_kernels, monkeypatch):
    monkeypatch.setattr(gpu_kernels, "CUBLAS_ROWS", 16)
    model = _model()
    gen = torch.Generator().manual_seed(2)
    depths, blocks = (7, 30, 60), (1, 3, 16)
    bases = []
    for d in depths:
        c = model.new_cache(96)
        model(torch.randint(0, 200, (d,), generator=gen), c, 0, 1)
        bases.append(c)
    toks = [torch.randint(0, 200, (k,), generator=gen) for k in blocks]

    def fresh(c):
        tmp = model.new_cache(96)
        _copy(tmp, c)
        return tmp

    alone = [model(t, fresh(c), d, len(t)).clone() for c, d, t in zip(bases, depths, toks, strict=True)]
    slots = SlotGraphs(model, 4, 96, attention="invariant-cublas")
    views = [slots.take(fresh(c)) for c in bases]
    passes = [(t, v, d, len(t)) for t, v, d in zip(toks, views, depths, strict=True)]
    assert slots.shape(passes)[1] == 16  # the longest pass's bucket; products on 4 x 16 rows
    rounds = slots.run(passes)
    batched = batched_forward(
        model, [Forward(t, fresh(c), d, len(t)) for c, d, t in zip(bases, depths, toks, strict=True)]
    )
    for a, r, b in zip(alone, rounds, batched, strict=True):
        assert torch.equal(a, r) and torch.equal(a, b)


@pytest.mark.parametrize("switch_at", ["16 rows", "above 32 rows"])
@torch.inference_mode()
def test_row_limits_keep_batches_equal_alone_when_the_kernel_changes(cpu_kernels, monkeypatch, switch_at):
    """A down projection whose summation order changes with the row count, as cuBLAS changes kernel on the GPU:
    another order at 16 rows than above (the 7B shape's on the H200), or above 32 rows. A batched round of 4 x 16
    rows then differs from each sequence alone, unless the probe finds it (engine/runtimes/row_limits.py) and every
    pass runs that product on at least 32 rows, or in pieces of at most 32."""
    from engine.runtimes import row_limits as rl

    real_addmm = rl.addmm
    low, high = (16, 1 << 20) if switch_at == "16 rows" else (0, 32)

    def switching_addmm(weight, x, a):
        if low < x.shape[0] <= high or a.shape[1] < 100:  # the down projection only (160 inputs; o has 64)
            return real_addmm(weight, x, a)
        k = a.shape[1] // 2
        return x + (a[:, :k] @ weight[:, :k].t() + a[:, k:] @ weight[:, k:].t())

    monkeypatch.setattr(gpu_kernels, "CUBLAS_ROWS", 16)
    monkeypatch.setattr(rl, "addmm", switching_addmm)
    monkeypatch.setattr(rl, "ENOUGH", 32)
    want = (32, 512) if switch_at == "16 rows" else (16, 32)
    gen = torch.Generator().manual_seed(5)
    depths, blocks = (7, 30, 60), (1, 3, 16)
    differing = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("FIMBLE_CUDA_ROW_LIMITS", switch)
        model = _model()
        if switch == "1":
            assert rl.limits(model, 16)["down"] == want and rl.limits(model, 16)["o"] == (16, 512)
        bases = []
        for d in depths:
            c = model.new_cache(96)
            model(torch.randint(0, 200, (d,), generator=gen), c, 0, 1)
            bases.append(c)
        toks = [torch.randint(0, 200, (k,), generator=gen) for k in blocks]

        def fresh(c, model=model):
            tmp = model.new_cache(96)
            _copy(tmp, c)
            return tmp

        alone = [model(t, fresh(c), d, len(t)).clone() for c, d, t in zip(bases, depths, toks, strict=True)]
        slots = SlotGraphs(model, 4, 96, attention="invariant-cublas")
        views = [slots.take(fresh(c)) for c in bases]
        rounds = slots.run([(t, v, d, len(t)) for t, v, d in zip(toks, views, depths, strict=True)])
        calls = [Forward(t, fresh(c), d, len(t)) for c, d, t in zip(bases, depths, toks, strict=True)]
        batched = batched_forward(model, calls)
        differing[switch] = sum(
            int((a != r).any(-1).sum()) + int((a != b).any(-1).sum())
            for a, r, b in zip(alone, rounds, batched, strict=True)
        )
    assert differing["0"] > 0  # the switch shows without the limits
    assert differing["1"] == 0
