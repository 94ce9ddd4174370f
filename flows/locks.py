"""Cache-key locks that survive a killed run.

Cached tasks run with Prefect's serialisable isolation: the run computing a cache key holds a
lock file on it, and a concurrent run waits and then reads the result instead of computing it
again. Prefect's ``FileSystemLockManager`` writes a lock without an expiry, so a run killed while
holding one (SIGKILL, power loss) would leave every later run waiting forever. This manager
records the holder's host and process id in the lock file and treats a lock whose process on
this host is gone as stale (removed, then acquired). Locks held on other hosts of a cluster are
never judged stale. Lock files are written in full under a temporary name and hard-linked into
place, so a reader never sees half of one.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
from pathlib import Path

from prefect.locking.filesystem import FileSystemLockManager


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class ProcessLockManager(FileSystemLockManager):
    """``FileSystemLockManager`` whose locks name their process (see the module docstring)."""

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        info = self._get_lock_info(key, use_cache=use_cache)
        if info is not None and info.get("host") == socket.gethostname() and not process_alive(info.get("pid", -1)):
            Path(info["path"]).unlink(missing_ok=True)  # its holder was killed
            self._locks.pop(key, None)
            return False
        return super().is_locked(key, use_cache=use_cache)

    def acquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                     hold_timeout: float | None = None) -> bool:
        self._ensure_lock_files_directory_exists()
        path = Path(self._lock_path_for_key(key))
        while True:
            if self.is_locked(key) and not self.is_lock_holder(key, holder):
                if not self.wait_for_lock(key, acquire_timeout):
                    return False
            expiration = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=hold_timeout)
                          if hold_timeout is not None else None)
            info = {"holder": holder, "expiration": expiration.isoformat() if expiration else None,
                    "host": socket.gethostname(), "pid": os.getpid()}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")
            with os.fdopen(fd, "w") as f:
                json.dump(info, f)
            try:
                os.link(tmp, path)  # atomic: fails when another holder got there first
            except FileExistsError:
                if self.is_lock_holder(key, holder):
                    return True
                continue
            finally:
                os.unlink(tmp)
            self._locks[key] = {"holder": holder, "expiration": expiration, "path": path}
            return True


def locked(policy, directory: Path):
    """``policy`` with serialisable isolation and :class:`ProcessLockManager` locks in ``directory``."""
    return policy.configure(isolation_level="SERIALIZABLE", lock_manager=ProcessLockManager(lock_files_directory=directory))
