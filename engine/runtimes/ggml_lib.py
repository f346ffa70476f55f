"""The few llama.cpp C calls the ggml runtime needs, over whichever libllama is installed.

Where the library comes from, in the order tried:
- ``llama-cpp-python``'s ctypes bindings over the library fimble builds at install time
  (``python -m engine.runtimes.ggml_build``, into ``<venv>/lib/fimble-ggml``: llama.cpp with its
  f32 1-row products on tinyBLAS, so verify blocks equal 1-token steps without padding), or over
  ``$LLAMA_CPP_LIB_PATH``, or over the package's own build (the ``bench`` extra compiles one);
- ``llama-cpp-py-sync`` (the ``ggml`` extra): a 5.5 MB manylinux wheel, CFFI ABI-mode bindings,
  no compile. Its libraries need glibc >= 2.38 (they import ``__isoc23_strtol`` & co. although the
  wheel is tagged manylinux2014), so they load on Debian 13 / Ubuntu 24.04 and newer, not on
  Debian 12 (glibc 2.36).

Each binding matches its own library's struct layouts, so this module uses theirs and only papers
over cffi vs ctypes. ``FIMBLE_GGML_LIB=py-sync|llama-cpp-python`` picks one.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque

import numpy as np

from engine import env_settings
from engine.errors import ModelLoadError

BACKENDS = env_settings.setting("FIMBLE_GGML_LIB").choices  # llama-cpp-python, py-sync: tried in this order
_lock = threading.Lock()
_lib: LlamaLib | None = None
_failures: list[str] = []


class LlamaLib:
    """llama.cpp's C API as plain Python calls (pointers stay opaque)."""

    def __init__(self, name: str, lib, ffi=None, source: str = ""):
        self.name, self.lib, self.ffi = name, lib, ffi
        self._float_arrays: dict[int, type] = {}  # ctypes float array types by length (logits views)
        self.source = source or name  # where the library was loaded from, for reports
        self.errors: deque[str] = deque(maxlen=4)  # llama.cpp's last error lines, for load errors
        self.null = ffi.NULL if ffi is not None else None
        self._log_cb = self._make_log_callback()
        lib.llama_log_set(self._log_cb, self.null if ffi is not None else ctypes.c_void_p(0))
        lib.llama_backend_init()

    def _make_log_callback(self):
        def on_log(level, text, _user) -> None:
            # Quiet by default (llama.cpp prints a page per model load); keep errors (level 4) for messages.
            if level == 4 and text:
                raw = self.ffi.string(text) if self.ffi is not None else text
                line = raw.decode("utf-8", "replace").strip()
                if line:
                    self.errors.append(line)

        if self.ffi is not None:
            return self.ffi.callback("ggml_log_callback", on_log)
        import llama_cpp.llama_cpp as L

        return L.llama_log_callback(on_log)

    def is_null(self, ptr) -> bool:
        return ptr == self.ffi.NULL if self.ffi is not None else not ptr

    def system_info(self) -> str:
        info = self.lib.llama_print_system_info()
        return (self.ffi.string(info) if self.ffi is not None else info).decode()

    # -- model and contexts ------------------------------------------------------------
    def load_model(self, path: str, check_tensors: bool = True):
        """The model, its weights mapped from the file; ``check_tensors``: llama.cpp reads every weight first and
        refuses NaN/Inf (a load error, as for the compact loader): a pass over the whole file, ~1 s for 0.5B q8_0."""
        params = self.lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.check_tensors = check_tensors
        self.errors.clear()
        model = self.lib.llama_model_load_from_file(path.encode(), params)
        return None if self.is_null(model) else model

    def new_context(self, model, n_ctx: int, n_batch: int, threads: int, flash_attn: bool = True):
        p = self.lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_batch, 1
        p.n_threads = p.n_threads_batch = threads
        p.no_perf = True
        # The runtime decides (engine/runtimes/ggml_runtime.py flash_preference and its load-time probe):
        # off unless FIMBLE_GGML_FLASH=on, as llama-cpp-python runs it; faster here.
        p.flash_attn_type = 1 if flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        ctx = self.lib.llama_init_from_model(model, p)
        if self.is_null(ctx):
            raise ModelLoadError(f"llama.cpp cannot make a context of {n_ctx} tokens: {self.last_error()}")
        return ctx

    def last_error(self) -> str:
        return self.errors[-1] if self.errors else "no reason given"

    def n_vocab(self, model) -> int:
        return int(self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(model)))

    def n_ctx(self, ctx) -> int:
        return int(self.lib.llama_n_ctx(ctx))

    # -- decoding ----------------------------------------------------------------------
    def new_batch(self, n: int):
        return self.lib.llama_batch_init(n, 0, 1)

    def decode(self, ctx, batch, tokens: list[int], start: int, outputs: int, vocab: int) -> np.ndarray:
        """Run ``tokens`` at positions ``start..`` of sequence 0 (dropping whatever the cache held from
        ``start`` on); return float32 logits [outputs, vocab] of the last ``outputs`` tokens."""
        lib = self.lib
        n = len(tokens)
        lib.llama_memory_seq_rm(lib.llama_get_memory(ctx), 0, start, -1)
        batch.n_tokens = n
        first_out = n - outputs
        tok, pos, nseq, seq, want = batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits
        for i, t in enumerate(tokens):
            tok[i], pos[i], nseq[i] = t, start + i, 1
            seq[i][0] = 0
            want[i] = 1 if i >= first_out else 0
        rc = lib.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}): {self.last_error()}")
        if outputs == 0:
            return np.empty((0, vocab), dtype=np.float32)
        ptr = lib.llama_get_logits(ctx)
        count = outputs * vocab
        if self.ffi is not None:
            out = np.frombuffer(self.ffi.buffer(ptr, count * 4), dtype=np.float32)
        else:  # a float array at the pointer's address: 2 us, against 15 for np.ctypeslib.as_array (per step)
            kind = self._float_arrays.get(count)
            if kind is None:
                kind = self._float_arrays[count] = ctypes.c_float * count
            out = np.frombuffer(kind.from_address(ctypes.addressof(ptr.contents)), dtype=np.float32)
        return out.reshape(outputs, vocab).copy()

    def seq_rm(self, ctx, p0: int) -> None:
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(ctx), 0, p0, -1)

    def copy_sequence(self, src_ctx, dst_ctx) -> None:
        """Copy sequence 0's keys/values from one context into another (cells keep their order)."""
        lib = self.lib
        size = int(lib.llama_state_seq_get_size(src_ctx, 0))
        buf = self.ffi.new("uint8_t[]", size) if self.ffi is not None else (ctypes.c_uint8 * size)()
        got = int(lib.llama_state_seq_get_data(src_ctx, buf, size, 0))
        self.seq_rm(dst_ctx, 0)
        if got == 0 or int(lib.llama_state_seq_set_data(dst_ctx, buf, got, 0)) == 0:
            raise RuntimeError(f"llama.cpp could not copy a sequence: {self.last_error()}")


def _load(name: str) -> LlamaLib:
    if name == "py-sync":
        from llama_cpp_py_sync._cffi_bindings import get_ffi, get_lib

        return LlamaLib(name, get_lib(), get_ffi())
    from engine.runtimes.ggml_build import is_built, lib_dir

    if not os.environ.get("LLAMA_CPP_LIB_PATH") and is_built():
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir())  # read by llama_cpp when it is first imported
    import llama_cpp.llama_cpp as L  # llama-cpp-python: loads its libllama on import

    return LlamaLib(name, L, source=str(L._base_path))


def get_lib() -> LlamaLib:
    """The loaded library (loaded once); ModelLoadError with every reason if none loads."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        try:
            forced = env_settings.read("FIMBLE_GGML_LIB")  # "" (each in turn) or one of BACKENDS
        except env_settings.SettingError as exc:
            raise ModelLoadError(str(exc)) from None
        _failures.clear()
        for name in (forced,) if forced else BACKENDS:
            try:
                _lib = _load(name)
                return _lib
            except Exception as exc:  # ImportError, or a library the system's glibc cannot load
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                _failures.append(f"{name}: {first[:300]}")
        raise ModelLoadError(
            "the ggml runtime needs llama.cpp's library: run `python -m engine.runtimes.ggml_build` "
            f"(the README's install step); {'; '.join(_failures)}"
        )


def unavailable_reason() -> str | None:
    """None when a libllama loads here, else why not (tests skip with it)."""
    try:
        get_lib()
    except ModelLoadError as exc:
        return str(exc)
    return None
