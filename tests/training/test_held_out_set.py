"""training/held_out_set.py: the held-out bundle's files are outside the training set by construction."""

from __future__ import annotations

from pathlib import Path

from bench.harness.cursor_sets import load_held_out
from training import held_out_set as hos
from training.corpus import normalized_hash
from training.corpus_langs import read_parts


def _go(i: int) -> str:
    block = "\tx{i}_{k} := compute{k}(a, b)\n\tif x{i}_{k} > 0 {{\n\t\treturn x{i}_{k}\n\t}}"
    body = "\n".join(block.format(i=i, k=k) for k in range(8))
    return f"package p{i}\n\nfunc F{i}(a, b int) int {{\n{body}\n\treturn 0\n}}\n"


def test_bundle_keeps_only_files_outside_training(tmp_path, monkeypatch):
    src = tmp_path / "go"
    src.mkdir()
    texts = {f"f{i}.go": _go(i) for i in range(6)}
    for name, text in texts.items():
        (src / name).write_text(text)
    (src / "tiny.go").write_text("package x\n")  # under the size floor
    (src / "testdata").mkdir()
    (src / "testdata" / "t.go").write_text(_go(99))  # excluded by the source's pattern
    monkeypatch.setattr(hos, "LOCAL", {"go": [(str(src), (".go",), r"/testdata/", "test licence")]})
    trained = normalized_hash(texts["f0.go"].replace("\t", "    "))  # a copy of a training file, re-indented
    fingerprint = "x1_3 := compute3(a, b)"  # a HumanEval-like line
    device = [
        {"lang": "python", "path": "/site/a.py", "text": "def f():\n    return 1\n" * 20, "held_out": True},
        {"lang": "ruby", "path": "/site/b.rb", "text": "puts 1\n" * 80, "held_out": True},  # not a split language
    ]
    m = hos.build(tmp_path / "out", device, {trained}, {fingerprint}, per_lang=10, seed=0, debian_root=None)
    rows = read_parts(tmp_path / "out")
    got = {(r["lang"], Path(r["path"]).name) for r in rows}
    assert got == {("python", "a.py")} | {("go", f"f{i}.go") for i in (2, 3, 4, 5)}
    assert all(r["held_out"] for r in rows)
    st = m["stats"]["go"]
    assert st["in_training"] == 1 and st["humaneval_like"] == 1 and st["unusable"] == 1 and st["files"] == 4
    assert st["sources"] == ["test licence"]
    # bench/quality.py reads the bundle as it reads training/corpus_langs.py's
    assert sorted((r["lang"], r["path"]) for r in load_held_out(tmp_path / "out", None)) == sorted(
        (r["lang"], r["path"]) for r in rows
    )
    # seeded: the same files again
    m2 = hos.build(tmp_path / "out2", device, {trained}, {fingerprint}, per_lang=2, seed=0, debian_root=None)
    m3 = hos.build(tmp_path / "out3", device, {trained}, {fingerprint}, per_lang=2, seed=0, debian_root=None)
    assert m2["sha256"] == m3["sha256"]


def test_a_held_out_sample_in_pieces_is_the_whole_sample():
    """bench/quality.py --held-out-from A --limit B runs cursors A..B of each language's seeded sample: the runs
    [0, A) and [A, B) together are --limit B's sample, and --limit A's sample is its head."""
    from bench.harness.cursor_sets import held_out_sample

    for n in (20, 45, 60, 85):
        lp = list(range(n))
        for a, b in ((6, 12), (12, 20), (12, 30), (6, 36)):
            whole = held_out_sample(lp, b)
            assert held_out_sample(lp, a) == whole[:a]
            assert len(set(whole)) == min(b, n)
    assert sorted(held_out_sample([1, 2, 3], 5)) == [1, 2, 3] and held_out_sample([1, 2, 3], None) == [1, 2, 3]


def test_registry_sources_and_file_name_patterns(tmp_path, monkeypatch):
    """--registry-root adds REGISTRY's languages only when given; "=PATTERN" kinds match file names (Makefile,
    Dockerfile.template), suffix kinds stay suffixes."""
    reg = tmp_path / "reg" / "deb" / "lib"
    reg.mkdir(parents=True)
    for i in range(3):
        (reg / f"m{i}.rb").write_text("".join(f"def m{i}_{k}(a)\n  a + {k}\nend\n\n" for k in range(40)))
    local = tmp_path / "local"
    (local / "a").mkdir(parents=True)
    rule = "".join(f"target{k}: dep{k}.o\n\t$(CC) -o $@ $^ -lm{k}\n\n" for k in range(30))
    (local / "a" / "Makefile").write_text(rule)
    (local / "a" / "rules.mk").write_text(rule.replace("target", "rule"))
    (local / "a" / "Makefile.txt").write_text(rule.replace("target", "other"))  # a suffix, not the name
    (local / "Dockerfile.template").write_text("".join(f"RUN apt-get install -y pkg{k}\n" for k in range(30)))
    monkeypatch.setattr(
        hos,
        "LOCAL",
        {
            "makefile": [(str(local), ("=Makefile", "=*.mk"), None, "l")],
            "dockerfile": [(str(local), ("=Dockerfile*",), None, "l")],
        },
    )
    monkeypatch.setattr(hos, "REGISTRY", {"ruby": [("{registry}/deb/lib", (".rb",), None, "r")]})
    hos.build(tmp_path / "o1", [], set(), set(), per_lang=10, seed=0, debian_root=None)
    got = {(r["lang"], Path(r["path"]).name) for r in read_parts(tmp_path / "o1")}
    assert got == {("makefile", "Makefile"), ("makefile", "rules.mk"), ("dockerfile", "Dockerfile.template")}
    hos.build(tmp_path / "o2", [], set(), set(), per_lang=10, seed=0, debian_root=None, registry_root=tmp_path / "reg")
    rows = read_parts(tmp_path / "o2")
    assert {Path(r["path"]).name for r in rows if r["lang"] == "ruby"} == {"m0.rb", "m1.rb", "m2.rb"}
    assert {r["source"] for r in rows if r["lang"] == "ruby"} == {"r"}
