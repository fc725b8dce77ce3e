"""Rank 0 -> workers: one call at a time through a shared-memory segment.

    buf: [8-byte little-endian length | pickled (method, args)]

Rank 0 writes a call and releases each worker's `ready` semaphore; a worker takes its `ready`,
unpickles the call (copying what it needs out of the segment) and releases `ack`. Before writing
the next call rank 0 takes N-1 acks, so a call is never overwritten before every worker has read
it. A call larger than the segment first moves everybody to a larger one (the "_attach" call).
Replies (results of start-up calls, and errors) come back on one pipe per worker.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

from minillm.parallel.errors import DEFAULT_TIMEOUT_S, wait_for

HEADER = 8
INITIAL_BYTES = 1 << 20
ATTACH = "_attach"


@dataclass
class ChannelHandle:
    """What a worker needs to read calls; passed to workers when they are spawned."""

    shm_name: str
    ready: list                     # [N - 1] semaphores, one per worker (rank r uses ready[r - 1])
    ack: object                     # one semaphore, released once per worker per call


class ChannelWriter:
    """Rank 0's end: send(method, *args) to every worker."""

    def __init__(self, ctx, num_workers: int, check_peers, timeout: float = DEFAULT_TIMEOUT_S,
                 capacity: int | None = None):
        self._shm = SharedMemory(create=True, size=capacity or INITIAL_BYTES)
        self.handle = ChannelHandle(self._shm.name, [ctx.Semaphore(0) for _ in range(num_workers)],
                                    ctx.Semaphore(0))
        self._check_peers, self._timeout = check_peers, timeout
        self._unread = False         # the last call may not have been read by every worker yet

    def send(self, method: str, *args) -> None:
        """Write a call for every worker and wake them; returns once it is written, not run."""
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        if HEADER + len(payload) > self._shm.size:
            self._grow(HEADER + len(payload))
        self._wait_read()
        self._shm.buf[:HEADER] = len(payload).to_bytes(HEADER, "little")
        self._shm.buf[HEADER:HEADER + len(payload)] = payload
        for ready in self.handle.ready:
            ready.release()
        self._unread = True

    def _wait_read(self) -> None:
        if not self._unread:
            return
        for _ in self.handle.ready:
            wait_for(lambda t: self.handle.ack.acquire(timeout=t), "the workers to read the last call",
                     self._check_peers, self._timeout)
        self._unread = False

    def _grow(self, size: int) -> None:
        """Move every worker to a segment of at least `size` bytes."""
        bigger = SharedMemory(create=True, size=max(size, 2 * self._shm.size))
        self.send(ATTACH, bigger.name)
        self._wait_read()            # each worker has attached to `bigger` before it acked
        self._shm.close()
        self._shm.unlink()
        self._shm = bigger
        self.handle.shm_name = bigger.name

    @property
    def capacity(self) -> int:
        """Bytes the segment holds."""
        return self._shm.size

    def close(self) -> None:
        """Unmap and remove the segment, and drop the semaphores (the workers have stopped)."""
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None
        # A spawn-context semaphore is named in /dev/shm until its last reference in this process
        # goes: the handle's are the only ones, so dropping them removes the names now, not when
        # the engine is garbage collected.
        self.handle.ready.clear()
        self.handle.ack = None


class ChannelReader:
    """A worker's end: recv() blocks until rank 0 sends a call (for as long as rank 0 lives)."""

    def __init__(self, handle: ChannelHandle, rank: int, check_parent):
        self._shm = SharedMemory(name=handle.shm_name)
        self._ready, self._ack = handle.ready[rank - 1], handle.ack
        self._check_parent = check_parent

    def recv(self) -> tuple[str, tuple]:
        """The next call as (method, args)."""
        while True:
            # No time limit: an idle engine sends nothing for as long as it likes.
            wait_for(lambda t: self._ready.acquire(timeout=t), "the next call", self._check_parent, None)
            size = int.from_bytes(self._shm.buf[:HEADER], "little")
            method, args = pickle.loads(self._shm.buf[HEADER:HEADER + size])
            if method == ATTACH:
                self._shm.close()
                self._shm = SharedMemory(name=args[0])
            self._ack.release()
            if method != ATTACH:
                return method, args

    def close(self) -> None:
        """Unmap the segment."""
        self._shm.close()
