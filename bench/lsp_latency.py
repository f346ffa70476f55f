"""Headless LSP latency benchmark: type real Python files into ``fimble lsp`` the way an editor would.

The server is launched over stdio exactly as an editor launches it. A trace re-types a
span of a real file (the Python standard library's own modules) one character at a
time at a human rate (default 80 ms/char, a longer pause after each line), sending
``didChange`` per keystroke and, like an editor with a debounce, an inline completion
request shortly after each keystroke, cancelling the previous one if still pending.
The client asks for ``fimble/completionDelta`` streaming and measures, per request:

- time to first delta: request sent -> first non-empty completion text (a delta or the response);
- time to first full line: -> text holding a complete line, or the finished completion;
- time to full completion: -> the stream's end, for streams that ran to their end;

plus the fraction of requests served from the type-through cache and the tokens the
engine generated that were never sent to the editor. Requests overtaken by the next
keystroke before any text arrived count as infinitely slow in the first-delta
percentiles (so they can't flatter them). The last line printed is the headline.

    python -m bench.lsp_latency --quick          # about 45 s
    python -m bench.lsp_latency --json out.json  # four files
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])
DEFAULT_FILES = ["textwrap.py", "queue.py", "fnmatch.py", "bisect.py"]
TARGET_P50_MS, TARGET_P95_MS = 30.0, 80.0


# -- a minimal JSON-RPC client over the server's stdio -----------------------------------------
class RpcClient:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self._next = 0
        self._pending: dict[int, asyncio.Future] = {}
        self.on_notification: Any = None
        self._reader = asyncio.create_task(self._read())

    def _write(self, msg: dict) -> None:
        body = json.dumps(msg).encode()
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def notify(self, method: str, params: Any) -> None:
        self._write({"jsonrpc": "2.0", "method": method, "params": params})

    def request(self, method: str, params: Any) -> tuple[int, asyncio.Future]:
        self._next += 1
        fut = asyncio.get_running_loop().create_future()
        self._pending[self._next] = fut
        self._write({"jsonrpc": "2.0", "id": self._next, "method": method, "params": params})
        return self._next, fut

    async def call(self, method: str, params: Any, timeout: float = 120.0) -> Any:
        _, fut = self.request(method, params)
        msg = await asyncio.wait_for(fut, timeout)
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        return msg.get("result")

    async def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while True:
            length = 0
            while True:
                line = await out.readline()
                if not line:
                    return
                if line in (b"\r\n", b"\n"):
                    break
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            msg = json.loads(await out.readexactly(length))
            now = time.perf_counter()
            if "method" in msg and "id" not in msg:
                if self.on_notification:
                    self.on_notification(msg["method"], msg.get("params"), now)
            elif "method" not in msg:
                fut = self._pending.pop(msg.get("id"), None)
                if fut is not None and not fut.done():
                    msg["_t"] = now
                    fut.set_result(msg)


# -- traces ------------------------------------------------------------------------------------
@dataclass
class Trace:
    name: str
    before: str  # document text before the typed span (the cursor starts at its end)
    typed: str  # what the user types
    after: str  # the rest of the file (the suffix)


def build_trace(path: Path, chars: int) -> Trace:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    start = len(lines) * 2 // 5  # 40% in: real context above and below
    while start < len(lines) and not lines[start].strip():
        start += 1
    head = "".join(lines[:start])
    span = "".join(lines[start:])
    typed = span[:chars]
    return Trace(path.name, head, typed, span[chars:])


def has_full_line(text: str) -> bool:
    """A newline ends a line with content (leading blank lines don't count)."""
    i = text.find("\n")
    while i != -1 and not text[:i].strip():
        i = text.find("\n", i + 1)
    return i != -1


def utf16_len(s: str) -> int:
    return len(s.encode("utf-16-le")) // 2


# -- per-request measurements -----------------------------------------------------------------
@dataclass
class Req:
    rid: int
    t_sent: float
    t_key: float = 0.0  # the keystroke (didChange) this request follows
    t_first: float | None = None
    t_line: float | None = None
    t_done: float | None = None
    t_response: float | None = None
    finish: str | None = None
    cached: bool | None = None
    text: str = ""
    cancelled_by_client: bool = False
    future: asyncio.Future | None = None

    def see(self, text: str, t: float, cached: bool | None = None) -> None:
        if text and self.t_first is None:
            self.t_first = t
            self.cached = cached
        if self.t_line is None and has_full_line(text):
            self.t_line = t
        self.text = max(self.text, text, key=len)


@dataclass
class RunResult:
    requests: list[Req] = field(default_factory=list)
    server_stats: dict = field(default_factory=dict)
    traces: list[str] = field(default_factory=list)
    seconds: float = 0.0


async def run_trace(rpc: RpcClient, trace: Trace, args: argparse.Namespace, out: RunResult, index: int) -> None:
    uri = f"file:///bench/{index}/{trace.name}"
    version = 1
    rpc.notify(
        "textDocument/didOpen",
        {"textDocument": {"uri": uri, "languageId": "python", "version": version, "text": trace.before + trace.after}},
    )
    line = trace.before.count("\n")
    col = utf16_len(trace.before[trace.before.rfind("\n") + 1 :])
    by_id: dict[int, Req] = {}

    def on_note(method: str, params: Any, t: float) -> None:
        if method != "fimble/completionDelta":
            return
        req = by_id.get(params.get("requestId"))
        if req is None:
            return
        req.see(params.get("text") or "", t, params.get("cached"))
        if params.get("done"):
            req.finish = params.get("finishReason")
            if req.finish in ("stop", "eos", "length"):
                req.t_done = t
                if req.t_line is None and req.text.strip():
                    req.t_line = t

    rpc.on_notification = on_note

    def ask() -> Req:
        rid, fut = rpc.request(
            "textDocument/inlineCompletion",
            {"textDocument": {"uri": uri}, "position": {"line": line, "character": col}, "context": {"triggerKind": 2}},
        )
        req = Req(rid, time.perf_counter())
        by_id[rid] = req

        def done(f: asyncio.Future) -> None:
            msg = f.result()
            req.t_response = msg["_t"]
            items = (msg.get("result") or {}).get("items") or []
            if items and items[0].get("insertText"):
                req.see(items[0]["insertText"], msg["_t"], req.cached)

        fut.add_done_callback(done)
        req.future = fut
        return req

    # Warm-up: the first request pays the cold prefill of this file; not counted.
    warm = ask()
    assert warm.future is not None
    await asyncio.wait_for(warm.future, 120)
    await asyncio.sleep(0.3)

    pending: Req | None = None
    t_next = time.perf_counter()
    for ch in trace.typed:
        await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
        if pending is not None and pending.future is not None and not pending.future.done():
            rpc.notify("$/cancelRequest", {"id": pending.rid})  # the editor moves on, as VS Code does
            pending.cancelled_by_client = True
        version += 1
        t_key = time.perf_counter()
        rpc.notify(
            "textDocument/didChange",
            {
                "textDocument": {"uri": uri, "version": version},
                "contentChanges": [
                    {
                        "range": {"start": {"line": line, "character": col}, "end": {"line": line, "character": col}},
                        "text": ch,
                    }
                ],
            },
        )
        if ch == "\n":
            line, col = line + 1, 0
        else:
            col += utf16_len(ch)
        gap = args.ms_per_char + (args.pause_ms if ch == "\n" else 0)
        t_next += gap / 1e3
        await asyncio.sleep(args.debounce_ms / 1e3)
        pending = ask()
        pending.t_key = t_key
        out.requests.append(pending)
    await asyncio.sleep(1.0)  # let the last stream finish
    rpc.notify("textDocument/didClose", {"textDocument": {"uri": uri}})


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(res: RunResult) -> dict:
    reqs = res.requests
    # First delta: requests that got text; those overtaken before any text count as infinite.
    got = [r for r in reqs if r.t_first is not None]
    overtaken = [
        r
        for r in reqs
        if r.t_first is None and (r.cancelled_by_client or r.finish in ("stale", "superseded", "cancelled"))
    ]
    empty = len(reqs) - len(got) - len(overtaken)
    first = [(r.t_first - r.t_sent) * 1e3 for r in got] + [math.inf] * len(overtaken)
    from_key = [(r.t_first - r.t_key) * 1e3 for r in got] + [math.inf] * len(overtaken)
    line = [(r.t_line - r.t_sent) * 1e3 for r in reqs if r.t_line is not None]
    full = [(r.t_done - r.t_sent) * 1e3 for r in reqs if r.t_done is not None]
    cached = [r for r in got if r.cached]
    cache_first = [(r.t_first - r.t_sent) * 1e3 for r in cached]
    tokens = res.server_stats.get("tokens", {})
    gen = tokens.get("tokens_generated", 0)
    never = tokens.get("tokens_never_shown", 0)

    def row(values: list[float]) -> dict:
        return {"n": len(values), **{f"p{int(q * 100)}": percentile(values, q) for q in (0.5, 0.95, 0.99)}}

    return {
        "requests": len(reqs),
        "with_text": len(got),
        "overtaken_before_text": len(overtaken),
        "empty": empty,
        "first_delta_ms": row(first),
        "keystroke_to_first_delta_ms": row(from_key),
        "first_line_ms": row(line),
        "full_completion_ms": row(full),
        "served_from_cache": len(cached) / len(got) if got else 0.0,
        "cache_first_delta_ms": row(cache_first),
        "tokens_generated": gen,
        "tokens_never_shown": never,
        "never_shown_fraction": never / gen if gen else 0.0,
        "server_latency_ms": res.server_stats.get("latency_ms", {}),
        "engine": res.server_stats.get("engine", {}),
        "traces": res.traces,
        "seconds": res.seconds,
    }


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return "inf" if math.isinf(v) else f"{v:.1f}"


def print_table(s: dict) -> None:
    print(f"{'metric':<26}{'n':>6}{'p50':>10}{'p95':>10}{'p99':>10}")
    for label, key in (
        ("time to first delta (ms)", "first_delta_ms"),
        ("keystroke to first delta", "keystroke_to_first_delta_ms"),
        ("time to first line (ms)", "first_line_ms"),
        ("time to full completion", "full_completion_ms"),
        ("first delta, cache hits", "cache_first_delta_ms"),
    ):
        r = s[key]
        print(f"{label:<26}{r['n']:>6}{fmt(r['p50']):>10}{fmt(r['p95']):>10}{fmt(r['p99']):>10}")
    print(
        f"requests {s['requests']}: with text {s['with_text']}, overtaken by typing before any text "
        f"{s['overtaken_before_text']}, empty {s['empty']}"
    )
    print(f"served from type-through cache: {s['served_from_cache']:.1%} of answered requests")
    print(
        f"tokens generated {s['tokens_generated']}, never shown {s['tokens_never_shown']} "
        f"({s['never_shown_fraction']:.1%})"
    )
    stages = s["server_latency_ms"]
    if stages:
        parts = [f"{k} {fmt(v.get('p50'))}/{fmt(v.get('p95'))}" for k, v in stages.items() if v.get("count")]
        print("server stages p50/p95 ms: " + ", ".join(parts))


async def bench(args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if args.model:
        env["FIMBLE_MODEL"] = args.model
    if args.draft:
        env["FIMBLE_DRAFT"] = args.draft
    files = [Path(f) if Path(f).is_file() else STDLIB / f for f in args.files]
    traces = [build_trace(f, args.chars) for f in files]
    cmd = [sys.executable, "-m", "lsp_server", "lsp"]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, cwd=str(REPO), limit=1 << 24
    )
    rpc = RpcClient(proc)
    res = RunResult(traces=[f"{t.name}: {len(t.typed)} chars" for t in traces])
    t0 = time.perf_counter()
    try:
        await rpc.call(
            "initialize",
            {
                "processId": os.getpid(),
                "rootUri": None,
                "capabilities": {
                    "general": {"positionEncodings": ["utf-16"]},
                    "textDocument": {"inlineCompletion": {}, "synchronization": {}},
                },
                "initializationOptions": {
                    "streaming": True,
                    "maxTokens": args.max_tokens,
                    "maxLines": args.max_lines,
                    "tokenHealing": args.heal,
                    "prefetch": not args.no_prefetch,
                },
            },
        )
        rpc.notify("initialized", {})
        while (st := await rpc.call("fimble/stats", None))["engine"]["state"] == "starting":
            await asyncio.sleep(0.2)
        if st["engine"]["state"] != "ready":
            raise RuntimeError(f"engine did not start: {st['engine'].get('error')}")
        for i, trace in enumerate(traces):
            await run_trace(rpc, trace, args, res, i)
        res.server_stats = await rpc.call("fimble/stats", None)
        res.seconds = time.perf_counter() - t0
        await rpc.call("shutdown", None)
        rpc.notify("exit", None)
    finally:
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
    return summarize(res)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one file, 300 characters (under a minute)")
    ap.add_argument("--json", metavar="PATH", help="write the full results here")
    ap.add_argument("--files", nargs="+", default=None, help="Python files to type (default: stdlib modules)")
    ap.add_argument("--chars", type=int, default=600, help="characters typed per file")
    ap.add_argument("--ms-per-char", type=float, default=80.0)
    ap.add_argument("--pause-ms", type=float, default=300.0, help="extra pause after each newline")
    ap.add_argument("--debounce-ms", type=float, default=15.0, help="editor debounce before each request")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-lines", type=int, default=4)
    ap.add_argument("--no-heal", dest="heal", action="store_false", help="token healing off (server default: on)")
    ap.add_argument("--no-prefetch", action="store_true", help="don't start decoding before the request")
    ap.add_argument("--model", help="model folder (default: $FIMBLE_MODEL, else the embedded model)")
    ap.add_argument("--draft", help="draft model folder")
    args = ap.parse_args(argv)
    if args.files is None:
        args.files = DEFAULT_FILES[:1] if args.quick else DEFAULT_FILES
    if args.quick:
        args.chars = min(args.chars, 300)
    try:
        s = asyncio.run(bench(args))
    except (RuntimeError, OSError) as exc:
        print(f"bench.lsp_latency: {exc}", file=sys.stderr)
        return 2
    print_table(s)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "args": vars(args)}, indent=2, default=str))
    fd = s["first_delta_ms"]
    ok = fd["p50"] is not None and fd["p50"] <= TARGET_P50_MS and (fd["p95"] or math.inf) <= TARGET_P95_MS
    print(
        f"first delta p50 {fmt(fd['p50'])} ms, p95 {fmt(fd['p95'])} ms over {fd['n']} requests "
        f"(target p50 <= {TARGET_P50_MS:.0f}, p95 <= {TARGET_P95_MS:.0f}: {'met' if ok else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
