"""What a load-time probe learns about a (library build, model file, thread count), kept on disk.

Why: the batch-invariance probe (engine/runtimes/ggml_runtime.py) and the verify-cost probe
(engine/decoding/spec_policy.py) took about 27 s of a 38 s start with the default model on a 2-core CPU,
and both answer the same for the same library build, model file and settings; so does the healing
token index's decode of every token (about 4 s for Qwen's vocabulary, engine/loader.py). So each answer
is written once under ``<cache>/probes/`` and read back on the next start.

Trust: an entry is found only under the key of everything its answer depends on (the library files'
names, sizes and modification times, the model file's resolved path, size and modification time, the
probe's own version and settings). A changed build, file or thread count is a new key, so it is probed
again. An entry that cannot be read, is not JSON, or fails its reader's checks is ignored (and
overwritten by the next probe), never trusted. ``FIMBLE_PROBE_CACHE=off`` probes on every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import env_settings

log = logging.getLogger("fimble.probe_cache")

CACHE_VERSION = "1"  # bump when an entry's meaning changes
MAX_ENTRY_BYTES = 64 * 1024  # a probe's answer is a few numbers: anything larger is not one of ours
LIBRARY_SUFFIXES = (".so", ".dylib", ".dll")


def enabled() -> bool:
    return env_settings.read("FIMBLE_PROBE_CACHE")


def cache_root() -> Path:
    """fimble's cache folder: ``$FIMBLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/fimble`` or ``~/.cache/fimble``
    (exported GGUFs live beside the probes, engine/runtimes/ggml_runtime.py)."""
    root = env_settings.read("FIMBLE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fimble"
    )
    return Path(root)


def probe_dir() -> Path:
    return cache_root() / "probes"


def file_identity(path: str | os.PathLike) -> str:
    """Resolved path, size and modification time: a rebuilt or replaced file reads differently."""
    p = Path(path).resolve()
    st = p.stat()
    return f"{p}:{st.st_size}:{st.st_mtime_ns}"


def library_identity(source: str) -> str:
    """The loaded llama.cpp build: the identity of each shared library in its folder (or of the file)."""
    p = Path(source)
    try:
        if p.is_dir():
            libs = sorted(f for f in p.iterdir() if f.is_file() and any(s in f.name for s in LIBRARY_SUFFIXES))
            return "|".join(file_identity(f) for f in libs) or f"{p.resolve()}:empty"
        if p.exists():
            return file_identity(p)
    except OSError:
        pass
    return f"unlocated:{source}"  # e.g. a binding named by its package: keyed by name only


# What fimble's patched library reads from the environment (getenv in engine/runtimes/ggml_patch*.py): each picks its
# q8_0 kernel, so a probe's answer (verify costs above all) belongs to their values as much as to the build.
LIBRARY_SETTINGS = ("FIMBLE_Q8_0_AVX2", "FIMBLE_Q8_0_LANES", "FIMBLE_Q8_0_PACK")


def library_settings() -> str:
    """The library's environment settings as given (unset: empty), a part of every key of its probes."""
    return ",".join(f"{name}={os.environ.get(name, '')}" for name in LIBRARY_SETTINGS)


def key(kind: str, parts: tuple[str, ...]) -> str:
    h = hashlib.sha256(f"{CACHE_VERSION}\0{kind}".encode())
    for part in parts:
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:32]


def _path(kind: str, parts: tuple[str, ...]) -> Path:
    return probe_dir() / f"{kind}-{key(kind, parts)}.json"


def load(
    kind: str, parts: tuple[str, ...], read: Callable[[dict], Any], max_bytes: int = MAX_ENTRY_BYTES
) -> Any | None:
    """``read(entry)`` of the stored entry, or None where there is none or it fails ``read``'s checks
    (``read`` raises on anything it does not accept)."""
    if not enabled():
        return None
    path = _path(kind, parts)
    try:
        if path.stat().st_size > max_bytes:
            raise ValueError("too large")
        entry = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(entry, dict) or entry.get("kind") != kind or entry.get("key") != key(kind, parts):
            raise ValueError("not this probe's entry")
        return read(entry["value"])
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001  (corrupt, truncated or foreign: probe again)
        log.info("fimble: ignoring the cached %s probe (%s); probing again", kind, type(exc).__name__)
        return None


def store(kind: str, parts: tuple[str, ...], value: dict) -> None:
    """Write an entry atomically (a reader sees the old one or the new one, never half); a cache that
    cannot be written costs only the next start's probe."""
    if not enabled():
        return
    path = _path(kind, parts)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"kind": kind, "key": key(kind, parts), "value": value}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.info("fimble: could not cache the %s probe (%s)", kind, type(exc).__name__)
        try:
            tmp.unlink()
        except OSError:
            pass
