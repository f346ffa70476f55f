"""One session must not stall another: heavy requests of one TCP/WS session against a pinger's.

A real ``fimble lsp --tcp`` (or ``--ws``) on loopback. A pinger in its own process holds a second
session and sends a request every 20 ms (a method the server does not have: the server's event
loop answers it); its worst round trip during each attack is how long the attacker's work kept
the shared loop from the pinger. Attacks (one session, each after the previous one ended):

- one ``didChange`` with 20,000 small edits;
- a 50 MB ``didOpen``; one change inserting 5 MB; one inserting 10 MB;
- 5,000 ``fimble/stats`` requests in one write;
- and larger variants (from the attack audit, bench/reports/attacks-audit-2026-12-03.md): one ``didChange`` of
  160,000 edits (16 MB), one notification of 14 MB of empty JSON arrays, and a ``didOpen`` of 84,000 characters
  whose parse is slow (error recovery).

The peer is the same pinger while the attacker sends one ordinary keystroke change (the idle
floor, interleaved before each attack); the ratio is attack / ordinary. Target: worst wait
≤ 250 ms. Wall times: this is a loaded 2-core CPU; report the load average with the figures.

    python -m bench.session_fairness --quick
    python -m bench.session_fairness --transport ws --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TARGET_MS = 250.0
INIT = {"processId": None, "rootUri": None, "capabilities": {}, "initializationOptions": {"preload": False}}

PINGER = r"""
import asyncio, json, sys, time
port, scheme, token = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def frame(m):
    b = json.dumps(m).encode()
    return b"Content-Length: %d\r\n\r\n" % len(b) + b
async def main():
    opts = {"preload": False}
    if token:
        opts["token"] = token
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"processId": None, "rootUri": None, "capabilities": {}, "initializationOptions": opts}}
    if scheme == "tcp":
        r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        async def send(m): w.write(frame(m))
        async def recv():
            n = 0
            while True:
                line = await r.readline()
                if not line:
                    raise EOFError
                if line in (b"\r\n", b"\n"):
                    break
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":")[1])
            return json.loads(await r.readexactly(n))
    else:
        from websockets.asyncio.client import connect
        headers = {"Authorization": f"Bearer {token}"} if token else None
        ws = await connect(f"ws://127.0.0.1:{port}/", max_size=None, additional_headers=headers)
        async def send(m): await ws.send(json.dumps(m))
        async def recv(): return json.loads(await ws.recv())
    await send(init)
    while (await recv()).get("id") != 0:
        pass
    await send({"jsonrpc": "2.0", "method": "initialized", "params": {}})
    print("ready", flush=True)
    i = 0
    while True:
        i += 1
        t = time.monotonic()
        await send({"jsonrpc": "2.0", "id": i, "method": "fimble/ping"})
        while True:
            m = await recv()
            if m.get("id") == i:
                break
        print(f"{time.time():.4f} {(time.monotonic() - t) * 1000:.2f}", flush=True)
        await asyncio.sleep(0.02)
asyncio.run(main())
"""


def frame(m: Any) -> bytes:
    body = json.dumps(m).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


class Attacker:
    def __init__(self, scheme: str, port: int, token: str | None):
        self.scheme, self.port, self.token, self.ids = scheme, port, token, 0

    async def connect(self) -> None:
        if self.scheme == "tcp":
            self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port, limit=1 << 28)
        else:
            from websockets.asyncio.client import connect

            headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
            self.ws = await connect(f"ws://127.0.0.1:{self.port}/", max_size=None, additional_headers=headers)
        opts = dict(INIT["initializationOptions"], **({"token": self.token} if self.token else {}))
        await self.call("initialize", dict(INIT, initializationOptions=opts))
        await self.send_many([{"jsonrpc": "2.0", "method": "initialized", "params": {}}])

    async def send_many(self, msgs: list[dict]) -> None:
        if self.scheme == "tcp":
            self.w.write(b"".join(frame(m) for m in msgs))
            await self.w.drain()
        else:
            for m in msgs:
                await self.ws.send(json.dumps(m))

    async def recv(self) -> dict:
        if self.scheme == "tcp":
            n = 0
            while True:
                line = await self.r.readline()
                if not line:
                    raise EOFError
                if line in (b"\r\n", b"\n"):
                    break
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":")[1])
            return json.loads(await self.r.readexactly(n))
        return json.loads(await self.ws.recv())

    async def call(self, method: str, params: Any = None) -> dict:
        self.ids += 1
        await self.send_many([{"jsonrpc": "2.0", "id": self.ids, "method": method, "params": params}])
        while True:
            m = await self.recv()
            if m.get("id") == self.ids and "method" not in m:
                return m

    async def barrier(self) -> None:
        """Every message sent before it has been handled: a request answered after them."""
        await self.call("fimble/ping")


def open_msg(uri: str, text: str) -> dict:
    return {
        "jsonrpc": "2.0",
        "method": "textDocument/didOpen",
        "params": {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}},
    }


def change_msg(uri: str, version: int, edits: list[tuple[int, int, str]]) -> dict:
    return {
        "jsonrpc": "2.0",
        "method": "textDocument/didChange",
        "params": {
            "textDocument": {"uri": uri, "version": version},
            "contentChanges": [
                {"range": {"start": {"line": ln, "character": ch}, "end": {"line": ln, "character": ch}}, "text": t}
                for ln, ch, t in edits
            ],
        },
    }


BASE = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(1000))


def attacks(quick: bool) -> dict[str, Any]:
    n_edits = 2_000 if quick else 20_000
    big = 5_000_000 if quick else 50_000_000
    stats_n = 500 if quick else 5_000

    async def many_edits(a: Attacker, v: int) -> None:
        await a.send_many([change_msg("file:///w/base.py", v, [(i % 1000, 0, "x") for i in range(n_edits)])])

    async def big_open(a: Attacker, v: int) -> None:
        await a.send_many([open_msg(f"file:///w/big{v}.py", "x = 1\n" * (big // 6))])

    def insert(size: int) -> Any:
        async def run(a: Attacker, v: int) -> None:
            await a.send_many([change_msg("file:///w/base.py", v, [(5, 0, "y = 2\n" * (size // 6))])])

        return run

    async def stats_burst(a: Attacker, v: int) -> None:
        msgs = [{"jsonrpc": "2.0", "id": f"s{i}", "method": "fimble/stats"} for i in range(stats_n)]
        await a.send_many(msgs)

    out: dict[str, Any] = {f"didChange, {n_edits:,} edits": many_edits, f"didOpen, {big / 1e6:.0f} MB": big_open}
    if not quick:
        out["didChange inserting 5 MB"] = insert(5_000_000)
    out["didChange inserting 10 MB" if not quick else "didChange inserting 1 MB"] = insert(
        10_000_000 if not quick else 1_000_000
    )
    out[f"{stats_n:,} fimble/stats in one write"] = stats_burst

    async def huge_change(a: Attacker, v: int) -> None:  # under the 16 MiB limit: refused by its JSON structure
        await a.send_many([change_msg("file:///w/base.py", v, [(1, 0, "x")] * 160_000)])

    async def arrays(a: Attacker, v: int) -> None:
        await a.send_many([{"jsonrpc": "2.0", "method": "fimble/x", "params": {"a": [[]] * 3_500_000}}])

    async def slow_parse(a: Attacker, v: int) -> None:  # under SLICED_PARSE_CHARS, 0.2-0.7 s of parse here
        await a.send_many([open_msg(f"file:///w/slow{v}.py", '"""aaaaaaaaaa\n' * 6_000)])

    if not quick:
        out["didChange, 160,000 edits (16 MB)"] = huge_change
        out["14 MB of empty JSON arrays"] = arrays
    out["didOpen, 84 KB of slow-to-parse text"] = slow_parse
    return out


async def ordinary(a: Attacker, v: int) -> None:
    await a.send_many([change_msg("file:///w/base.py", v, [(7, 0, "z")])])


def is_closed(exc: Exception) -> bool:
    return isinstance(exc, EOFError | ConnectionError) or type(exc).__name__.startswith("ConnectionClosed")


def pings_between(lines: list[str], t0: float, t1: float) -> list[float]:
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0] != "ready":
            t, ms = float(parts[0]), float(parts[1])
            # a ping that ended within the window, or started in it (end - rtt)
            if t0 <= t <= t1 + 0.001 or t0 <= t - ms / 1000 <= t1:
                out.append(ms)
    return out


async def run(scheme: str, quick: bool) -> list[dict]:
    log = tempfile.NamedTemporaryFile(prefix="fimble-fair-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "lsp_server", "lsp", f"--{scheme}", "127.0.0.1:0", *EXTRA]
    server = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, cwd=REPO)
    try:
        port, token = wait_listening(Path(log.name), server)
        pinger = subprocess.Popen(
            [sys.executable, "-c", PINGER, str(port), scheme, token or ""], stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        assert pinger.stdout is not None
        assert pinger.stdout.readline().strip() == "ready"
        lines: list[str] = []
        import threading

        threading.Thread(target=lambda: lines.extend(iter(pinger.stdout.readline, "")), daemon=True).start()
        a = Attacker(scheme, port, token)
        await a.connect()
        await a.send_many([open_msg("file:///w/base.py", BASE)])
        await a.barrier()
        rows = []
        v = 1
        for name, attack in attacks(quick).items():
            v += 1
            t0 = time.time()
            await ordinary(a, v)
            await a.barrier()
            await asyncio.sleep(0.3)
            t1 = time.time()
            v += 1
            outcome = "handled"
            try:
                await attack(a, v)
                await a.barrier()
            except Exception as exc:  # noqa: BLE001 (a websocket over its size limit is closed: reconnect)
                if not is_closed(exc):
                    raise
                outcome = "connection closed"
                a = Attacker(scheme, port, token)
                await a.connect()
                await a.send_many([open_msg("file:///w/base.py", BASE)])
                await a.barrier()
            await asyncio.sleep(0.3)
            t2 = time.time()
            floor = pings_between(lines, t0, t1)
            hit = pings_between(lines, t1, t2)
            rows.append(
                {
                    "attack": name,
                    "attack_s": round(t2 - t1 - 0.3, 2),
                    "outcome": outcome,
                    "worst_wait_ms": round(max(hit, default=0.0), 1),
                    "ordinary_worst_ms": round(max(floor, default=0.0), 1),
                    "pings": len(hit),
                }
            )
        pinger.kill()
        return rows
    finally:
        server.kill()
        server.wait()
        os.unlink(log.name)


def wait_listening(log: Path, proc: subprocess.Popen) -> tuple[int, str | None]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        port = token = None
        for line in text.splitlines():
            if line.startswith("fimble: listening on "):
                port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
            if line.startswith("fimble: token: "):
                token = line.split(": ", 2)[2].strip()
        if port is not None:
            return port, token
        if proc.poll() is not None:
            raise RuntimeError(text)
        time.sleep(0.05)
    raise TimeoutError("server did not listen")


EXTRA: list[str] = []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=["tcp", "ws", "both"], default="both")
    p.add_argument("--quick", action="store_true", help="smaller attacks (under a minute)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for fimble lsp")
    args = p.parse_args()
    EXTRA.extend(args.server_arg)
    results = {}
    for scheme in ["tcp", "ws"] if args.transport == "both" else [args.transport]:
        results[scheme] = asyncio.run(run(scheme, args.quick))
    load = os.getloadavg()
    print(
        f"fimble lsp sessions, pinger every 20 ms in its own process; load {load[0]:.2f} {load[1]:.2f}; "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"{'transport':9} {'attack':38} {'outcome':17} {'attack s':>8} {'worst wait ms':>13} "
        f"{'ordinary ms':>11} {'ratio':>6}"
    )
    worst = 0.0
    for scheme, rows in results.items():
        for r in rows:
            ratio = r["worst_wait_ms"] / max(r["ordinary_worst_ms"], 1.0)
            worst = max(worst, r["worst_wait_ms"])
            print(
                f"{scheme:9} {r['attack']:38} {r['outcome']:17} {r['attack_s']:8.2f} {r['worst_wait_ms']:13.1f} "
                f"{r['ordinary_worst_ms']:11.1f} {ratio:6.1f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"load": load, "results": results}, indent=1))
    print(
        f"headline: worst wait of another session during any attack {worst:.0f} ms "
        f"(target <= {TARGET_MS:.0f} ms): {'met' if worst <= TARGET_MS else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
