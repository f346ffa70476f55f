"""Event-loop stalls on pathological documents, and engine recovery after SIGKILL / SIGSTOP.

A real ``fimble lsp`` over stdio with the real engine. While work runs, a thread pings the
server's event loop (a request for a method it does not have, answered by the loop itself)
every 20 ms; a ping's round trip is how long the loop was busy when it arrived. Per document:
the worst block while it is opened, and while 8 keystrokes each followed by an inline
completion request are typed at its cursor. The peer is the same server on an ordinary 20 KB
Python file, interleaved with the pathological ones; the ratio is pathological / ordinary.

Recovery: the engine's cold start (``initialized`` -> engine ready, same server), then the time
from SIGKILL of the engine to the next completion (sent right after the kill), and the time
from SIGSTOP to the answer of a request waiting on the stopped engine (stall timeout 6 s).

    python -m bench.stall_figures --quick          # about a minute
    python -m bench.stall_figures --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from bench.harness.raw_lsp import (  # the raw stdio client and the documents
    Pinger,
    RawServer,
    big_line_document,
    engine_pid,
    lone_cr_document,
)

TARGET_BLOCK_S = 0.25


def ordinary_document() -> tuple[str, tuple[int, int]]:
    text = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(600)) + "def g(y):\n    return max(y, \n"
    return text, (text.count("\n") - 1, len("    return max(y, "))


def many_statements_document() -> tuple[str, tuple[int, int]]:
    text = "x = 1\n" * 150_000 + "def g(y):\n    return max(y, \n"
    return text, (text.count("\n") - 1, len("    return max(y, "))


def one_megabyte_line_document() -> tuple[str, tuple[int, int]]:
    text = "x = [" + "1, " * 340_000
    return text, (0, len(text))


CASES = {
    "1M chars, 1 MB line above cursor": big_line_document,
    "900 KB Python, one lone \\r": lone_cr_document,
    "900 KB, 150,000 statements": many_statements_document,
    "1 MB single line, cursor at end": one_megabyte_line_document,
}


def measure(server: RawServer, name: str, make, keys: str) -> dict:
    text, cursor = make()
    uri = f"file:///bench/{abs(hash(name))}.py"
    with Pinger(server) as opening:
        server.open(uri, text)
        server.call("fimble/noSuchMethod", {}, timeout=300)
        time.sleep(0.3)  # a sliced parse may still run: keep pinging through it
    line, col = cursor
    version = 1
    with Pinger(server) as typing:
        for ch in keys:
            version += 1
            server.change(uri, version, (line, col), (line, col), ch)
            col += 1
            server.wait(server.inline(uri, line, col), 300)
    server.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
    return {
        "case": name,
        "chars": len(text),
        "open_block_s": opening.max_block,
        "typing_block_s": typing.max_block,
        "pings": len(opening.latencies) + len(typing.latencies),
    }


def recovery(quick: bool) -> dict:
    server = RawServer(env=None)
    try:
        t0 = time.perf_counter()
        server.initialize()
        engine_pid(server)  # waits for ready
        cold = time.perf_counter() - t0
        uri = "file:///bench/recover.py"
        text = "import os\n\n\ndef main():\n    print(os.getcwd(), \n"
        server.open(uri, text)
        server.wait(server.inline(uri, 4, 22), 300)
        pid = engine_pid(server)
        os.kill(pid, signal.SIGKILL)
        t1 = time.perf_counter()
        server.change(uri, 2, (0, 0), (0, 0), "import sys\n")
        first = server.wait(server.inline(uri, 5, 22), 300)
        after_kill = time.perf_counter() - t1
        got_text = bool((first.get("result") or {}).get("items"))
        shown = [m["message"] for m in server.messages("window/showMessage")]
        result = {
            "cold_start_s": cold,
            "sigkill_to_next_completion_s": after_kill,
            "answer_had_text": got_text,
            "message": shown[-1] if shown else None,
        }
        if not quick:
            pid = engine_pid(server)
            os.kill(pid, signal.SIGSTOP)
            t2 = time.perf_counter()
            server.change(uri, 3, (0, 0), (0, 0), "import re\n")
            server.wait(server.inline(uri, 6, 22), 300)
            result["sigstop_to_answer_s"] = time.perf_counter() - t2
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return result
    finally:
        server.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two documents, 4 keystrokes, no SIGSTOP (about a minute)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    load_start = os.getloadavg()
    keys = "abcd" if args.quick else "abcdefgh"
    names = list(CASES)[:2] if args.quick else list(CASES)
    server = RawServer()
    rows = []
    try:
        server.initialize()
        engine_pid(server)
        for name in names:  # interleaved: the peer before each pathological document
            peer = measure(server, "ordinary 20 KB Python", ordinary_document, keys)
            rows.append((measure(server, name, CASES[name], keys), peer))
    finally:
        server.close()
    rec = recovery(args.quick)
    load_end = os.getloadavg()

    print(f"{'document':36} {'chars':>9} {'open max':>9} {'typing max':>11} {'peer typing':>12} {'ratio':>6}")
    for row, peer in rows:
        ratio = row["typing_block_s"] / max(peer["typing_block_s"], 1e-3)
        print(
            f"{row['case']:36} {row['chars']:>9,} {row['open_block_s'] * 1e3:>7.0f}ms "
            f"{row['typing_block_s'] * 1e3:>9.0f}ms {peer['typing_block_s'] * 1e3:>10.0f}ms {ratio:>6.1f}"
        )
    print(
        f"engine cold start {rec['cold_start_s']:.2f} s; SIGKILL -> next completion "
        f"{rec['sigkill_to_next_completion_s']:.2f} s (text: {rec['answer_had_text']}); message: {rec['message']!r}"
    )
    if "sigstop_to_answer_s" in rec:
        print(f"SIGSTOP -> answer of the waiting request {rec['sigstop_to_answer_s']:.2f} s (stall timeout 6 s)")
    print(
        f"engine threads 1 (server default); load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end; "
        f"{os.cpu_count()} cores"
    )
    worst = max(max(r["open_block_s"], r["typing_block_s"]) for r, _ in rows)
    print(
        f"HEADLINE: worst event-loop block {worst * 1e3:.0f} ms (target {TARGET_BLOCK_S * 1e3:.0f} ms); "
        f"SIGKILL recovery {rec['sigkill_to_next_completion_s']:.2f} s vs cold start {rec['cold_start_s']:.2f} s "
        f"(ratio {rec['sigkill_to_next_completion_s'] / rec['cold_start_s']:.2f})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": [{"doc": r, "peer": p} for r, p in rows],
                    "recovery": rec,
                    "load_avg_start": load_start,
                    "load_avg_end": load_end,
                    "quick": args.quick,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
