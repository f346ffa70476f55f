"""A FIM corpus for the languages the first adapter never saw, from permissively licensed public repositories.

    python -m training.corpus_repos --out DIR --mirror-root /work/.mirror --exclude BUNDLE [--exclude BUNDLE ...]
                                    [--seed 0] [--part-mib 4]

The first Qwen FIM adapter (models/qwen2.5-coder-0.5b-fim) was trained on Python, C and C++ alone; its held-out
cursors were up against the Instruct default in 33 of 35 languages, level in Ruby and in the Dockerfile bundle,
and closest in Elixir and TypeScript React (issue 25's note of 2026-12-05). This corpus gives the second round
those languages, from sources the held-out sets do not use:

- the held-out cursors come from Debian packages (libruby3.1, elixir-lang), npm packages and this machine's
  files (training/held_out_set.py), and a Dockerfile addendum from jessfraz/dockerfiles;
- these files come from the GitHub repositories in REPOS (snapshots fetched by the session's ``fetch`` tool,
  git directories without a work tree), each with its licence below;
- any file whose whitespace-collapsed hash (training/corpus.py ``normalized_hash``) equals a held-out file's
  (``--exclude``, bundles in training/corpus_langs.py's format) is dropped and counted.

Per language: files sorted by path, minified or generated ones and exact duplicates dropped, a seeded sample up
to the language's file cap (Dockerfiles per repository: docker-library's are generated from one template per
image, so a few per image carry all its variety). A seeded 3% is held out for the training report's per-language
loss. Output: training/corpus_langs.py's bundle (``langs.jsonl.xz.partNN`` + ``langs_manifest.json``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
from pathlib import Path

from training.corpus import normalized_hash
from training.corpus_langs import MAX_CHARS, MIN_CHARS, _looks_generated, read_parts, write_bundle

# repository -> licence (read from its LICENSE file when this list was written)
REPOS = {
    "rubocop/rubocop": "MIT",
    "jekyll/jekyll": "MIT",
    "sinatra/sinatra": "MIT",
    "phoenixframework/phoenix": "MIT",
    "phoenixframework/phoenix_live_view": "MIT",
    "elixir-ecto/ecto": "Apache-2.0",
    "elixir-plug/plug": "Apache-2.0",
    "shadcn-ui/ui": "MIT",
    "docker-library/python": "MIT",
    "docker-library/postgres": "MIT",
    "docker-library/php": "MIT",
    "docker-library/golang": "MIT",
    "docker-library/ruby": "MIT",
    "docker-library/node": "MIT",
    "docker-library/redis": "BSD-3-Clause",
    "docker-library/wordpress": "GPL-2.0 (skipped)",
    "docker-library/buildpack-deps": "MIT",
    "docker-library/mongo": "Apache-2.0",
    "nginxinc/docker-nginx": "BSD-2-Clause",
}
# LSP language id -> the most files kept (all repositories together)
CAPS = {"ruby": 2200, "elixir": 600, "typescriptreact": 1600, "dockerfile": 400}
DOCKERFILES_PER_REPO = 40
HELD_OUT_SHARE = 0.03
_SKIP = re.compile(r"(/vendor/|/node_modules/|/dist/|\.min\.|/fixtures?/)")


def language(path: str) -> str | None:
    name = path.rsplit("/", 1)[-1]
    if name.startswith("Dockerfile"):
        return "dockerfile"
    if name.endswith((".rb", ".rake")):
        return "ruby"
    if name.endswith((".ex", ".exs")):
        return "elixir"
    if name.endswith(".tsx"):
        return "typescriptreact"
    return None


def _git_dir(mirror_root: Path, repo: str) -> Path:
    base = mirror_root / repo.replace("/", "+") / "repo"
    return base / ".git" if (base / ".git").is_dir() else base


def repo_files(git_dir: Path) -> list[tuple[str, str]]:
    """(path, text) of every file of HEAD in a language above, in path order."""
    listing = subprocess.run(
        ["git", f"--git-dir={git_dir}", "ls-tree", "-r", "-z", "HEAD"], capture_output=True, check=True
    ).stdout.decode("utf-8", "replace")
    wanted = []
    for entry in listing.split("\0"):
        if not entry:
            continue
        meta, path = entry.split("\t", 1)
        if meta.split()[1] == "blob" and language(path) and not _SKIP.search("/" + path):
            wanted.append((path, meta.split()[2]))
    wanted.sort()
    if not wanted:
        return []
    proc = subprocess.run(
        ["git", f"--git-dir={git_dir}", "cat-file", "--batch"],
        input="".join(f"{sha}\n" for _p, sha in wanted).encode(),
        capture_output=True,
        check=True,
    )
    out, blob, pos = [], proc.stdout, 0
    for path, _sha in wanted:
        head_end = blob.index(b"\n", pos)
        size = int(blob[pos:head_end].split()[2])
        data = blob[head_end + 1 : head_end + 1 + size]
        pos = head_end + 1 + size + 1
        out.append((path, data.decode("utf-8", "replace")))
    return out


def build(mirror_root: Path, excluded: set[str], seed: int) -> tuple[list[dict], dict]:
    rng = random.Random(seed)
    seen: set[str] = set()
    counts: dict = {"dropped_held_out_copy": 0, "dropped_duplicate": 0, "dropped_size_or_generated": 0}
    by_lang: dict[str, list[dict]] = {lang: [] for lang in CAPS}
    licences = {}  # repository -> "licence @ commit"
    for repo, licence in REPOS.items():
        if "skipped" in licence:
            licences[repo] = licence
            continue
        git_dir = _git_dir(mirror_root, repo)
        head = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", "HEAD"], capture_output=True, text=True)
        licences[repo] = f"{licence} @ {head.stdout.strip()}"
        files = repo_files(git_dir)
        dockerfiles = []
        for path, text in files:
            lang = language(path)
            # docker-library's Dockerfiles say "generated ... do not edit" (from one template per image): they are
            # ordinary Dockerfiles, so only the size rule applies to them, and a smaller floor.
            small = 120 if lang == "dockerfile" else MIN_CHARS
            generated = lang != "dockerfile" and _looks_generated(text)
            if not small <= len(text) <= MAX_CHARS or generated:
                counts["dropped_size_or_generated"] += 1
                continue
            h = normalized_hash(text)
            if h in excluded:
                counts["dropped_held_out_copy"] += 1
                continue
            if h in seen:
                counts["dropped_duplicate"] += 1
                continue
            seen.add(h)
            row = {"lang": lang, "path": f"{repo}/{path}", "text": text, "held_out": False}
            (dockerfiles if lang == "dockerfile" else by_lang[lang]).append(row)
        rng.shuffle(dockerfiles)
        by_lang["dockerfile"] += dockerfiles[:DOCKERFILES_PER_REPO]
    rows = []
    per_lang = {}
    for lang, cands in by_lang.items():
        rng.shuffle(cands)
        kept = cands[: CAPS[lang]]
        for row in kept:
            row["held_out"] = rng.random() < HELD_OUT_SHARE
        rows += kept
        per_lang[lang] = {
            "files": len(kept),
            "chars": sum(len(r["text"]) for r in kept),
            "held_out": sum(r["held_out"] for r in kept),
        }
    return rows, {**counts, "languages": per_lang, "licences": licences}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mirror-root", type=Path, default=Path("/work/.mirror"))
    ap.add_argument("--exclude", type=Path, action="append", default=[], help="held-out bundles (their files)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--part-mib", type=float, default=4)
    args = ap.parse_args()
    excluded = {normalized_hash(r["text"]) for folder in args.exclude for r in read_parts(folder)}
    rows, stats = build(args.mirror_root, excluded, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    fields = {"what": "training/corpus_repos.py", "seed": args.seed, "excluded_files": len(excluded), **stats}
    manifest = write_bundle(args.out, rows, args.part_mib, fields, preset=6)
    print(json.dumps({k: v for k, v in manifest.items() if k != "licences"}, indent=1))


if __name__ == "__main__":
    main()
