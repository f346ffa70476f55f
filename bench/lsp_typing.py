"""A person typing real files into ``fimble lsp`` as VS Code drives it.

    python -m bench.lsp_typing --quick --model embedded   # under a minute
    python -m bench.lsp_typing --model default --json out.json

It reports the time from the last key of each pause to the first visible text (p50/p90, the share within 300 ms
and 1 s), the time to the next text after a Tab accept, the cold wait to the first text after start, engine
restarts and the server's CPU seconds per second; what exactly is measured follows.

The server is started over stdio with the settings the VS Code extension sends by default
(editors/vscode/package.json through settings.ts's ``wireSettings``: streaming on, token healing
off, ``maxTokens`` 64, one engine thread, ...) and the client capabilities it advertises
(``experimental.fimble.completionDelta`` and ``replaceStart``). Four files of the Python standard library (700-1,800
lines) are each opened with a span of lines in the middle removed (the rest of the file before and
after the cursor), and the span is typed back:

- a key every ~110 ms (80-140 ms, seeded); Enter inserts the newline and the next line's
  indentation in one edit (the editor's auto-indent); a ``didChange`` per key, the previous
  ``textDocument/inlineCompletion`` cancelled (``$/cancelRequest``) and a new one sent 50 ms later
  (``--debounce-ms``: about VS Code's own inline-suggest debounce); ``fimble/cursor`` once the cursor
  rests 150 ms (editors/vscode/src/cursor.ts);
- pauses after the indentation of each new line that has code (3 s) and at some word ends
  (1.5 s, a seeded 12% of them);
- Tab: when the ghost text shown in a pause is what the file goes on with, the person accepts it
  (a ``didChange`` applying it) and types on after it; at every second new-line pause whose text is
  not (every one with ``--quick``), they accept it anyway, look at the next suggestion and undo (a
  ``didChange`` putting the line back). After each accept the client asks again at the new cursor.
  Only text the extension shows is accepted.

Measured: per pause, the time from its last key to the first visible text (the first non-empty
text, a ``fimble/completionDelta`` or the response, of the request sent after that key; "as VS Code
shows it": the extension (editors/vscode/src/stream.ts) shows a delta only once the request's
response is in, so a non-empty response, or a delta after an empty one); after Tab, the time to the
next completion's text; the cold wait (server process start -> the first text of the first request,
sent as soon as ``initialize`` returns and re-sent until text comes, bounded); engine restarts
(``fimble/stats`` ``engine.restarts`` / ``supervision``, and ``window/showMessage`` "restarting");
the server process tree's CPU time (/proc/PID/stat of the server and all its descendants): per
second and per minute of typing, and in a 1 s window starting 2 s after the last key of each
new-line pause (its Tab or undo, if any, is the last key) and of each file's end, where it should have
fallen under 2% of a core. A pause whose request showed nothing before the person typed on counts as
infinitely slow. Not modelled: the editor's auto-closing of brackets and quotes, and selection moves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.lsp_latency import STDLIB, RpcClient, percentile, utf16_len
from engine.model_info import default_target
from lsp_server.shaping.syntax import suffix_overlap

REPO = Path(__file__).resolve().parent.parent

DEFAULT_FILES = ["tempfile.py", "fractions.py", "configparser.py", "shutil.py"]  # 910, 756, 1382, 1530 lines
# What the VS Code extension sends as initializationOptions with its defaults (package.json + wireSettings).
VSCODE_SETTINGS = {
    "noDraft": False,
    "device": "cpu",
    "engineThreads": 1,
    "drafter": "auto",
    "maxLines": 8,
    "maxTokens": 64,
    "debounceMs": 0,
    "earlyAnswerMs": 150,
    "answerAt": "line",
    "prefetch": True,
    "tokenHealing": False,
    "prefixChars": 4000,
    "suffixChars": 1000,
    "preload": True,
    "kvCacheMB": 0,
    "kvShiftReuse": False,
    "prewarm": True,
    "prewarmDelayMs": 300,
    "streaming": True,
}


def setting_overrides(pairs: list[str]) -> dict:
    """``--setting NAME=VALUE`` pairs as initializationOptions entries (VALUE as JSON where it parses); a clear
    error for a pair without ``=`` (the server range-checks the values themselves)."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--setting {pair!r}: want NAME=VALUE")
        try:
            out[name] = json.loads(value)
        except ValueError:
            out[name] = value
    return out


CURSOR_REST_S = 0.150  # editors/vscode/src/cursor.ts: fimble/cursor once the cursor rests this long
CPU_DELAY_S, CPU_WINDOW_S, CPU_TARGET_PCT = 2.0, 1.0, 2.0
AFTER_TAB_TARGET_MS = 50.0
WORD_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


# -- the server's process tree ------------------------------------------------------------------
def tree_cpu(root: int) -> tuple[float, dict[int, int]]:
    """CPU seconds (user + system) of ``root`` and every live descendant, plus the children each has
    reaped (cutime/cstime: an engine that died and was waited for still counts); and {pid: start time}."""
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    started: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rfind(b")") + 2 :].split()
        pid = int(name)
        kids.setdefault(int(rest[1]), []).append(pid)
        ticks[pid] = sum(int(x) for x in rest[11:15])  # utime stime cutime cstime
        started[pid] = int(rest[19])
    total, seen, stack = 0, {}, [root]
    while stack and len(seen) < 10_000:
        pid = stack.pop()
        if pid in ticks and pid not in seen:
            total += ticks[pid]
            seen[pid] = started[pid]
            stack.extend(kids.get(pid, []))
    return total / tick, seen


def start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rfind(b")") + 2 :].split()[19])


def thread_counts(pids: Any) -> dict[int, int]:
    out = {}
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("Threads:"):
                    out[pid] = int(line.split()[1])
        except OSError:
            pass
    return out


def kill_tree(procs: dict[int, int]) -> int:
    """SIGKILL those of the server's processes ({pid: start time}, seen as the server and its descendants)
    that are still alive: the same pid with the same start time, so never a process that reused a pid."""
    killed = 0
    for pid, started in sorted(procs.items()):
        if start_time(pid) != started:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            pass
    return killed


# -- traces -------------------------------------------------------------------------------------
@dataclass
class Trace:
    name: str
    first_line: int  # 1-based line of the span's first line in the file
    lines: int  # lines in the span
    before: str  # the document before the cursor: up to the end of the line above the span
    typed: str  # "\n" + the span (each line starts with Enter + its indentation)
    after: str  # the document after the cursor: "\n" + the rest of the file
    path: str = ""  # the file typed (opened under its own URI where a workspace folder is sent)


def build_trace(path: Path, chars: int) -> Trace:
    """The span: whole lines from the first ``def`` at or after 40% of the file, ``chars`` or a bit more."""
    text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
    lines = text.splitlines(keepends=True)
    n = len(lines)
    start = next((i for i in range(max(1, n * 2 // 5), n) if lines[i].lstrip().startswith("def ")), max(1, n * 2 // 5))
    end, total = start, 0
    while end < n and (end == start or total < chars):
        total += len(lines[end])
        end += 1
    before = "".join(lines[:start])
    span = "".join(lines[start:end])
    rest = "".join(lines[end:])
    if span.endswith("\n"):
        typed, after = "\n" + span[:-1], "\n" + rest
    else:
        typed, after = "\n" + span, rest
    return Trace(path.name, start + 1, end - start, before[:-1], typed, after, str(path.resolve()))


def key_at(typed: str, p: int) -> str:
    """The key pressed at ``typed[p]``: Enter brings the next line's indentation (auto-indent)."""
    if typed[p] == "\n":
        q = p + 1
        while q < len(typed) and typed[q] in " \t":
            q += 1
        return typed[p:q]
    line_start = typed.rfind("\n", 0, p) + 1
    if typed[p] in " \t" and not typed[line_start:p].strip():  # inside the indentation (after an accept)
        q = p
        while q < len(typed) and typed[q] in " \t":
            q += 1
        return typed[p:q]
    return typed[p]


def word_pauses(trace: Trace, prob: float, seed: int) -> set[int]:
    """Positions of word-final characters (2+ characters, mid-line) where the person pauses."""
    rng = random.Random(f"{seed}:{trace.name}:words")
    t = trace.typed
    out = set()
    for p in range(1, len(t) - 1):
        if t[p] in WORD_CHARS and t[p - 1] in WORD_CHARS and t[p + 1] not in WORD_CHARS and t[p + 1] != "\n":
            if rng.random() < prob:
                out.add(p)
    return out


# -- the document as the editor holds it --------------------------------------------------------
class Doc:
    def __init__(self, uri: str, text: str, cursor: int):
        self.uri, self.text, self.cursor, self.version = uri, text, cursor, 1

    def position(self, off: int) -> dict:
        line = self.text.count("\n", 0, off)
        start = self.text.rfind("\n", 0, off) + 1
        return {"line": line, "character": utf16_len(self.text[start:off])}

    def offset(self, pos: dict) -> int:
        start = 0
        for _ in range(pos["line"]):
            start = self.text.index("\n", start) + 1
        end = self.text.find("\n", start)
        end = len(self.text) if end == -1 else end
        col, i = 0, start
        while i < end and col < pos["character"]:
            col += utf16_len(self.text[i])
            i += 1
        return i

    def edit(self, rpc: Any, start: int, end: int, text: str) -> None:
        """Replace [start, end) by ``text``, send the didChange, leave the cursor after it."""
        rng = {"start": self.position(start), "end": self.position(end)}
        self.text = self.text[:start] + text + self.text[end:]
        self.cursor = start + len(text)
        self.version += 1
        rpc.notify(
            "textDocument/didChange",
            {
                "textDocument": {"uri": self.uri, "version": self.version},
                "contentChanges": [{"range": rng, "text": text}],
            },
        )


# -- requests -----------------------------------------------------------------------------------
@dataclass
class Ask:
    rid: int
    t_sent: float
    t_key: float
    t_first: float | None = None  # first non-empty text, a delta or the response
    t_vscode: float | None = None  # first text the VS Code extension would show
    t_response: float | None = None
    current: str = ""  # the text shown now (the latest delta, or the response)
    response_chars: int | None = None
    replace_end: dict | None = None
    replace_start: dict | None = None  # where a dedent's range starts (the line's start): lsp_server/line_start.py
    cached: bool | None = None
    finish: str | None = None
    cancelled_by_client: bool = False
    events: list = field(default_factory=list)  # (t, "delta" | "answer", text length, finishReason), the first 64
    future: Any = field(default=None, repr=False)
    shown: Any = field(default=None, repr=False)  # asyncio.Event, set at the first text

    def see(
        self,
        text: str,
        t: float,
        *,
        response: bool,
        cached: bool | None = None,
        replace_end: dict | None = None,
        replace_start: dict | None = None,
    ) -> None:
        if len(self.events) < 64:
            self.events.append((t, "answer" if response else "delta", len(text), self.finish))
        if response:
            self.t_response, self.response_chars = t, len(text)
            if text and not self.current.startswith(text):
                self.current = text
            if text and self.t_vscode is None:
                self.t_vscode = t
        else:
            self.current = text
            if text and self.t_response is not None and self.t_vscode is None:
                self.t_vscode = t  # an empty answer, then text: the extension re-triggers and shows it
        if replace_end is not None:
            self.replace_end = replace_end
        if replace_start is not None:
            self.replace_start = replace_start
        if text and self.t_first is None:
            self.t_first = t
            self.cached = cached
            self.shown.set()


class Session:
    """One editor talking to one server: documents, requests, notifications, the cursor reporter."""

    def __init__(self, rpc: Any, args: argparse.Namespace):
        self.rpc, self.args = rpc, args
        self.asks: dict[int, Ask] = {}
        self.messages: list[tuple[float, int, str]] = []
        self.statuses: list[tuple[float, dict]] = []
        self._cursor_timer: asyncio.TimerHandle | None = None
        self._cursor_last: tuple | None = None
        self.cursor_sent = 0
        rpc.on_notification = self.on_note

    def on_note(self, method: str, params: Any, t: float) -> None:
        if method == "fimble/completionDelta" and isinstance(params, dict):
            ask = self.asks.get(params.get("requestId"))
            if ask is not None:
                if params.get("done"):
                    ask.finish = params.get("finishReason")
                ask.see(
                    params.get("text") or "",
                    t,
                    response=False,
                    cached=params.get("cached"),
                    replace_end=params.get("replaceEnd"),
                    replace_start=params.get("replaceStart"),
                )
        elif method == "window/showMessage" and isinstance(params, dict) and len(self.messages) < 1000:
            self.messages.append((t, params.get("type", 0), str(params.get("message", ""))[:300]))
        elif method == "fimble/status" and isinstance(params, dict) and len(self.statuses) < 1000:
            self.statuses.append((t, params))

    def ask(self, doc: Doc, t_key: float) -> Ask:
        rid, fut = self.rpc.request(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": doc.uri},
                "position": doc.position(doc.cursor),
                "context": {"triggerKind": 2, "selectedCompletionInfo": None},
            },
        )
        a = Ask(rid, time.perf_counter(), t_key, future=fut, shown=asyncio.Event())
        self.asks[rid] = a

        def done(f: asyncio.Future) -> None:
            msg = f.result()
            res = msg.get("result")
            items = res if isinstance(res, list) else (res or {}).get("items") or []
            text = (items[0].get("insertText") or "") if items else ""
            rng = (items[0].get("range") or {}) if items else {}
            a.see(
                text if isinstance(text, str) else "",
                msg["_t"],
                response=True,
                replace_end=rng.get("end"),
                replace_start=rng.get("start"),
            )

        fut.add_done_callback(done)
        return a

    def cancel(self, a: Ask | None) -> None:
        """What vscode-languageclient does when VS Code cancels the token: $/cancelRequest if still out."""
        if a is not None and a.future is not None and not a.future.done():
            self.rpc.notify("$/cancelRequest", {"id": a.rid})
            a.cancelled_by_client = True

    def cursor_moved(self, doc: Doc) -> None:
        if self._cursor_timer is not None:
            self._cursor_timer.cancel()
        key = (doc.uri, doc.version, doc.cursor)
        if key == self._cursor_last:
            return
        pos = doc.position(doc.cursor)

        def send() -> None:
            self._cursor_last = key
            self.cursor_sent += 1
            self.rpc.notify("fimble/cursor", {"textDocument": {"uri": doc.uri}, "position": pos})

        self._cursor_timer = asyncio.get_running_loop().call_later(CURSOR_REST_S, send)


async def wait_text(a: Ask, until: float) -> bool:
    """Wait for ``a``'s first text, at most until ``until`` (perf_counter time)."""
    if a.t_first is not None:
        return True
    try:
        await asyncio.wait_for(a.shown.wait(), max(0.0, until - time.perf_counter()))
    except TimeoutError:
        pass
    return a.t_first is not None


async def sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.perf_counter()))


def ms(t: float | None, t0: float) -> float | None:
    return None if t is None else (t - t0) * 1e3


# -- one file -----------------------------------------------------------------------------------
@dataclass
class Pause:
    file: str
    kind: str  # "line" | "word" | "end"
    line: int  # 1-based line in the file
    t_key_s: float  # since the start of typing
    text_ms: float | None = None  # last key -> first text; None: nothing before the person typed on
    vscode_ms: float | None = None
    response_ms: float | None = None  # last key -> the response (None: not before the person typed on)
    response_chars: int | None = None
    finish: str | None = None  # the stream's finishReason, if it ended within the pause
    cached: bool | None = None
    text_chars: int = 0
    accept: str | None = None  # "matched" (the file goes on so: typed on after it) | "undone"
    after_tab_request_ms: float | None = None
    after_tab_key_ms: float | None = None
    after_tab_cached: bool | None = None
    cpu_pct: float | None = None  # server tree CPU, % of one core, in [last key + 2 s, + 3 s]
    # The shown text re-types the document after the cursor (lsp_server/shaping/syntax/suffix_overlap.py's cut
    # rule), and the looser measure: a 10+ char line of it equals one of the next 10 non-blank lines.
    # None: nothing shown.
    retypes_suffix: bool | None = None
    repeats_suffix_line: bool | None = None
    stream: list = field(default_factory=list)  # the request's deltas and answer: [ms after the key, kind, chars, end]


async def type_file(
    s: Session, doc: Doc, trace: Trace, server_pid: int, t_typing0: float, out: dict, deadline: float
) -> None:
    args = s.args
    typed = trace.typed
    words = word_pauses(trace, args.word_pause_p, args.seed)
    gaps = random.Random(f"{args.seed}:{trace.name}:gaps")
    base = len(trace.before)  # the document offset where typed[0] goes
    pauses: list[Pause] = out["pauses"]
    line_pauses_with_text = 0
    pending: Ask | None = None
    p = 0
    t_next = time.perf_counter()
    keys = 0

    def file_line() -> int:
        return doc.text.count("\n", 0, doc.cursor) + 1

    async def cpu_window(last_key: float) -> float:
        """Server tree CPU, % of one core, over [last_key + 2 s, + 3 s]."""
        await sleep_until(last_key + CPU_DELAY_S)
        c0, t0 = tree_cpu(server_pid)[0], time.perf_counter()
        await asyncio.sleep(CPU_WINDOW_S)
        c1, t1 = tree_cpu(server_pid)[0], time.perf_counter()
        return (c1 - c0) / (t1 - t0) * 100.0

    async def press(key_text: str, start: int, end: int) -> Ask:
        nonlocal pending
        s.cancel(pending)  # the editor moves on: the shown (or awaited) suggestion goes
        t_key = time.perf_counter()
        doc.edit(s.rpc, start, end, key_text)
        s.cursor_moved(doc)
        await asyncio.sleep(args.debounce_ms / 1e3)
        pending = s.ask(doc, t_key)
        return pending

    while p < len(typed):
        if time.perf_counter() > deadline:
            out["truncated"] = True
            break
        await sleep_until(t_next)
        key = key_at(typed, p)
        off = base + p
        assert doc.cursor == off, (doc.cursor, off)
        a = await press(key, off, off)
        keys += 1
        t_key = a.t_key
        p += len(key)
        t_next = t_key + args.ms_per_key / 1e3 * gaps.uniform(80 / 110, 140 / 110)
        kind = None
        if key.startswith("\n") and p < len(typed) and typed[p] != "\n":
            kind = "line"
        elif len(key) == 1 and p - 1 in words:
            kind = "word"
        if kind is None:
            continue
        # -- a pause -----------------------------------------------------------------------------
        pause = Pause(trace.name, kind, file_line(), t_key - t_typing0)
        pauses.append(pause)
        end_at = t_key + (args.line_pause_s if kind == "line" else args.word_pause_s)
        horizon = None  # when the suggestion of this pause's request stopped being shown (a Tab)
        cpu = asyncio.create_task(cpu_window(t_key)) if kind == "line" else None
        if await wait_text(a, end_at):
            pause.text_ms = ms(a.t_first, t_key)
            pause.cached = a.cached
        if pause.text_ms is not None:
            await asyncio.sleep(args.read_s)  # the person reads the suggestion
        if a.t_vscode is not None:  # Tab only for what the extension shows (a delta before the answer isn't)
            shown = a.current
            pause.text_chars = len(shown)
            if shown.strip():
                ov = suffix_overlap
                line_prefix = doc.text[doc.text.rfind("\n", 0, doc.cursor) + 1 : doc.cursor]
                after = ov.text_after(doc.text.encode("utf-8"), len(doc.text[: doc.cursor].encode("utf-8")))
                pause.retypes_suffix = ov.suffix_overlap_cut(shown, line_prefix, after) is not None
                pause.repeats_suffix_line = ov.repeats_a_suffix_line(shown, line_prefix, after)
            matched = (
                bool(shown.strip())
                and typed.startswith(shown, p)
                and a.replace_end in (None, doc.position(doc.cursor))
                and a.replace_start in (None, doc.position(doc.cursor))
            )
            forced = False
            if not matched and kind == "line" and shown.strip() and args.accept_every > 0:
                line_pauses_with_text += 1
                forced = line_pauses_with_text % args.accept_every == 0
            if matched or forced:
                at = doc.offset(a.replace_start) if a.replace_start else doc.cursor  # a dedent: the line's start
                rend = doc.offset(a.replace_end) if a.replace_end else doc.cursor
                replaced = doc.text[at:rend]
                if cpu is not None:
                    cpu.cancel()
                horizon = time.perf_counter()
                b = await press(shown, at, rend)  # Tab: the suggestion goes into the document
                cpu = asyncio.create_task(cpu_window(b.t_key))
                got = await wait_text(b, b.t_key + args.after_tab_wait_s)
                pause.accept = "matched" if matched else "undone"
                if got:
                    pause.after_tab_request_ms = ms(b.t_first, b.t_sent)
                    pause.after_tab_key_ms = ms(b.t_first, b.t_key)
                    pause.after_tab_cached = b.cached
                if matched:
                    p += len(shown)
                else:
                    if got:
                        await asyncio.sleep(args.read_s)
                    s.cancel(pending)  # Ctrl+Z: the line goes back to what it was
                    t_undo = time.perf_counter()
                    doc.edit(s.rpc, at, at + len(shown), replaced)
                    s.cursor_moved(doc)
                    pending = None
                    cpu.cancel()
                    cpu = asyncio.create_task(cpu_window(t_undo))
        if cpu is not None:
            pause.cpu_pct = await cpu
            end_at = max(end_at, time.perf_counter())
        await sleep_until(end_at)
        t_next = time.perf_counter()
        horizon = horizon or t_next
        if a.t_vscode is not None and a.t_vscode <= horizon:
            pause.vscode_ms = ms(a.t_vscode, t_key)
        if a.t_response is not None and a.t_response <= horizon:
            pause.response_ms, pause.response_chars = ms(a.t_response, t_key), a.response_chars
        pause.finish = a.finish
        pause.stream = [[round((t - t_key) * 1e3, 1), what, n, fin] for t, what, n, fin in a.events if t <= horizon]
    # the person stops at the end of the span: the server should go quiet
    end = Pause(trace.name, "end", file_line(), time.perf_counter() - t_typing0)
    last = pending.t_key if pending is not None else time.perf_counter()
    if pending is not None and await wait_text(pending, last + CPU_DELAY_S):
        end.text_ms = ms(pending.t_first, last)
    end.cpu_pct = await cpu_window(last)
    pauses.append(end)
    s.cancel(pending)
    out["files"].append(
        {
            "file": trace.name,
            "first_line": trace.first_line,
            "span_lines": trace.lines,
            "chars": len(typed),
            "typed_to": p,
            "keys": keys,
        }
    )


# -- the run ------------------------------------------------------------------------------------
def default_model() -> str:
    """The model a server started with nothing pinned loads (engine/model_info.py: no torch)."""
    saved = os.environ.pop("FIMBLE_DEFAULT_MODEL", None)
    try:
        target = default_target()
    finally:
        if saved is not None:
            os.environ["FIMBLE_DEFAULT_MODEL"] = saved
    return str(target.relative_to(REPO)) if target.is_relative_to(REPO) else str(target)


def server_env(model: str) -> tuple[dict, str]:
    env = dict(os.environ)
    env.pop("FIMBLE_MODEL", None)
    if model == "default":  # what a user gets: engine/model_info.py default_target(), nothing pinned
        env.pop("FIMBLE_DEFAULT_MODEL", None)
        return env, default_model()
    if model == "embedded":
        env["FIMBLE_DEFAULT_MODEL"] = "embedded"
        return env, "models/fimble-target (embedded)"
    env["FIMBLE_MODEL"] = str(Path(model).expanduser().resolve())
    return env, model


async def _run_session(
    rpc: Any,
    s: Session,
    proc: Any,
    traces: list[Trace],
    args: argparse.Namespace,
    out: dict,
    t_start: float,
    deadline: float,
    tree: dict[int, int],
) -> None:
    """initialize, the cold wait, the typing of every file, the server's stats, shutdown."""
    root = Path(args.root).resolve() if args.root else None  # a folder open in the editor: its workspace
    init = await rpc.call(
        "initialize",
        {
            "processId": os.getpid(),
            "rootUri": root.as_uri() if root else None,
            "workspaceFolders": [{"uri": root.as_uri(), "name": root.name}] if root else None,
            "clientInfo": {"name": "Visual Studio Code"},
            "capabilities": {
                "general": {"positionEncodings": ["utf-16"]},
                "window": {"showMessage": {}},
                "textDocument": {
                    "inlineCompletion": {"dynamicRegistration": True},
                    "synchronization": {"dynamicRegistration": True},
                },
                "experimental": {"fimble": {"completionDelta": True, "status": True, "replaceStart": True}},
            },
            "initializationOptions": {
                **VSCODE_SETTINGS,
                "crossFileContext": not args.no_context,
                **setting_overrides(args.setting),
            },
        },
        timeout=60,
    )
    out["t_initialize_s"] = time.perf_counter() - t_start
    out["server_languages"] = (((init or {}).get("capabilities") or {}).get("experimental") or {}).get("fimble")
    rpc.notify("initialized", {})
    docs = []
    for i, tr in enumerate(traces):
        # With a workspace folder, the file's own URI (imports resolve beside it, as in the editor); else a
        # made-up one, so nothing on disk is read
        uri = Path(tr.path).as_uri() if args.root and tr.path else f"file:///bench/typing/{i}/{tr.name}"
        docs.append(Doc(uri, tr.before + tr.after, len(tr.before)))
    # -- cold: the first request as soon as initialize returns, again until text comes -----
    d0 = docs[0]
    rpc.notify(
        "textDocument/didOpen", {"textDocument": {"uri": d0.uri, "languageId": "python", "version": 1, "text": d0.text}}
    )
    s.cursor_moved(d0)
    cold_until = min(deadline, time.perf_counter() + args.cold_timeout)
    cold_asks, empty_answers = 0, 0
    cold: Ask | None = None
    first_answer: float | None = None
    while time.perf_counter() < cold_until and cold_asks < 1000:
        cold = s.ask(d0, time.perf_counter())
        cold_asks += 1
        while time.perf_counter() < cold_until and cold.t_first is None:
            if cold.t_response is not None and (cold.finish is not None or time.perf_counter() - cold.t_response > 2.0):
                break  # answered empty and its stream is over: ask again
            await wait_text(cold, min(cold_until, time.perf_counter() + 0.1))
        if cold.t_response is not None and first_answer is None:
            first_answer = cold.t_response
        if cold.t_first is not None:
            break
        empty_answers += cold.t_response is not None
        if empty_answers >= 5 and any(st.get("state") == "ready" for _, st in s.statuses):
            break  # the model has nothing to say here: the cold wait is "no text" (see cold_first_answer_s)
        await asyncio.sleep(0.2)
    out["cold_requests"] = cold_asks
    out["cold_first_answer_s"] = None if first_answer is None else first_answer - t_start
    out["cold_wait_s"] = None if cold is None or cold.t_first is None else cold.t_first - t_start
    out["cold_first_request_sent_s"] = None if cold is None else cold.t_sent - t_start
    ready = [t for t, st in s.statuses if st.get("state") == "ready"]
    out["engine_ready_s"] = ready[0] - t_start if ready else None
    models = [st.get("model") for _, st in s.statuses if st.get("model")]
    out["server_model"] = models[-1] if models else None
    cpu_cold, seen = tree_cpu(proc.pid)
    tree.update(seen)
    out["cpu_cold_s"] = cpu_cold
    if cold is not None:
        s.cancel(cold)
    # -- typing --------------------------------------------------------------------------
    await asyncio.sleep(args.read_s)
    t_typing0 = time.perf_counter()
    cpu0 = tree_cpu(proc.pid)[0]
    for i, (tr, doc) in enumerate(zip(traces, docs, strict=True)):
        if time.perf_counter() > deadline:
            out["truncated"] = True
            break
        if i > 0:
            rpc.notify(
                "textDocument/didOpen",
                {"textDocument": {"uri": doc.uri, "languageId": "python", "version": 1, "text": doc.text}},
            )
            s.cursor_moved(doc)  # the person clicks where they will type
            await asyncio.sleep(args.settle_s)
        await type_file(s, doc, tr, proc.pid, t_typing0, out, deadline)
    t_typing1 = time.perf_counter()
    cpu1, seen = tree_cpu(proc.pid)
    tree.update(seen)
    out["typing_s"] = t_typing1 - t_typing0
    out["cpu_typing_s"] = cpu1 - cpu0
    out["threads"] = {str(k): v for k, v in thread_counts(seen).items()}
    out["server_stats"] = await rpc.call("fimble/stats", None, timeout=30)
    out["wall_s"] = time.perf_counter() - t_start
    out["cpu_total_s"] = cpu1
    out["cursor_notifications"] = s.cursor_sent
    out["messages"] = [(round(t - t_start, 2), k, m) for t, k, m in s.messages]
    out["requests"] = len(s.asks)
    for d in docs:
        rpc.notify("textDocument/didClose", {"textDocument": {"uri": d.uri}})
    await rpc.call("shutdown", None, timeout=15)
    rpc.notify("exit", None)


async def run(args: argparse.Namespace) -> dict:
    env, model_label = server_env(args.model)
    files = [Path(f) if Path(f).is_file() else STDLIB / f for f in args.files]
    traces = [build_trace(f, args.chars) for f in files]
    out: dict = {
        "model": model_label,
        "pauses": [],
        "files": [],
        "truncated": False,
        "load_avg_start": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    log = tempfile.NamedTemporaryFile(prefix="fimble-typing-", suffix=".log", delete=False)
    out["server_log"] = log.name
    t_start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lsp_server",
        "lsp",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
        env=env,
        cwd=str(REPO),
        limit=1 << 24,
    )
    rpc = RpcClient(proc)
    s = Session(rpc, args)
    tree: dict[int, int] = {}  # the server's processes seen, {pid: start time}
    deadline = t_start + args.max_seconds
    try:
        await _run_session(rpc, s, proc, traces, args, out, t_start, deadline, tree)
    except BaseException:
        print(f"bench.lsp_typing: the server's log: {log.name}", file=sys.stderr)
        raise
    finally:
        if proc.returncode is None:
            tree.update(tree_cpu(proc.pid)[1])
        tree.setdefault(proc.pid, start_time(proc.pid) or 0)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            pass
        out["killed_at_end"] = kill_tree(tree)  # the server and the engine it started, if still alive
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            pass
        log.close()
        out["load_avg_end"] = os.getloadavg()
    if out.get("killed_at_end") == 0:
        os.unlink(log.name)  # a clean run: the server's log says nothing the results don't
    return out


# -- the report ---------------------------------------------------------------------------------
def spread(values: list[float | None], within: tuple[float, ...] = (300.0, 1000.0)) -> dict:
    v = [math.inf if x is None else x for x in values]
    row: dict = {"n": len(v), "p50": percentile(v, 0.5), "p90": percentile(v, 0.9)}
    for w in within:
        row[f"within_{int(w)}ms"] = sum(x <= w for x in v) / len(v) if v else None
    return row


def summarize(out: dict) -> dict:
    pauses = [Pause(**p) if isinstance(p, dict) else p for p in out["pauses"]]
    line = [p for p in pauses if p.kind == "line"]
    word = [p for p in pauses if p.kind == "word"]
    both = line + word
    tabs = [p for p in pauses if p.accept]
    windows = [p.cpu_pct for p in pauses if p.cpu_pct is not None]
    stats = out.get("server_stats") or {}
    eng = stats.get("engine") or {}
    restart_msgs = [m for _, _, m in out.get("messages", []) if "restarting" in m]
    typing_s = out.get("typing_s") or 0.0
    cpu_typing = out.get("cpu_typing_s") or 0.0
    tab_req = [p.after_tab_request_ms for p in tabs]
    tab_key = [p.after_tab_key_ms for p in tabs]
    return {
        "line_pauses": spread([p.text_ms for p in line]),
        "word_pauses": spread([p.text_ms for p in word]),
        "all_pauses": spread([p.text_ms for p in both]),
        "all_pauses_vscode": spread([p.vscode_ms for p in both]),
        "line_pauses_vscode": spread([p.vscode_ms for p in line]),
        "pauses_without_text": sum(p.text_ms is None for p in both),
        # of those: answered with nothing (the model's end, or validation cut it all) / no answer before typing on
        "pauses_answered_empty": sum(p.text_ms is None and p.response_ms is not None for p in both),
        # text came (a delta) but the extension never showed it: the final text was cut to nothing, or late
        "pauses_text_not_shown": sum(p.text_ms is not None and p.vscode_ms is None for p in both),
        "pauses_served_from_cache": sum(bool(p.cached) for p in both),
        # of the pauses whose text the extension showed: those re-typing the text after the cursor
        "pauses_shown": sum(p.retypes_suffix is not None for p in both),
        "shown_retyping_suffix": sum(bool(p.retypes_suffix) for p in both),
        "shown_repeating_suffix_line": sum(bool(p.repeats_suffix_line) for p in both),
        "after_tab_request": spread(tab_req, (AFTER_TAB_TARGET_MS, 300.0)),
        "after_tab_key": spread(tab_key, (AFTER_TAB_TARGET_MS, 300.0)),
        "accepts_matched": sum(p.accept == "matched" for p in tabs),
        "accepts_undone": sum(p.accept == "undone" for p in tabs),
        "after_tab_cached": sum(bool(p.after_tab_cached) for p in tabs),
        "cpu_windows": len(windows),
        "cpu_quiet_share": sum(w < CPU_TARGET_PCT for w in windows) / len(windows) if windows else None,
        "cpu_window_p50_pct": percentile(windows, 0.5),
        "cpu_window_max_pct": max(windows) if windows else None,
        "cpu_s_per_s_typing": cpu_typing / typing_s if typing_s else None,
        "cpu_s_per_min_typing": cpu_typing / typing_s * 60 if typing_s else None,
        "cpu_s_per_s_run": (out.get("cpu_total_s") or 0.0) / out["wall_s"] if out.get("wall_s") else None,
        "cold_wait_s": out.get("cold_wait_s"),
        "engine_restarts": eng.get("restarts"),
        "supervision": eng.get("supervision"),
        "restart_messages": len(restart_msgs),
        # cross-file context: engine requests whose prompt had other files' chunks at its head
        "engine_submitted": (eng.get("counters") or {}).get("submitted"),
        "context_prompts": (eng.get("counters") or {}).get("context_prompts", 0),
        "context_tokens": (eng.get("counters") or {}).get("context_tokens", 0),
    }


def fmt_share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def num(v: float | None, digits: int = 1) -> str:
    if v is None:
        return "-"
    return "inf" if math.isinf(v) else f"{v:.{digits}f}"


def print_report(out: dict, s: dict, args: argparse.Namespace, commit: str) -> None:
    la0, la1 = out["load_avg_start"], out["load_avg_end"]
    threads = "+".join(str(v) for v in out.get("threads", {}).values()) or "-"
    print(
        f"bench.lsp_typing, commit {commit}: model {out['model']} (the server reports {out.get('server_model')}), "
        f"{len(out['files'])} file(s){' (TRUNCATED by --max-seconds)' if out['truncated'] else ''}"
    )
    print(
        f"engine threads {VSCODE_SETTINGS['engineThreads']} (engineThreads, the VS Code default); server process "
        f"tree: {len(out.get('threads', {}))} processes, {threads} OS threads; {out['cpus']} CPU cores; load average "
        f"{la0[0]:.2f} {la0[1]:.2f} {la0[2]:.2f} at start, {la1[0]:.2f} {la1[1]:.2f} {la1[2]:.2f} at end"
        + (f"; {args.hogs} CPU hogs (busy loops) running beside it" if getattr(args, "hogs", 0) else "")
        + (f"; settings changed: {', '.join(args.setting)}" if getattr(args, "setting", None) else "")
    )
    print(
        f"typing: {args.ms_per_key:.0f} ms/key (80-140), request {args.debounce_ms:.0f} ms after each key, pauses: "
        f"new line {args.line_pause_s:.1f} s, word end {args.word_pause_s:.1f} s ({args.word_pause_p:.0%} of word "
        f"ends); Tab then undo at every {args.accept_every}. new-line pause with text that the file doesn't go on "
        f"with"
    )
    print(f"{'file':<18}{'lines':>11}{'chars':>7}{'keys':>6}{'line':>6}{'word':>6}{'Tab':>5}{'no text':>9}")
    for f in out["files"]:
        ps = [p for p in out["pauses"] if p["file"] == f["file"]]
        nl = sum(p["kind"] == "line" for p in ps)
        nw = sum(p["kind"] == "word" for p in ps)
        nt = sum(bool(p["accept"]) for p in ps)
        nn = sum(p["kind"] in ("line", "word") and p["text_ms"] is None for p in ps)
        span = f"{f['first_line']}-{f['first_line'] + f['span_lines'] - 1}"
        print(f"{f['file']:<18}{span:>11}{f['chars']:>7}{f['keys']:>6}{nl:>6}{nw:>6}{nt:>5}{nn:>9}")
    print()
    print(f"{'last key -> first visible text (ms)':<46}{'n':>5}{'p50':>9}{'p90':>9}{'<=300ms':>9}{'<=1s':>7}")
    for label, key in (
        ("new-line pauses (after the indentation)", "line_pauses"),
        ("word-end pauses", "word_pauses"),
        ("all pauses", "all_pauses"),
        ("new-line pauses, as the VS Code extension shows", "line_pauses_vscode"),
        ("all pauses, as the VS Code extension shows", "all_pauses_vscode"),
    ):
        r = s[key]
        print(
            f"{label:<46}{r['n']:>5}{num(r['p50']):>9}{num(r['p90']):>9}{fmt_share(r['within_300ms']):>9}"
            f"{fmt_share(r['within_1000ms']):>7}"
        )
    print(f"{'after Tab -> next completion visible (ms)':<46}{'n':>5}{'p50':>9}{'p90':>9}{'<=50ms':>9}{'<=300':>7}")
    for label, key in (
        ("from the request at the new cursor", "after_tab_request"),
        ("from the Tab key (the request's debounce too)", "after_tab_key"),
    ):
        r = s[key]
        print(
            f"{label:<46}{r['n']:>5}{num(r['p50']):>9}{num(r['p90']):>9}{fmt_share(r['within_50ms']):>9}"
            f"{fmt_share(r['within_300ms']):>7}"
        )
    print("(inf: no text before the person typed on; such pauses count as the slowest)")
    print(
        f"pauses without text: {s['pauses_without_text']} of {s['all_pauses']['n']} ({s['pauses_answered_empty']} "
        f"answered empty: the model ended or validation cut it all; the rest unanswered when the person typed on); "
        f"with a delta's text the extension never showed (cut to nothing, or answered late): "
        f"{s['pauses_text_not_shown']}; first text from the type-through cache: {s['pauses_served_from_cache']}"
    )
    print(
        f"shown text re-typing what follows the cursor: {s['shown_retyping_suffix']} of {s['pauses_shown']} "
        f"pauses with shown text (the shaper's rule, lsp_server/shaping/syntax/suffix_overlap.py); "
        f"with a 10+ char line equal "
        f"to one of the next 10 lines: {s['shown_repeating_suffix_line']}"
    )
    print(
        f"Tab: {s['accepts_matched']} accepted (the file goes on so), {s['accepts_undone']} accepted then undone; "
        f"the next completion's first delta said cached: {s['after_tab_cached']}"
    )
    cw, ready = out.get("cold_wait_s"), out.get("engine_ready_s")
    print(
        f"cold wait, server start -> first text: {num(cw)} s (initialize {num(out.get('t_initialize_s'))} s, "
        f"engine ready {num(ready)} s, {out.get('cold_requests', 0)} request(s), bound {args.cold_timeout:.0f} s); "
        f"server CPU until then {num(out.get('cpu_cold_s'))} s"
    )
    print(
        f"server CPU (process tree): {num(s['cpu_s_per_s_typing'], 2)} s/s while typing = "
        f"{num(s['cpu_s_per_min_typing'])} CPU s per minute of typing ({num(out.get('typing_s'), 0)} s typed); "
        f"{num(s['cpu_s_per_s_run'], 2)} s/s over the whole run ({num(out.get('wall_s'), 0)} s)"
    )
    print(
        f"CPU 2-3 s after the last key (new-line pauses, file ends): under {CPU_TARGET_PCT:.0f}% of a core in "
        f"{fmt_share(s['cpu_quiet_share'])} of {s['cpu_windows']} windows (p50 {num(s['cpu_window_p50_pct'])}%, "
        f"max {num(s['cpu_window_max_pct'])}%)"
    )
    print(
        f"engine restarts: {s['engine_restarts']} (supervision {s.get('supervision')}); 'restarting' messages: "
        f"{s['restart_messages']}"
    )
    print(
        f"cross-file context: {s['context_prompts']} of {s['engine_submitted']} engine requests had other files' "
        f"chunks ({s['context_tokens']} context tokens in all)"
    )
    other = list(dict.fromkeys(m for _, _, m in out.get("messages", []) if "restarting" not in m))
    if other:
        print(f"other server messages ({len(other)} distinct): " + " | ".join(m[:120] for m in other[:4]))
    lp, ap, ta = s["line_pauses"], s["all_pauses"], s["after_tab_request"]
    print(
        f"typing {out['model']}: new-line pauses p50 {num(lp['p50'], 0)} / p90 {num(lp['p90'], 0)} ms to ghost "
        f"text; all pauses {fmt_share(ap['within_300ms'])} within 300 ms, {fmt_share(ap['within_1000ms'])} within "
        f"1 s (n={ap['n']}); after Tab {fmt_share(ta['within_50ms'])} within 50 ms of the request (n={ta['n']}); "
        f"CPU < 2% by 2 s in {fmt_share(s['cpu_quiet_share'])}; {num(s['cpu_s_per_min_typing'])} CPU s/typing min; "
        f"cold {num(cw)} s; restarts {s['engine_restarts']}"
    )


def git_commit() -> str:
    """HEAD's short hash, and the files of the server's code (engine/, lsp_server/) that differ from it."""
    try:
        head = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "?"
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "engine", "lsp_server"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "?"
    dirty = [line[3:] for line in dirty if line.strip()]
    return head + (
        f" + uncommitted changes in {', '.join(dirty[:6])}{' ...' if len(dirty) > 6 else ''}" if dirty else ""
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.lsp_typing",
        description="A person typing real files into `fimble lsp` as VS Code drives it.",
    )
    ap.add_argument("--quick", action="store_true", help="one file, fewer pauses (under a minute)")
    ap.add_argument("--json", metavar="PATH", help="write the results (every pause) here")
    ap.add_argument(
        "--model", default="default", help="default (the installed default model), embedded, or a model folder / GGUF"
    )
    ap.add_argument("--files", nargs="+", default=None, help="files to type (default: four stdlib modules)")
    ap.add_argument(
        "--root",
        default=None,
        help="the workspace folder sent in initialize, as VS Code does with a folder open (cross-file "
        "context reads imports inside it; default: none)",
    )
    ap.add_argument("--no-context", action="store_true", help="crossFileContext off (the extension's default is on)")
    ap.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one of the extension's settings (a JSON value, else a string), e.g. earlyAnswerMs=0",
    )
    ap.add_argument("--chars", type=int, default=None, help="characters typed per file (whole lines; default 240)")
    ap.add_argument("--ms-per-key", type=float, default=110.0)
    ap.add_argument("--debounce-ms", type=float, default=50.0, help="the editor's wait before each request")
    ap.add_argument("--line-pause-s", type=float, default=3.0, help="pause after a new line's indentation")
    ap.add_argument("--word-pause-s", type=float, default=1.5)
    ap.add_argument("--word-pause-p", type=float, default=0.12, help="share of word ends with a pause")
    ap.add_argument("--read-s", type=float, default=0.4, help="time to read a suggestion before Tab")
    ap.add_argument(
        "--accept-every",
        type=int,
        default=None,
        help="accept (then undo) the text of every Nth new-line pause that showed text (0: never; "
        "default 2, --quick 1)",
    )
    ap.add_argument("--after-tab-wait-s", type=float, default=1.5)
    ap.add_argument("--settle-s", type=float, default=1.5, help="from opening a file to its first key")
    ap.add_argument("--cold-timeout", type=float, default=None, help="bound on the cold wait (default 180 s)")
    ap.add_argument("--max-seconds", type=float, default=None, help="bound on the whole run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hogs", type=int, default=0, help="CPU hogs (busy loops) beside the server for the whole run")
    args = ap.parse_args(argv)
    if not 0 <= args.hogs <= 64:
        ap.error("--hogs must be 0-64")
    setting_overrides(args.setting)  # a malformed pair fails here, before a server starts
    if args.files is None:
        args.files = DEFAULT_FILES[:1] if args.quick else DEFAULT_FILES
    if args.chars is None:
        args.chars = 110 if args.quick else 240
    if args.cold_timeout is None:
        args.cold_timeout = 20.0 if args.quick else 180.0
    if args.max_seconds is None:
        args.max_seconds = 45.0 if args.quick else 600.0
    if args.accept_every is None:
        args.accept_every = 1 if args.quick else 2
    commit = git_commit()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        out = asyncio.run(run(args))
    except (RuntimeError, OSError, TimeoutError) as exc:
        print(f"bench.lsp_typing: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    out["commit"] = commit
    out["pauses"] = [asdict(p) for p in out["pauses"]]
    s = summarize(out)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "run": out, "args": vars(args)}, indent=1, default=str))
    print_report(out, s, args, commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
