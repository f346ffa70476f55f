"""Many editors typing into one ``fimble serve``: aggregate tok/s, first-delta latency, errors.

Each editor is one websocket session (engine/serve/protocol.py) replaying a typing trace: it
opens its own copy of a Python file, re-types one of its lines a character at a time, and per
keystroke cancels its previous completion and asks for a new one at the cursor (as
``fimble lsp`` does), waits for the first delta, thinks ``--think-ms``, types on. The last
keystroke of a line lets its completion run to the end. Measured per concurrency level (1, 8,
32, 64 editors): tokens decoded per second by the daemon (its ``tokens_generated`` counter over
the level's wall time), p50/p95 time from submit to the first delta, and errors.

The peer, interleaved level by level: the same daemon code with ``--no-batch`` (round-robin:
every sequence still steps each round, one forward each), so the ratio is what batching the
passes buys. Both daemons run with 1 torch thread (the default).

    python bench/serve_load.py --quick              # 1 and 4 editors, under a minute
    python bench/serve_load.py --json out.json      # 1, 8, 32, 64

The last line printed is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from websockets.asyncio.client import connect  # noqa: E402

from engine.serve import protocol  # noqa: E402

CORPUS = REPO / "tests" / "data" / "lossless_corpus"


class Daemon:
    """``fimble serve --port 0`` in a subprocess; its port read from the line it prints."""

    def __init__(self, *extra: str):
        self.log = tempfile.NamedTemporaryFile(prefix="fimble-serve-load-", suffix=".log", delete=False)
        env = dict(os.environ)
        env.setdefault("FIMBLE_DEFAULT_MODEL", "embedded")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lsp_server", "serve", "--port", "0", *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            env=env,
        )
        deadline = time.monotonic() + 180
        while True:
            text = Path(self.log.name).read_text(errors="replace")
            found = re.search(r"on ws://127\.0\.0\.1:(\d+)", text)
            if found:
                self.url = f"ws://127.0.0.1:{found.group(1)}"
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"fimble serve did not start: {text[-1000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self.log.name)


class Session:
    """One editor's websocket session: submit/cancel by id, deltas routed to per-request queues."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = 0
        self.queues: dict[int, asyncio.Queue] = {}
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str) -> Session:
        ws = await connect(url, max_size=protocol.DEFAULT_MAX_MESSAGE, compression=None)
        await ws.send(protocol.pack(protocol.hello("serve_load")))
        reply = protocol.unpack(await ws.recv())
        if reply.get("op") != "ready":
            raise SystemExit(f"refused: {reply}")
        return cls(ws)

    async def _read(self) -> None:
        async for raw in self.ws:
            msg = protocol.unpack(raw)
            q = self.queues.get(msg.get("id"))
            if q is not None:
                q.put_nowait(msg)

    async def call(self, op: str) -> dict:
        self.ids += 1
        q = self.queues[self.ids] = asyncio.Queue()
        await self.ws.send(protocol.pack({"op": op, "id": self.ids}))
        msg = await q.get()
        del self.queues[self.ids]
        return msg

    async def submit(self, prefix: str, suffix: str, doc: str, max_tokens: int) -> tuple[int, asyncio.Queue]:
        self.ids += 1
        q = self.queues[self.ids] = asyncio.Queue()
        request = {
            "prefix": prefix,
            "suffix": suffix,
            "document_id": doc,
            "options": {"max_tokens": max_tokens, "max_lines": 1},
        }
        await self.ws.send(protocol.pack({"op": "submit", "id": self.ids, "request": request}))
        return self.ids, q

    async def cancel(self, rid: int) -> None:
        await self.ws.send(protocol.pack({"op": "cancel", "id": rid}))

    async def close(self) -> None:
        self.reader.cancel()
        await self.ws.close()


def traces(n: int, chars: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """(text before the line, the line to type, text after it) per editor, from the frozen corpus."""
    texts = [f.read_text() for f in sorted(CORPUS.glob("*.py.txt"))]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        text = rng.choice(texts)
        lines = text.split("\n")
        i = rng.randrange(20, len(lines) - 20)
        line = lines[i]
        if len(line.strip()) < chars:
            continue
        indent = len(line) - len(line.lstrip())
        before = "\n".join(lines[max(0, i - 60) : i]) + "\n" + line[:indent]
        after = "\n" + "\n".join(lines[i + 1 : i + 20])
        out.append((before, line[indent : indent + chars], after))
    return out


async def editor(url: str, trace: tuple[str, str, str], think_s: float, max_tokens: int, name: str) -> dict:
    before, typed, after = trace
    s = await Session.open(url)
    firsts: list[float] = []
    errors = 0
    previous: int | None = None
    try:
        for k in range(1, len(typed) + 1):
            if previous is not None:
                await s.cancel(previous)
                s.queues.pop(previous, None)  # its remaining deltas are of no interest
            t0 = time.perf_counter()
            rid, q = await s.submit(before + typed[:k], after, name, max_tokens)
            previous = rid
            last = k == len(typed)
            while True:
                msg = await q.get()
                if msg["op"] != "delta":
                    continue
                d = msg["delta"]
                if d["text"] or d["finished"]:
                    if len(firsts) < k:
                        firsts.append(time.perf_counter() - t0)
                    if d.get("finish_reason") == "error":
                        errors += 1
                if d["finished"] or (not last and len(firsts) == k):
                    break
            if not last:
                await asyncio.sleep(think_s)
    finally:
        await s.close()
    return {"first_delta_s": firsts, "errors": errors, "requests": len(typed)}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def level(url: str, editors: int, chars: int, think_s: float, max_tokens: int, seed: int) -> dict:
    probe = await Session.open(url)
    before = (await probe.call("counters"))["counters"]
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(
            editor(url, tr, think_s, max_tokens, f"file:///editor{i}.py")
            for i, tr in enumerate(traces(editors, chars, seed))
        ),
        return_exceptions=True,
    )
    wall = time.perf_counter() - t0
    after = (await probe.call("counters"))["counters"]
    await probe.close()
    firsts = [x for r in results if isinstance(r, dict) for x in r["first_delta_s"]]
    errors = sum(r["errors"] if isinstance(r, dict) else chars for r in results)  # a failed editor: all its requests
    tokens = after["tokens_generated"] - before["tokens_generated"]
    rounds = after["sched_rounds"] - before["sched_rounds"]
    rows = after["sched_batched_rows"] - before["sched_batched_rows"]
    return {
        "editors": editors,
        "requests": editors * chars,
        "wall_s": round(wall, 2),
        "tokens": tokens,
        "tok_per_s": round(tokens / wall, 1),
        "p50_first_delta_ms": round(pct(firsts, 0.5) * 1e3, 1),
        "p95_first_delta_ms": round(pct(firsts, 0.95) * 1e3, 1),
        "errors": errors,
        "max_batch": after["sched_max_batch"],
        "mean_rows_per_round": round(rows / rounds, 1) if rounds else 0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,8,32,64", help="concurrent editors per level, comma-separated")
    ap.add_argument("--chars", type=int, default=12, help="characters each editor types (one request each)")
    ap.add_argument("--think-ms", type=int, default=100, help="pause between a first delta and the next keystroke")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="levels 1 and 4, 6 characters: under a minute")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.levels, args.chars = "1,4", 6
    levels = [int(x) for x in args.levels.split(",")]
    if any(not 1 <= n <= 1024 for n in levels) or not 1 <= args.chars <= 200 or not 0 <= args.think_ms <= 10_000:
        raise SystemExit("levels 1-1024 editors, --chars 1-200, --think-ms 0-10000")
    load_start = os.getloadavg()
    print(
        f"fimble serve load: levels {levels}, {args.chars} keystrokes each, think {args.think_ms} ms, "
        f"max_tokens {args.max_tokens}, daemon threads 1, load average {load_start[0]:.2f}",
        flush=True,
    )
    daemons = {"batched": Daemon("--threads", "1"), "round-robin": Daemon("--threads", "1", "--no-batch")}
    rows: list[dict] = []
    try:
        for n in levels:  # interleaved: both schedulers at one level before the next level
            for name, daemon in daemons.items():
                r = asyncio.run(level(daemon.url, n, args.chars, args.think_ms / 1e3, args.max_tokens, seed=n))
                r["scheduler"] = name
                r["load_average"] = round(os.getloadavg()[0], 2)
                rows.append(r)
                print(
                    f"  {name:>11} {n:>3} editors: {r['tok_per_s']:>7.1f} tok/s, first delta p50 "
                    f"{r['p50_first_delta_ms']:>7.1f} ms p95 {r['p95_first_delta_ms']:>7.1f} ms, "
                    f"errors {r['errors']}, rows/round {r['mean_rows_per_round']}, load {r['load_average']}",
                    flush=True,
                )
    finally:
        for d in daemons.values():
            d.stop()
    print()
    print(
        f"{'editors':>7} | {'batched tok/s':>13} | {'rr tok/s':>8} | {'ratio':>5} | {'p50 ms':>7} | {'p95 ms':>7} | "
        f"{'rr p95 ms':>9} | errors"
    )
    headline = ""
    for n in levels:
        b = next(r for r in rows if r["editors"] == n and r["scheduler"] == "batched")
        rr = next(r for r in rows if r["editors"] == n and r["scheduler"] == "round-robin")
        ratio = b["tok_per_s"] / rr["tok_per_s"] if rr["tok_per_s"] else float("nan")
        print(
            f"{n:>7} | {b['tok_per_s']:>13.1f} | {rr['tok_per_s']:>8.1f} | {ratio:>5.2f} | "
            f"{b['p50_first_delta_ms']:>7.1f} | {b['p95_first_delta_ms']:>7.1f} | {rr['p95_first_delta_ms']:>9.1f} | "
            f"{b['errors'] + rr['errors']}"
        )
        headline = (
            f"serve_load: {n} editors on one fimble serve (CPU, 1 thread): {b['tok_per_s']:.0f} tok/s "
            f"aggregate batched vs {rr['tok_per_s']:.0f} round-robin ({ratio:.2f}x), p95 first delta "
            f"{b['p95_first_delta_ms']:.0f} ms vs {rr['p95_first_delta_ms']:.0f} ms, "
            f"errors {b['errors'] + rr['errors']}, load average {os.getloadavg()[0]:.2f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "bench": "serve_load",
                    "date": time.strftime("%Y-%m-%d"),
                    "threads": 1,
                    "levels": levels,
                    "chars": args.chars,
                    "think_ms": args.think_ms,
                    "max_tokens": args.max_tokens,
                    "load_average_start": load_start,
                    "load_average_end": os.getloadavg(),
                    "cpu_count": os.cpu_count(),
                    "rows": rows,
                    "headline": headline,
                },
                indent=2,
            )
            + "\n"
        )
    print(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
