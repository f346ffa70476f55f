"""The second round's training inputs: the repository corpus (training/corpus_repos.py) and the trainer's
continuation, exclusion and packing (training/qwen_fim_train.py). Real git repositories, a real tiny Qwen2."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.training.test_qwen_fim import trained_adapter
from training import adapter as lora
from training import corpus_repos
from training.corpus import normalized_hash
from training.qwen_fim_train import _load_init, pack

RUBY = (
    "class Greeter\n  def initialize(name)\n    @name = name\n  end\n\n"
    '  def greet\n    puts "hi #{@name}"\n  end\nend\n'
) * 3


def make_repo(root: Path, name: str, files: dict[str, str]) -> None:
    work = root / name.replace("/", "+") / "repo"
    work.mkdir(parents=True)
    for path, text in files.items():
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text)
    git = ["git", "-C", str(work), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)


def test_languages_by_file_name() -> None:
    assert corpus_repos.language("a/b/Dockerfile.alpine") == "dockerfile"
    assert corpus_repos.language("lib/x.rb") == corpus_repos.language("Rakefile.rake") == "ruby"
    assert corpus_repos.language("lib/x.exs") == "elixir"
    assert corpus_repos.language("ui/button.tsx") == "typescriptreact"
    assert corpus_repos.language("ui/button.ts") is None


def test_build_drops_held_out_copies_duplicates_and_generated_files(tmp_path, monkeypatch) -> None:
    held = "module Held\n  def self.secret\n    42\n  end\nend\n" * 8
    make_repo(
        tmp_path,
        "o/ruby",
        {
            "lib/greeter.rb": RUBY,
            "lib/copy.rb": RUBY.replace("  ", "    "),  # the same file but for spacing: a duplicate
            "lib/held.rb": held,  # a scored file's copy
            "lib/min.rb": "x=1;" * 200,  # one long line: generated
            "lib/tiny.rb": "puts 1\n",  # under the size floor
            "vendor/lib/v.rb": RUBY + "# vendored\n",  # a vendored path
        },
    )
    make_repo(tmp_path, "o/docker", {"Dockerfile": "# GENERATED, DO NOT EDIT\nFROM debian\nRUN apt-get update\n" * 3})
    monkeypatch.setattr(corpus_repos, "REPOS", {"o/ruby": "MIT", "o/docker": "MIT", "o/gpl": "GPL-2.0 (skipped)"})
    rows, stats = corpus_repos.build(tmp_path, {normalized_hash(held)}, seed=0)
    by_path = {r["path"]: r for r in rows}
    # Files in path order: lib/copy.rb comes first and lib/greeter.rb is its duplicate. docker-library's
    # "generated, do not edit" header does not drop a Dockerfile.
    assert set(by_path) == {"o/ruby/lib/copy.rb", "o/docker/Dockerfile"}
    assert stats["dropped_held_out_copy"] == 1
    assert stats["dropped_duplicate"] == 1
    assert stats["dropped_size_or_generated"] == 2
    assert stats["licences"]["o/ruby"].startswith("MIT @ ") and len(stats["licences"]["o/ruby"]) == len("MIT @ ") + 40
    assert stats["licences"]["o/gpl"] == "GPL-2.0 (skipped)"
    assert {r["lang"] for r in rows} == {"ruby", "dockerfile"}


def test_init_adapter_continues_exactly_where_the_export_was(tmp_path) -> None:
    trained = trained_adapter(tmp_path / "a", rank=4, alpha=8.0)
    fresh = {name: lora.LoRALinear(m.base, 4, 8.0) for name, m in trained.items()}
    meta = _load_init(fresh, tmp_path / "a", 4, 8.0)
    assert meta["steps"] == 1
    for name, m in trained.items():  # bf16 on disk: what the export kept, to the bit
        assert torch.equal(fresh[name].lora_a, m.lora_a.detach().to(torch.bfloat16).float())
        assert torch.equal(fresh[name].lora_b, m.lora_b.detach().to(torch.bfloat16).float())
    with pytest.raises(SystemExit, match="rank"):
        _load_init(fresh, tmp_path / "a", 8, 8.0)


def test_pack_keeps_whole_samples_and_handles_none() -> None:
    x, y = pack([([1, 2, 3], [4, 5], "line"), ([6] * 5, [7], "line"), ([8] * 20, [9], "span")], seq=8, pad=0)
    assert x.shape == y.shape == (2, 8)  # the 21-token sample does not fit: skipped, never split
    assert x[0].tolist()[:5] == [1, 2, 3, 4, 5] and y[0].tolist()[:4] == [-100, -100, 4, 5]
    x, y = pack([], seq=8, pad=0)
    assert x.shape == y.shape == (0, 8)
