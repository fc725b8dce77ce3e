"""The Prometheus multiprocess directory of several API servers, removed by the last process to leave.

The supervising `minillm serve` makes it and each API server joins it: a shared lock on its lock
file, held while the process may write there. Leaving lets go of that lock and then asks for the
lock alone: whoever gets it (the supervisor after its servers, or the last API server out when the
supervisor was killed outright) is the last and removes the directory. Whatever the order, the
process that lets go last gets the lock, unless another's try holds it then, and that one removes it.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from dataclasses import dataclass

LOCK_NAME = "members.lock"      # prometheus_client reads only its *.db files


@dataclass
class MetricsDir:
    """A process's membership of the directory: its path and the lock file held open."""

    path: str
    lock_fd: int | None         # None: left already, or the directory was gone when joining

    def leave(self) -> bool:
        """Let go; remove the directory when no other process is in it; True if removed."""
        if self.lock_fd is None:
            return False
        fd, self.lock_fd = self.lock_fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            shutil.rmtree(self.path, ignore_errors=True)
            return True
        finally:
            os.close(fd)


def make_metrics_dir() -> MetricsDir:
    """A new minillm-metrics-* directory in the temporary directory, joined."""
    return join_metrics_dir(tempfile.mkdtemp(prefix="minillm-metrics-"))


def join_metrics_dir(path: str) -> MetricsDir:
    """Membership of the directory at path (none when it is gone: every other process has left)."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return MetricsDir(path, None)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return MetricsDir(path, fd)
