"""Disk reads for imports (lsp_server/context/files.py): only inside the workspace, size-capped, no links out."""

from __future__ import annotations

import os

from lsp_server.context.files import read_inside, resolve_roots, uri_to_path


def make(tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "pkg").mkdir(parents=True)
    outside.mkdir()
    (ws / "pkg" / "mod.py").write_text("def f():\n    pass\n")
    (outside / "secret.py").write_text("SECRET = 1\n")
    return ws, outside, resolve_roots([str(ws)])


def test_reads_a_file_inside(tmp_path):
    ws, _, roots = make(tmp_path)
    assert read_inside(roots, str(ws / "pkg" / "mod.py")) == "def f():\n    pass\n"


def test_never_outside_the_folder(tmp_path):
    ws, outside, roots = make(tmp_path)
    assert read_inside(roots, str(outside / "secret.py")) is None
    assert read_inside(roots, str(ws / "pkg" / ".." / ".." / "outside" / "secret.py")) is None
    assert read_inside([], str(ws / "pkg" / "mod.py")) is None  # no workspace folder: no disk at all


def test_never_through_a_link_out_of_it(tmp_path):
    ws, outside, roots = make(tmp_path)
    os.symlink(outside / "secret.py", ws / "pkg" / "link.py")
    os.symlink(outside, ws / "pkg" / "linkdir")
    assert read_inside(roots, str(ws / "pkg" / "link.py")) is None
    assert read_inside(roots, str(ws / "pkg" / "linkdir" / "secret.py")) is None


def test_a_link_that_stays_inside_is_followed(tmp_path):
    ws, _, roots = make(tmp_path)
    os.symlink(ws / "pkg" / "mod.py", ws / "pkg" / "alias.py")
    assert read_inside(roots, str(ws / "pkg" / "alias.py")) == "def f():\n    pass\n"


def test_size_cap_and_special_files(tmp_path):
    ws, _, roots = make(tmp_path)
    (ws / "big.py").write_text("x = 1\n" * 1000)
    assert read_inside(roots, str(ws / "big.py"), max_bytes=5999) is None
    assert read_inside(roots, str(ws / "big.py"), max_bytes=6000) is not None
    os.mkfifo(ws / "pipe.py")
    assert read_inside(roots, str(ws / "pipe.py")) is None  # refused without blocking on the FIFO
    assert read_inside(roots, str(ws / "pkg")) is None  # a folder
    (ws / "bin.py").write_bytes(b"\x00\x01")
    assert read_inside(roots, str(ws / "bin.py")) is None


def test_uri_to_path():
    assert uri_to_path("file:///home/u/a%20b.py") == "/home/u/a b.py"
    assert uri_to_path("untitled:Untitled-1") is None
    assert uri_to_path("file://otherhost/x.py") is None
