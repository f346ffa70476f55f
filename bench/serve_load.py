"""Many editors typing into one ``fimble serve``: aggregate tok/s, first-delta latency, errors.

Each editor is one websocket session (engine/serve/protocol.py) replaying a typing trace. All
editors first open their own copy of a Python file at the same moment (a completion at the start
of a line: the whole prompt is prefilled, about 1,000 tokens: "cold"). Then, together, each
re-types the line a character at a time; per keystroke it cancels its previous completion and
asks for a new one at the cursor (as ``fimble lsp`` does), waits for the first delta, thinks
``--think-ms``, types on; the last keystroke's completion runs to its end. Measured per
concurrency level (1, 8, 32, 64 editors): tokens decoded per second while typing (the daemon's
``tokens_generated`` counter over the typing phase's wall time), p50/p95 time from a keystroke's
submit to its first delta, the cold first delta, and errors.

The peer, interleaved level by level: the same daemon code with ``--no-batch`` (round-robin:
every sequence still steps each round, one forward each), so the ratio is what batching the
passes buys. Both daemons run with 1 torch thread (the default).

    python -m bench.serve_load --quick              # 1 and 4 editors, under a minute
    python -m bench.serve_load --json out.json      # 1, 8, 32, 64
    python -m bench.serve_load --device cuda --shape 1.5B --levels 1,8,32 --no-peer   # the GPU scale-out bar

``--shape`` (CUDA): the daemon serves a random-weight bf16 model of that Qwen2.5 shape (bench/harness/random_models.py:
0.5B, 1.5B, 7B) with the embedded target's tokenizer and FIM template, no draft model
(n-gram drafts only). The model's vocabulary rows past the tokenizer's are zeroed in ``lm_head`` (same
matmul, never the argmax), so every token decodes. Random weights: the text is noise and acceptance of
n-gram drafts means nothing; the point is the cost of serving that shape. The slotted rounds' graphs
(engine/runtimes/cuda_graphs.py SlotGraphs) are captured at start (``--no-warm-graphs``: on first use), so
capture time stays out of the timed levels. ``--max-tokens 128 --max-lines 0`` makes every completion run
until the next keystroke cancels it (the trace's default, 16 tokens and one line, caps tok/s: at 32 editors
with 100 ms think time, 32 x 16 tokens per ~0.15 s is about 3,400 tok/s whatever the engine does).
``sched_round_ms``/``sched_pass_ms`` give each level's mean round time and its share spent launching and waiting
for target passes (the text of the previous step is streamed while a slotted round's graph runs);
``sched_gpu_ms`` the graph's GPU time; ``sched_shortened`` the verify blocks the round's block choice cut.
Where the Python 3.12 daemon's decode loop should be profiled, set ``SERVE_LOAD_PROFILE=path`` (--shape).
Each level's second line is about stalls: first deltas of ``SLOW_FIRST_DELTA_MS`` or more, grouped where their waits
overlap (one group holding every editor at once: the server stopped as a whole), the decode loop's rounds of 25 ms or
more and where their time went, and full garbage collections in the engine's process and the listeners'
(engine/serve/gc_pauses.py; ``FIMBLE_SERVE_GC_FREEZE=0`` turns the start-up freeze off to compare).

A second peer, another program (issue 27, item 4): ``--llama-server BIN --gguf PATH`` also drives llama.cpp's
``llama-server`` (built with CUDA from the vendored llama.cpp that fimble's CPU library comes from, MIT licence;
bench/peer_h200.sh builds it, and bench/harness/llama_server_cuda.py writes the same random weights as a GGUF) with
the same trace, interleaved level by level: one slot per editor (``--llama-slots``, default the largest level),
continuous batching, each editor's prompt laid out by fimble's FIM template and sent to ``/completion`` with
``cache_prompt`` in its own slot, greedy; a keystroke closes the previous request's connection, which stops it.
Its tok/s counts the tokens the client received while typing, up to each cancel (fimble's: the tokens its daemon
emitted, counted server-side, so tokens decoded between a cancel and the engine seeing it count for fimble alone).
What still differs: fimble heals the prompt's ragged last token and drafts n-grams; llama-server does neither here.
``--rounds N`` repeats the levels. The table's "same last" counts editors whose last completion (run to its end) is
the same text in fimble serve and the peer.

    python -m bench.serve_load --device cuda --shape 1.5B --levels 1,8,32 --no-peer --max-tokens 128 --max-lines 0 \
        --llama-server /tmp/peerjob/build/bin/llama-server --gguf /tmp/peerjob/r15-bf16.gguf --rounds 2

The last line printed is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from websockets.asyncio.client import connect

from bench import serve_timers
from engine.serve import protocol

REPO = Path(__file__).resolve().parent.parent

CORPUS = REPO / "tests" / "data" / "lossless_corpus"
MAX_LINES = 1  # each completion's max_lines (--max-lines; 0: no limit)


class Daemon:
    """``fimble serve --port 0`` in a subprocess; its port read from the line it prints."""

    def __init__(
        self, *extra: str, shape: str | None = None, warm_graphs: bool = True, command: list[str] | None = None
    ):
        """``command``: another daemon's whole command line (bench/serve_host.py's simulated one)."""
        self.log = tempfile.NamedTemporaryFile(prefix="fimble-serve-load-", suffix=".log", delete=False)
        env = dict(os.environ)
        env.setdefault("FIMBLE_DEFAULT_MODEL", "embedded")
        if command:
            cmd = command
        elif shape:  # this file, as a daemon serving a random-weight model of that shape (serve_shape below)
            cmd = [sys.executable, "-m", "bench.serve_load", "--serve-shape", shape, *extra]
            if not warm_graphs:
                cmd.append("--no-warm-graphs")
        else:
            # --no-token: the benchmark's own loopback daemon (a token is required by default, engine/auth.py)
            cmd = [sys.executable, "-m", "lsp_server", "serve", "--port", "0", "--no-token", *extra]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,  # where ``python -m bench.NAME`` finds the bench package
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            env=env,
        )
        deadline = time.monotonic() + 600
        while True:
            text = Path(self.log.name).read_text(errors="replace")
            found = re.search(r"on ws://127\.0\.0\.1:(\d+)", text)
            if found:
                self.url = f"ws://127.0.0.1:{found.group(1)}"
                for line in text.splitlines():
                    if line.startswith("serve_shape:"):
                        print(f"  daemon: {line}", flush=True)
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

    async def submit(
        self, prefix: str, suffix: str, doc: str, max_tokens: int, max_lines: int = 1
    ) -> tuple[int, asyncio.Queue]:
        self.ids += 1
        q = self.queues[self.ids] = asyncio.Queue()
        request = {
            "prefix": prefix,
            "suffix": suffix,
            "document_id": doc,
            "options": {"max_tokens": max_tokens, "max_lines": max_lines},
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


async def _first_delta(q: asyncio.Queue, t0: float, wait_end: bool) -> tuple[float | None, bool, str]:
    """(seconds to the first delta, whether it ended in an error, the text read); reads to the end if ``wait_end``."""
    first, error, text = None, False, ""
    while True:
        msg = await q.get()
        if msg["op"] != "delta":
            continue
        d = msg["delta"]
        text += d["text"]
        if first is None and (d["text"] or d["finished"]):
            first = time.perf_counter() - t0
        error = error or d.get("finish_reason") == "error"
        if d["finished"] or (first is not None and not wait_end):
            return first, error, text


async def editor(
    url: str, trace: tuple[str, str, str], think_s: float, max_tokens: int, name: str, opened, go: asyncio.Event
) -> dict:
    """Open the file (a completion at the line's start: the cold prefill), wait for ``go``, then type."""
    before, typed, after = trace
    s = None
    cold, warm, warm_at, errors, final = None, [], [], 0, None
    try:
        try:
            s = await Session.open(url)
            t0 = time.perf_counter()
            _, q = await s.submit(before, after, name, max_tokens, MAX_LINES)
            cold, err, _ = await _first_delta(q, t0, wait_end=True)
            errors += err
        finally:
            opened()
        await go.wait()
        previous: int | None = None
        for k in range(1, len(typed) + 1):
            if previous is not None:  # a keystroke cancels the completion it outdates, as fimble lsp does
                await s.cancel(previous)
                s.queues.pop(previous, None)
            t0 = time.perf_counter()
            previous, q = await s.submit(before + typed[:k], after, name, max_tokens, MAX_LINES)
            first, err, text = await _first_delta(q, t0, wait_end=k == len(typed))
            errors += err
            if first is not None:
                warm.append(first)
                warm_at.append(t0)
            if k == len(typed):
                final = text
            await asyncio.sleep(think_s)
    finally:
        if s is not None:
            await s.close()
    return {"cold_s": cold, "warm_s": warm, "warm_at": warm_at, "errors": errors, "final": final}


def shape_engine(shape: str, device: str, batch: bool, max_active: int, warm_graphs: bool, attention: str):
    """A ServeEngine on a random-weight model of a Qwen2.5 shape (bench/harness/random_models.py; a line to stderr)."""
    from dataclasses import replace

    import torch

    from bench.harness.llama_server_cuda import tokenizer_only
    from bench.harness.random_models import random_model
    from engine.runtimes.cuda_graphs import GraphRuntime
    from engine.serve.scheduler import ServeEngine, use_serve_kernels

    if device != "cuda":
        raise SystemExit("--shape needs --device cuda (the shapes are built on CUDA, bf16)")
    base = tokenizer_only()  # the embedded target's tokenizer, template and stop ids; its weights are not read
    model = random_model(shape)
    vocab = len(base.tokenizer)
    with torch.no_grad():
        model.lm_head.weight[vocab:].zero_()  # ids the tokenizer lacks: logit 0, never the argmax
    use_serve_kernels()  # fimble serve's kernel set (open_serve_engine does the same), unless the user chose one
    runtime = GraphRuntime(model, attention=None if attention == "default" else attention)
    attention = runtime.attention
    target = replace(base, name=f"random-{shape}", runtime=runtime)
    del base
    torch.cuda.empty_cache()
    engine = ServeEngine(target, None, batch=batch, max_active=max_active, threads=1)
    t0 = time.perf_counter()
    if warm_graphs:
        engine.warm_graphs()  # as fimble serve does at start
    print(
        f"serve_shape: {shape}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, "
        f"scheduler {engine.info()['scheduler']}, attention {attention}, slots "
        f"{engine.slots.streams if engine.slots else 0} x {engine.slots.slot_len if engine.slots else 0}, "
        f"{engine.slots.captures if engine.slots else 0} graphs captured in {time.perf_counter() - t0:.1f} s, "
        f"GPU memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB, "
        f"engine {'in a child process' if os.environ.get('SERVE_LOAD_CHILD') else 'in the daemon process'}",
        file=sys.stderr,
        flush=True,
    )
    if os.environ.get("SERVE_LOAD_CHILD"):  # as engine/process.py --serve does
        sys.setswitchinterval(switch_interval())
    if os.environ.get("SERVE_LOAD_TIMERS"):  # where a round's host time goes (bench/serve_timers.py)
        from bench import serve_timers

        serve_timers.install(engine)
    profile = os.environ.get("SERVE_LOAD_PROFILE")  # a path: cProfile the decode loop, stats written at its end
    if profile:
        import cProfile

        prof = cProfile.Profile()
        serve = engine.serve_forever

        def profiled() -> None:
            try:
                prof.runcall(serve)
            finally:
                prof.dump_stats(profile)

        engine.serve_forever = profiled
    return engine


def switch_interval() -> float:
    """fimble serve's GIL switch interval for its two processes (engine_process.py), or SERVE_LOAD_SWITCH_MS's
    (an experiment: 5 is Python's default)."""
    from engine.serve.engine_process import SWITCH_INTERVAL_S

    ms = os.environ.get("SERVE_LOAD_SWITCH_MS")
    return float(ms) / 1e3 if ms else SWITCH_INTERVAL_S


def serve_shape(args: argparse.Namespace) -> int:
    """Run ``fimble serve`` (port 0, loopback) on a random-weight model of a Qwen2.5 shape: the engine in a
    child process as fimble serve does on CUDA (``--engine-process on``), or in this one."""
    from engine.process import serve_built
    from engine.serve.daemon import ServeOptions, run_daemon

    build = lambda: shape_engine(  # noqa: E731
        args.serve_shape, args.device, not args.no_batch, args.max_active, not args.no_warm_graphs, args.attention
    )
    if os.environ.get("SERVE_LOAD_CHILD"):  # this process is the engine process of the one below
        return serve_built(build)
    announce = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.engine_process == "off":
        return run_daemon(build(), ServeOptions(port=0), announce=announce)
    from engine.serve.engine_process import ServeEngineProcess

    sys.setswitchinterval(switch_interval())  # as fimble serve's daemon does with its engine in a child
    os.environ["SERVE_LOAD_CHILD"] = "1"  # inherited by the child: it builds the engine and serves it on stdio
    engine = ServeEngineProcess.start(command=[sys.executable, "-m", "bench.serve_load", *sys.argv[1:]])
    del os.environ["SERVE_LOAD_CHILD"]
    return run_daemon(engine, ServeOptions(port=0), announce=announce)


SLOW_FIRST_DELTA_MS = 150.0  # a first delta this late is part of a stall (the level's p50 is 15-80 ms)


def stalls(events: list[tuple[float, float]]) -> dict:
    """Slow first deltas (``SLOW_FIRST_DELTA_MS`` or more) grouped into stalls: ``events`` are (submit ms, latency
    ms); slow requests whose waits overlap are one stall. One stall holding many editors at once points at the
    server stopping as a whole (a collection, a capture); slow requests spread thinly over the level, at load."""
    slow = sorted((t, t + lat) for t, lat in events if lat >= SLOW_FIRST_DELTA_MS)
    groups: list[list[float]] = []  # [start, end, requests]
    for start, end in slow:
        if groups and start <= groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], end)
            groups[-1][2] += 1
        else:
            groups.append([start, end, 1])
    worst = max(groups, key=lambda g: g[2], default=[0.0, 0.0, 0])
    return {
        "slow_first_deltas": len(slow),
        "stalls": len(groups),
        "worst_stall_requests": worst[2],
        "worst_stall_at_ms": round(worst[0], 1),
        "worst_stall_ms": round(worst[1] - worst[0], 1),
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def level(url: str, editors: int, chars: int, think_s: float, max_tokens: int, seed: int) -> dict:
    """All editors open their files at once (cold), then type together; tok/s is over the typing."""
    probe = await Session.open(url)
    count, all_open, go = 0, asyncio.Event(), asyncio.Event()

    def opened() -> None:
        nonlocal count
        count += 1
        if count == editors:
            all_open.set()

    t_open = time.perf_counter()
    tasks = asyncio.gather(
        *(
            editor(url, tr, think_s, max_tokens, f"file:///editor{i}.py", opened, go)
            for i, tr in enumerate(traces(editors, chars, seed))
        ),
        return_exceptions=True,
    )
    await all_open.wait()
    open_wall = time.perf_counter() - t_open
    before = (await probe.call("counters"))["counters"]
    t0 = time.perf_counter()
    go.set()
    results = await tasks
    wall = time.perf_counter() - t0
    after = (await probe.call("counters"))["counters"]
    await probe.close()
    cold = [r["cold_s"] for r in results if isinstance(r, dict) and r["cold_s"] is not None]
    warm = [x for r in results if isinstance(r, dict) for x in r["warm_s"]]
    events = sorted(
        (round((at - t0) * 1e3, 1), round(w * 1e3, 1))
        for r in results
        if isinstance(r, dict)
        for at, w in zip(r["warm_at"], r["warm_s"], strict=True)
    )
    errors = sum(r["errors"] if isinstance(r, dict) else chars + 1 for r in results)  # a failed editor: all of it
    tokens = after["tokens_generated"] - before["tokens_generated"]
    rounds = after["sched_rounds"] - before["sched_rounds"]
    rows = after["sched_batched_rows"] - before["sched_batched_rows"]
    round_ms = after.get("sched_round_ms", 0) - before.get("sched_round_ms", 0)
    pass_ms = after.get("sched_pass_ms", 0) - before.get("sched_pass_ms", 0)
    overlap_ms = after.get("sched_overlap_ms", 0) - before.get("sched_overlap_ms", 0)
    launch_ms = after.get("sched_launch_ms", 0) - before.get("sched_launch_ms", 0)
    advance_ms = after.get("sched_advance_ms", 0) - before.get("sched_advance_ms", 0)
    graph_rounds = after.get("sched_graph_rounds", 0) - before.get("sched_graph_rounds", 0)
    gpu_ms = after.get("sched_gpu_ms", 0) - before.get("sched_gpu_ms", 0)
    shortened = after.get("sched_shortened", 0) - before.get("sched_shortened", 0)

    def diff(name: str) -> float:  # a counter over the typing phase (0 where the daemon lacks it)
        return round(after.get(name, 0) - before.get(name, 0), 1)

    return {
        "editors": editors,
        "requests": editors * (chars + 1),
        "open_wall_s": round(open_wall, 2),
        "cold_p50_ms": round(pct(cold, 0.5) * 1e3, 1),
        "cold_p95_ms": round(pct(cold, 0.95) * 1e3, 1),
        "typing_wall_s": round(wall, 2),
        "tokens": tokens,
        "tok_per_s": round(tokens / wall, 1),
        "p50_first_delta_ms": round(pct(warm, 0.5) * 1e3, 1),
        "p95_first_delta_ms": round(pct(warm, 0.95) * 1e3, 1),
        "errors": errors,
        "max_batch": after["sched_max_batch"],
        "mean_rows_per_round": round(rows / rounds, 1) if rounds else 0,
        "rounds": rounds,
        "graph_rounds": graph_rounds,
        "mean_round_ms": round(round_ms / rounds, 2) if rounds else 0,
        "mean_pass_ms": round(pass_ms / rounds, 2) if rounds else 0,
        "mean_launch_ms": round(launch_ms / rounds, 2) if rounds else 0,
        "mean_overlap_ms": round(overlap_ms / rounds, 2) if rounds else 0,
        "mean_advance_ms": round(advance_ms / rounds, 2) if rounds else 0,
        "mean_graph_gpu_ms": round(gpu_ms / graph_rounds, 2) if graph_rounds else 0,
        "drafts_shortened": shortened,
        # the slotted graphs' mean shape: batch (slots) x block (rows a slot), attended keys
        "mean_graph_batch": round(diff("sched_graph_batch") / graph_rounds, 1) if graph_rounds else 0,
        "mean_graph_block": round(diff("sched_graph_block") / graph_rounds, 2) if graph_rounds else 0,
        "mean_graph_keys": round(diff("sched_graph_keys") / graph_rounds) if graph_rounds else 0,
        # fed rounds (engine/fed_rounds.py): rounds launched before the one in flight was read, guessed steps
        "fed_rounds": diff("sched_fed_rounds"),
        "fed_rows": diff("sched_fed_rows"),
        "fed_matched": diff("sched_fed_matched"),
        "busy_share": round(round_ms / 1e3 / wall, 2) if wall else 0,
        # stalls: slow rounds of the decode loop, and the garbage collector's full collections in the engine's
        # process (gc_) and the listeners' (daemon_gc_; engine/serve/gc_pauses.py)
        "slow_rounds": diff("sched_slow_rounds"),
        "slow_round_ms": diff("sched_slow_round_ms"),
        "slow_drafts_ms": diff("sched_slow_drafts_ms"),
        "slow_overlap_ms": diff("sched_slow_overlap_ms"),
        "slow_advance_ms": diff("sched_slow_advance_ms"),
        "admitted": diff("sched_admitted"),
        "tokens_prefilled": diff("tokens_prefilled"),
        "tokens_reused": diff("tokens_reused"),
        "gc_full": diff("gc_full"),
        "gc_full_ms": diff("gc_full_ms"),
        "gc_pause_ms": diff("gc_pause_ms"),
        "daemon_gc_full": diff("daemon_gc_full"),
        "daemon_gc_full_ms": diff("daemon_gc_full_ms"),
        "daemon_gc_pause_ms": diff("daemon_gc_pause_ms"),
        **stalls(events),
        "timers": serve_timers.summary(diff),
        "first_delta_events": events,
        "finals": [r.get("final") if isinstance(r, dict) else None for r in results],
    }


# -- the peer: llama.cpp's llama-server (bench/harness/llama_server_cuda.py), the same trace over HTTP ----------
async def llama_editor(
    port: int, trace: tuple[str, str, str], think_s: float, max_tokens: int, slot: int, opened, go, counter: list
) -> dict:
    """``editor`` against llama-server: the same prompts laid out by fimble's FIM template (the embedded target's:
    suffix first), ``/completion`` streamed with ``cache_prompt`` in this editor's own slot, greedy; a keystroke
    closes the previous request's connection (llama-server then stops that task). ``counter[0]`` counts the tokens
    streamed back (``return_tokens``), the cancelled requests' too until their connection closes."""
    from bench.harness.llama_server_cuda import Stream
    from engine.fim import TEMPLATES

    before, typed, after = trace
    loop = asyncio.get_running_loop()

    async def run(prefix: str, first: asyncio.Future) -> str:
        body = {
            "prompt": TEMPLATES["fimble"].build(prefix, after),
            "n_predict": max_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "samplers": ["top_k"],
            "cache_prompt": True,
            "id_slot": slot,
            "return_tokens": True,
        }
        if MAX_LINES:  # an approximation of fimble's max_lines: stop at the first newline
            body["stop"] = ["\n"]
        text, s = "", None
        try:
            s = await Stream.open(port, "/completion", body)
            async for chunk in s.events():
                counter[0] += len(chunk.get("tokens") or [])
                text += chunk.get("content") or ""
                if not first.done() and (chunk.get("content") or chunk.get("stop")):
                    first.set_result(time.perf_counter())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an error is counted, as fimble's error deltas are
            if not first.done():
                first.set_exception(exc)
            raise
        finally:
            if s is not None:
                s.close()
            if not first.done():
                first.set_result(time.perf_counter())
        return text

    cold, warm, errors, final, previous = None, [], 0, None, None
    try:
        try:
            fut = loop.create_future()
            t0 = time.perf_counter()
            task = asyncio.create_task(run(before, fut))
            try:
                await task
                cold = fut.result() - t0
            except Exception:  # noqa: BLE001
                errors += 1
        finally:
            opened()
        await go.wait()
        for k in range(1, len(typed) + 1):
            if previous is not None:
                previous.cancel()
            fut = loop.create_future()
            t0 = time.perf_counter()
            previous = asyncio.create_task(run(before + typed[:k], fut))
            try:
                warm.append((await fut) - t0)
                if k == len(typed):
                    final = await previous
            except Exception:  # noqa: BLE001
                errors += 1
            await asyncio.sleep(think_s)
    finally:
        if previous is not None and not previous.done():
            previous.cancel()
    return {"cold_s": cold, "warm_s": warm, "errors": errors, "final": final}


async def llama_level(server, editors: int, chars: int, think_s: float, max_tokens: int, seed: int) -> dict:
    """``level`` against llama-server: editor i in slot i; tok/s counts the tokens streamed back while typing."""
    count, all_open, go, counter = 0, asyncio.Event(), asyncio.Event(), [0]

    def opened() -> None:
        nonlocal count
        count += 1
        if count == editors:
            all_open.set()

    t_open = time.perf_counter()
    tasks = asyncio.gather(
        *(
            llama_editor(server.port, tr, think_s, max_tokens, i, opened, go, counter)
            for i, tr in enumerate(traces(editors, chars, seed))
        ),
        return_exceptions=True,
    )
    await all_open.wait()
    open_wall = time.perf_counter() - t_open
    m0 = server.metrics()
    before = counter[0]
    t0 = time.perf_counter()
    go.set()
    results = await tasks
    wall = time.perf_counter() - t0
    tokens = counter[0] - before
    m1 = server.metrics()
    cold = [r["cold_s"] for r in results if isinstance(r, dict) and r["cold_s"] is not None]
    warm = [x for r in results if isinstance(r, dict) for x in r["warm_s"]]
    errors = sum(r["errors"] if isinstance(r, dict) else chars + 1 for r in results)
    diff = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1 if k.endswith("_total")}
    decodes = diff.get("n_decode_total", 0)
    return {
        "editors": editors,
        "requests": editors * (chars + 1),
        "open_wall_s": round(open_wall, 2),
        "cold_p50_ms": round(pct(cold, 0.5) * 1e3, 1),
        "cold_p95_ms": round(pct(cold, 0.95) * 1e3, 1),
        "typing_wall_s": round(wall, 2),
        "tokens": tokens,
        "tok_per_s": round(tokens / wall, 1),
        "p50_first_delta_ms": round(pct(warm, 0.5) * 1e3, 1),
        "p95_first_delta_ms": round(pct(warm, 0.95) * 1e3, 1),
        "errors": errors,
        # /metrics over the typing phase (a slot's generated tokens are counted when the slot is next reset, so
        # the last completions of the phase may be missing here): prompt tokens computed and reused, decode calls
        "server_tokens_predicted": diff.get("tokens_predicted_total", 0),
        "server_prompt_tokens": diff.get("prompt_tokens_total", 0),
        "server_prompt_tokens_cached": diff.get("prompt_tokens_cached_total", 0),
        "server_decode_calls": decodes,
        "mean_tokens_per_decode": round(diff.get("tokens_predicted_total", 0) / decodes, 1) if decodes else 0,
        "finals": [r.get("final") if isinstance(r, dict) else None for r in results],
    }


def identical(a: dict, b: dict) -> tuple[int, int]:
    """(editors whose last completion has the same text in ``a`` and ``b``, editors compared)."""
    pairs = [(x, y) for x, y in zip(a.get("finals", []), b.get("finals", []), strict=False) if x is not None]
    return sum(x == y for x, y in pairs if y is not None), len(pairs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,8,32,64", help="concurrent editors per level, comma-separated")
    ap.add_argument("--chars", type=int, default=12, help="characters each editor types (one request each)")
    ap.add_argument("--think-ms", type=int, default=100, help="pause between a first delta and the next keystroke")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-lines", type=int, default=1, help="each completion's max_lines (0: no limit)")
    ap.add_argument("--quick", action="store_true", help="levels 1 and 4, 6 characters: under a minute")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--device", default="cpu", help="the daemons' --device (cpu, cuda)")
    ap.add_argument("--shape", choices=("0.5B", "1.5B", "7B"), help="serve a random-weight model of this shape (CUDA)")
    ap.add_argument("--no-peer", action="store_true", help="batched daemon only (no round-robin peer)")
    ap.add_argument("--no-warm-graphs", action="store_true", help="--shape: capture graphs on first use instead")
    ap.add_argument("--max-active", type=int, default=64, help="--shape: the daemon's max active sequences")
    ap.add_argument(
        "--attention",
        choices=("default", "invariant-cublas", "invariant", "fused", "sdpa", "matmul"),
        default="default",
        help="--shape: the graphs' attention (default: GraphRuntime's, the Triton kernels where Triton runs, else "
        "sdpa; on 2026-12-01 matmul was slower than sdpa in 32-slot rounds of the 1.5B shape: 6.5 ms against 5.4)",
    )
    ap.add_argument(
        "--engine-process",
        choices=("on", "off"),
        default="on",
        help="--shape: the decode loop in a child process (on: fimble serve's CUDA default) or in the daemon's",
    )
    ap.add_argument(
        "--llama-server",
        metavar="BIN",
        help="also drive llama.cpp's llama-server (a CUDA build: bench/peer_h200.sh) serving --gguf with the same "
        "trace, interleaved level by level (bench/harness/llama_server_cuda.py)",
    )
    ap.add_argument("--gguf", help="--llama-server's model (python -m bench.harness.llama_server_cuda --write-gguf)")
    ap.add_argument("--llama-slots", type=int, default=0, help="llama-server's parallel slots (0: the largest level)")
    ap.add_argument("--rounds", type=int, default=1, help="run the levels this many times, interleaved")
    ap.add_argument(
        "--fresh-traces",
        action="store_true",
        help="a new trace every round (seed level + 1000 x round): without it every round re-types the same lines "
        "into the same documents, so the server's memos of earlier rounds answer later ones",
    )
    ap.add_argument("--serve-shape", help=argparse.SUPPRESS)  # internal: be the daemon (serve_shape)
    ap.add_argument("--no-batch", action="store_true", help=argparse.SUPPRESS)  # internal, with --serve-shape
    args = ap.parse_args(argv)
    if args.serve_shape:
        return serve_shape(args)
    if args.quick:
        args.levels, args.chars = "1,4", 6
    global MAX_LINES
    MAX_LINES = args.max_lines
    levels = [int(x) for x in args.levels.split(",")]
    if any(not 1 <= n <= 1024 for n in levels) or not 1 <= args.chars <= 200 or not 0 <= args.think_ms <= 10_000:
        raise SystemExit("levels 1-1024 editors, --chars 1-200, --think-ms 0-10000")
    load_start = os.getloadavg()
    model = f"random {args.shape}" if args.shape else os.environ.get("FIMBLE_DEFAULT_MODEL", "embedded")
    print(
        f"fimble serve load: {model} on {args.device}, levels {levels}, {args.chars} keystrokes each, think "
        f"{args.think_ms} ms, max_tokens {args.max_tokens}, max_lines {args.max_lines}, daemon threads 1, "
        f"load average {load_start[0]:.2f}",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the daemons
    if args.shape:
        common = ("--device", args.device, "--max-active", str(args.max_active), "--attention", args.attention)
        common += ("--engine-process", args.engine_process)
        kw = {"shape": args.shape, "warm_graphs": not args.no_warm_graphs}
    else:
        common, kw = ("--threads", "1", "--device", args.device), {}
    if args.llama_server and not args.gguf:
        raise SystemExit("--llama-server needs --gguf")
    daemons: dict = {"batched": Daemon(*common, **kw)}
    if not args.no_peer:
        daemons["round-robin"] = Daemon(*common, "--no-batch", **kw)
    llama = None
    if args.llama_server:
        from bench.harness.llama_server_cuda import CudaLlamaServer

        slots = args.llama_slots or max(levels)
        log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        llama = daemons["llama-server"] = CudaLlamaServer(args.llama_server, Path(args.gguf), slots, log)
        print(f"  peer: {' '.join(llama.cmd)} (log {log})", flush=True)
    rows: list[dict] = []
    try:
        for rnd, n in ((r, n) for r in range(args.rounds) for n in levels):  # every system at a level, then the next
            seed = n + 1000 * rnd if args.fresh_traces else n
            for name, daemon in daemons.items():
                think = args.think_ms / 1e3
                if daemon is llama:
                    r = asyncio.run(llama_level(llama, n, args.chars, think, args.max_tokens, seed=seed))
                else:
                    r = asyncio.run(level(daemon.url, n, args.chars, think, args.max_tokens, seed=seed))
                r["scheduler"] = name
                r["round"] = rnd
                r["load_average"] = round(os.getloadavg()[0], 2)
                rows.append(r)
                if daemon is llama:
                    print(
                        f"  {name:>12} {n:>3} editors: cold first delta p95 {r['cold_p95_ms']:>8.1f} ms; typing "
                        f"{r['tok_per_s']:>7.1f} tok/s, first delta p50 {r['p50_first_delta_ms']:>7.1f} ms p95 "
                        f"{r['p95_first_delta_ms']:>7.1f} ms; errors {r['errors']}; server: "
                        f"{r['server_decode_calls']:.0f} decodes, {r['mean_tokens_per_decode']} tokens/decode, "
                        f"prompt tokens {r['server_prompt_tokens']:.0f} computed / "
                        f"{r['server_prompt_tokens_cached']:.0f} reused, load {r['load_average']}",
                        flush=True,
                    )
                    continue
                print(
                    f"  {name:>11} {n:>3} editors: cold first delta p95 {r['cold_p95_ms']:>8.1f} ms; typing "
                    f"{r['tok_per_s']:>7.1f} tok/s, first delta p50 {r['p50_first_delta_ms']:>7.1f} ms p95 "
                    f"{r['p95_first_delta_ms']:>7.1f} ms; errors {r['errors']}, rows/round "
                    f"{r['mean_rows_per_round']}, round {r['mean_round_ms']} ms (passes {r['mean_pass_ms']} ms, "
                    f"launching {r['mean_launch_ms']} ms of it, "
                    f"overlapped {r['mean_overlap_ms']} ms, advancing {r['mean_advance_ms']} ms, "
                    f"graph GPU {r['mean_graph_gpu_ms']} ms of {r.get('mean_graph_batch', 0)} x "
                    f"{r.get('mean_graph_block', 0)} rows, {r.get('mean_graph_keys', 0)} keys, busy "
                    f"{r['busy_share']:.0%}), drafts cut "
                    f"{r['drafts_shortened']}, fed rounds {r['fed_rounds']:.0f} ({r['fed_matched']:.0f} of "
                    f"{r['fed_rows']:.0f} guessed steps held), load {r['load_average']}",
                    flush=True,
                )
                print(
                    f"  {'':>11} {'':>3}          stalls: {r['slow_first_deltas']} first deltas >= "
                    f"{SLOW_FIRST_DELTA_MS:.0f} ms in {r['stalls']} stalls (worst: {r['worst_stall_requests']} "
                    f"requests over {r['worst_stall_ms']} ms from {r['worst_stall_at_ms']} ms); rounds >= 25 ms "
                    f"{r['slow_rounds']:.0f} ({r['slow_round_ms']:.0f} ms: drafts {r['slow_drafts_ms']:.0f}, "
                    f"overlapped {r['slow_overlap_ms']:.0f}, advancing {r['slow_advance_ms']:.0f}); admitted "
                    f"{r['admitted']:.0f}, prefilled {r['tokens_prefilled']:.0f} tokens, reused "
                    f"{r['tokens_reused']:.0f}; full collections engine "
                    f"{r['gc_full']:.0f} ({r['gc_full_ms']:.0f} ms of {r['gc_pause_ms']:.0f} ms collecting), "
                    f"listeners {r['daemon_gc_full']:.0f} ({r['daemon_gc_full_ms']:.0f} ms of "
                    f"{r['daemon_gc_pause_ms']:.0f} ms)",
                    flush=True,
                )
                if r.get("timers"):
                    print(f"  {'':>11} {'':>3}          timers: {serve_timers.line(r['timers'])}", flush=True)
    finally:
        for d in daemons.values():
            if d is llama:
                d.close()
            else:
                d.stop()
    print()
    print(
        f"{'editors':>7} | {'round':>5} | {'batched tok/s':>13} | {'rr tok/s':>8} | {'ratio':>5} | {'p50 ms':>7} | "
        f"{'p95 ms':>7} | {'rr p95 ms':>9} | {'cold p95 ms':>11} | {'rr cold p95':>11} | {'llama tok/s':>11} | "
        f"{'/llama':>6} | {'llama p50':>9} | {'llama p95':>9} | {'llama cold p95':>14} | same last | errors"
    )
    headline = ""
    none = {
        "tok_per_s": float("nan"),
        "p50_first_delta_ms": float("nan"),
        "p95_first_delta_ms": float("nan"),
        "cold_p95_ms": float("nan"),
        "errors": 0,
    }
    for n in levels:
        per_round = []
        for rnd in range(args.rounds):
            at = [r for r in rows if r["editors"] == n and r["round"] == rnd]
            b = next(r for r in at if r["scheduler"] == "batched")
            rr = next((r for r in at if r["scheduler"] == "round-robin"), none)
            ll = next((r for r in at if r["scheduler"] == "llama-server"), none)
            ratio = b["tok_per_s"] / rr["tok_per_s"] if rr["tok_per_s"] else float("nan")
            vs = b["tok_per_s"] / ll["tok_per_s"] if ll["tok_per_s"] else float("nan")
            same = identical(b, ll) if ll is not none else identical(b, rr) if rr is not none else (0, 0)
            per_round.append((b, rr, ll, ratio, vs, same))
            print(
                f"{n:>7} | {rnd:>5} | {b['tok_per_s']:>13.1f} | {rr['tok_per_s']:>8.1f} | {ratio:>5.2f} | "
                f"{b['p50_first_delta_ms']:>7.1f} | {b['p95_first_delta_ms']:>7.1f} | "
                f"{rr['p95_first_delta_ms']:>9.1f} | {b['cold_p95_ms']:>11.1f} | {rr['cold_p95_ms']:>11.1f} | "
                f"{ll['tok_per_s']:>11.1f} | {vs:>6.2f} | {ll['p50_first_delta_ms']:>9.1f} | "
                f"{ll['p95_first_delta_ms']:>9.1f} | {ll['cold_p95_ms']:>14.1f} | {same[0]:>4}/{same[1]:<4} | "
                f"{b['errors'] + rr['errors'] + ll['errors']}"
            )

        def each(key: str, which: int, per_round: list = per_round) -> str:
            return "/".join(f"{p[which][key]:.0f}" for p in per_round)

        b, rr, ll, ratio, vs, same = per_round[-1]
        errors = sum(p[0]["errors"] + p[1]["errors"] + p[2]["errors"] for p in per_round)
        same_all = f"{sum(p[5][0] for p in per_round)}/{sum(p[5][1] for p in per_round)}"
        headline = (
            f"serve_load: {n} editors typing into one fimble serve ({model}, {args.device}, 1 thread): "
            f"{each('tok_per_s', 0)} tok/s aggregate batched"
        )
        if llama is not None:
            headline += (
                f" vs llama-server {each('tok_per_s', 2)} ({'/'.join(f'{p[4]:.2f}' for p in per_round)}x), p95 first "
                f"delta {each('p95_first_delta_ms', 0)} ms vs {each('p95_first_delta_ms', 2)} ms, last completions "
                f"identical to llama-server's {same_all}"
            )
        if rr is not none:
            headline += (
                f" vs {each('tok_per_s', 1)} round-robin ({'/'.join(f'{p[3]:.2f}' for p in per_round)}x), p95 "
                f"first delta {each('p95_first_delta_ms', 0)} ms vs {each('p95_first_delta_ms', 1)} ms"
            )
            if llama is None:
                headline += f", last completions identical batched vs round-robin {same_all}"
        headline += f", errors {errors}, load average {os.getloadavg()[0]:.2f}"
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "bench": "serve_load",
                    "date": time.strftime("%Y-%m-%d"),
                    "threads": 1,
                    "device": args.device,
                    "model": model,
                    "levels": levels,
                    "chars": args.chars,
                    "think_ms": args.think_ms,
                    "max_tokens": args.max_tokens,
                    "max_lines": args.max_lines,
                    "load_average_start": load_start,
                    "load_average_end": os.getloadavg(),
                    "cpu_count": os.cpu_count(),
                    "rounds": args.rounds,
                    "fresh_traces": args.fresh_traces,
                    "peer": llama.cmd if llama is not None else None,
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
