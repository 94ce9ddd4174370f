"""Cache-key locks: atomic, exclusive between threads and processes, stale once their process died."""

import json
import subprocess
import sys
import threading
from pathlib import Path

from flows.locks import ProcessLockManager, process_alive


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_acquire_release_and_reentry(tmp_path):
    m = ProcessLockManager(tmp_path)
    assert m.acquire_lock("k", "a") and m.is_locked("k") and m.is_lock_holder("k", "a")
    assert m.acquire_lock("k", "a")  # the holder again
    assert not m.acquire_lock("k", "b", acquire_timeout=0.3)  # another holder times out
    info = json.loads((tmp_path / "k.lock").read_text())
    assert info["holder"] == "a" and info["pid"] > 0 and info["host"]
    m.release_lock("k", "a")
    assert not m.is_locked("k") and m.acquire_lock("k", "b")
    assert not list(tmp_path.glob("*.partial"))


def test_lock_of_a_dead_process_is_stale(tmp_path):
    import socket

    pid = _dead_pid()
    assert not process_alive(pid)
    (tmp_path / "k.lock").write_text(json.dumps({"holder": "x", "expiration": None, "host": socket.gethostname(),
                                                 "pid": pid}))
    m = ProcessLockManager(tmp_path)
    assert not m.is_locked("k") and not (tmp_path / "k.lock").exists()
    assert m.acquire_lock("k", "y", acquire_timeout=1) and m.is_lock_holder("k", "y")
    # a live process's lock, or one on another host, is respected
    for host, owner in ((socket.gethostname(), 1), ("other-host", pid)):
        (tmp_path / "j.lock").write_text(json.dumps({"holder": "x", "expiration": None, "host": host, "pid": owner}))
        assert m.is_locked("j") and not m.acquire_lock("j", "y", acquire_timeout=0.3)
        (tmp_path / "j.lock").unlink()


def test_lock_waiter_gets_it_after_release(tmp_path):
    m = ProcessLockManager(tmp_path)
    assert m.acquire_lock("k", "a")
    waiting, wait_for_lock = threading.Event(), m.wait_for_lock

    def wait(key, timeout=None):  # the waiter found the lock taken and waits on it
        waiting.set()
        return wait_for_lock(key, timeout)

    m.wait_for_lock = wait
    got = []
    waiter = threading.Thread(target=lambda: got.append(m.acquire_lock("k", "b", acquire_timeout=60)))
    waiter.start()
    assert waiting.wait(60)
    assert not got and m.is_lock_holder("k", "a")  # still held by a: the waiter has nothing yet
    m.release_lock("k", "a")
    waiter.join(60)
    assert got == [True] and m.is_lock_holder("k", "b")


def test_lock_exclusive_between_processes(tmp_path):
    """Eight processes each take the lock, append to a shared file twice with a pause, release:
    no two appends of different processes interleave."""
    script = f"""
import os, sys, time
from pathlib import Path
from flows.locks import ProcessLockManager
m = ProcessLockManager(Path({str(tmp_path)!r}))
h = str(os.getpid())
assert m.acquire_lock("k", h, acquire_timeout=60)
with open({str(tmp_path / "log")!r}, "a") as f:
    f.write(h + "\\n"); f.flush(); time.sleep(0.05); f.write(h + "\\n")
m.release_lock("k", h)
"""
    root = Path(__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=root) for _ in range(8)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    lines = (tmp_path / "log").read_text().split()
    assert len(lines) == 16 and all(lines[i] == lines[i + 1] for i in range(0, 16, 2))
