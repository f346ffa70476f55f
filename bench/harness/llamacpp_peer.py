"""The llama.cpp side of bench/vs_llamacpp.py: llama-cpp-python in a worker process, and llama-server.

Nothing here imports torch or fimble's engine. llama-cpp-python runs in its own process because
fimble's ggml runtime (FIMBLE_RUNTIME=ggml) loads another build of libllama/libggml with the same
sonames: two builds in one process would bind each other's symbols.

Worker protocol (JSON lines on stdin/stdout), one model per worker:
  {"op": "cold", "prompt": [ids], "n": N} -> {"out": [ids], "ttft": s, "total": s}
  {"op": "tokenize", "texts": [str]}     -> {"ids": [[ids], ...]}
Timings are taken inside the worker, so the pipe costs nothing to llama.cpp's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

now = time.perf_counter


# -- llama-cpp-python, out of process ------------------------------------------------------------
class LlamaWorker:
    """llama.cpp through llama-cpp-python: greedy, exactly n tokens (no EOS stop), a cold cache each time."""

    def __init__(self, model: Path, threads: int, lib_dir: str | None = None, flash_attn: bool = False):
        # lib_dir: a stock llama.cpp build's libraries (the peer as users run it), not the library fimble
        # builds for itself (engine/runtimes/ggml_build.py patches one line of it).
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        env.pop("LLAMA_CPP_LIB_PATH", None)
        if lib_dir:
            env["LLAMA_CPP_LIB_PATH"] = lib_dir
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(model), str(threads), str(int(flash_attn))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        hello = self.proc.stdout.readline()
        if not hello:
            err = self.proc.stderr.read().strip().splitlines()
            raise RuntimeError(err[-1] if err else "llama-cpp-python worker exited")
        self.info = json.loads(hello)

    def _call(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("llama-cpp-python worker died")
        return json.loads(line)

    def cold(self, prompt: list[int], n: int):
        r = self._call({"op": "cold", "prompt": prompt, "n": n})
        return r["out"], r["ttft"], r["total"], {}

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self._call({"op": "tokenize", "texts": texts})["ids"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()


def worker_main(model: str, threads: int, flash_attn: bool) -> None:
    from llama_cpp import Llama, __version__
    from llama_cpp.llama_cpp import _base_path

    llm = Llama(
        model_path=model,
        n_ctx=4096,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=flash_attn,
        verbose=False,
    )
    info = {"llama_cpp_python": __version__, "lib": str(_base_path), "flash_attn": flash_attn}
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "tokenize":
            reply = {"ids": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in msg["texts"]]}
        else:
            llm.reset()  # n_tokens = 0: no reuse of the previous prompt's cache, a cold prefill
            out, ttft, t0 = [], None, now()
            for tok in llm.generate(msg["prompt"], top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
                ttft = ttft if ttft is not None else now() - t0
                out.append(int(tok))
                if len(out) == msg["n"]:
                    break
            reply = {"out": out, "ttft": ttft, "total": now() - t0}
        print(json.dumps(reply), flush=True)


# -- llama-server -------------------------------------------------------------------------------------
# llama-server's --spec-type values that draft without a draft model: n-gram lookups in the context
# (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod) or in a lookup cache built as it decodes (ngram-cache).
DRAFT_FREE_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def spec_types(text: str) -> list[str]:
    """argparse type of a comma list of draft-free --spec-type values: each once, in the order given."""
    types = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [t for t in types if t not in DRAFT_FREE_SPEC_TYPES]
    if bad or not types:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or repr(text)}: not a draft-free llama-server --spec-type; "
            f"choose from {','.join(DRAFT_FREE_SPEC_TYPES)}"
        )
    return types


def find_server(arg: str | None) -> tuple[str | None, str]:
    """(binary path or None, why not). ``arg`` is --llama-server or $LLAMA_SERVER; else PATH."""
    cand = arg or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not cand:
        return None, "no llama-server binary: pass --llama-server PATH or set LLAMA_SERVER"
    path = Path(cand).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        return None, f"llama-server binary {path} does not exist or is not executable"
    return str(path), ""


class LlamaServer:
    """llama-server on loopback with the same draft model, draft-simple speculation (``draft`` None:
    no draft model: plain decoding, or ``spec``, a draft-free --spec-type such as ngram-simple).

    ``--spec-type draft-simple`` is what turns the draft on (``-md`` alone loads it and never
    drafts). ``-b`` above ``-c`` leaves /infill no room for its repository header
    (``<|file_sep|>filename``: its budget is n_ctx - n_batch - 2 n_predict), so /infill's prompt
    is token for token fimble's: suffix-first (``spm``: ``--spm-infill``) or prefix-first as the
    model's FIM template orders it, no BOS (unless the GGUF asks for one).
    """

    def __init__(
        self,
        binary: str,
        target: Path,
        draft: Path | None,
        threads: int,
        draft_max: int,
        log_path: Path,
        draft_p_min: float | None = None,
        flash: str = "auto",
        spm: bool = True,
        spec: str | None = None,
        slots: int = 1,
    ):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        t = str(threads)
        cmd = [
            binary,
            "-m",
            str(target),
            "-t",
            t,
            "-tb",
            t,
            "-c",
            str(4096 * slots),  # the context is split between the slots: 4096 each
            "-b",
            "8192",
            "-ub",
            "512",
            "-np",
            str(slots),
            *(["--spm-infill"] if spm else []),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-webui",
            "-fa",
            flash,  # llama.cpp's default, auto, is on for the CPU (its outputs equal flash_attn=True's)
        ]
        if draft is not None:
            cmd += [
                "-md",
                str(draft),
                "--spec-type",
                "draft-simple",
                "--spec-draft-n-max",
                str(draft_max),
                "--spec-draft-n-min",
                "0",
                "-td",
                t,
                "-tbd",
                t,
            ]
            if draft_p_min is not None:
                cmd += ["--spec-draft-p-min", str(draft_p_min)]
        elif spec:  # speculation without a draft model, e.g. ngram-simple (prompt lookup)
            cmd += ["--spec-type", spec]
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - kept open for the server's lifetime
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS=t)
        )
        deadline = now() + 120
        while now() < deadline:
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self._get("/health")[0] == 200:
                    self.props = self._get("/props")[1]
                    return
            time.sleep(0.3)
        self.close()
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError("llama-server did not become healthy: " + " | ".join(tail))

    def _get(self, path: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            with contextlib.suppress(ValueError):
                return resp.status, json.loads(body)
            return resp.status, {}
        finally:
            conn.close()

    def stream(self, path: str, body: dict):
        """Yield (seconds since the request was sent, chunk) for each streamed chunk."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        t0 = now()
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"llama-server {path}: HTTP {resp.status}: {resp.read()[:200]!r}")
        while line := resp.readline():
            if line.startswith(b"data: "):
                chunk = json.loads(line[6:])
                yield now() - t0, chunk
                if chunk.get("stop"):
                    break
        conn.close()

    def cold(self, prompt: list[int], n: int):
        """/completion from token ids, no prompt cache: (tokens, ttft s, total s, final chunk's figures).

        ``ignore_eos`` makes it decode exactly n tokens like the other systems (it masks the end
        tokens, so outputs can differ from greedy only after a point where greedy would have ended)."""
        out, ttft, total, final = [], None, 0.0, {}
        body = {
            "prompt": prompt,
            "n_predict": n,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
            "ignore_eos": True,
            "samplers": ["top_k"],
        }
        for t, chunk in self.stream("/completion", body):
            toks = chunk.get("tokens") or []
            if toks and ttft is None:
                ttft = t
            out.extend(int(x) for x in toks)
            total = t
            if chunk.get("stop"):
                final = chunk
        return out, ttft or total, total, final.get("timings", {})

    def infill(self, prefix: list[int] | str, suffix: list[int] | str, n: int, slot: int = 0):
        """/infill with cache_prompt, as an editor plugin calls it: (text, ttft s, first line s, final chunk).
        Token ids, or text that the server tokenises and lays out itself. ``slot``: which slot's cache
        (a server with ``slots`` > 1 keeps one prompt cache per slot; two kinds of prompt sent to one
        slot in turn would evict each other's cache every request)."""
        body = {
            "id_slot": slot,
            "input_prefix": prefix,
            "input_suffix": suffix,
            "n_predict": n,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": True,
            "samplers": ["top_k"],
        }
        return read_completion(self.stream("/infill", body))

    def completion_cached(self, prompt: list[int], n: int):
        """/completion from token ids with cache_prompt, in slot 0: (text, ttft s, first line s, final chunk)."""
        body = {
            "id_slot": 0,
            "prompt": prompt,
            "n_predict": n,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": True,
            "samplers": ["top_k"],
        }
        return read_completion(self.stream("/completion", body))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()
        self._log.close()


def read_completion(chunks):
    """(text, first token s, first complete line or end s, final chunk) from (seconds, chunk) pairs."""
    text, ttft, line_t, t, final = "", None, None, 0.0, {}
    for t, chunk in chunks:
        if chunk.get("content"):
            ttft = ttft if ttft is not None else t
            text += chunk["content"]
            if line_t is None and "\n" in text.lstrip("\n"):
                line_t = t
        if chunk.get("stop"):
            final = chunk
    return text, ttft if ttft is not None else t, line_t if line_t is not None else t, final


if __name__ == "__main__":
    worker_main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")
