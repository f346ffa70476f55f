"""The target's (and draft's) forward pass on llama.cpp's ggml kernels, under fimble's own engine.

The CPU default where its library is built (engine/loader.py runtime_choice; ``FIMBLE_RUNTIME=ggml`` forces
it). Speculative decoding, per-document segmented
caches, healing, streaming and cancellation stay fimble's: this is only the runtime behind the
calls the compact runtime answers (``new_cache``, ``runtime(tokens, cache, start, num_logits)``,
``cache.rollback``, ``cache.length``/``max_len``).

Why: the compact torch step pays per-op dispatch on every forward pass; llama.cpp's one
``llama_decode`` per step runs the whole graph in C (bench/vs_transformers.py figures in the commit).
A HF folder is exported once to a cached GGUF (engine/runtimes/gguf_export.py; f32, or q8_0 with
``FIMBLE_QUANT=int8``) under ``~/.cache/fimble/gguf`` (or ``$FIMBLE_CACHE_DIR``); a GGUF file is
loaded as it is, tokenizer and FIM template from its metadata (engine/runtimes/gguf_loader.py).

Mapping:
- each cache (a document's target or draft cache) is its own ``llama_context`` with one
  sequence, sized like a compact cache. Not seq ids of one shared context: one context per
  document keeps its cells in position order (a shared KV pool interleaves documents, and the
  attention's accumulation order, so the bits, would then depend on other documents' history),
  and its size and lifetime map one to one onto KVStore's per-document byte budget;
- a verify block is one ``llama_decode`` with logits at every position;
- rollback only lowers ``cache.length``; the next decode drops the cells from its start position
  on (``llama_memory_seq_rm(seq, start, -1)``);
- borrowing another document's identical leading segments (and growing/shrinking a cache)
  copies sequence state between contexts (``llama_state_seq_get_data``/``set_data``), then
  truncates; where the copy cannot fit the destination, the tokens are re-prefilled.

Lossless: greedy speculative output must equal this runtime's own plain greedy output, so a
verify block's logits must equal 1-token steps' bit for bit. On fimble's own build of llama.cpp
(engine/runtimes/ggml_build.py: one kernel path per product for 1 to 32 rows) blocks of 1 to 32 rows
are bit-identical with flash attention off, and with it on at 1 thread. On a stock build f32 blocks are
invariant only with flash attention on and for 2 to 33 rows. So a load-time probe picks the first
setting whose blocks equal steps among: the preferred flash attention setting, the other one, then
each with every 1-token pass run as 2 tokens (the second a throwaway at the next position, dropped
by the next decode) and every pass outputting at least 2 rows. Blocks that need logits on every row
run in passes of at most 32 tokens.

Same output as llama.cpp: with f32 or q8_0 weights, fimble's greedy output equals llama.cpp's own
(llama-cpp-python, llama-server, llama-cli) on the same GGUF when both run the same flash attention
setting. That takes stock kernels in 1-token steps (the build's patch keeps them) and prefill passes
that run the kernels llama.cpp's own prefill runs: see _blocks.

Flash attention (``FIMBLE_GGML_FLASH=auto|on|off``): auto is off, as llama-cpp-python runs it. On this
CPU (1 thread, q8_0 embedded target, 600 cached positions) a 1-token step costs 3.2-3.4 ms off against
3.7 on, and each extra verify row about 50% more on (its kernel works row by row), so speculation stops
paying. ``on`` matches llama-server's and llama-cli's default (``-fa auto``, on for the CPU), bit for bit.
With flash attention on, a 1-row pass over 512+ cached positions splits the keys across threads, so
with 2 threads the probe finds it not batch-invariant and keeps it off.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine import env_settings
from engine.errors import ModelLoadError
from engine.runtimes import probe_cache
from engine.runtimes.ggml_lib import get_lib
from engine.runtimes.model_config import CompactConfig

if TYPE_CHECKING:  # only __call__ (torch callers: tests, sampling) takes and gives tensors; the engine's
    import torch  # greedy path goes through numpy_logits and never imports torch

log = logging.getLogger("fimble.ggml")

INVARIANT_ROWS = 32  # blocks needing logits on every row run in chunks of at most this many tokens
PREFILL_BATCH = 256  # llama.cpp batch (and ubatch) size: prefill chunk, and the context's compute buffer
LLAMA_UBATCH = 512  # llama.cpp's default ubatch (llama-server -ub, llama-cpp-python n_ubatch): see _blocks
EXPORT_VERSION = "1"  # bump when engine/runtimes/gguf_export.py writes different files for the same folder
MAX_THREADS = int(env_settings.setting("FIMBLE_GGML_THREADS").high)  # 256
KV_BYTES = 2  # llama.cpp's default f16 keys and values
PROBE_TOKENS = 8  # the load-time forward pass that refuses corrupt weights (as weights_check.bad_probe's)
PROBE_DEPTH = 200  # cached positions before the load-time batch-invariance probe
# With flash attention on, a 1-row pass over 512 or more cached positions splits the keys across threads
# and reduces the parts (ggml-cpu ops.cpp, use_split_kv_path), in an order that depends on the thread
# count: its probe runs past that depth, where the kernels differ.
FLASH_PROBE_DEPTH = 520
FLASH_CHOICES = env_settings.setting("FIMBLE_GGML_FLASH").choices  # auto, on, off
KERNEL_FIELDS = ("flash_attn", "pad_single", "batch_invariant", "threads")


def _read_kernel_choice(value: dict) -> tuple[bool, bool, bool, int]:
    """A cached kernel choice, checked field by field (probe_cache ignores the entry on any error)."""
    flash, pad, invariant, threads = (value[f] for f in KERNEL_FIELDS)
    if not all(isinstance(v, bool) for v in (flash, pad, invariant)):
        raise TypeError("kernel flags")
    if type(threads) is not int or not 1 <= threads <= MAX_THREADS:
        raise ValueError("threads")
    return flash, pad, invariant, threads


def _read_checked(value: dict) -> bool:
    if value.get("finite") is not True:
        raise ValueError("finite")
    return True


def default_threads() -> int:
    """1 on a machine of 2 cores or fewer (the editor and server need the other), else 2."""
    return 1 if (os.cpu_count() or 1) <= 2 else 2


def resolve_threads(threads: int | None = None) -> int:
    """``threads``, else ``$FIMBLE_GGML_THREADS``, else ``$OMP_NUM_THREADS`` (the engineThreads setting),
    else ``default_threads()``; range-checked."""
    raw: object = threads
    if raw is None:
        try:
            raw = env_settings.read("FIMBLE_GGML_THREADS")  # 1..MAX_THREADS, None when unset
        except env_settings.SettingError as exc:
            raise ModelLoadError(str(exc)) from None
    if raw is None and os.environ.get("OMP_NUM_THREADS", "").strip():
        raw = os.environ["OMP_NUM_THREADS"].strip()
    if raw is None:
        return default_threads()
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ModelLoadError(f"ggml thread count {raw!r} is not a whole number") from None
    if not 1 <= value <= MAX_THREADS:
        raise ModelLoadError(f"ggml thread count {value} is out of range (1..{MAX_THREADS})")
    return value


def flash_preference() -> bool:
    """Whether to try flash attention on first: ``$FIMBLE_GGML_FLASH`` on/off, auto (default) is off
    (the module docstring says why)."""
    try:
        return env_settings.read("FIMBLE_GGML_FLASH") == "on"  # one of FLASH_CHOICES
    except env_settings.SettingError as exc:
        raise ModelLoadError(str(exc)) from None


class GGMLCache:
    """One document's keys/values: a llama.cpp context holding sequence 0, positions 0..length-1."""

    def __init__(self, runtime: GGMLRuntime, max_len: int):
        self.runtime = runtime  # keeps the model alive as long as its contexts
        runtime._contexts += 1  # (and GGMLRuntime.__del__ waits for the last one)
        lib = runtime.lib
        self.ctx = lib.new_context(
            runtime.model, max_len, min(PREFILL_BATCH, max_len), runtime.threads, runtime.flash_attn
        )
        self.batch = lib.new_batch(min(PREFILL_BATCH, max_len))
        self.n_ctx = lib.n_ctx(self.ctx)  # llama.cpp may round the size up
        self.max_len = max_len
        self.length = 0

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}, cache holds {self.length}")
        self.length = length  # the cells past it go at the next decode (it starts there)

    def nbytes(self) -> int:
        return self.max_len * self.runtime.kv_bytes_per_token

    def copy_prefix_from(self, src: GGMLCache, n: int, ids: list[int] | None = None) -> None:
        """Hold ``src``'s first ``n`` positions: a state copy, else (too big to fit here) a prefill of ``ids``."""
        lib = self.runtime.lib
        n = min(n, src.length, self.max_len)
        lib.seq_rm(src.ctx, src.length)  # cells past src's length are stale: never copy them
        if src.length <= self.max_len:
            lib.copy_sequence(src.ctx, self.ctx)
            lib.seq_rm(self.ctx, n)
            self.length = n
        elif ids is not None and n > 0:
            self.length = 0
            self.runtime.numpy_logits(list(ids[:n]), self, 0, 1)
        else:
            self.length = 0

    def __del__(self) -> None:
        rt = getattr(self, "runtime", None)
        if rt is not None and getattr(self, "ctx", None) is not None and not sys.is_finalizing():
            rt.lib.lib.llama_batch_free(self.batch)
            rt.lib.lib.llama_free(self.ctx)
            self.ctx = None
            rt.context_closed()


class GGMLRuntime:
    """A GGUF model on llama.cpp, called like the compact runtime."""

    # capabilities (engine/runtimes/protocol.py)
    numpy_rows = True
    greedy_drafts = False
    # engine/decoding/spec_policy.py: draft only what pays (each extra q8_0 verify row still costs a part of a
    # step here: bench/verify_rows.py).
    cost_aware_drafting = True
    shift_reuse = False
    # The columns of numpy_logits' rows that can be finite, where not all of them (None): a sub-vocabulary
    # drafter's (engine/runtimes/mapped_runtime.py); ModelDrafter's greedy choice then looks at these alone.
    finite_columns: np.ndarray | None = None

    def __init__(
        self, path: Path, cfg: CompactConfig, threads: int | None = None, loaded: tuple[object, bool] | None = None
    ):
        """``loaded``: ``load_weights``'s answer, where the caller loaded the model already (``WeightsLoad``)."""
        self.lib = get_lib()
        self._contexts, self._closing = 0, False  # live GGMLCache contexts of this model (``__del__``)
        self.path = path
        self.cfg = cfg
        self.threads = resolve_threads(threads)
        model, self.weights_checked = loaded or load_weights(self.lib, path)
        self.model = model
        self.vocab = self.lib.n_vocab(model)
        self.device = "cpu"  # a device name, as torch takes it: no torch import here
        self.kv_element_bytes = KV_BYTES  # of the keys/values: KVStore budgets bytes per position with it
        self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * KV_BYTES
        self.flash_first = flash_preference()
        self.flash_attn = False
        # Everything the probes' answers depend on (engine/runtimes/probe_cache.py): the answers are read
        # back on the next start instead of being probed again.
        self.probe_parts = (
            self.lib.name,
            probe_cache.library_identity(self.lib.source),
            probe_cache.library_settings(),
            probe_cache.file_identity(path),
            f"threads={self.threads}:flash_first={self.flash_first}",
            f"depths={PROBE_DEPTH},{FLASH_PROBE_DEPTH}:rows={INVARIANT_ROWS}",
        )
        settled = probe_cache.load("ggml-kernels", self.probe_parts, _read_kernel_choice)
        if settled is None:
            settled = self._choose_kernels()
            probe_cache.store("ggml-kernels", self.probe_parts, dict(zip(KERNEL_FIELDS, settled, strict=True)))
        self.flash_attn, self.pad_single, self.batch_invariant, self.threads = settled
        if not self.batch_invariant:
            log.warning(
                "fimble: %s: llama.cpp's logits depend on the block size here; speculative output "
                "may differ from plain decoding at near-ties",
                path.name,
            )

    def _choose_kernels(self) -> tuple[bool, bool, bool, int]:
        """(flash attention, pad 1-token passes, blocks equal steps, threads): probed on this build."""
        wanted = self.threads
        flash, pad, invariant = self._probe_shapes()
        if not invariant and wanted > 1:
            # A safety net: with flash attention on and 2 threads, q8_0 blocks differed from 1-token steps
            # here (speculative output equalled plain on 19/24 prompts); on fimble's build the probe finds
            # flash attention off equal with 2 threads too. Where nothing is, lossless comes before speed.
            self.threads = 1
            flash, pad, invariant = self._probe_shapes()
            if invariant:
                log.warning(
                    "fimble: %s: llama.cpp's blocks equal its 1-token steps only with 1 thread here; "
                    "using 1 thread, not %d, so speculative output stays equal to plain decoding",
                    self.path.name,
                    wanted,
                )
            else:
                self.threads = wanted
        return flash, pad, invariant, self.threads

    def __del__(self) -> None:
        # A cache and its runtime dropped together (a reference cycle, a test's engines) are finalised in any
        # order: the model is freed only once no context of it is left, or a context freed after it would touch
        # freed memory. At interpreter exit nothing is freed: the process ends, and llama.cpp's objects torn down
        # in arbitrary order crashed a test run's exit (SIGSEGV after the last test, 2026-12-04).
        self._closing = True
        if getattr(self, "_contexts", 0) == 0:
            self._free_model()

    def context_closed(self) -> None:
        self._contexts -= 1
        if self._contexts == 0 and getattr(self, "_closing", False):
            self._free_model()

    def _free_model(self) -> None:
        if getattr(self, "model", None) is not None and not sys.is_finalizing():
            self.lib.lib.llama_model_free(self.model)
            self.model = None

    def new_cache(self, max_len: int | None = None) -> GGMLCache:
        return GGMLCache(self, max_len or self.cfg.max_position_embeddings)

    def _probe_shapes(self) -> tuple[bool, bool, bool]:
        """(flash attention, pad 1-token passes to 2, blocks are bit-identical to steps): the first setting,
        preferred flash attention first, whose blocks equal 1-token steps on this build, at a realistic
        depth (kernels can switch with the number of cached positions)."""
        lib = self.lib
        # Padding costs a whole extra row a step: both flash settings unpadded before either padded.
        for flash, pad in ((f, pad) for pad in (False, True) for f in (self.flash_first, not self.flash_first)):
            self.flash_attn = flash
            d = FLASH_PROBE_DEPTH if flash else PROBE_DEPTH
            toks = [(i * 7919 + 11) % self.vocab for i in range(d + INVARIANT_ROWS)]
            cache = self.new_cache(d + INVARIANT_ROWS + 8)
            for a, b in _blocks(d, 1, flash):
                lib.decode(cache.ctx, cache.batch, toks[a:b], a, 1, self.vocab)

            def run(start: int, block: list[int], cache: GGMLCache = cache, pad: bool = pad) -> np.ndarray:
                if pad and len(block) == 1:
                    return lib.decode(cache.ctx, cache.batch, block * 2, start, 2, self.vocab)[:1]
                return lib.decode(cache.ctx, cache.batch, block, start, len(block), self.vocab)

            steps = np.concatenate([run(d + i, [toks[d + i]]) for i in range(INVARIANT_ROWS)])
            blocks = [run(d, toks[d : d + k]) for k in (INVARIANT_ROWS, 6, 3, 2)]
            if all(np.array_equal(b, steps[: len(b)]) for b in blocks):
                return flash, pad, True
        return True, False, False

    def __call__(
        self, tokens: torch.Tensor, cache: GGMLCache, start: int | None = None, num_logits: int = 1
    ) -> torch.Tensor:
        """Run ``tokens`` at positions ``start..``; float32 logits [num_logits, vocab] of the last ones."""
        import torch

        return torch.from_numpy(self.numpy_logits([int(t) for t in tokens.tolist()], cache, start, num_logits))

    def numpy_logits(
        self, ids: list[int], cache: GGMLCache, start: int | None = None, num_logits: int = 1
    ) -> np.ndarray:
        """``__call__`` on token ids, with numpy logits: the greedy decoding loop's path (no torch call)."""
        start = cache.length if start is None else start
        t = len(ids)
        end = start + t
        if start > cache.length:
            raise ValueError(f"position {start} leaves a gap after cache length {cache.length}")
        if end > cache.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache's {cache.max_len}")
        num_logits = max(1, min(num_logits, t))
        rows: list[np.ndarray] = []
        for a, b in _blocks(t, num_logits, self.flash_attn):
            want = max(0, b - max(t - num_logits, a))  # rows of this block among the last num_logits
            out = self._decode(cache, ids[a:b], start + a, want)
            if want:
                rows.append(out)
        cache.length = end
        return np.concatenate(rows) if len(rows) > 1 else rows[0]

    def _decode(self, cache: GGMLCache, block: list[int], pos: int, want: int) -> np.ndarray:
        """One llama_decode; logits of the block's last ``want`` rows. In pad mode no pass has one row,
        and none outputs one row."""
        lib, n = self.lib, len(block)
        if self.pad_single and n == 1 and pos + 2 <= cache.n_ctx:
            return lib.decode(cache.ctx, cache.batch, block * 2, pos, 2, self.vocab)[:want]
        k = min(n, max(want, 2)) if self.pad_single and want else want
        return lib.decode(cache.ctx, cache.batch, block, pos, k, self.vocab)[k - want :]


def _blocks(t: int, num_logits: int, flash_attn: bool) -> list[tuple[int, int]]:
    """[a, b) passes for ``t`` tokens, in order (a pass may start before the previous one ended: the
    decode drops the cache from its start). Up to INVARIANT_ROWS tokens: one pass (its rows equal
    1-token steps'). Longer, with logits on several rows: passes of INVARIANT_ROWS. A longer prefill:
    llama.cpp's own split, ubatches of LLAMA_UBATCH with the last token inside the last, each passed
    in near-equal pieces of at most PREFILL_BATCH rows, so that every prompt row runs the kernels it
    runs in llama.cpp's own prefill:
    - flash attention off: f32 weights' and attention's f16 products take ggml's own path up to 32
      rows and tinyBLAS above (the build's patch), while llama.cpp runs tinyBLAS from 2 rows. Pieces of a ubatch of 33+
      rows have 33+ rows; a last ubatch of 2-32 rows is run as the last 33 tokens (recomputing a few
      rows of the previous ubatch, to the same bits), so it runs tinyBLAS as in llama.cpp.
    - flash attention on: its tiled kernel runs for passes of 64+ rows (GGML_FA_TILE_Q), the per-row
      kernel below; pieces of a ubatch of 64+ rows have 64+ rows (at least PREFILL_BATCH / 2), and a
      smaller ubatch passes whole.
    Measured: fimble's greedy output then equals llama.cpp's on 24/24 bench prompts (bench/vs_llamacpp.py)."""
    if t <= INVARIANT_ROWS:
        return [(0, t)]
    if num_logits > 1:
        return [(a, min(t, a + INVARIANT_ROWS)) for a in range(0, t, INVARIANT_ROWS)]
    passes: list[tuple[int, int]] = []
    for a in range(0, t, LLAMA_UBATCH):
        b = min(t, a + LLAMA_UBATCH)
        if not flash_attn and 2 <= b - a <= INVARIANT_ROWS:
            passes.append((t - INVARIANT_ROWS - 1, t))  # t > LLAMA_UBATCH here: a full ubatch came before
            continue
        k = -(-(b - a) // PREFILL_BATCH)
        edges = [a + (b - a) * i // k for i in range(k + 1)]
        passes += list(itertools.pairwise(edges))
    return passes


# -- models ---------------------------------------------------------------------------------
def cache_dir() -> Path:
    return probe_cache.cache_root() / "gguf"


def cached_gguf(folder: Path, qtype: str) -> Path:
    """A GGUF of the HF ``folder`` (written once, keyed by the source files' names, sizes and times)."""
    from engine.runtimes.gguf_export import export_gguf

    h = hashlib.sha256(f"{EXPORT_VERSION}:{qtype}:{folder.resolve()}".encode())
    for f in sorted(folder.iterdir()):
        if f.suffix in (".json", ".safetensors"):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = cache_dir() / f"{folder.name}-{qtype}-{h.hexdigest()[:16]}.gguf"
    if out.is_file():
        return out
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        export_gguf(folder, tmp, qtype)
        os.replace(tmp, out)
    except OSError as exc:
        raise ModelLoadError(f"cannot write the GGUF cache {out.parent}: {exc.strerror or exc}") from None
    except ModelLoadError:
        raise
    except Exception as exc:  # unreadable safetensors, shapes that do not fit the config: one line
        raise ModelLoadError(f"cannot read weights in {folder}: {type(exc).__name__}: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _weights_parts(lib, path: Path) -> tuple[str, ...]:
    return (
        probe_cache.library_identity(lib.source),
        probe_cache.library_settings(),
        probe_cache.file_identity(path),
        f"probe={PROBE_TOKENS}",
    )


def load_weights(lib, path: Path) -> tuple[object, bool]:
    """(llama.cpp's model, its weights mapped from the file; whether they passed the checks before). The checks,
    llama.cpp's scan of every weight for NaN/Inf and ``_check_probe``'s pass, answer the same for the same file
    and build: once both passed, that is remembered under their identities (engine/runtimes/probe_cache.py) and
    later starts skip them."""
    checked = probe_cache.load("ggml-weights-checked", _weights_parts(lib, path), _read_checked) is True
    model = lib.load_model(str(path), check_tensors=not checked)
    if model is None:
        raise ModelLoadError(f"{path.name}: llama.cpp cannot load it: {lib.last_error()}")
    return model, checked


class WeightsLoad:
    """``load_weights`` on a thread: llama.cpp reads the file's header and builds its own vocabulary (most of a
    load: ~0.6 s for Qwen's 151,936 tokens on a 2-core CPU) in C, without the GIL, while the caller reads the same
    header for fimble's tokenizer. Then one short pass, which reads every weight once (the mapped file's pages
    come in here, not in the first completion): ``_check_probe``'s pass where the file is not checked yet."""

    def __init__(self, path: Path):
        self.lib, self.path = get_lib(), path
        self._answer: tuple[object, bool] | None = None
        self._error: BaseException | None = None
        self.probe_finite: bool | None = None  # the probe pass's verdict, where it ran here
        self._thread = threading.Thread(target=self._run, name="fimble-ggml-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._answer = load_weights(self.lib, self.path)
            model, checked = self._answer
            finite = _probe_pass(self.lib, model, 1 if checked else PROBE_TOKENS, resolve_threads())
            self.probe_finite = None if checked else finite
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by result()
            self._error = exc

    def result(self) -> tuple[object, bool]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer

    def discard(self) -> None:
        """The caller failed first: free the model once it is loaded."""
        self._thread.join()
        if self._answer is not None:
            self.lib.lib.llama_model_free(self._answer[0])
            self._answer = None


def _probe_pass(lib, model, n: int, threads: int) -> bool:
    """Whether ``n`` tokens spread over the vocabulary give finite logits (weights_check.bad_probe's pass, on
    llama.cpp's own calls: weights_check imports torch)."""
    vocab = lib.n_vocab(model)
    n = max(1, min(n, vocab))
    ctx, batch = lib.new_context(model, n, n, threads, False), lib.new_batch(n)
    try:
        tokens = [(i * 7919 + 1) % vocab for i in range(n)]
        return bool(np.isfinite(lib.decode(ctx, batch, tokens, 0, n, vocab)).all())
    finally:
        lib.lib.llama_batch_free(batch)
        lib.lib.llama_free(ctx)


def _check_probe(runtime: GGMLRuntime, source: object, finite: bool | None = None) -> None:
    """Refuse weights whose probe pass gives NaN or Inf (``finite``: its verdict where ``WeightsLoad`` ran it);
    skipped where the file passed it before (``load_weights``)."""
    if runtime.weights_checked:
        return
    if finite is None:
        finite = _probe_pass(runtime.lib, runtime.model, PROBE_TOKENS, runtime.threads)
    if not finite:
        raise ModelLoadError(f"weights in {source} are corrupt: a probe forward pass gives NaN or Inf logits")
    probe_cache.store("ggml-weights-checked", _weights_parts(runtime.lib, runtime.path), {"finite": True})


def folder_runtime(folder: Path, cfg: dict, quant: str) -> GGMLRuntime:
    """The ggml runtime of a HF folder (exported to a cached GGUF first): f32, or q8_0 for ``int8``."""
    compact_cfg = CompactConfig.from_hf_dict(cfg)  # the same architectures as the compact runtime
    path = cached_gguf(folder, "q8_0" if quant == "int8" else "f32")
    runtime = GGMLRuntime(path, compact_cfg)
    _check_probe(runtime, folder)
    return runtime


def gguf_model(path: Path):
    """A GGUF file on the ggml runtime: engine.runtimes.gguf_loader.GGUFModel, tokenizer and template from the file."""
    from engine.runtimes.gguf_loader import GGUFModel, _config, _template, _tokenizer, open_meta

    loading = WeightsLoad(path)  # llama.cpp loads on a thread while the tokenizer is built here
    try:
        reader = open_meta(path)  # llama.cpp reads the tensors: only the metadata is needed here
        cfg, _ = _config(reader, path)
        tokenizer, tokens = _tokenizer(reader, path)
        template, stops = _template(reader, tokens)
    except BaseException as exc:
        loading.discard()
        if isinstance(exc, ModelLoadError) or not isinstance(exc, Exception):
            raise
        # a GGUF with missing or malformed entries
        raise ModelLoadError(f"{path.name} is a malformed GGUF file: {type(exc).__name__}: {exc}") from None
    del reader
    runtime = GGMLRuntime(path, cfg, loaded=loading.result())
    _check_probe(runtime, path, loading.probe_finite)
    notice = (
        None
        if template
        else (
            f"model {path.name} has no fill-in-the-middle tokens: completing from the "
            "text before the cursor only (the text after it is not used)"
        )
    )
    return GGUFModel(runtime, tokenizer, template, stops, cfg.max_position_embeddings, notice)


__all__ = [
    "GGMLCache",
    "GGMLRuntime",
    "cached_gguf",
    "default_threads",
    "flash_preference",
    "folder_runtime",
    "gguf_model",
    "resolve_threads",
]
