"""fimble against llama.cpp on the same model: cold prompts and a keystroke loop, interleaved per prompt.

    pip install -e '.[bench]'     # llama-cpp-python (compiles llama.cpp; not in CI's path)
    python bench/vs_llamacpp.py [--quick] [--threads 1,2] [--server PATH/llama-server] [--json PATH]

The embedded target and draft are written as GGUF (engine/gguf_export.py: pre-tokenizer "gpt-2",
FIM ids, add_bos false) into --gguf-dir, f32 and q8_0. Before timing, the script checks that
llama.cpp tokenises real code to fimble's ids, and it reports how many greedy outputs are
identical to fimble plain of the same precision (f32 against fimble fp32: expected identical up
to near ties; q8_0 against fimble int8: both 8-bit, but q8_0 scales blocks of 32 weights while
fimble's int8 scales whole rows, so their outputs are not expected to match token for token).

Cold prompts: each system decodes exactly --tokens new tokens greedily from the same token ids
(no EOS stop). Per system: end-to-end ms, TTFT (prefill + first token) and decode tok/s (tokens
after the first). Systems run one after another on each prompt, so load hits them alike; ratios
are against llama.cpp plain, q8_0 and llama-server with the same draft model.

Keystroke loop (needs --server): real files typed one key at a time. llama-server /infill with
cache_prompt against fimble's engine with its per-document KV cache: median and p90 time to the
first token, and to the first complete line (or 16 tokens).

Without llama-cpp-python the fimble rows still run and the llama.cpp rows say why they are missing.
The last line is the headline.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.api import CompletionRequest  # noqa: E402
from engine.drafters import ModelDrafter, NgramDrafter  # noqa: E402
from engine.gguf_export import export_gguf  # noqa: E402
from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model  # noqa: E402
from engine.local import LocalEngine  # noqa: E402
from engine.speculative import DecodeOptions, SpeculativeDecoder  # noqa: E402

CORPUS = REPO / "tests" / "data" / "lossless_corpus"
now = time.perf_counter


# -- inputs ---------------------------------------------------------------------------
def code_files() -> list[str]:
    return [f.read_text() for f in sorted(CORPUS.glob("*.py.txt"))]


def cold_prompts(n: int, seed: int) -> list[tuple[str, str]]:
    rng, texts, out = random.Random(seed), code_files(), []
    while len(out) < n:
        text = rng.choice(texts)
        cut = text.find("\n", rng.randrange(600, len(text) - 400)) + 1
        out.append((text[max(0, cut - 1500): cut], text[cut: cut + 500]))
    return out


def ensure_ggufs(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for model, src in (("target", DEFAULT_TARGET), ("draft", DEFAULT_DRAFT)):
        for q in ("f32", "q8_0"):
            path = folder / f"fimble-{model}-{q}.gguf"
            if not path.exists():
                print(f"  writing {path}", file=sys.stderr)
                export_gguf(src, path, q)
            files[f"{model}-{q}"] = path
    return files


# -- systems ----------------------------------------------------------------------------
def fimble_cold(target, drafter_name, prompt, n, model_drafter=None, ngram=None):
    """(tokens, ttft s, total s)."""
    opts = DecodeOptions(max_tokens=n, drafter=drafter_name)
    cache = target.runtime.new_cache(len(prompt) + n + 16)
    t0 = now()
    dec = SpeculativeDecoder(target.runtime, cache, set(), opts, model_drafter, ngram)
    dec.prefill(prompt)
    ttft = now() - t0
    while not dec.done:
        dec.step()
    return dec.output, ttft, now() - t0


class LlamaInProcess:
    """llama.cpp through llama-cpp-python, greedy, exactly n tokens (no EOS stop)."""

    def __init__(self, path: Path, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=4096, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=False)

    def cold(self, prompt: list[int], n: int):
        out, ttft, t0 = [], None, now()
        for tok in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            ttft = ttft if ttft is not None else now() - t0
            out.append(int(tok))
            if len(out) == n:
                break
        return out, ttft, now() - t0


class LlamaServer:
    """llama-server with the same draft model (draft-simple speculation), over HTTP on loopback."""

    def __init__(self, binary: str, target: Path, draft: Path, threads: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [binary, "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple", "--draft-max", "12",
               "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1", "--spm-infill",
               "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = now() + 120
        while now() < deadline:
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self._get("/health") == 200:
                    return
            time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def _get(self, path: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        conn.request("GET", path)
        return conn.getresponse().status

    def stream(self, path: str, body: dict):
        """Yield (seconds since send, chunk dict) for each streamed chunk."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        t0 = now()
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        while line := resp.readline():
            if line.startswith(b"data: "):
                chunk = json.loads(line[6:])
                yield now() - t0, chunk
                if chunk.get("stop"):
                    break
        conn.close()

    def cold(self, prompt: list[int], n: int):
        out, ttft, total = [], None, 0.0
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True}
        for t, chunk in self.stream("/completion", body):
            toks = chunk.get("tokens") or []
            if toks and ttft is None:
                ttft = t
            out.extend(int(x) for x in toks)
            total = t
        return out, ttft or total, total

    def infill(self, prefix: str, suffix: str, n: int):
        """(ttft s, first line s)."""
        body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": n, "temperature": 0.0, "top_k": 1,
                "cache_prompt": True}
        ttft, text, line_t, t = None, "", None, 0.0
        for t, chunk in self.stream("/infill", body):
            if chunk.get("content"):
                ttft = ttft if ttft is not None else t
                text += chunk["content"]
                if line_t is None and "\n" in text.lstrip("\n"):
                    line_t = t
        return ttft or t, line_t or t

    def close(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def fimble_keystroke(engine: LocalEngine, prefix: str, suffix: str, n: int):
    opts = DecodeOptions(max_tokens=n)
    t0, ttft, text, line_t = now(), None, "", None
    for delta in engine.submit(CompletionRequest(prefix, suffix, opts, document_id="bench.py")):
        if delta.text:
            ttft = ttft if ttft is not None else now() - t0
            text += delta.text
            if line_t is None and "\n" in text.lstrip("\n"):
                line_t = now() - t0
    end = now() - t0
    return ttft or end, line_t or end


# -- runs ---------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def cold_run(systems: dict, prompts: list[list[int]], n: int) -> dict:
    rows = {name: {"e2e": [], "ttft": [], "decode_tps": [], "identical": 0} for name in systems}
    for i, prompt in enumerate(prompts):
        reference: dict[str, list[int]] = {}
        for name, (fn, precision) in systems.items():  # interleaved per prompt
            out, ttft, total = fn(prompt)
            r = rows[name]
            r["e2e"].append(total * 1e3)
            r["ttft"].append(ttft * 1e3)
            r["decode_tps"].append((len(out) - 1) / max(1e-9, total - ttft))
            ref = reference.setdefault(precision, out)  # the first system of a precision is fimble plain
            common = min(len(ref), len(out))
            r["identical"] += int(out[:common] == ref[:common] and common > 0)
        print(f"  prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    return rows


def keystroke_run(engine: LocalEngine, server: LlamaServer | None, keys: int, seed: int) -> dict:
    rng = random.Random(seed)
    text = rng.choice(code_files())
    start = text.find("\n", rng.randrange(1500, len(text) - keys - 200)) + 1
    # One fixed window for the whole typing session (as an editor plugin keeps it while the user
    # types), about 1,000 tokens of context: both systems can reuse their caches key after key.
    window = max(0, start - 3000)
    rows = {"fimble": {"ttft": [], "line": []}, "llama-server": {"ttft": [], "line": []}}
    for k in range(0, keys + 1):
        pos = start + k
        line_end = text.find("\n", pos)
        line_end = len(text) if line_end < 0 else line_end
        prefix, suffix = text[window:pos], text[line_end: line_end + 1000]
        if k == 0:  # prime both caches with the document as it is (the editor opened it before typing)
            fimble_keystroke(engine, prefix, suffix, 1)
            if server:
                server.infill(prefix, suffix, 1)
            continue
        a = fimble_keystroke(engine, prefix, suffix, 16)
        rows["fimble"]["ttft"].append(a[0] * 1e3)
        rows["fimble"]["line"].append(a[1] * 1e3)
        if server:
            b = server.infill(prefix, suffix, 16)
            rows["llama-server"]["ttft"].append(b[0] * 1e3)
            rows["llama-server"]["line"].append(b[1] * 1e3)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few prompts and keys, one thread count, under 60 s")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--keys", type=int, help="keystrokes in the typing loop")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default 1,2; --quick 1)")
    ap.add_argument("--server", default=os.environ.get("LLAMA_SERVER"), help="llama-server binary (keystroke loop)")
    ap.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache" / "fimble" / "gguf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n_prompts = args.prompts or (4 if args.quick else 24)
    n_tokens = args.tokens or (32 if args.quick else 96)
    keys = args.keys or (12 if args.quick else 60)
    thread_counts = [int(t) for t in (args.threads or ("1" if args.quick else "1,2")).split(",")]
    load = os.getloadavg()

    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    target8, draft8 = load_model(DEFAULT_TARGET, quant="int8"), load_model(DEFAULT_DRAFT, quant="int8")
    builder = LocalEngine(target, None, start_thread=False)
    prompts = [builder.build_prompt(CompletionRequest(p, s, heal=False))[0] for p, s in cold_prompts(n_prompts,
                                                                                                     args.seed)]
    try:
        import llama_cpp  # noqa: F401

        have_llama, why = True, ""
        ggufs = ensure_ggufs(args.gguf_dir)
    except (ImportError, OSError):  # not installed, or its shared library does not load
        have_llama, why = False, "llama-cpp-python is not installed (pip install -e '.[bench]')"

    report: dict = {"load_average": load, "prompts": n_prompts, "tokens": n_tokens, "runs": {}}
    for threads in thread_counts:
        torch.set_num_threads(threads)
        md, md8, ng = ModelDrafter(draft.runtime, draft.max_len), ModelDrafter(draft8.runtime, draft8.max_len), \
            NgramDrafter(history=0)
        systems = {
            "fimble plain": (partial(fimble_cold, target, "none", n=n_tokens), "f32"),
            "fimble auto": (partial(fimble_cold, target, "auto", n=n_tokens, model_drafter=md, ngram=ng), "f32"),
            "fimble int8 plain": (partial(fimble_cold, target8, "none", n=n_tokens), "q8"),
            "fimble int8 auto": (partial(fimble_cold, target8, "auto", n=n_tokens, model_drafter=md8, ngram=ng), "q8"),
        }
        server = None
        if have_llama:
            f32, q8 = LlamaInProcess(ggufs["target-f32"], threads), LlamaInProcess(ggufs["target-q8_0"], threads)
            code = "\n".join(code_files())
            snippets = [code[i: i + 400] for i in range(0, 50 * 997, 997)]
            matches = sum(f32.tokenize(s) == target.encode(s) for s in snippets)
            print(f"token ids identical on {matches}/{len(snippets)} code snippets", file=sys.stderr)
            report["token_match"] = f"{matches}/{len(snippets)}"
            systems["llama.cpp f32 plain"] = (partial(f32.cold, n=n_tokens), "f32")
            systems["llama.cpp q8_0 plain"] = (partial(q8.cold, n=n_tokens), "q8")
            if args.server:
                server = LlamaServer(args.server, ggufs["target-f32"], ggufs["draft-f32"], threads)
                systems["llama-server + draft"] = (partial(server.cold, n=n_tokens), "f32")
        for fn, _ in systems.values():  # warm-up
            fn(prompts[0])
        rows = cold_run(systems, prompts, n_tokens)
        engine = LocalEngine(target, draft)
        try:
            keyrows = keystroke_run(engine, server, keys, args.seed)
        finally:
            engine.close()
            if server:
                server.close()
        report["runs"][threads] = {"cold": rows, "keystroke": keyrows}
        print_tables(threads, rows, keyrows, n_prompts, n_tokens, load, why)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    print_headline(report, why)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def print_tables(threads, rows, keyrows, n_prompts, n_tokens, load, why) -> None:
    print(f"\ncold prompts: {n_prompts} prompts x {n_tokens} tokens, greedy, threads={threads}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    peers = [p for p in ("llama.cpp f32 plain", "llama.cpp q8_0 plain", "llama-server + draft") if p in rows]
    head = f"{'system':24s} {'e2e ms':>8s} {'TTFT ms':>8s} {'dec tok/s':>9s} {'identical':>9s}" + \
        "".join(f" {'x ' + p.split()[0] + (' q8' if 'q8' in p else ' srv' if 'server' in p else ''):>14s}"
                for p in peers)
    print(head)
    for name, r in rows.items():
        ratios = "".join(f" {sum(r['e2e']) / sum(rows[p]['e2e']):14.2f}" for p in peers)
        print(f"{name:24s} {med(r['e2e']):8.1f} {med(r['ttft']):8.1f} {med(r['decode_tps']):9.1f} "
              f"{r['identical']:>4d}/{len(r['e2e']):<4d}{ratios}")
    if why:
        print(f"llama.cpp rows missing: {why}")
    print(f"\nkeystroke loop, threads={threads}: {len(keyrows['fimble']['ttft'])} keys")
    for name, r in keyrows.items():
        if r["ttft"]:
            print(f"{name:24s} TTFT median {med(r['ttft']):7.1f} ms  p90 {pct(r['ttft'], 0.9):7.1f} ms   "
                  f"first line/16 tokens median {med(r['line']):7.1f} ms  p90 {pct(r['line'], 0.9):7.1f} ms")


def print_headline(report: dict, why: str) -> None:
    threads = min(report["runs"])
    cold = report["runs"][threads]["cold"]
    auto = sum(cold["fimble auto"]["e2e"])
    la = os.getloadavg()
    if "llama.cpp f32 plain" in cold:
        base = sum(cold["llama.cpp f32 plain"]["e2e"])
        srv = cold.get("llama-server + draft")
        extra = f", {auto / sum(srv['e2e']):.2f}x llama-server + draft" if srv else ""
        print(f"headline (threads={threads}, load {la[0]:.1f}): fimble auto end to end {auto / base:.2f}x the time "
              f"of llama.cpp f32 plain{extra}; fimble plain {sum(cold['fimble plain']['e2e']) / base:.2f}x")
    else:
        plain = sum(cold["fimble plain"]["e2e"])
        print(f"headline (threads={threads}, load {la[0]:.1f}): fimble auto {auto / plain:.2f}x the time of fimble "
              f"plain; int8 auto {sum(cold['fimble int8 auto']['e2e']) / plain:.2f}x; no llama.cpp: {why}")


if __name__ == "__main__":
    main()
