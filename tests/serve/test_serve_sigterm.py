"""`fimble serve` stops on SIGTERM whatever its decode loop holds when the signal lands (engine/serve/daemon.py,
run_daemon). The loop waits in queue.Queue.get (or threading.Event.wait), which holds a non-reentrant lock around
its wait; the handler runs in that same thread between two bytecodes. A handler that took the lock itself (close()
putting on the queue) waited for itself forever: seen once in the suite as a `fimble serve` that ignored SIGTERM.

Here the race is made certain: a stand-in engine sends itself SIGTERM while holding the lock its close() takes,
in a real `run_daemon` (real listeners, in a child process: only a main thread gets signals). Before the fix the
child hangs (the test's wait gives up); after it, close() runs in another thread once the lock is free.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import os, signal, threading
from engine.serve.daemon import ServeOptions, run_daemon

class LockedEngine:
    def __init__(self):
        self.lock = threading.Lock()  # what queue.Queue's mutex is to the real loop
        self.closed = threading.Event()
        self.signalled_with_lock_held = False

    def info(self):
        return {"model": "stand-in"}

    def serve_forever(self):
        with self.lock:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs now, in this thread, the lock held
            for _ in range(1000):  # bytecodes for the handler to run between
                pass
            self.signalled_with_lock_held = True
        self.closed.wait(30)
        if not self.closed.is_set():
            raise SystemExit(3)

    def close(self):
        with self.lock:
            self.closed.set()

engine = LockedEngine()
code = run_daemon(engine, ServeOptions(host="127.0.0.1", port=0), announce=lambda line: None)
print("stopped", code, engine.signalled_with_lock_held, engine.closed.is_set(), flush=True)
"""


def test_sigterm_while_the_loop_holds_its_lock_stops_the_daemon():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["stopped", "0", "True", "True"]
