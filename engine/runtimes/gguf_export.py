"""Write a Hugging Face Llama/Qwen2 folder with a byte-level BPE tokenizer as a GGUF file.

Used by tests (a GGUF made from the embedded model, no download) and by bench/vs_llamacpp.py (the
same weights for llama.cpp). The layout is the one llama.cpp's own converter writes:
- Llama's q/k rows are permuted from HF's half-split rotary layout to GGML's interleaved one
  (Qwen2 runs NEOX rotary in llama.cpp and is stored as is);
- the tokenizer is "gpt2" (byte-level BPE) with pre-tokenizer "gpt-2": fimble's tokenizers are
  ByteLevel with the GPT-2 split regex, which is what that name means in llama.cpp;
- the FIM sentinel ids are written, and add_bos is false (fimble prompts never start with BOS).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.errors import ModelLoadError
from engine.fim import detect_template

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def hf_to_gguf_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """HF half-split rotary rows -> GGML interleaved rows (llama.cpp's converter ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of ``hf_to_gguf_qk``."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_tables(folder: Path) -> tuple[list[str], list[int], list[str], dict[str, int], int | None]:
    tok = json.loads((folder / "tokenizer.json").read_text())
    model, pre = tok.get("model", {}), tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ModelLoadError(f"{folder}: only byte-level BPE tokenizers with the GPT-2 split map to GGUF 'gpt-2'")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {}
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special[added["content"]] = added["id"]
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for text, i in vocab.items():
        tokens[i] = text
    types = [3 if t in special else 1 for t in tokens]  # 3: control, 1: normal (gguf.TokenType)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    tok_cfg_path = folder / "tokenizer_config.json"
    cfg_tok = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    eos = vocab.get(cfg_tok.get("eos_token") or "", None)
    return tokens, types, merges, special, eos


def add_tokenizer(w, tables: tuple, pre: str = "gpt-2") -> None:
    """Write ``_tokenizer_tables``' output to the GGUFWriter ``w``: the BPE vocabulary and merges, end and pad ids,
    and the FIM token ids llama.cpp reads (prefix, suffix, middle, file separator, pad) where the vocabulary has
    them. Also the peer's random-weight GGUF (bench/harness/llama_server_cuda.py) uses it."""
    import gguf

    tokens, types, merges, special, eos = tables
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if eos is not None:
        w.add_eos_token_id(eos)
        w.add_pad_token_id(eos)
    w.add_add_bos_token(False)
    fim = detect_template(set(special))
    if fim is not None:
        w.add_uint32(gguf.Keys.Tokenizer.FIM_PRE_ID, special[fim.prefix_token])
        w.add_uint32(gguf.Keys.Tokenizer.FIM_SUF_ID, special[fim.suffix_token])
        w.add_uint32(gguf.Keys.Tokenizer.FIM_MID_ID, special[fim.middle_token])
        extra = (("<|file_sep|>", gguf.Keys.Tokenizer.FIM_SEP_ID), ("<|fim_pad|>", gguf.Keys.Tokenizer.FIM_PAD_ID))
        for name, key in extra:
            if name in special:
                w.add_uint32(key, special[name])


def export_gguf(folder: str | Path, out: str | Path, qtype: str = "f32", pre: str = "gpt-2") -> Path:
    """Write ``folder`` (HF safetensors) to ``out`` with 2-D weights as ``qtype`` ("f32", "f16" or "q8_0").
    ``pre`` names the pre-tokenizer in the file (tests write other split rules over the same vocabulary)."""
    import gguf
    from safetensors.torch import load_file

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH.get(cfg.get("model_type"))
    if arch is None:
        raise ModelLoadError(f"cannot export model_type {cfg.get('model_type')!r} to GGUF")
    qt = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }[qtype]
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[qtype]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    tokens, types, merges, special, eos = _tokenizer_tables(folder)

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(folder.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_vocab_size(len(tokens))
    w.add_file_type(file_type)
    add_tokenizer(w, (tokens, types, merges, special, eos), pre)

    state: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):  # bf16 widens to float32 exactly
        state.update({k: v.float().numpy() for k, v in load_file(str(f)).items()})

    def put(name: str, arr: np.ndarray, quantise: bool = True) -> None:
        arr = np.ascontiguousarray(arr.astype(np.float32))
        if quantise and arr.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            if qt == gguf.GGMLQuantizationType.F16:
                w.add_tensor(name, arr.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, arr)

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"], False)
    if not cfg.get("tie_word_embeddings", False) and "lm_head.weight" in state:
        put("output.weight", state["lm_head.weight"])
    permute = arch == "llama"
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = state[p + "self_attn.q_proj.weight"], state[p + "self_attn.k_proj.weight"]
        put(b + "attn_norm.weight", state[p + "input_layernorm.weight"], False)
        put(b + "attn_q.weight", hf_to_gguf_qk(q, heads) if permute else q)
        put(b + "attn_k.weight", hf_to_gguf_qk(k, kv_heads) if permute else k)
        put(b + "attn_v.weight", state[p + "self_attn.v_proj.weight"])
        for proj in ("q", "k", "v"):
            if p + f"self_attn.{proj}_proj.bias" in state:
                put(b + f"attn_{proj}.bias", state[p + f"self_attn.{proj}_proj.bias"], False)
        put(b + "attn_output.weight", state[p + "self_attn.o_proj.weight"])
        put(b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"], False)
        put(b + "ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
        put(b + "ffn_up.weight", state[p + "mlp.up_proj.weight"])
        put(b + "ffn_down.weight", state[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
