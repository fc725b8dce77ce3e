"""Collectives of a tensor-parallel group: the interface the decoder calls, and its CPU version
over shared memory.

The decoder needs two collectives and nothing else:

    all_reduce(x)   x: [T, D] partial sums on every rank -> their sum, the same on every rank
    all_gather(x)   x: [B, V/N] on every rank -> [B, V] (rank 0's columns first)

ShmCommunicator does them for N processes on one host. The segment holds two phases of N slots:

    buf: [2, N, slot_bytes] uint8     phase p, slot r: rank r's contribution to a collective

A collective writes this rank's part into its slot of the current phase, meets the others at a
barrier, then reads all N slots. With two phases one barrier per collective is enough: a rank
that writes phase p again (two collectives later) has passed the barrier in between, which every
rank reached only after reading phase p. Arrays larger than a slot go through in slot-sized
chunks. Every rank sums the slots in rank order, so all ranks hold bit-identical results.

The barrier: rank r owns a counting semaphore; arriving, a rank releases every other rank's once
and then takes its own N-1 times. A release for the next barrier can only come from a rank that
has passed this one, which it did after all N arrived, so counts never carry a rank through early.
"""
from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Protocol

import numpy as np

from minillm.parallel.errors import DEFAULT_TIMEOUT_S, wait_for


class Communicator(Protocol):
    """What the decoder asks of a tensor-parallel group (CPU: ShmCommunicator; GPU: NCCL)."""

    rank: int
    world_size: int

    def all_reduce(self, x):
        """Sum of x over the ranks, same shape; may reduce x in place and return it."""

    def all_gather(self, x):
        """x: [..., k] from each rank -> [..., N k], rank r's part in columns [r k, (r + 1) k)."""


@dataclass
class ShmGroupHandle:
    """What a rank needs to join the group; passed to workers when they are spawned."""

    shm_name: str
    world_size: int
    slot_bytes: int
    arrivals: list                  # [world_size] semaphores, one per rank


class ShmGroup:
    """Rank 0's side of the segment: creates it and, at close(), removes it."""

    def __init__(self, ctx, world_size: int, slot_bytes: int):
        slot_bytes = max(64, -(-slot_bytes // 64) * 64)
        self.shm = SharedMemory(create=True, size=2 * world_size * slot_bytes)
        self.handle = ShmGroupHandle(self.shm.name, world_size, slot_bytes,
                                     [ctx.Semaphore(0) for _ in range(world_size)])

    def close(self) -> None:
        """Unmap and remove the segment (ranks still attached keep their mapping until they exit),
        and drop the barrier's semaphores (a collective after this is an error)."""
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None
        self.handle.arrivals.clear()     # named in /dev/shm until rank 0's last reference goes


class ShmCommunicator:
    """One rank's end of a ShmGroup: all_reduce and all_gather of NumPy arrays."""

    def __init__(self, handle: ShmGroupHandle, rank: int, check_peers, timeout: float = DEFAULT_TIMEOUT_S):
        self.rank, self.world_size = rank, handle.world_size
        self.slot_bytes = handle.slot_bytes
        self._arrivals = handle.arrivals
        self._check_peers, self._timeout = check_peers, timeout
        self._shm = SharedMemory(name=handle.shm_name)
        # buf: [2, N, slot_bytes] uint8
        self._buf = np.ndarray((2, self.world_size, self.slot_bytes), np.uint8, buffer=self._shm.buf)
        self._phase = 0

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """Sum of x over the ranks (in rank order, so every rank gets the same bits)."""
        flat = np.ascontiguousarray(x).reshape(-1)
        out = np.empty_like(flat)
        for start, slots in self._chunks(flat):
            acc = out[start:start + len(slots[0])]
            np.copyto(acc, slots[0])
            for part in slots[1:]:
                acc += part
        return out.reshape(x.shape)

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        """x: [..., k] -> [..., N k], rank r's x in columns [r k, (r + 1) k)."""
        flat = np.ascontiguousarray(x).reshape(-1)
        parts = np.empty((self.world_size, flat.size), flat.dtype)      # [N, x.size]
        for start, slots in self._chunks(flat):
            for r, part in enumerate(slots):
                parts[r, start:start + len(part)] = part
        return np.concatenate([p.reshape(x.shape) for p in parts], axis=-1)

    def _chunks(self, flat: np.ndarray):
        """Exchange flat in slot-sized chunks: yields (offset, the N ranks' chunks) per chunk."""
        step = self.slot_bytes // flat.itemsize
        for start in range(0, flat.size, step):
            chunk = flat[start:start + step]
            mine = self._buf[self._phase, self.rank, :chunk.nbytes].view(flat.dtype)
            mine[:] = chunk
            self._barrier()
            yield start, [self._buf[self._phase, r, :chunk.nbytes].view(flat.dtype)
                          for r in range(self.world_size)]
            self._phase ^= 1

    def _barrier(self) -> None:
        # No semaphore is held in a local: the traceback of a failed wait keeps this frame, and
        # a semaphore it held would keep its name in /dev/shm after the group is closed.
        arrivals, rank = self._arrivals, self.rank
        for r in range(self.world_size):
            if r != rank:
                arrivals[r].release()
        for _ in range(self.world_size - 1):
            wait_for(lambda t: arrivals[rank].acquire(timeout=t), f"the other ranks at a collective (rank {rank})",
                     self._check_peers, self._timeout)

    def close(self) -> None:
        """Unmap the segment from this process."""
        if self._shm is not None:
            self._buf = None
            self._shm.close()
            self._shm = None
