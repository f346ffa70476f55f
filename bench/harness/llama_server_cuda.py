"""llama.cpp's server on the GPU as fimble serve's peer: the GGUF it serves, an asyncio client, the single-stream step.

The peer of bench/serve_load.py ``--llama-server`` and bench/gpu.py ``--llama-server`` (issue 27, item 4): llama.cpp's
``llama-server`` built with CUDA (sm_90) from the same vendored source as fimble's CPU library (llama-cpp-python
0.3.36's ``vendor/llama.cpp``, MIT licence; bench/peer_h200.sh builds it on the GPU machine), serving the same
random-weight Qwen2.5-shape model as fimble serve's ``--shape``:

    python -m bench.harness.llama_server_cuda --write-gguf /tmp/r15.gguf --shape 1.5B [--dtype bf16|f16]
    python -m bench.harness.llama_server_cuda --step --llama-server BIN --gguf /tmp/r15.gguf --shape 1.5B

``--write-gguf``: bench/harness/random_models.py's model (seed 0, built on CUDA, bf16) with the rows of ``lm_head``
past the tokenizer zeroed as serve_load's daemon does, written tensor for tensor (bf16 bytes as they are; ``f16``
converts them) with the embedded target's tokenizer, its token list padded to the model's 151,936 rows
(``[PADn]``, never produced: their logits are 0), SPM FIM sentinels, no BOS. Qwen2's rotary layout is NEOX in
llama.cpp, fimble's too, so q/k are stored as they are; ``embed`` and ``lm_head`` are separate tensors in
the random model (each drawn), so the GGUF has ``output.weight``.

``--step``: both greedy on the same 1,024 random prompt ids, 128 tokens: fimble's CUDA-graph runtime one token a
step (what bench/gpu.py calls the graph step: the call plus reading the argmax back), and llama-server's
``/completion`` alone on the server (``timings.predicted_per_token_ms``, llama.cpp's own figure, and the client's
time between streamed tokens). The outputs are compared token for token (llama-server with ``ignore_eos``;
fimble's argmax masks the same end tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
END_TOKENS = ("<|endoftext|>", "<|file_sep|>", "<|fim_pad|>")  # what llama.cpp treats as end of generation here


# -- the GGUF -------------------------------------------------------------------------------------------------
def write_gguf(model, tokenizer_folder: Path, out: Path, dtype: str = "bf16") -> Path:
    """Write a CompactTransformer (Qwen2 shape) and the tokenizer of ``tokenizer_folder`` as a GGUF file."""
    import gguf
    import numpy as np
    import torch

    from engine.runtimes.gguf_export import _tokenizer_tables, add_tokenizer

    cfg = model.cfg
    tokens, types, merges, special, eos = _tokenizer_tables(Path(tokenizer_folder))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg.vocab_size)]
    types += [1] * (cfg.vocab_size - len(types))
    qt = {"bf16": gguf.GGMLQuantizationType.BF16, "f16": gguf.GGMLQuantizationType.F16}[dtype]
    ft = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f16": gguf.LlamaFileType.MOSTLY_F16}[dtype]
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name(f"fimble-random-{dtype}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_file_type(ft)
    add_tokenizer(w, (tokens, types, merges, special, eos))

    def put(name: str, t: torch.Tensor) -> None:
        t = t.detach()
        if t.ndim == 1:  # norms and biases: f32, as llama.cpp's converter writes them
            w.add_tensor(name, t.float().cpu().numpy())
        elif dtype == "f16":
            w.add_tensor(name, t.to(torch.float16).cpu().numpy())
        else:  # bf16 bytes as they are (numpy has no bf16): a uint8 view, its last dimension in bytes
            raw = t.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().view(np.uint8)
            w.add_tensor(name, raw, raw_dtype=qt)

    q_dim, kv_dim, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    put("token_embd.weight", model.embed.weight)
    put("output_norm.weight", model.norm.weight)
    put("output.weight", model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        q, k, v = layer.qkv.weight.split((q_dim, kv_dim, kv_dim))
        put(b + "attn_norm.weight", layer.attn_norm.weight)
        put(b + "attn_q.weight", q)
        put(b + "attn_k.weight", k)
        put(b + "attn_v.weight", v)
        if layer.qkv.bias is not None:
            qb, kb, vb = layer.qkv.bias.split((q_dim, kv_dim, kv_dim))
            put(b + "attn_q.bias", qb)
            put(b + "attn_k.bias", kb)
            put(b + "attn_v.bias", vb)
        put(b + "attn_output.weight", layer.o_proj.weight)
        put(b + "ffn_norm.weight", layer.mlp_norm.weight)
        gate, up = layer.gate_up.weight.split((f, f))
        put(b + "ffn_gate.weight", gate)
        put(b + "ffn_up.weight", up)
        put(b + "ffn_down.weight", layer.down.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def tokenizer_only(folder: Path | None = None):
    """The embedded target as engine.loader.load_model assembles it (tokenizer, FIM template, stop ids, context
    length), without reading its weights: ``runtime`` is None. What bench/serve_load.py's ``--shape`` daemon serves
    the random model with; the GPU machine then needs no shard of models/fimble-target."""
    from engine.loader import DEFAULT_TARGET, _assemble, _load_tokenizer, _read_config

    folder = Path(folder or DEFAULT_TARGET)
    return _assemble(folder, _read_config(folder), _load_tokenizer(folder, False), None, None, "compact")


def served_random_model(shape: str):
    """(model, tokenizer) as serve_load's daemon serves ``--shape``: lm_head rows past the tokenizer zeroed."""
    import torch

    from bench.harness.random_models import random_model

    base = tokenizer_only()
    model = random_model(shape)
    with torch.no_grad():
        model.lm_head.weight[len(base.tokenizer) :].zero_()
    return model, base.tokenizer


# -- llama-server ---------------------------------------------------------------------------------------------
class CudaLlamaServer:
    """``llama-server`` on loopback, all layers on the GPU, ``slots`` parallel slots of ``ctx`` tokens each,
    continuous batching (its default), flash attention auto (on for CUDA), ``/metrics`` on. ``LLAMA_SERVER_ARGS``
    (split on spaces) adds arguments, e.g. ``-bs``: llama.cpp's backend (on-GPU) sampling, off by default."""

    def __init__(self, binary: str, gguf: Path, slots: int, log_path: Path, ctx: int = 4096, extra: tuple = ()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [
            binary,
            "-m",
            str(gguf),
            "-ngl",
            "999",
            "-fit",
            "off",
            "-c",
            str(ctx * slots),
            "-np",
            str(slots),
            "-cb",
            "--metrics",
            "--no-webui",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra,
            *os.environ.get("LLAMA_SERVER_ARGS", "").split(),
        ]
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - kept open for the server's lifetime
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self.get("/health")[0] == 200:
                    self.props = self.get("/props")[1]
                    return
            time.sleep(0.3)
        self.close()
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError("llama-server did not become healthy: " + " | ".join(tail))

    def get(self, path: str) -> tuple[int, object]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            with contextlib.suppress(ValueError):
                return resp.status, json.loads(body)
            return resp.status, body.decode(errors="replace")
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """``/metrics``' counters (Prometheus text), names without the ``llamacpp:`` prefix."""
        status, text = self.get("/metrics")
        out: dict[str, float] = {}
        if status == 200 and isinstance(text, str):
            for line in text.splitlines():
                if line and not line.startswith("#"):
                    name, _, value = line.rpartition(" ")
                    with contextlib.suppress(ValueError):
                        out[name.removeprefix("llamacpp:")] = float(value)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()
        self._log.close()


class Stream:
    """One streamed llama-server request over a raw asyncio connection (HTTP/1.1, SSE ``data:`` lines; chunked
    or not). Closing the connection is the cancel: the server stops the task when it sees the socket gone."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chunked: bool):
        self.reader, self.writer, self.chunked = reader, writer, chunked
        self.buf = b""

    @classmethod
    async def open(cls, port: int, path: str, body: dict) -> Stream:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = json.dumps({**body, "stream": True}).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + data)
        await writer.drain()
        status = await reader.readline()
        headers = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        if b" 200 " not in status:
            rest = await reader.read(300)
            writer.close()
            raise RuntimeError(f"llama-server {path}: {status.decode(errors='replace').strip()}: {rest[:200]!r}")
        return cls(reader, writer, "transfer-encoding: chunked" in headers)

    async def _more(self) -> bool:
        if self.chunked:
            size = int((await self.reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return False
            self.buf += await self.reader.readexactly(size)
            await self.reader.readexactly(2)
            return True
        data = await self.reader.read(65536)
        self.buf += data
        return bool(data)

    async def events(self):
        """Yield each ``data:`` chunk as a dict, until the final one (``stop``) or the end of the body."""
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    yield chunk
                    if chunk.get("stop"):
                        return
            if not await self._more():
                return

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


# -- the single-stream step -----------------------------------------------------------------------------------
def fimble_greedy(model, prompt: list[int], n: int, masked: list[int], reps: int = 2) -> tuple[list[int], list[float]]:
    """Greedy ``n`` tokens after ``prompt`` on fimble's CUDA-graph runtime, one token a step; (output, step seconds
    of the last repetition). The first repetition captures the graphs (cache buckets) and is not timed."""
    import torch

    from engine.runtimes.cuda_graphs import GraphRuntime

    dev = model.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
    runtime = GraphRuntime(model)
    cache = model.new_cache(len(prompt) + n + 64)
    ids = torch.tensor(prompt, device=dev)
    mask = torch.zeros(model.cfg.vocab_size, device=dev)
    mask[masked] = float("-inf")
    out: list[int] = []
    steps: list[float] = []
    for _ in range(reps):
        logits = runtime(ids, cache, 0, 1)
        tok = int((logits[-1] + mask).argmax())
        out, steps = [tok], []
        one = torch.empty(1, dtype=torch.long, device=dev)
        for i in range(n - 1):
            sync()
            t0 = time.perf_counter()
            one.fill_(tok)
            tok = int((runtime(one, cache, len(prompt) + i, 1)[-1] + mask).argmax())
            steps.append(time.perf_counter() - t0)
            out.append(tok)
    return out, steps


def llama_greedy(port: int, prompt: list[int], n: int, reps: int = 2) -> tuple[list[int], dict, list[float]]:
    """Greedy ``n`` tokens (ignore_eos) on llama-server alone, no prompt cache; (output, llama.cpp's timings of the
    last repetition, client seconds between streamed tokens)."""
    body = {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k"],
        "cache_prompt": False,
        "ignore_eos": True,
        "return_tokens": True,
        "id_slot": 0,
    }

    async def once():
        s = await Stream.open(port, "/completion", body)
        out, stamps, timings = [], [], {}
        try:
            async for chunk in s.events():
                toks = chunk.get("tokens") or []
                out.extend(int(t) for t in toks)
                if toks:
                    stamps.append(time.perf_counter())
                if chunk.get("stop"):
                    timings = chunk.get("timings", {})
        finally:
            s.close()
        return out, timings, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]

    result = None
    for _ in range(reps):
        result = asyncio.run(once())
    return result


def step_compare(binary: str, gguf: Path, shape: str, context: int, n: int, log_dir: Path, model=None, tok=None):
    """fimble's graph step and llama-server's step on the same prompt; outputs compared. A dict."""
    import random

    if model is None:
        model, tok = served_random_model(shape)
    vocab = len(tok)
    rng = random.Random(1)
    prompt = [rng.randrange(8, vocab) for _ in range(context)]
    added = json.loads((REPO / "models" / "fimble-target" / "tokenizer.json").read_text())["added_tokens"]
    masked = [a["id"] for a in added if a["content"] in END_TOKENS]
    f_out, f_steps = fimble_greedy(model, prompt, n, masked)
    server = CudaLlamaServer(binary, gguf, 1, log_dir / f"llama-server-step-{gguf.stem}.log", ctx=context + n + 64)
    try:
        l_out, timings, l_gaps = llama_greedy(server.port, prompt, n)
    finally:
        server.close()
    same = next((i for i, (a, b) in enumerate(zip(f_out, l_out, strict=False)) if a != b), min(len(f_out), len(l_out)))
    row = {
        "shape": shape,
        "gguf": str(gguf),
        "llama_server_args": os.environ.get("LLAMA_SERVER_ARGS", ""),
        "context": context,
        "tokens": n,
        "fimble_step_ms_median": round(statistics.median(f_steps) * 1e3, 3),
        "fimble_step_ms_mean": round(statistics.fmean(f_steps) * 1e3, 3),
        "llama_step_ms": round(timings.get("predicted_per_token_ms", float("nan")), 3),
        "llama_client_gap_ms_median": round(statistics.median(l_gaps) * 1e3, 3) if l_gaps else float("nan"),
        "llama_prompt_ms": round(timings.get("prompt_ms", float("nan")), 1),
        "identical_prefix": same,
        "identical_tokens": sum(a == b for a, b in zip(f_out, l_out, strict=False)),
        "compared": min(len(f_out), len(l_out)),
    }
    row["step_ratio"] = round(row["fimble_step_ms_median"] / row["llama_step_ms"], 3) if row["llama_step_ms"] else None
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-gguf", metavar="PATH", help="write the random model of --shape as a GGUF here")
    ap.add_argument("--dtype", choices=("bf16", "f16"), default="bf16")
    ap.add_argument("--shape", default="1.5B", choices=("0.5B", "1.5B", "7B"))
    ap.add_argument("--step", action="store_true", help="single-stream step: fimble against llama-server")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="the llama-server binary")
    ap.add_argument("--gguf", action="append", default=[], help="the GGUF(s) llama-server serves (--step)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    model = tok = None
    if args.write_gguf:
        model, tok = served_random_model(args.shape)
        t0 = time.perf_counter()
        write_gguf(model, REPO / "models" / "fimble-target", Path(args.write_gguf), args.dtype)
        size = Path(args.write_gguf).stat().st_size / 2**30
        print(f"wrote {args.write_gguf} ({args.dtype}, {size:.2f} GiB) in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.step:
        if not args.llama_server or not args.gguf:
            raise SystemExit("--step needs --llama-server and --gguf")
        rows = []
        for g in args.gguf:
            row = step_compare(
                args.llama_server, Path(g), args.shape, args.context, args.tokens, Path(g).parent, model, tok
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        for r in rows:
            print(
                f"step_peer: {args.shape} at {r['context']} cached, {r['tokens']} greedy tokens: fimble graph step "
                f"{r['fimble_step_ms_median']:.3f} ms vs llama-server ({Path(r['gguf']).name}) "
                f"{r['llama_step_ms']:.3f} ms ({r['step_ratio']}x); outputs identical for the first "
                f"{r['identical_prefix']} of {r['compared']} tokens ({r['identical_tokens']} equal by position)"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
