"""A dict of arrays handed to another process through one shared-memory segment (a weight shard)."""
from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import numpy as np

ALIGN = 64


@dataclass
class SharedArraysHandle:
    """Where each array lies in the segment: name -> (dtype string, shape, byte offset)."""

    shm_name: str
    layout: dict[str, tuple[str, tuple[int, ...], int]]


def share_arrays(arrays: dict[str, np.ndarray]) -> tuple[SharedMemory, SharedArraysHandle]:
    """Copy arrays into a new segment; the caller unlinks it once the reader has read it."""
    layout, offset = {}, 0
    for name, a in arrays.items():
        layout[name] = (a.dtype.str, tuple(a.shape), offset)
        offset += -(-a.nbytes // ALIGN) * ALIGN
    shm = SharedMemory(create=True, size=max(offset, 1))
    for name, a in arrays.items():
        _view(shm, *layout[name])[...] = a
    return shm, SharedArraysHandle(shm.name, layout)


def read_shared_arrays(handle: SharedArraysHandle) -> dict[str, np.ndarray]:
    """Owned copies of the arrays in a segment (the segment is unmapped before returning)."""
    shm = SharedMemory(name=handle.shm_name)
    try:
        return {name: _view(shm, *where).copy() for name, where in handle.layout.items()}
    finally:
        shm.close()


def _view(shm: SharedMemory, dtype: str, shape: tuple[int, ...], offset: int) -> np.ndarray:
    return np.ndarray(shape, np.dtype(dtype), buffer=shm.buf, offset=offset)
