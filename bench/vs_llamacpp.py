"""fimble against llama.cpp on the same model: cold prompts and a keystroke loop, interleaved per prompt.

    pip install -e '.[bench]'     # llama-cpp-python (compiles llama.cpp; not in CI's path)
    python -m bench.vs_llamacpp [--quick] [--threads 1,2] [--llama-server PATH] [--fimble-runtime compact|ggml]
                                [--precision f32|q8_0 | --model PATH.gguf [--server-spec TYPES]] [--json PATH]

Model: the embedded target and draft (bf16 weights), written as GGUF by engine/runtimes/gguf_export.py
(pre-tokenizer "gpt-2", FIM ids, add_bos false) into --gguf-dir, f32 and q8_0. --precision picks
the weights of both sides: f32 (fimble fp32) or q8_0 (fimble FIMBLE_QUANT=int8: q8_0 itself on the
ggml runtime, fbgemm int8 rows on the compact one). llama.cpp must tokenise real code to fimble's
ids, and every row of that precision reports how many greedy outputs equal fimble plain's.

--model PATH.gguf: the same comparison on one GGUF file instead (e.g. Qwen2.5-Coder-0.5B q8_0), run in
its own weight type by both sides (no FIMBLE_QUANT; --precision does not apply). With no draft model
sharing its tokenizer (other than fimble's own Qwen drafter, --draft), fimble default is the auto drafter
with that drafter or n-gram drafting alone,
llama.cpp plain is one row, "llama.cpp plain (gguf)", and llama-server runs the file without a draft
("llama-server": plain /completion and /infill, no speculation). llama-server's draft-model setting does
not apply to this one-file comparison: no model smaller than Qwen2.5-Coder-0.5B shares Qwen's tokenizer,
so the only draft would be the target itself. Its speculative settings here are the draft-free n-gram
types: --server-spec TYPES (a comma list of ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod,
ngram-cache) adds one cold-prompt row per type, "llama-server + TYPE", each its own server at the type's
default sizes (--server-ngram: --server-spec ngram-simple). The 1.3x decode-rate bar is taken against
the row of them with the highest decode rate, which the ratios and the headline name. The keystroke
loop's engine process loads the file with the same --draft. The token-id check compares fimble's tokenizer for
the file with llama.cpp's; the report records the file's path and sha256.

Cold prompts (--prompts x --tokens, default 24 x 96): each system decodes exactly that many tokens
greedily from the same token ids, cold caches. The prompts cut code in four languages in turn (Python,
TypeScript, Lua, JavaScript: LANGUAGE_SOURCES) with --middle characters of whole lines removed at the
cursor; the report gives each system's rate per language. Per prompt the systems run one after another
(interleaved), so load hits them alike. Systems: fimble plain and default (auto: n-gram, else the
draft model), in this process; llama.cpp plain f32 and q8_0 through llama-cpp-python (a worker
process each); llama-server with the same draft model (--spec-type draft-simple: -md alone never
drafts; draft length 3 and p-min 0 are its defaults and were the best of an interleaved sweep).
Figures: end-to-end ms, TTFT (prefill + first token), decode tok/s (tokens after the first).

Keystroke loop (--keys): real files of this repository typed one key at a time, the rest of the
current line removed. fimble's engine process (engine/process.py, the path the LSP uses, warm
per-document caches) against llama-server /infill with cache_prompt, given the same prompt ids
(suffix-first, no repository header), so the greedy outputs must be identical. Median and p90 time
to the first token; median time to the first complete line or 16 tokens. One more fimble row runs
the LSP's own prompt (token healing on): not the same prompt, timed for reference. For a PSM model
(Qwen2.5-Coder) fimble's prompt carries the cursor's line after the middle sentinel, which /infill
cannot express, so the same ids go through /completion with cache_prompt; one more row sends the
text to /infill as llama.vim does ("llama-server /infill, own prompt": the cursor's line ends the
prefix, so each key re-evaluates the suffix), timed for reference.

Flash attention: every llama.cpp system runs the setting fimble's runtime picked (--peer-flash,
--server-flash): off by default, as llama-cpp-python runs it, and the faster setting on this CPU
(engine/runtimes/ggml_runtime.py); llama-server's own default, -fa auto, would turn it on. With the same
setting and q8_0 weights, the outputs must be identical (engine/runtimes/ggml_build.py says how).

FIMBLE_RUNTIME (--fimble-runtime) picks fimble's runtime; the report names the one that ran.
--threads sets every system's threads (fimble: torch, FIMBLE_GGML_THREADS, the engine process).
Without llama-cpp-python or llama-server, those rows are skipped with the reason. Headline last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from bench.harness.llamacpp_peer import LlamaServer, LlamaWorker, find_server, read_completion, spec_types
from bench.harness.llamacpp_report import PRECISIONS, SPEC_SERVER, STOCK_INFILL, cold_table, headline, print_run, ratios
from bench.harness.prompts import COLD_MIDDLE_CHARS, cold_prompts, corpus_files, typing_files

REPO = Path(__file__).resolve().parent.parent

now = time.perf_counter
REF = "fimble plain"  # the greedy reference: every system of the same weight precision must match it


# -- inputs ---------------------------------------------------------------------------------
def ensure_ggufs(folder: Path, target_dir: Path, draft_dir: Path) -> dict[str, Path]:
    from engine.runtimes.gguf_export import export_gguf

    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for model, src in (("target", target_dir), ("draft", draft_dir)):
        for q in ("f32", "q8_0"):
            path = folder / f"fimble-{model}-{q}.gguf"
            if not path.exists():
                print(f"  writing {path}", file=sys.stderr)
                export_gguf(src, path, q)
            files[f"{model}-{q}"] = path
    return files


# -- fimble ---------------------------------------------------------------------------------
def chosen_draft(model_file: Path, choice: str) -> Path | None:
    """``--draft``'s folder: none, a named one, or (auto) the Qwen drafter beside a Qwen 0.5B file where installed."""
    from engine.model_info import QWEN_TARGET, qwen_draft, qwen_fim_target
    from engine.runtimes.draft_vocab import is_mapped_draft

    if choice == "none":
        return None
    if choice != "auto":
        return Path(choice).expanduser().resolve()
    qwen = {QWEN_TARGET.resolve(), qwen_fim_target().resolve()}
    return qwen_draft() if model_file in qwen and is_mapped_draft(qwen_draft()) else None


def fimble_cold(target, drafter_name, prompt, n, model_drafter=None, ngram=None):
    """(tokens, ttft s, total s, figures): SpeculativeDecoder on a fresh cache, exactly n tokens."""
    from engine.decoding.speculative import DecodeOptions, SpeculativeDecoder

    opts = DecodeOptions(max_tokens=n, drafter=drafter_name)
    cache = target.runtime.new_cache(len(prompt) + n + 16)
    t0 = now()
    dec = SpeculativeDecoder(target.runtime, cache, set(), opts, model_drafter, ngram)
    dec.prefill(prompt)
    ttft = now() - t0
    while not dec.done:
        dec.step()
    total = now() - t0
    return dec.output, ttft, total, {"drafted": dec.stats.drafted, "accepted": dec.stats.accepted}


def fimble_request(prefix: str, suffix: str, doc: str, n: int, heal: bool):
    from engine.api import CompletionRequest, DecodeOptions

    return CompletionRequest(prefix, suffix, DecodeOptions(max_tokens=n), document_id=doc, heal=heal)


def fimble_keystroke(engine, request):
    """(text, ttft s, first line s, stats) through the engine process, as the LSP submits."""
    t0 = now()

    def chunks():
        for delta in engine.submit(request):
            yield now() - t0, {"content": delta.text, "stop": delta.finished}

    text, ttft, line_t, _ = read_completion(chunks())
    return text, ttft, line_t, {}


def runtime_name(model) -> str:
    rt = model.runtime
    return f"{type(rt).__module__}.{type(rt).__name__}"


# -- statistics ------------------------------------------------------------------------------
def agree(ref: list[int], out: list[int], stops: set[int]) -> bool:
    """Identical up to where greedy would end (llama-server masks end tokens: ignore_eos)."""
    end = next((i for i, t in enumerate(ref) if t in stops), len(ref))
    return out[:end] == ref[:end]


def source_state() -> dict:
    """The commit this ran at and the engine files that differed from it (a shared tree moves)."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "engine_changes": git("status", "--porcelain", "engine", ":(exclude)engine/serve"),
    }


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def same_file(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes (fimble's ggml runtime and llama.cpp load the same GGUF)."""
    if a.resolve() == b.resolve():
        return True
    return a.stat().st_size == b.stat().st_size and sha256_file(a) == sha256_file(b)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- runs -------------------------------------------------------------------------------------
def cold_run(systems: dict, prompts: list[list[int]], n: int, stops: set[int], same: str, other: str | None) -> dict:
    """Outputs are compared with fimble plain's and with ``same`` (llama.cpp plain of the same
    precision); ``other`` (llama.cpp plain of the other precision; None with --model) is compared
    with neither."""
    rows = {
        name: {
            "e2e_ms": [],
            "ttft_ms": [],
            "decode_s": [],
            "tokens": [],
            "identical": 0,
            "identical_llamacpp": 0,
            "compared": 0,
            "outputs": [],
            "draft_n": 0,
            "draft_accepted": 0,
        }
        for name in systems
    }
    for i, prompt in enumerate(prompts):
        for name, fn in systems.items():  # interleaved per prompt; fimble plain first: the reference
            out, ttft, total, extra = fn(prompt)
            r = rows[name]
            r["e2e_ms"].append(total * 1e3)
            r["ttft_ms"].append(ttft * 1e3)
            r["decode_s"].append(total - ttft)
            r["tokens"].append(len(out))
            r["draft_n"] += int(extra.get("draft_n", extra.get("drafted", 0)))
            r["draft_accepted"] += int(extra.get("draft_n_accepted", extra.get("accepted", 0)))
            r["outputs"].append(out)
        ref, peer = rows[REF]["outputs"][-1], rows[same]["outputs"][-1] if same in rows else None
        for name, r in rows.items():
            if name not in (REF, other):
                r["compared"] += 1
                r["identical"] += int(agree(ref, r["outputs"][-1], stops))
                r["identical_llamacpp"] += int(peer is not None and agree(peer, r["outputs"][-1], stops))
        print(f"  prompt {i + 1}/{len(prompts)}  load {load()[0]}", file=sys.stderr, flush=True)
    for r in rows.values():
        r["decode_tok_s"] = sum(t - 1 for t in r["tokens"]) / max(1e-9, sum(r["decode_s"]))
    return rows


def keystroke_run(engine, server, server_row: str, target, files: list[Path], keys: int, seed: int) -> dict:
    """Type ``keys`` characters, spread over ``files``; both systems primed on the file as opened.
    ``server_row``: the llama-server row's name ("llama-server + draft", or "llama-server" with --model)."""
    from engine.caching.prompt_plan import PromptBuilder

    builder, rng = PromptBuilder(target), random.Random(seed)
    names = ["fimble", server_row, "fimble, LSP prompt (healing)"]
    # PSM models: llama-server's /infill on the text, in its own layout (the cursor's line ends the prefix,
    # so every key re-evaluates the suffix), as llama.vim and llama.vscode call it. Not the same prompt.
    stock = STOCK_INFILL if target.template.order == "psm" else None
    if stock:
        names.append(stock)
    rows = {k: {"ttft_ms": [], "line_ms": [], "texts": []} for k in names}
    identical = compared = 0
    per_file = max(1, keys // len(files))
    for f in files:
        text = f.read_text()
        start = text.find("\n", rng.randrange(1500, len(text) - per_file - 200)) + 1
        window = max(0, start - 3000)  # a fixed window while the user types, as an editor plugin keeps it
        doc = f"bench/{f.name.removesuffix('.txt')}"
        for k in range(per_file + 1):
            pos = start + k
            line_end = text.find("\n", pos)
            line_end = len(text) if line_end < 0 else line_end
            prefix, suffix = text[window:pos], text[line_end : line_end + 1000]
            n = 1 if k == 0 else 16  # k == 0 primes the caches: the editor opened the file before typing
            req = fimble_request(prefix, suffix, doc, n, heal=False)
            a = fimble_keystroke(engine, req)
            b = d = None
            if server:
                ids = builder.build(req).ids
                b = server_same_prompt(server, ids, target, n)
                if k == 0 and f == files[0]:
                    rows["prompt_check"] = {
                        "fimble_prompt_tokens": len(ids),
                        "server_tokens_evaluated": b[3].get("tokens_evaluated"),
                    }
            c = fimble_keystroke(engine, fimble_request(prefix, suffix, doc + "#heal", n, heal=True))
            if server and stock:
                d = server.infill(prefix, suffix, n, slot=1)
            if k == 0:
                continue
            for name, res in zip(names, (a, b, c, d)[: len(names)], strict=True):
                if res is not None:
                    rows[name]["ttft_ms"].append(res[1] * 1e3)
                    rows[name]["line_ms"].append(res[2] * 1e3)
                    rows[name]["texts"].append(res[0])
            if b is not None:
                compared += 1
                identical += int(a[0] == b[0])
        print(f"  typed {per_file} keys into {f.name}  load {load()[0]}", file=sys.stderr, flush=True)
    rows["identical"] = {"identical": identical, "compared": compared}
    return rows


def server_same_prompt(server, ids: list[int], target, n: int):
    """fimble's prompt ids through llama-server with cache_prompt: /infill where the prompt ends in the
    middle sentinel; /completion from the ids where a PSM prompt carries the cursor's line after it
    (engine/caching/prompt_plan.py), which /infill cannot express (its "prompt" joins the prefix)."""
    if ids[-1] == target.token_id(target.template.middle_token):
        return server.infill(*split_fim(ids, target), n)
    return server.completion_cached(ids, n)


def split_fim(ids: list[int], tok) -> tuple[list[int], list[int]]:
    """fimble's prompt, suffix-first [SUF] suffix [PRE] prefix [MID] or prefix-first [PRE] prefix [SUF]
    suffix [MID] (the template's order), as /infill's (prefix ids, suffix ids)."""
    tpl = tok.template
    suf, pre, mid = tok.token_id(tpl.suffix_token), tok.token_id(tpl.prefix_token), tok.token_id(tpl.middle_token)
    first, second = (suf, pre) if tpl.order == "spm" else (pre, suf)
    if tpl.order not in ("spm", "psm") or ids[0] != first or ids[-1] != mid or ids.count(second) != 1:
        raise RuntimeError("unexpected fimble prompt layout: cannot give llama-server the same prompt")
    cut = ids.index(second)
    head, tail = ids[1:cut], ids[cut + 1 : -1]
    return (tail, head) if tpl.order == "spm" else (head, tail)


# -- main ---------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 prompts x 32 tokens, 6 keys, 1 thread: under 60 s")
    ap.add_argument("--prompts", type=int)
    ap.add_argument(
        "--middle",
        type=int,
        default=COLD_MIDDLE_CHARS,
        help=f"characters of whole lines removed at each cold prompt's cursor (default {COLD_MIDDLE_CHARS}); "
        "0: none (the suffix starts at the cursor, so the best completion is empty)",
    )
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--keys", type=int, help="keystrokes in the typing loop (spread over --files files)")
    ap.add_argument("--files", type=int, help="files typed into (default 3; --quick 1)")
    ap.add_argument("--threads", help="comma-separated thread counts for every system (default 1,2; --quick 1)")
    ap.add_argument("--llama-server", "--server", dest="server", help="llama-server binary (or env LLAMA_SERVER)")
    ap.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="weights of fimble, llama-server and the compared llama.cpp row: f32 (default), or q8_0 "
        "(fimble: FIMBLE_QUANT=int8, which is q8_0 on the ggml runtime); not with --model",
    )
    ap.add_argument(
        "--model",
        type=Path,
        metavar="PATH.gguf",
        help="compare on this one GGUF file instead of the embedded target/draft: both sides run it in its "
        "own weight type; no draft model (fimble default drafts n-grams, llama-server runs without a draft)",
    )
    ap.add_argument(
        "--draft",
        default="auto",
        metavar="auto|none|DIR",
        help="with --model: fimble's draft model (engine.loader.load_draft). auto: the installed Qwen drafter "
        "(models/qwen2.5-coder-0.5b-draft) when --model is a Qwen2.5-Coder-0.5B file, else none",
    )
    ap.add_argument(
        "--server-spec",
        type=spec_types,
        metavar="TYPES",
        help="with --model: comma list of llama-server's draft-free --spec-type values (ngram-simple, "
        "ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache); one more cold-prompt row per type, "
        "'llama-server + TYPE' (its own server, the type's default sizes). fimble default's 1.3x decode-rate "
        "bar is taken against the fastest of them. The draft-model setting does not apply to one file: no "
        "model smaller than Qwen2.5-Coder-0.5B shares Qwen's tokenizer to draft for it",
    )
    ap.add_argument(
        "--server-ngram",
        action="store_true",
        help="with --model: shorthand for --server-spec ngram-simple (llama-server's prompt-lookup speculation)",
    )
    ap.add_argument(
        "--draft-max",
        type=int,
        default=3,
        help="llama-server's --spec-draft-n-max (default 3, its own: the best in an interleaved sweep; "
        "unused with --model)",
    )
    ap.add_argument(
        "--draft-p-min", type=float, help="llama-server's --spec-draft-p-min (default: its own; unused with --model)"
    )
    ap.add_argument(
        "--fimble-runtime",
        choices=("compact", "ggml"),
        default=os.environ.get("FIMBLE_RUNTIME"),
        help="fimble's runtime, passed as env FIMBLE_RUNTIME (default: the env's, else fimble's default)",
    )
    ap.add_argument(
        "--llama-lib",
        help="folder of a stock libllama.so for the llama.cpp plain rows (default: llama-server's folder)",
    )
    ap.add_argument(
        "--peer-flash",
        choices=("fimble", "on", "off"),
        default="fimble",
        help="flash attention of the llama.cpp plain rows (llama-cpp-python): fimble (default: the setting "
        "fimble's runtime picked, so both run the same attention kernels), on or off",
    )
    ap.add_argument(
        "--server-flash",
        choices=("fimble", "auto", "on", "off"),
        default="fimble",
        help="llama-server's -fa: fimble (default: fimble's setting, the same attention kernels), or auto "
        "(llama-server's own default: on for the CPU), on, off",
    )
    ap.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache" / "fimble" / "gguf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model_file: Path | None = None
    if args.model is not None:
        if args.precision is not None:
            ap.error("--precision does not apply with --model: a GGUF file runs in its own weight type")
        model_file = args.model.expanduser().resolve()
        draft_dir = chosen_draft(model_file, args.draft)
        if model_file.suffix.lower() != ".gguf" or not model_file.is_file():
            ap.error(f"--model {args.model}: not a .gguf file")
    server_specs = list(dict.fromkeys((["ngram-simple"] if args.server_ngram else []) + (args.server_spec or [])))
    if server_specs and model_file is None:
        ap.error("--server-spec/--server-ngram need --model (the embedded model's llama-server drafts with its draft)")
    n_prompts = args.prompts or (3 if args.quick else 24)
    n_tokens = args.tokens or (32 if args.quick else 96)
    keys = args.keys if args.keys is not None else (6 if args.quick else 60)
    n_files = args.files or (1 if args.quick else 3)
    thread_counts = [int(t) for t in (args.threads or ("1" if args.quick else "1,2")).split(",")]
    if model_file:  # one file, its own weights: one llama.cpp plain row, named "gguf"
        prec, other, quant = "gguf", None, "none"
    else:
        prec = args.precision or "f32"
        other, quant = next(q for q in PRECISIONS if q != prec), "int8" if prec == "q8_0" else "none"
    server_row = "llama-server" if model_file else "llama-server + draft"
    # Before fimble loads anything; the engine process inherits them.
    if args.fimble_runtime:
        os.environ["FIMBLE_RUNTIME"] = args.fimble_runtime
    os.environ["FIMBLE_QUANT"] = quant
    t_start = now()

    import torch

    from engine.caching.prompt_plan import PromptBuilder
    from engine.decoding.drafters import ModelDrafter, NgramDrafter
    from engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_draft, load_model
    from engine.process import EngineProcess

    skipped: list[str] = []
    if model_file:
        args.gguf_dir.mkdir(parents=True, exist_ok=True)  # llama-server's log
        ggufs = {"target-gguf": model_file}
    else:
        ggufs = ensure_ggufs(args.gguf_dir, DEFAULT_TARGET, DEFAULT_DRAFT)
    server_bin, why_server = find_server(args.server)
    if not server_bin:
        skipped.append(f"llama-server rows: {why_server}")
    # llama.cpp plain runs on the stock build next to llama-server (a build tree keeps libllama.so beside
    # it), else --llama-lib, else llama-cpp-python's own: never on fimble's patched library.
    peer_lib = args.llama_lib or (
        str(Path(server_bin).parent) if server_bin and (Path(server_bin).parent / "libllama.so").exists() else None
    )
    report: dict = {
        "command": " ".join(["python", *sys.argv]),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "precision": prec,
        "source": source_state(),
        "fimble_runtime_requested": os.environ.get("FIMBLE_RUNTIME", "(unset)"),
        "model": (
            {"file": str(model_file), "bytes": model_file.stat().st_size, "sha256": sha256_file(model_file)}
            if model_file
            else {
                "target": DEFAULT_TARGET.name,
                "draft": DEFAULT_DRAFT.name,
                "gguf": {k: str(v) for k, v in ggufs.items()},
            }
        ),
        "runs": [],
    }
    files = typing_files(n_files) if keys else []  # fixed files; --seed picks where typing starts

    for threads in thread_counts:
        # Thread count of every fimble runtime: torch here, the ggml runtime (read when it loads)
        # and the engine process (inherits the environment).
        os.environ["OMP_NUM_THREADS"] = os.environ["FIMBLE_GGML_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        if model_file:
            target = load_model(model_file)
            draft = load_draft(draft_dir, target) if draft_dir is not None else None
        else:
            target, draft = load_model(DEFAULT_TARGET, quant=quant), load_model(DEFAULT_DRAFT, quant=quant)
        rt_name = runtime_name(target)
        gguf = getattr(target.runtime, "path", None)  # the ggml runtime's GGUF (its own cached export)
        same = same_file(Path(gguf), ggufs[f"target-{prec}"]) if gguf is not None else None
        builder = PromptBuilder(target)
        cuts = cold_prompts(n_prompts, args.seed, args.middle)
        prompts = [builder.build(fimble_request(p, s, None, n_tokens, heal=False)).ids for _, p, s in cuts]
        run = {
            "threads": threads,
            "load_before": load(),
            "prompts": n_prompts,
            "tokens": n_tokens,
            "precision": prec,
            "fimble_runtime": rt_name,
            "typing_files": [f.name for f in files],
            "prompt_languages": [lang for lang, _, _ in cuts],
            "middle_chars": args.middle,
            "skipped": list(skipped),
            "same_gguf": same,
            "server_row": server_row,
        }
        fimble_flash = bool(getattr(target.runtime, "flash_attn", False))
        peer_flash = fimble_flash if args.peer_flash == "fimble" else args.peer_flash == "on"
        server_flash = ("on" if fimble_flash else "off") if args.server_flash == "fimble" else args.server_flash
        run["flash_attn"] = {"fimble": fimble_flash, "llama.cpp plain": peer_flash, "llama-server": server_flash}
        # --model: no draft model; fimble default is then the auto drafter's n-gram drafting alone
        md = ModelDrafter(draft.runtime, draft.max_len) if draft is not None else None
        ng = NgramDrafter(history=0)
        systems = {
            REF: partial(fimble_cold, target, "none", n=n_tokens),
            "fimble default": partial(fimble_cold, target, "auto", n=n_tokens, model_drafter=md, ngram=ng),
        }
        peers: list = []
        server, spec_servers = None, {}
        try:
            try:
                for q in ("gguf",) if model_file else PRECISIONS:
                    peers.append(LlamaWorker(ggufs[f"target-{q}"], threads, peer_lib, peer_flash))
                    systems[f"llama.cpp plain ({q})"] = partial(peers[-1].cold, n=n_tokens)
                code = "\n".join(corpus_files())
                snippets = [code[i : i + 400] for i in range(0, 50 * 997, 997)]
                ids = peers[0].tokenize(snippets)
                report["token_ids_identical"] = (
                    f"{sum(a == target.encode(s) for a, s in zip(ids, snippets, strict=True))}/50"
                )
                report["llama_cpp_python"] = peers[0].info.get("llama_cpp_python")
                report["llama_cpp_lib"] = peers[0].info.get("lib")
            except RuntimeError as exc:
                run["skipped"].append(f"llama.cpp plain rows (llama-cpp-python): {exc}")
            if server_bin:
                server = LlamaServer(
                    server_bin,
                    ggufs[f"target-{prec}"],
                    None if model_file else ggufs[f"draft-{prec}"],
                    threads,
                    args.draft_max,
                    args.gguf_dir / f"llama-server-t{threads}.log",
                    args.draft_p_min,
                    server_flash,
                    spm=target.template is not None and target.template.order == "spm",
                    # PSM: the keystroke loop's /infill-on-text row keeps its own cache in slot 1
                    slots=2 if target.template is not None and target.template.order == "psm" else 1,
                )
                run["llama_server"] = {"cmd": " ".join(server.cmd[1:]), "build": server.props.get("build_info", "?")}
                systems[server_row] = partial(server.cold, n=n_tokens)
                for spec in server_specs:  # draft-free speculation, one server (and log) per --spec-type
                    try:
                        srv = spec_servers[spec] = LlamaServer(
                            server_bin,
                            model_file,
                            None,
                            threads,
                            args.draft_max,
                            args.gguf_dir / f"llama-server-{spec}-t{threads}.log",
                            flash=server_flash,
                            spm=target.template is not None and target.template.order == "spm",
                            spec=spec,
                        )
                    except RuntimeError as exc:
                        run["skipped"].append(f"{SPEC_SERVER}{spec}: {exc}")
                        continue
                    run.setdefault("llama_server_spec", {})[spec] = {"cmd": " ".join(srv.cmd[1:])}
                    systems[SPEC_SERVER + spec] = partial(srv.cold, n=n_tokens)
            for fn in systems.values():  # warm-up, not timed
                fn(prompts[0])
            cold = cold_run(
                systems, prompts, n_tokens, target.stop_ids, f"llama.cpp plain ({prec})", f"llama.cpp plain ({other})"
            )
            run["cold"], run["cold_table"] = cold, cold_table(cold)
            keyrows = None
            if files:
                if not model_file:
                    engine = EngineProcess(DEFAULT_TARGET, DEFAULT_DRAFT)
                elif draft_dir is not None:  # the keystroke loop drafts as the cold prompts do (--draft)
                    engine = EngineProcess(model_file, draft_dir)
                else:
                    engine = EngineProcess(model_file, no_draft=True)
                try:
                    run["engine_info"] = engine.info()
                    keyrows = keystroke_run(engine, server, server_row, target, files, keys, args.seed)
                finally:
                    engine.close()
                run["keystroke"] = keyrows
        finally:
            for p in peers:
                p.close()
            for srv in (server, *spec_servers.values()):
                if srv:
                    srv.close()
        del target, draft, md, systems  # free this thread count's runtimes before the next loads
        run["load_after"] = load()
        run["ratios"] = ratios(run["cold"], keyrows, prec, server_row)
        report["runs"].append(run)
        print_run(run)
    report["wall_s"] = round(now() - t_start, 1)
    report["headline"] = headline(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    src = report["source"]
    if src["engine_changes"]:  # another session edited engine/ in the shared tree: figures may not be the commit's
        print(f"\nwarning: engine/ differed from commit {src['commit']}: {src['engine_changes']}")
    print(f"\n{report['headline']}  [commit {src['commit']}, {report['wall_s']} s]")


if __name__ == "__main__":
    main()
