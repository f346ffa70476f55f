"""Load and soak: N clients typing into one ``fimble lsp --tcp`` server at once, with the real engine.

Each TCP client is its own session (lsp_server/transports.py). It opens its own copy of a
Python file and re-types one line of it a character at a time (``didChange`` per keystroke,
then an automatic ``textDocument/inlineCompletion``), while ``fimble/stats`` checks run in
between. Measured: requests, responses, error responses, responses that reached the wrong
client (a response whose id this client never sent, or a document that is not its own),
response latency, and the server's memory (the LSP process plus its engine child) before and
after. The peer, interleaved prompt by prompt: the same line typed by one client on a
``fimble lsp`` stdio server (how an editor runs it), so the ratio says what sharing one
engine between N sessions costs each of them.

    python -m bench.soak --quick                 # 3 clients, under a minute
    python -m bench.soak --clients 32 --rounds 6 --json out.json

The last line printed is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SERVER_CMD = [sys.executable, "-m", "lsp_server", "lsp"]
BASE = '''import os
import sys


def read_config(path):
    """Read a key=value file into a dict."""
    config = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition("=")
            config[key.strip()] = value.strip()
    return config


'''
LINES = [
    "def total(values):",
    "for key in sorted(config):",
    "print(key, config[key])",
    "return [x * 2 for x in values]",
    'if __name__ == "__main__":',
    "with open(path) as f:",
]
OPTIONS = {"preload": True, "maxTokens": 16, "maxLines": 1, "streaming": False}


def _frame(msg: dict) -> bytes:
    body = json.dumps(msg).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


class Client:
    """One session: a raw JSON-RPC client over a stream pair; counts what arrives."""

    def __init__(self, name: str, reader: asyncio.StreamReader, writer: Any):
        self.name, self.reader, self.writer = name, reader, writer
        self.ids = 0
        self.waiting: dict[int, asyncio.Future] = {}
        self.misrouted = self.errors = self.requests = 0
        self.latencies: list[float] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            length = 0
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if not line:
                return
            msg = json.loads(await self.reader.readexactly(length))
            if "method" in msg:
                continue  # notifications (showMessage, status)
            fut = self.waiting.pop(msg.get("id"), None)
            if fut is None:
                self.misrouted += 1  # an answer to a request this client never sent
            else:
                fut.set_result(msg)

    def send(self, msg: dict) -> None:
        self.writer.write(_frame(msg))

    async def call(self, method: str, params: Any, timeout: float = 120.0) -> dict:
        self.ids += 1
        fut = asyncio.get_running_loop().create_future()
        self.waiting[self.ids] = fut
        self.requests += 1
        t0 = time.perf_counter()
        self.send({"jsonrpc": "2.0", "id": self.ids, "method": method, "params": params})
        try:
            msg = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            self.errors += 1
            return {}
        self.latencies.append((time.perf_counter() - t0) * 1e3)
        if "error" in msg:
            self.errors += 1
        return msg

    async def open(self, uri: str, text: str) -> None:
        await self.call("initialize", {"processId": None, "capabilities": {}, "initializationOptions": OPTIONS})
        self.send({"jsonrpc": "2.0", "method": "initialized", "params": {}})
        self.send(
            {
                "jsonrpc": "2.0",
                "method": "textDocument/didOpen",
                "params": {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}},
            }
        )


class Typist:
    """A client typing lines into its own document, one character (and one request) at a time."""

    def __init__(self, client: Client, uri: str, interval_ms: float):
        self.client, self.uri, self.interval = client, uri, interval_ms / 1e3
        self.version, self.line, self._col = 1, BASE.count("\n"), 0
        self.wrong_document = 0  # fimble/stats showed a document count that is not this session's

    async def type_line(self, text: str) -> None:
        c = self.client
        for ch in text:
            self.version += 1
            c.send(
                {
                    "jsonrpc": "2.0",
                    "method": "textDocument/didChange",
                    "params": {
                        "textDocument": {"uri": self.uri, "version": self.version},
                        "contentChanges": [
                            {
                                "range": {
                                    "start": {"line": self.line, "character": self._col},
                                    "end": {"line": self.line, "character": self._col},
                                },
                                "text": ch,
                            }
                        ],
                    },
                }
            )
            self._col += 1
            await c.call(
                "textDocument/inlineCompletion",
                {
                    "textDocument": {"uri": self.uri},
                    "position": {"line": self.line, "character": self._col},
                    "context": {"triggerKind": 2},
                },
            )
            await asyncio.sleep(self.interval)
        self.version += 1
        c.send(
            {
                "jsonrpc": "2.0",
                "method": "textDocument/didChange",
                "params": {
                    "textDocument": {"uri": self.uri, "version": self.version},
                    "contentChanges": [
                        {
                            "range": {
                                "start": {"line": self.line, "character": self._col},
                                "end": {"line": self.line, "character": self._col},
                            },
                            "text": "\n",
                        }
                    ],
                },
            }
        )
        self.line += 1
        self._col = 0
        stats = await c.call("fimble/stats", None)
        if stats.get("result", {}).get("tables", {}).get("documents") != 1:
            self.wrong_document += 1


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc (Linux; no psutil: it is not a fimble dependency)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            todo += [int(c) for c in children.read_text().split()]
    return pids


def rss_mib(pid: int) -> float:
    try:
        total_kib = 0
        for p in _tree(pid):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        return total_kib / 1024
    except (OSError, ValueError):
        return float("nan")


async def start_tcp(env: dict) -> tuple[asyncio.subprocess.Process, int]:
    # --no-token: a local benchmark's own listener (a token is required by default, engine/auth.py)
    proc = await asyncio.create_subprocess_exec(
        *SERVER_CMD,
        "--tcp",
        "127.0.0.1:0",
        "--no-token",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    while line := await proc.stderr.readline():
        if line.startswith(b"fimble: listening on "):
            asyncio.create_task(_drain(proc.stderr))
            return proc, int(line.split()[-1].rsplit(b":", 1)[1])
    raise RuntimeError("the TCP server did not start")


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def run(args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    load_start = os.getloadavg()
    tcp, port = await start_tcp(env)
    stdio = await asyncio.create_subprocess_exec(
        *SERVER_CMD,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    peer = Typist(Client("stdio", stdio.stdout, stdio.stdin), "file:///soak/stdio.py", args.interval_ms)
    await peer.client.open(peer.uri, BASE)
    typists = []
    for i in range(args.clients):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t = Typist(Client(f"tcp{i}", reader, writer), f"file:///soak/{i}.py", args.interval_ms)
        await t.client.open(t.uri, BASE)
        typists.append(t)
    # Warm-up: one keystroke each, so the model is loaded before memory and latency count.
    await asyncio.gather(peer.type_line("x"), *(t.type_line("x") for t in typists))
    for t in [peer, *typists]:
        t.client.latencies.clear()
        t.client.requests = 0
    rss0 = {"tcp": rss_mib(tcp.pid), "stdio": rss_mib(stdio.pid)}
    t0 = time.perf_counter()
    rounds = []
    for r in range(args.rounds):  # interleaved per prompt: the peer types the line, then all N sessions
        line = LINES[r % len(LINES)][: args.chars]
        p0 = time.perf_counter()
        await peer.type_line(line)
        p1 = time.perf_counter()
        await asyncio.gather(*(t.type_line(line) for t in typists))
        rounds.append({"line": line, "stdio_s": round(p1 - p0, 2), "tcp_s": round(time.perf_counter() - p1, 2)})
    wall = time.perf_counter() - t0
    rss1 = {"tcp": rss_mib(tcp.pid), "stdio": rss_mib(stdio.pid)}
    tcp_alive = tcp.returncode is None
    for proc in (tcp, stdio):
        proc.kill()
        await proc.wait()
    lat_tcp = [x for t in typists for x in t.client.latencies]
    lat_peer = peer.client.latencies
    return {
        "clients": args.clients,
        "rounds": args.rounds,
        "interval_ms": args.interval_ms,
        "wall_s": round(wall, 1),
        "tcp": {
            "requests": sum(t.client.requests for t in typists),
            "answered": len(lat_tcp),
            "errors": sum(t.client.errors for t in typists),
            "misrouted": sum(t.client.misrouted + t.wrong_document for t in typists),
            "p50_ms": round(pct(lat_tcp, 50), 1),
            "p95_ms": round(pct(lat_tcp, 95), 1),
            "rss_mib": [round(rss0["tcp"]), round(rss1["tcp"])],
            "server_alive": tcp_alive,
        },
        "stdio": {
            "requests": peer.client.requests,
            "answered": len(lat_peer),
            "errors": peer.client.errors,
            "misrouted": peer.client.misrouted + peer.wrong_document,
            "p50_ms": round(pct(lat_peer, 50), 1),
            "p95_ms": round(pct(lat_peer, 95), 1),
            "rss_mib": [round(rss0["stdio"]), round(rss1["stdio"])],
        },
        "rounds_detail": rounds,
        "threads": {"cpus": os.cpu_count(), "engine_threads": 1, "asyncio": "one event loop per server"},
        "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=32, help="concurrent TCP sessions typing")
    ap.add_argument("--rounds", type=int, default=4, help="lines typed by each session")
    ap.add_argument("--interval-ms", type=float, default=80.0, help="pause between keystrokes")
    ap.add_argument("--chars", type=int, default=80, help="characters typed per line (at most)")
    ap.add_argument("--quick", action="store_true", help="3 clients, 2 lines of 8 characters (under a minute)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.rounds, args.chars = 3, 2, 8
    res = asyncio.run(run(args))
    print(
        f"{'transport':<10} {'sessions':>8} {'requests':>8} {'answered':>8} {'errors':>6} {'misrouted':>9} "
        f"{'p50 ms':>8} {'p95 ms':>8} {'RSS MiB (start->end)':>21}"
    )
    for name, sessions in (("tcp", res["clients"]), ("stdio", 1)):
        r = res[name]
        print(
            f"{name:<10} {sessions:>8} {r['requests']:>8} {r['answered']:>8} {r['errors']:>6} {r['misrouted']:>9} "
            f"{r['p50_ms']:>8} {r['p95_ms']:>8} {r['rss_mib'][0]:>10} -> {r['rss_mib'][1]:<8}"
        )
    print(
        f"threads: {res['threads']['cpus']} CPUs, engine threads {res['threads']['engine_threads']}; "
        f"load average start {res['load_average']['start']}, end {res['load_average']['end']}; "
        f"wall {res['wall_s']} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    t, s = res["tcp"], res["stdio"]
    ratio = t["p50_ms"] / s["p50_ms"] if s["p50_ms"] else float("nan")
    print(
        f"soak: {res['clients']} TCP sessions typing x {res['rounds']} lines: {t['requests']} requests, "
        f"{t['errors']} errors, {t['misrouted']} misrouted, p50 {t['p50_ms']} ms = {ratio:.2f}x one stdio "
        f"session ({s['p50_ms']} ms), server RSS {t['rss_mib'][0]} -> {t['rss_mib'][1]} MiB, "
        f"server alive: {t['server_alive']}"
    )
    return 0 if t["errors"] == 0 and t["misrouted"] == 0 and t["server_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
