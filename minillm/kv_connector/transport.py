"""Where a producer's KV pool can be read from another process, and the shared memory it lives in.

Two transports, chosen by kv_buffer_device (the device object allocates, exports and imports):

    shm        the CPU backend: the KV pool itself is a file in /dev/shm mapped by both engines;
               the consumer copies the leased blocks straight out of it (no copy on the producer)
    cuda_ipc   both engines on one GPU: the pool is one plain cudaMalloc whose IPC handle the
               consumer opens; it copies the blocks device to device on its compute stream

A KVRegion describes either as plain data (it travels in msgpack between the engines).
"""
from __future__ import annotations

import mmap
import os
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
SEGMENT_PREFIX = "minillm-kv-"
SHM_DIR_ENV = "MINILLM_KV_SHM_DIR"     # another directory for the segments (both engines must agree)
REGION_KINDS = ("shm", "cuda_ipc")


@dataclass(frozen=True)
class KVRegion:
    """A KV pool another process can map: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""

    kind: str                    # "shm" | "cuda_ipc"
    handle: str | bytes          # shm: the segment's path; cuda_ipc: the 64-byte cudaIpcMemHandle
    shape: tuple[int, ...]
    dtype: str                   # the engine's dtype name: "float32", "bfloat16", ...
    device: str = ""             # cuda_ipc: the GPU's PCI bus id
    model: str = ""              # the fingerprint of the weights whose KV it holds (fingerprint.py)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.shape[2]

    def to_dict(self) -> dict:
        """Plain data for a message."""
        return {"kind": self.kind, "handle": self.handle, "shape": list(self.shape), "dtype": self.dtype,
                "device": self.device, "model": self.model}

    @classmethod
    def from_dict(cls, data) -> "KVRegion":
        """From to_dict()'s form; ValueError when it is not one."""
        if not isinstance(data, dict):
            raise ValueError("the KV region must be an object")
        kind, handle, shape = data.get("kind"), data.get("handle"), data.get("shape")
        if kind not in REGION_KINDS:
            raise ValueError(f"the KV region's kind must be one of {', '.join(REGION_KINDS)}, got {kind!r}")
        if not isinstance(handle, (str, bytes)) or not handle:
            raise ValueError("the KV region has no handle")
        if (not isinstance(shape, (list, tuple)) or len(shape) != 6
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape)):
            raise ValueError(f"the KV region's shape must be 6 positive integers, got {shape!r}")
        dtype, device, model = data.get("dtype"), data.get("device", ""), data.get("model", "")
        if not all(isinstance(v, str) for v in (dtype, device, model)):
            raise ValueError("the KV region's dtype, device and model must be strings")
        return cls(kind, handle, tuple(shape), dtype, device, model)

    def check_compatible(self, shape: tuple[int, ...], dtype: str, model: str = "") -> None:
        """ValueError unless blocks of this region fit a pool of `shape` and `dtype` one for one, and
        hold the KV of the weights with fingerprint `model` (where both regions name theirs)."""
        mine = (self.shape[:2], self.shape[3:], self.dtype)
        theirs = (tuple(shape[:2]), tuple(shape[3:]), dtype)
        if mine != theirs:
            raise ValueError(f"the prefill engine's KV blocks (layers x K/V {list(mine[0])}, block "
                             f"{list(mine[1])}, {mine[2]}) do not fit this engine's ({list(theirs[0])}, "
                             f"{list(theirs[1])}, {theirs[2]}): both must serve the same model with the "
                             f"same block size and dtype")
        if self.model and model and self.model != model:
            raise ValueError(f"the prefill engine serves other weights (fingerprint {self.model[:12]}) than this "
                             f"engine ({model[:12]}): both must serve the same model")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shm_dir() -> Path:
    """Where KV segments live: $MINILLM_KV_SHM_DIR, else /dev/shm (the temporary directory without one)."""
    chosen = os.environ.get(SHM_DIR_ENV)
    return Path(chosen).resolve() if chosen else SHM_DIR


def sweep_stale_segments(directory: Path | None = None) -> list[Path]:
    """Remove segments left by producers that died without unlinking them; returns what was removed."""
    directory = directory or shm_dir()
    removed = []
    for path in directory.glob(f"{SEGMENT_PREFIX}*"):
        pid = path.name[len(SEGMENT_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class SharedSegment:
    """A file in shared memory mapped into this process; its name carries our pid, so a segment
    whose producer died is found and removed by the next producer on the machine. Its name goes
    with unlink(), or when the segment is collected, or when the interpreter exits."""

    def __init__(self, nbytes: int, directory: Path | None = None):
        directory = directory or shm_dir()
        sweep_stale_segments(directory)
        self.path = directory / f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._unlinker = weakref.finalize(self, _unlink, self.path)
        try:
            os.ftruncate(fd, nbytes)      # pages are taken when first written; they read as zeros
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)

    def array(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """The segment as an array (it must hold exactly shape x dtype)."""
        return np.ndarray(shape, dtype=dtype, buffer=self._map)

    def unlink(self) -> None:
        """Remove the name (mappings, ours and consumers', stay valid until they are dropped)."""
        self._unlinker()


def is_region_gone(region: KVRegion) -> bool:
    """Whether a producer's exported pool has lost its name: its producer exited (or died and a new
    producer swept it), so no lease of it can be claimed again. Only a shm segment tells."""
    return region.kind == "shm" and not Path(region.handle if isinstance(region.handle, str)
                                              else region.handle.decode()).exists()


def attach_segment(region: KVRegion) -> np.ndarray:
    """A read-only view of a producer's shm pool; ValueError when it is gone or not what it says."""
    try:
        dtype = np.dtype(region.dtype)
    except TypeError:
        raise ValueError(f"the KV region's dtype {region.dtype!r} is not one a host segment holds") from None
    path = Path(region.handle if isinstance(region.handle, str) else region.handle.decode())
    if not path.name.startswith(SEGMENT_PREFIX):
        raise ValueError(f"the KV region {str(path)!r} is not a minillm KV segment")
    if path.parent != shm_dir():
        # Only segments of our own directory are mapped (the path comes from a client's params).
        raise ValueError(f"the prefill engine's KV segment {str(path)!r} lies outside this engine's segment "
                         f"directory {str(shm_dir())!r}: give both engines the same ${SHM_DIR_ENV}")
    nbytes = int(np.prod(region.shape)) * dtype.itemsize
    try:
        size = path.stat().st_size
    except OSError:
        raise ValueError(f"the prefill engine's KV segment {path} is gone (has it exited?)") from None
    if size != nbytes:
        raise ValueError(f"the KV segment {path} holds {size} bytes, not the {nbytes} its shape says")
    return np.memmap(path, dtype=dtype, mode="r", shape=region.shape)
