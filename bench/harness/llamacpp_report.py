"""The report half of bench/vs_llamacpp.py: the cold-prompt table, the ratios against the issues' bars, the
printed run and the headline. Pure functions of a run's figures (a report's JSON can be recomputed with them)."""

from __future__ import annotations

import statistics
from pathlib import Path

PRECISIONS = ("f32", "q8_0")
SPEC_SERVER = "llama-server + "  # --model --server-spec: "llama-server + ngram-simple", a draft-free --spec-type
STOCK_INFILL = "llama-server /infill, own prompt"  # PSM models: the text as llama.vim sends it


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def cold_table(rows: dict) -> list[dict]:
    table = []
    for name, r in rows.items():
        table.append(
            {
                "system": name,
                "e2e_ms_median": med(r["e2e_ms"]),
                "e2e_ms_mean": statistics.fmean(r["e2e_ms"]),
                "ttft_ms_median": med(r["ttft_ms"]),
                "decode_tok_s": r["decode_tok_s"],
                "identical": f"{r['identical']}/{r['compared']}" if r["compared"] else "-",
                "identical_llamacpp": f"{r['identical_llamacpp']}/{r['compared']}" if r["compared"] else "-",
                "accepted_per_drafted": f"{r['draft_accepted']}/{r['draft_n']}" if r["draft_n"] else "-",
            }
        )
    return table


def server_key(server_row: str) -> str:
    """The ratio keys' name for the llama-server row: server_draft, or server (--model: no draft)."""
    return "server_draft" if server_row.endswith("+ draft") else "server"


def spec_rows(cold: dict) -> dict[str, str]:
    """llama-server's draft-free speculative rows (--server-spec), row name -> ratio key ("ngram_map_k4v");
    an older report's one such row, "llama-server + n-gram", was ngram-simple."""
    return {
        name: name.removeprefix(SPEC_SERVER).replace("-", "_")
        for name in cold
        if name.startswith(SPEC_SERVER) and not name.endswith("+ draft")
    }


def ratios(cold: dict, keys: dict | None, prec: str, server_row: str = "llama-server + draft") -> dict:
    """Each speed bar fimble must meet against llama.cpp (plain no slower, default no slower than llama-server with
    the same draft model and decoding >= 1.3x its rate, keystroke first token no later, first line <= 0.75x) as a
    ratio and whether it is met (against llama.cpp of the same precision;
    with --model, prec is "gguf" and the one llama.cpp plain row is the file's). With --model, issue 24's bars for
    the default model too: fimble default's decode rate >= 1.8x llama.cpp plain's and >= 1.3x that of llama-server's
    best speculative setting (without a draft model: the --server-spec row with the highest decode rate, named in
    "against"; each row's own ratio without a bar), first line <= 0.6x."""
    out: dict = {}
    one_file = prec == "gguf"

    def e2e(name):
        return sum(cold[name]["e2e_ms"])

    for q in (*PRECISIONS, "gguf"):
        if f"llama.cpp plain ({q})" in cold:
            r = e2e("fimble plain") / e2e(f"llama.cpp plain ({q})")
            out[f"plain_time_vs_llamacpp_{q}"] = {
                "ratio": r,
                **({"bar": "<= 1.00", "met": r <= 1.0} if q == prec else {}),
            }
    if one_file and "llama.cpp plain (gguf)" in cold:
        r = cold["fimble default"]["decode_tok_s"] / cold["llama.cpp plain (gguf)"]["decode_tok_s"]
        out["default_decode_rate_vs_llamacpp_gguf"] = {"ratio": r, "bar": ">= 1.80", "met": r >= 1.8}
    sk = server_key(server_row)
    if server_row in cold:
        r = e2e("fimble default") / e2e(server_row)
        out[f"default_time_vs_{sk}"] = {"ratio": r, "bar": "<= 1.00", "met": r <= 1.0}
        r = cold["fimble default"]["decode_tok_s"] / cold[server_row]["decode_tok_s"]
        out[f"default_decode_rate_vs_{sk}"] = {"ratio": r, "bar": ">= 1.30", "met": r >= 1.3}
    spec = spec_rows(cold)
    if spec:
        best = max(spec, key=lambda name: cold[name]["decode_tok_s"])
        r = cold["fimble default"]["decode_tok_s"] / cold[best]["decode_tok_s"]
        out["default_decode_rate_vs_server_best_spec"] = {
            "ratio": r,
            "bar": ">= 1.30",
            "met": r >= 1.3,
            "against": best,
            "against_decode_tok_s": cold[best]["decode_tok_s"],
        }
    for name, key in spec.items():
        out[f"default_time_vs_server_{key}"] = {"ratio": e2e("fimble default") / e2e(name)}
        r = cold["fimble default"]["decode_tok_s"] / cold[name]["decode_tok_s"]
        out[f"default_decode_rate_vs_server_{key}"] = {"ratio": r}
    if keys and keys[server_row]["ttft_ms"]:
        f, s = keys["fimble"], keys[server_row]
        r = med(f["ttft_ms"]) / med(s["ttft_ms"])
        out["keystroke_ttft_median_vs_server"] = {"ratio": r, "bar": "<= 1.00", "met": r <= 1.0}
        r, bar = med(f["line_ms"]) / med(s["line_ms"]), 0.6 if one_file else 0.75
        out["keystroke_first_line_median_vs_server"] = {"ratio": r, "bar": f"<= {bar:.2f}", "met": r <= bar}
    if keys and keys.get(STOCK_INFILL, {}).get("ttft_ms"):  # no bar: not the same prompt
        f, s = keys["fimble, LSP prompt (healing)"], keys[STOCK_INFILL]
        out["keystroke_ttft_median_lsp_vs_stock_infill"] = {"ratio": med(f["ttft_ms"]) / med(s["ttft_ms"])}
    return out


def language_rates(run: dict) -> dict[str, dict[str, float]]:
    """Each system's decode tok/s over each language's cold prompts (``run['prompt_languages']``)."""
    langs = run.get("prompt_languages")
    if not langs:
        return {}
    out: dict[str, dict[str, float]] = {}
    for name, r in run["cold"].items():
        rates = {}
        for lang in dict.fromkeys(langs):
            idx = [i for i, x in enumerate(langs) if x == lang and i < len(r["tokens"])]
            secs = sum(r["decode_s"][i] for i in idx)
            rates[lang] = sum(r["tokens"][i] - 1 for i in idx) / secs if secs > 0 else 0.0
        out[name] = rates
    return out


def print_run(run: dict) -> None:
    th, lb, la = run["threads"], run["load_before"], run["load_after"]
    print(
        f"\ncold prompts: {run['prompts']} prompts x {run['tokens']} tokens, greedy, threads={th}, "
        f"fimble runtime {run['fimble_runtime']}, flash attention {run.get('flash_attn')}, "
        f"load average before {lb} after {la}"
    )
    print(f"greedy outputs identical to fimble plain's (=fimble) and to llama.cpp plain {run['precision']}'s (=llama)")
    print(
        f"{'system':30s} {'e2e ms med':>10s} {'TTFT ms':>8s} {'dec tok/s':>9s} {'=fimble':>7s} {'=llama':>7s} "
        f"{'drafts acc':>12s}"
    )
    for row in run["cold_table"]:
        print(
            f"{row['system']:30s} {row['e2e_ms_median']:10.1f} {row['ttft_ms_median']:8.1f} "
            f"{row['decode_tok_s']:9.1f} {row['identical']:>7s} {row['identical_llamacpp']:>7s} "
            f"{row['accepted_per_drafted']:>12s}"
        )
    by_lang = language_rates(run)
    if by_lang:
        langs = sorted({lang for rates in by_lang.values() for lang in rates})
        counts = ", ".join(f"{lang} x{run['prompt_languages'].count(lang)}" for lang in langs)
        print(f"decode tok/s by language ({counts} prompts):")
        for name, rates in by_lang.items():
            print(f"  {name:28s} " + "  ".join(f"{lang} {rates.get(lang, 0.0):6.1f}" for lang in langs))
    best = run.get("ratios", {}).get("default_decode_rate_vs_server_best_spec")
    if best:
        print(f"llama-server's best speculative setting: {best['against']} ({best['against_decode_tok_s']:.1f} tok/s)")
    keys = run.get("keystroke")
    if keys:
        ident = keys["identical"]
        print(
            f"\nkeystroke loop, threads={th}: {len(keys['fimble']['ttft_ms'])} keys in "
            f"{', '.join(run['typing_files'])}; fimble and llama-server outputs identical "
            f"{ident['identical']}/{ident['compared']}"
        )
        for name in (
            "fimble",
            run.get("server_row", "llama-server + draft"),
            "fimble, LSP prompt (healing)",
            STOCK_INFILL,
        ):
            r = keys.get(name)
            if r is None:
                continue
            if r["ttft_ms"]:
                print(
                    f"{name:30s} TTFT median {med(r['ttft_ms']):6.1f} ms  p90 {pct(r['ttft_ms'], 0.9):6.1f} ms   "
                    f"first line/16 tokens median {med(r['line_ms']):6.1f} ms  p90 {pct(r['line_ms'], 0.9):6.1f} ms"
                )
    if run["same_gguf"] is not None:
        print(f"fimble's runtime loads the same GGUF bytes as llama.cpp: {run['same_gguf']}")
    for what in run["skipped"]:
        print(f"skipped: {what}")
    print(f"\nratios, threads={th} (time ratios: below 1 means fimble is faster):")
    for name, r in run["ratios"].items():
        bar = f"  bar {r['bar']}: {'met' if r['met'] else 'NOT met'}" if "bar" in r else ""
        bar += f" (against {r['against']})" if "against" in r else ""
        print(f"  {name:44s} {r['ratio']:6.2f}{bar}")


def headline(report: dict) -> str:
    run = report["runs"][0]
    r = run["ratios"]
    gguf = report["model"].get("file")  # --model
    parts = [
        f"threads={run['threads']}",
        f"model {Path(gguf).name} (its own weights)" if gguf else f"weights {report['precision']}",
        f"fimble runtime {run['fimble_runtime']}",
        f"load {run['load_after'][0]}",
    ]
    bits = []
    for sk, label in (("server_draft", "llama-server+draft"), ("server", "llama-server")):
        if f"default_time_vs_{sk}" in r:
            bits.append(
                f"fimble default {r[f'default_time_vs_{sk}']['ratio']:.2f}x {label}'s time, "
                f"{r[f'default_decode_rate_vs_{sk}']['ratio']:.2f}x its decode rate"
            )
    if "default_decode_rate_vs_server_best_spec" in r:
        b = r["default_decode_rate_vs_server_best_spec"]
        bits.append(
            f"fimble default {b['ratio']:.2f}x the decode rate of llama-server's best speculative setting, "
            f"{b['against']} ({b['against_decode_tok_s']:.1f} tok/s)"
        )
    q = report["precision"]
    if f"plain_time_vs_llamacpp_{q}" in r:
        bits.append(f"fimble plain {r[f'plain_time_vs_llamacpp_{q}']['ratio']:.2f}x llama.cpp {q} plain's time")
    if "keystroke_ttft_median_vs_server" in r:
        bits.append(
            f"keystroke TTFT {r['keystroke_ttft_median_vs_server']['ratio']:.2f}x, first line "
            f"{r['keystroke_first_line_median_vs_server']['ratio']:.2f}x llama-server's"
        )
    met = [v["met"] for v in r.values() if "met" in v]
    bits.append(f"bars met {sum(met)}/{len(met)}" if met else "no llama.cpp peer ran")
    return f"headline ({', '.join(parts)}): " + "; ".join(bits)
