"""The q8_0 lane kernel alone, blocks against packed weights (engine/runtimes/ggml_patch_packed.py), on this CPU.

    python -m bench.q8_kernel [--mb 571] [--columns 896,4864] [--repeats 3] [--quick] [--json PATH]

Compiles the patch's own C text (ggml_patch_lanes.py, ggml_patch_lanes_avx2.py, ggml_patch_packed.py) with a small
driver (gcc, -mavx2 -mfma -mf16c, as the library is built), then on one thread streams ``--mb`` MB of random q8_0
weights (the default model's size) through the AVX2 lane kernel with 1, 2, 3, 4, 8 and 16 activation rows: the
weights as blocks (what the kernel gathers and transposes in every pass) and packed at load (what it loads), the
variants interleaved, the fastest of ``--repeats``. Every result of the packed kernel is compared with the block
kernel's, bit for bit, on a sample of the weights (extremes included: -128 weights).

The floor: each row's 32 products of a block take a load, a vpsignb, a vpmaddubsw, a vpmaddwd and an add. On this
project's CPU (Zen 3, family 25: the sign and both multiplies issue two a cycle, on shared pipes) that runs at about
2 cycles per block and row with the weights in cache, so many-row passes are bound by these vector operations, not
by one port. The table gives each pass in ns per block and row, and that in cycles at the clock the driver measures
(a chain of dependent adds, one a cycle; a VM's /proc/cpuinfo reports a nominal clock). Not a test: timings, on
whatever else runs.
The headline, last: the packed kernel's 4- and 8-row passes against its 1-row pass, and its cycles per block-row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.runtimes.ggml_patch_lanes import LANES_KERNEL
from engine.runtimes.ggml_patch_lanes_avx2 import LANES_AVX2_KERNEL
from engine.runtimes.ggml_patch_packed import PACKED_KERNEL

ROWS = (1, 2, 3, 4, 8, 16)

# What quants.c gives the kernel text: ggml's block type and hsum_float_8, the row limits, the CPU check.
PRELUDE = r"""#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <assert.h>
#include <string.h>
#include <time.h>
#define GGML_RESTRICT __restrict__
#define QK8_0 32
#define FIMBLE_Q8_0_ROWS 16
#define FIMBLE_Q8_0_MAX_N 32768
#define GGML_ABORT(...) abort()
typedef uint16_t ggml_half;
typedef struct { ggml_half d; int8_t qs[32]; } block_q8_0;
static inline float hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}
int fimble_q8_0_lanes(void) { return 1; }  // the AVX2 lane kernel
"""

DRIVER = r"""
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
// The core's clock while busy: a chain of dependent adds, one a cycle (a VM's /proc/cpuinfo reports a nominal one).
static double measured_ghz(void) {
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
        long x = 0, k = 200000000;
        const double t0 = now();
        __asm__ volatile("1: add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tsub $4, %1\n\tjnz 1b"
                         : "+r"(x), "+r"(k));
        const double t = now() - t0;
        if (t < best) best = t;
    }
    return 0.2 / best;  // 200M dependent adds
}
int main(int argc, char ** argv) {
    const int n = atoi(argv[1]), repeats = atoi(argv[3]);
    const int nb = n / 32;
    const size_t bx = nb * sizeof(block_q8_0), rows = (size_t) atol(argv[2]) * 1000000 / bx;
    char * X = aligned_alloc(64, rows * bx + 64), * P = aligned_alloc(64, rows * bx + 64);
    srand(1);
    for (size_t i = 0; i < rows * nb; ++i) {
        block_q8_0 * b = (block_q8_0 *) X + i;
        b->d = 0x2000 + (rand() & 0x3ff);
        for (int j = 0; j < 32; ++j) b->qs[j] = (int8_t) ((rand() % 256) - 128);
    }
    fimble_q8_0_pack(X, P, rows, n);
    block_q8_0 * Y = aligned_alloc(64, 16 * bx);
    for (int i = 0; i < 16 * nb; ++i) {
        Y[i].d = 0x2400 + (rand() & 0x3ff);
        for (int j = 0; j < 32; ++j) Y[i].qs[j] = (int8_t) ((rand() % 255) - 127);  // as ggml quantises: never -128
    }
    float so[16 * 64], sp[16 * 64];
    const int nrs[] = {1, 2, 3, 4, 8, 16};
    long unequal = 0;
    printf("{\"ghz\": %.3f, \"weight_rows\": %zu, \"mb\": %.1f, \"blocks\": %zu, \"passes\": [", measured_ghz(), rows,
           rows * bx / 1e6, rows * nb);
    for (int ii = 0; ii < 6; ++ii) {
        const int nr = nrs[ii];
        for (size_t i0 = 0; i0 < rows; i0 += 64 * 97) {  // a sample of the chunks, bit for bit
            const int nx = rows - i0 < 64 ? (int) (rows - i0) : 64;
            fimble_q8_0_lanes_forget();
            fimble_vec_dot_q8_0_q8_0_lanes(n, nx, nr, so, 64, X + i0 * bx, bx, Y, bx);
            fimble_vec_dot_q8_0_q8_0_packed(n, nx, nr, sp, 64, P + i0 * bx, bx, Y, bx);
            for (int r = 0; r < nr; ++r)
                for (int i = 0; i < nx; ++i) unequal += memcmp(&so[r * 64 + i], &sp[r * 64 + i], 4) != 0;
        }
        double best[2] = {1e9, 1e9};
        for (int rep = 0; rep < repeats; ++rep)
            for (int v = 0; v < 2; ++v) {
                fimble_q8_0_lanes_forget();
                const double t0 = now();
                for (size_t i0 = 0; i0 < rows; i0 += 64) {  // ggml's 64-row chunks
                    const int nx = rows - i0 < 64 ? (int) (rows - i0) : 64;
                    if (v) fimble_vec_dot_q8_0_q8_0_packed(n, nx, nr, sp, 64, P + i0 * bx, bx, Y, bx);
                    else fimble_vec_dot_q8_0_q8_0_lanes(n, nx, nr, so, 64, X + i0 * bx, bx, Y, bx);
                }
                const double t = now() - t0;
                if (t < best[v]) best[v] = t;
            }
        printf("%s{\"rows\": %d, \"blocks_s\": %.6f, \"packed_s\": %.6f}", ii ? ", " : "", nr, best[0], best[1]);
    }
    printf("], \"unequal\": %ld}\n", unequal);
    return 0;
}
"""


def clock_ghz() -> float:
    """The clock /proc/cpuinfo reports (a VM's may be nominal); 0 where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) / 1000
    except (OSError, ValueError):
        pass
    return 0.0


def build(folder: Path) -> Path:
    src = folder / "q8_kernel.c"
    src.write_text(PRELUDE + LANES_KERNEL + LANES_AVX2_KERNEL + PACKED_KERNEL + DRIVER)
    exe = folder / "q8_kernel"
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("q8_kernel: needs gcc")
    subprocess.run([cc, "-O3", "-mavx2", "-mfma", "-mf16c", "-o", str(exe), str(src)], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=571, help="MB of weights streamed per pass (the default model's)")
    ap.add_argument("--columns", default="896,4864", help="row lengths (the default model's two)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="128 MB, 896 columns, best of 2: a few seconds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not 1 <= args.mb <= 8192 or not 1 <= args.repeats <= 50:
        raise SystemExit("q8_kernel: --mb 1..8192, --repeats 1..50")
    columns = [int(c) for c in args.columns.split(",")]
    if any(c % 32 or not 32 <= c <= 32768 for c in columns):
        raise SystemExit("q8_kernel: --columns are multiples of 32 up to 32768")
    if args.quick:
        args.mb, columns, args.repeats = 128, [896], 2
    load = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="fimble-q8-") as tmp:
        exe = build(Path(tmp))
        for n in columns:
            out = subprocess.run([str(exe), str(n), str(args.mb), str(args.repeats)], check=True,
                                 capture_output=True, text=True).stdout  # fmt: skip
            res = json.loads(out)
            res["columns"] = n
            results.append(res)
    ghz = results[0]["ghz"]
    print(
        f"q8_0 lane kernel alone, 1 thread, {args.mb} MB of weights a pass, clock {ghz:.2f} GHz measured "
        f"({clock_ghz():.2f} reported), load {load[0]:.2f}"
    )
    print(
        "| columns | rows | blocks ms | packed ms | packed/blocks | packed / its 1 row | packed ns per block-row "
        "| cycles per block-row |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for res in results:
        one = res["passes"][0]["packed_s"]
        for p in res["passes"]:
            ns = p["packed_s"] / (res["blocks"] * p["rows"]) * 1e9
            p["packed_ns_per_block_row"] = ns
            print(
                f"| {res['columns']} | {p['rows']} | {p['blocks_s'] * 1e3:.1f} | {p['packed_s'] * 1e3:.1f} | "
                f"{p['packed_s'] / p['blocks_s']:.2f} | {p['packed_s'] / one:.2f} | {ns:.2f} | {ns * ghz:.2f} |"
            )
    unequal = sum(r["unequal"] for r in results)
    print(f"packed results unequal to the block kernel's: {unequal}")
    if args.json:
        args.json.write_text(json.dumps({"clock_ghz": ghz, "load": load, "mb": args.mb, "results": results}, indent=1))
    first = results[0]
    by_rows = {p["rows"]: p for p in first["passes"]}
    one = by_rows[1]["packed_s"]
    print(
        f"headline ({first['columns']} columns, 1 thread, load {load[0]:.2f}): packed 4 rows "
        f"{by_rows[4]['packed_s'] / one:.2f}x and 8 rows {by_rows[8]['packed_s'] / one:.2f}x its 1-row pass "
        f"(blocks: {by_rows[4]['blocks_s'] / by_rows[1]['blocks_s']:.2f}x, "
        f"{by_rows[8]['blocks_s'] / by_rows[1]['blocks_s']:.2f}x); 8 rows at "
        f"{by_rows[8]['packed_ns_per_block_row'] * ghz:.2f} cycles a block-row (in cache: ~2); "
        f"bits {'equal' if unequal == 0 else 'UNEQUAL'}"
    )


if __name__ == "__main__":
    main()
