"""Install step: build llama.cpp's CPU library for the ggml runtime (the README's commands run it).

    python -m engine.runtimes.ggml_build [--jobs N] [--force] [--check]

Why it builds: PyPI has no llama.cpp library that loads on Debian 12. ``llama-cpp-python`` ships
only a source archive, and the one prebuilt wheel (``llama-cpp-py-sync``) needs glibc >= 2.38.
Measured here: this build takes 4-6 minutes on 2 cores.

Why llama.cpp is patched (engine/runtimes/ggml_patch.py holds the edits): fimble is lossless, so a
verify block's logits must equal 1-token steps' bit for bit. Stock ggml sends products with one row
through its own path (gemv-like: one vec_dot per output), but 2 or more rows of f32 and f16 (and q8_0)
products through llamafile's tinyBLAS. The two sum in different orders, so logits differ by up to
3e-3. The patch gives each product one path for 1 to 32 rows (verify blocks run in passes of at most
32; engine/runtimes/ggml_runtime.py):
- f32 weights and f16 products (attention's keys and values, flash attention off): ggml's own path,
  stock's 1-row path, up to 32 rows; tinyBLAS from 33, as stock. So a 1-token step runs exactly
  stock's kernels at stock's speed, and every row of a 2-32-row block runs the same sum as a step.
  Prefill passes of 33+ rows run stock's tinyBLAS (the runtime lengthens a shorter last prefill
  pass to 33), so fimble's greedy output equals llama.cpp's (q8_0 aside: below).
- ggml's own path reads each weight row once for two or three rows of a block (stock: once per row),
  each sum in ggml_vec_dot_f32's (f16: ggml_vec_dot_f16's) exact order: blocks cost less, so
  speculation pays more.
- q8_0 weights: stock's gemv and tinyBLAS already agree bit for bit, but tinyBLAS's tiles cost about
  0.8 of a step per extra row. On every x86 CPU with AVX2, every q8_0 product, 1-token steps and
  prefills included, runs fimble's lane-order kernel (ggml_patch.py, item 3; AVX-512 VNNI's where the
  CPU has it, chosen at run time, else AVX2's, and the two agree bit for bit): faster steps, rows and
  prefills, every row equal to a step's, but sums in an order of fimble's own, not stock's
  (bench/verify_rows.py has the figures). FIMBLE_Q8_0_AVX2=1 restores stock's order: ggml's own path
  reading each weight block once for up to 16 rows, each sum in ggml_vec_dot_q8_0_q8_0's exact order.
  On the AVX2 lane kernel the q8_0 weights are packed in its lane order when the model loads (ggml's
  CPU_REPACK buffer type; ggml_patch_packed.py): the same sums, without a transpose in every pass.
- Flash attention stays off, as llama-cpp-python runs it: with it on, a 1-token step costs ~12% more
  and each verify row ~50% more here (the kernel is per row), so speculation stops paying.
Measured on this 2-core AVX2 CPU, 1 thread, embedded target f32, 900 cached positions (ms for 1 / 2 /
4 / 8 rows; median of 55, three interleaved runs each):
- stock (not invariant): 5.3-5.8 / 11.5-12.3 / 15.1-16.3 / 20.5-21.7;
- the first patch, f32 through tinyBLAS from 1 row: 8.4-8.9 / 11.5-12.0 / 16.0-16.4 / 23.1-24.0
  (tinyBLAS keeps one accumulator per output, a serial chain of FMAs; ggml's vec_dot keeps four);
- ggml's own path up to 32 rows, one row a pass: 5.3-5.8 / 8.4-8.9 / 13.7-13.9 / 22.9-23.9;
- with two f32 rows a pass: 5.6-6.4 / 6.1-7.1 / 11.2-11.7 / 19.4-20.8.
Then, pinned to one core, 20th percentile of 145, three interleaved runs (1 / 2 / 3 / 4 / 5 rows): two
f32 rows a pass 4.7-5.8 / 5.7-6.4 / 9.5-10.2 / 10.9-11.3 / 13.3-13.5; adding three f32 rows and two
f16 rows a pass 5.2-5.6 / 5.5-6.2 / 7.4-7.9 / 10.1-10.4 / 11.7-12.2.
Alternatives dropped: llamafile off altogether (invariant, but prefill 1.66x slower); stock with
flash attention on and every 1-token step run as 2 rows (30-40% slower decode); four f32 rows a pass
(16 accumulators spill AVX2's 16 registers: 2-row blocks got slower, 4-row ones no faster).

Steps:
1. Fetch the pinned llama-cpp-python source archive from the package index (``pip download``) and
   check its sha256.
2. Install its Python bindings without their own compile (``CMAKE_ARGS=-DLLAMA_BUILD=OFF``).
3. Patch the vendored llama.cpp and build only ``libllama`` and ``libggml*`` (``-march=native``:
   it runs where it was built).
4. Install the libraries into ``<venv>/lib/fimble-ggml``, with ``$ORIGIN`` rpaths.
5. Write a stamp, so a second run with the same version and patch does nothing.

engine/runtimes/ggml_lib.py loads from there. Nothing is fetched at run time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from engine.runtimes.ggml_patch import PATCHES

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PATCH_ID = hashlib.sha256(repr(PATCHES).encode()).hexdigest()[:12]
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_CURL=OFF",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    # The x86 kernels the patch and the lossless probes were checked on: AVX2/FMA/F16C, not -march=native.
    # A native build on an AVX-512/AMX Xeon (the CI machine of 2026-12-02) segfaulted in a q8_0 llama_decode
    # during the load-time probe, on the unchanged engine; the AVX2 build runs there. ARM builds ignore these.
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
]


def lib_dir() -> Path:
    """Where the built libraries live: inside the environment that built them."""
    return Path(sys.prefix) / "lib" / "fimble-ggml"


def stamp() -> dict:
    return {"package": PACKAGE, "version": VERSION, "patch": PATCH_ID, "flags": CMAKE_FLAGS}


def is_built() -> bool:
    try:
        return json.loads((lib_dir() / "build.json").read_text()) == stamp() and (lib_dir() / "libllama.so").is_file()
    except (OSError, ValueError):
        return False


def say(msg: str) -> None:
    print(f"fimble ggml build: {msg}", flush=True)


def run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None, log: Path) -> None:
    """Run a build command with its output in ``log``; on failure, show the log's tail and stop."""
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        rc = subprocess.call(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        head = " ".join(cmd[:4])
        sys.exit(f"fimble ggml build: `{head} ...` failed ({rc}); the build log ends:\n" + "\n".join(tail))


def fetch_sdist(work: Path, log: Path) -> Path:
    pip = [sys.executable, "-m", "pip"]
    run(
        [*pip, "download", "-q", "--no-deps", "--no-binary", ":all:", f"{PACKAGE}=={VERSION}", "-d", str(work)], log=log
    )
    sdist = work / SDIST
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"fimble ggml build: {SDIST} has sha256 {digest}, expected {SDIST_SHA256}; not building it")
    return sdist


def install_bindings(sdist: Path, log: Path) -> None:
    """llama-cpp-python's ctypes bindings only: its own copy of llama.cpp is not compiled."""
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
    run([sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", str(sdist)], env=env, log=log)


def patch_source(src: Path) -> None:
    """Apply every edit of PATCHES, or none: a source whose texts differ stops the build."""
    texts = {rel: (src / rel).read_text() for rel in {rel for rel, _, _ in PATCHES}}
    for rel, old, new in PATCHES:
        if texts[rel].count(old) != 1:
            sys.exit(f"fimble ggml build: {rel} is not the expected source (the patch does not apply)")
        texts[rel] = texts[rel].replace(old, new)
    for rel, text in texts.items():
        (src / rel).write_text(text)


def cmake_binary() -> str:
    found = shutil.which("cmake")
    if found:
        return found
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "cmake>=3.21"])  # a PyPI wheel
    return str(Path(sys.executable).parent / "cmake")


def build(jobs: int, force: bool) -> Path:
    if is_built() and not force:
        say(f"up to date in {lib_dir()}")
        return lib_dir()
    with tempfile.TemporaryDirectory(prefix="fimble-ggml-") as tmp:
        work = Path(tmp)
        log = work / "build.log"
        say(f"fetching {PACKAGE} {VERSION} (source)")
        sdist = fetch_sdist(work, log)
        say("installing its Python bindings (no compile)")
        install_bindings(sdist, log)
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        src = work / SDIST.removesuffix(".tar.gz")
        patch_source(src)
        cmake = cmake_binary()
        llama_cpp = src / "vendor" / "llama.cpp"
        build_dir = work / "build"
        say(f"compiling llama.cpp's CPU library with {jobs} jobs (4-6 minutes on 2 cores)")
        run([cmake, "-S", str(llama_cpp), "-B", str(build_dir), *CMAKE_FLAGS], log=log)
        run([cmake, "--build", str(build_dir), "--target", "llama", "-j", str(jobs)], log=log)
        out = lib_dir()
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for lib in sorted(build_dir.rglob("lib*.so*")):
            if lib.name.startswith(("libllama.", "libggml")):
                shutil.copy2(lib, out / lib.name, follow_symlinks=False)
        if not (out / "libllama.so").exists():
            sys.exit(f"fimble ggml build: no libllama.so was built (see {log})")
        (out / "build.json").write_text(json.dumps(stamp(), indent=1))
    say(f"done: {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    ap.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    ap.add_argument("--check", action="store_true", help="only say whether the library is built (exit 1 if not)")
    args = ap.parse_args()
    if args.check:
        say(f"built in {lib_dir()}" if is_built() else "not built")
        sys.exit(0 if is_built() else 1)
    if not 1 <= args.jobs <= 256:
        sys.exit("fimble ggml build: --jobs must be 1-256")
    build(args.jobs, args.force)


if __name__ == "__main__":
    main()
