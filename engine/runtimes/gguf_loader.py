"""Load a GGUF file (what llama.cpp, Ollama and LM Studio keep on disk) into the compact runtime.

Weights of any type the ``gguf`` package can dequantise (F32, F16, BF16, Q8_0, Q4_0/1, K-quants)
become float tensors with Hugging Face names: Llama's q/k rows go back from GGML's interleaved
rotary layout to HF's half-split one. The tokenizer is rebuilt from the file's own vocabulary
and merges (byte-level BPE, "gpt2" in GGUF terms), and the FIM template from its
``tokenizer.ggml.fim_*_token_id`` entries. Anything else is a one-line ``ModelLoadError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import ModelLoadError
from engine.fim import TEMPLATES, FimTemplate, detect_template
from engine.runtimes.gguf_export import gguf_to_hf_qk
from engine.runtimes.model_config import CompactConfig

if TYPE_CHECKING:  # the compact runtime's load only: the ggml runtime reads metadata here without torch
    import torch

    from engine.runtimes.compact import CompactTransformer

GGUF_MAGIC = b"GGUF"
# GGUF pre-tokenizer names whose split rule this loader reproduces exactly: None means GPT-2's own
# byte-level regex; a string is the split pattern llama.cpp uses for that name (llama-vocab.cpp), applied
# before byte-level mapping, as the model's Hugging Face tokenizer.json does. Tests check each against
# llama.cpp's own tokenizer on code.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE: dict[str, str | None] = {"gpt-2": None, "gpt2": None, "default": None, "qwen2": QWEN2_SPLIT}


@dataclass
class GGUFModel:
    runtime: CompactTransformer
    tokenizer: object
    template: FimTemplate | None
    stop_ids: set[int]
    max_len: int
    notice: str | None


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def _tokenizer(reader, path: Path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from engine.runtimes.bpe_tokenizer import BPETokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ModelLoadError(f"{path.name}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    if pre not in SUPPORTED_PRE:
        known = ", ".join(sorted(SUPPORTED_PRE))
        raise ModelLoadError(f"{path.name}: GGUF pre-tokenizer {pre!r} is not supported yet (supported: {known})")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    split = SUPPORTED_PRE[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # NFC as the model's own tokenizer.json does (llama.cpp skips it: equal on text already in NFC)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are whole tokens, never split by BPE.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=False) if ty in (3, 4)]
    )
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return BPETokenizer(tok, int(eos) if eos is not None else None), tokens


def _template(reader, tokens: list[str]) -> tuple[FimTemplate | None, set[int]]:
    """The FIM template named by the file's fim ids, and the ids that end an infill."""
    ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("fim_pre", "fim_suf", "fim_mid")]
    if None in ids:  # older files: prefix/suffix/middle
        ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("prefix", "suffix", "middle")]
    stops = {
        int(v)
        for k in ("eos", "eot", "fim_pad", "fim_rep", "fim_sep")
        if (v := _field(reader, f"tokenizer.ggml.{k}_token_id")) is not None
    }
    if None in ids:  # files converted without fim ids (Qwen2.5-Coder's often are): the sentinels by name
        named = detect_template(set(tokens))
        if named is None:
            return None, stops
        stops |= {tokens.index(s) for s in named.stop_tokens if s in tokens}
        return named, stops
    pre, suf, mid = (tokens[i] for i in ids)
    for t in TEMPLATES.values():  # a known family keeps its order (SPM/PSM) and stop tokens
        if (t.prefix_token, t.suffix_token, t.middle_token) == (pre, suf, mid):
            stops |= {tokens.index(s) for s in t.stop_tokens if s in tokens}
            return t, stops
    return FimTemplate("gguf", pre, suf, mid, "psm"), stops


def _config(reader, path: Path) -> tuple[CompactConfig, str]:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"{path.name}: GGUF architecture {arch!r} is not supported (llama, qwen2)")

    def get(key: str, default=None):
        v = _field(reader, f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(f"{path.name}: GGUF lacks {arch}.{key}")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(_field(reader, f"{arch}.rope.dimension_count") or hidden // heads)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(f"{path.name}: GGUF has no token_embd.weight")
    vocab = int(embd.shape[-1]) if len(embd.shape) > 1 else len(_field(reader, "tokenizer.ggml.tokens"))
    cfg = CompactConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        attention_bias=any(t.name == "blk.0.attn_q.bias" for t in reader.tensors),
    )
    return cfg, arch


def _hf_state(reader, cfg: CompactConfig, arch: str) -> dict[str, torch.Tensor]:
    import torch
    from gguf.quants import dequantize

    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            hf_name = f"model.layers.{layer}.{per_layer.get(rest, rest)}"
        else:
            hf_name = names.get(t.name, t.name)
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGML lists dimensions innermost first
        arr = arr.reshape(shape)
        if arch == "llama" and rest_is(t.name, "attn_q.weight"):
            arr = gguf_to_hf_qk(arr, cfg.num_heads)
        elif arch == "llama" and rest_is(t.name, "attn_k.weight"):
            arr = gguf_to_hf_qk(arr, cfg.num_kv_heads)
        state[hf_name] = torch.from_numpy(np.array(arr, copy=True))  # the reader's memory map is read-only
    return state


def rest_is(name: str, suffix: str) -> bool:
    return name.startswith("blk.") and name.endswith("." + suffix)


def open_reader(path: Path):
    """The file's GGUFReader, or a one-line ModelLoadError (both runtimes read GGUF metadata through this)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError("loading GGUF files needs the 'gguf' package (pip install gguf)") from None
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # truncated or not a GGUF: the package raises many kinds
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path.name} is not a readable GGUF file: {first}") from None


def open_meta(path: Path):
    """The file's metadata and tensor table without tensor data (engine/runtimes/gguf_meta.py: the ggml
    runtime's fast path, ~0.4 s where GGUFReader takes 10+ s on a 151k vocabulary), or a one-line
    ModelLoadError."""
    from engine.runtimes.gguf_meta import GGUFFormatError, GGUFMeta

    try:
        return GGUFMeta(path)
    except (OSError, GGUFFormatError) as exc:
        raise ModelLoadError(f"{path.name} is not a readable GGUF file: {exc}") from None


def load_gguf(path: Path, dtype: torch.dtype | None = None, device: str = "cpu") -> GGUFModel:
    import torch

    from engine.runtimes.compact import compact_from_hf_state

    dtype = torch.float32 if dtype is None else dtype
    reader = open_reader(path)
    try:
        cfg, arch = _config(reader, path)
        tokenizer, tokens = _tokenizer(reader, path)
        template, stops = _template(reader, tokens)
        state = _hf_state(reader, cfg, arch)
    except ModelLoadError:
        raise
    except Exception as exc:  # a GGUF with missing or malformed entries
        raise ModelLoadError(f"{path.name} is a malformed GGUF file: {type(exc).__name__}: {exc}") from None
    runtime = compact_from_hf_state(cfg, state, path.name, dtype, device)
    notice = (
        None
        if template
        else (
            f"model {path.name} has no fill-in-the-middle tokens: completing from the "
            "text before the cursor only (the text after it is not used)"
        )
    )
    return GGUFModel(runtime, tokenizer, template, stops, cfg.max_position_embeddings, notice)
