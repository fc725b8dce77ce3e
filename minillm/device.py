"""Device work behind one small object per backend: the compute stream, read-backs, timers,
memory figures, graphs and release. The model runner calls these and never branches on the backend.

    CpuDevice   everything runs on the host, synchronously; "copies" are the arrays themselves
    CudaDevice  one non-blocking compute stream; tokens come back through pinned buffers and events
"""
from __future__ import annotations

import contextlib
import os
import time

import numpy as np

DEFAULT_CPU_KV_BYTES = 1 << 30


class HostArray:
    """A device array on its way to the host; result() waits for it."""

    def __init__(self, array):
        self._array = array

    def result(self) -> np.ndarray:
        """The host copy (waits for the device when there is one)."""
        return np.asarray(self._array)


class CpuTimer:
    """Wall-clock marks: on the CPU the step runs while the host waits for it."""

    def __init__(self):
        self.marks = [time.perf_counter()]

    def mark(self) -> None:
        """Record the time now."""
        self.marks.append(time.perf_counter())

    def elapsed(self) -> list[float]:
        """Seconds between consecutive marks."""
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class CpuDevice:
    """The host: synchronous work, the process's resident memory."""

    name = "cpu"
    kv_pool_fills_memory = False     # the pool is sized by a byte budget, capped by what it can use

    def compute(self):
        """Context in which device work is queued (nothing to enter on the CPU)."""
        return contextlib.nullcontext()

    def to_host_async(self, array) -> HostArray:
        """Start copying array to the host."""
        return HostArray(array)

    def timer(self) -> CpuTimer:
        """A timer whose first mark is now."""
        return CpuTimer()

    def synchronize(self) -> None:
        """Wait for all queued work (none on the CPU)."""

    def kv_cache_budget_bytes(self, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float,
                              activation_bytes, graph_bytes: int) -> int:
        """Bytes the KV pool may take."""
        return kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES

    def used_bytes(self) -> int:
        """Memory the process holds (resident set)."""
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def decode_graphs(self, model, ops, kv_pool, max_num_seqs: int, max_model_len: int, block_size: int):
        """Captured decode graphs, or None where there are none."""
        return None

    def is_fatal(self, exc: BaseException) -> bool:
        """True when exc leaves the device unusable (no such error on the CPU)."""
        return False

    def release(self) -> None:
        """Give cached memory back (nothing is cached on the CPU)."""


class _CudaHostArray(HostArray):
    def __init__(self, cp, array):
        import cupyx
        self._host = cupyx.empty_pinned(array.shape, dtype=array.dtype)
        self._src = array                 # keeps the source alive until the copy is done
        array.get(out=self._host, blocking=False)
        self._done = cp.cuda.Event(block=False, disable_timing=True)
        self._done.record()

    def result(self) -> np.ndarray:
        self._done.synchronize()
        self._src = None
        return self._host


class CudaTimer:
    """CUDA events on the compute stream; elapsed() waits for the last one."""

    def __init__(self, cp):
        self.cp = cp
        self.events = [cp.cuda.Event()]
        self.events[0].record()

    def mark(self) -> None:
        """Record an event now on the current stream."""
        event = self.cp.cuda.Event()
        event.record()
        self.events.append(event)

    def elapsed(self) -> list[float]:
        """Seconds between consecutive events (waits for the last)."""
        self.events[-1].synchronize()
        get = self.cp.cuda.get_elapsed_time
        return [get(a, b) / 1e3 for a, b in zip(self.events, self.events[1:])]


class CudaDevice:
    """One GPU through CuPy: a non-blocking compute stream, pinned read-backs, CuPy's memory pools."""

    name = "cuda"
    kv_pool_fills_memory = True      # the pool takes what gpu_memory_utilization leaves

    def __init__(self):
        import cupy
        self.cp = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def compute(self):
        """Context in which device work is queued: the compute stream."""
        return self.stream

    def to_host_async(self, array) -> HostArray:
        """Start copying array to pinned host memory on the current stream."""
        return _CudaHostArray(self.cp, array)

    def timer(self) -> CudaTimer:
        """CUDA events on the current stream, the first recorded now."""
        return CudaTimer(self.cp)

    def synchronize(self) -> None:
        """Wait for all work queued on the device by this process."""
        self.cp.cuda.Device().synchronize()

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes, counting what CuPy's pool holds unused as free."""
        free, total = self.cp.cuda.runtime.memGetInfo()
        return int(free) + int(self.cp.get_default_memory_pool().free_bytes()), int(total)

    def kv_cache_budget_bytes(self, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float,
                              activation_bytes, graph_bytes: int) -> int:
        """Bytes the KV pool may take: the utilisation share less what is in use, a forward
        pass's activations (measured by calling activation_bytes()) and the decode graphs."""
        if kv_cache_memory_bytes:
            return kv_cache_memory_bytes
        peak = activation_bytes()
        free, total = self.memory_info()
        budget = int(total * gpu_memory_utilization) - (total - free) - peak - graph_bytes
        if budget <= 0:
            raise ValueError(f"no device memory left for the KV pool: {free / 2**30:.1f} GiB free of "
                             f"{total / 2**30:.1f} GiB, a forward pass needs {peak / 2**30:.1f} GiB; "
                             f"lower max_num_batched_tokens or raise gpu_memory_utilization")
        return budget

    def peak_bytes(self, fn) -> int:
        """Device memory that fn() takes at its peak, measured on CuPy's pool."""
        pool = self.cp.get_default_memory_pool()
        self.synchronize()
        before = pool.total_bytes()
        fn()
        self.synchronize()
        peak = pool.total_bytes() - before
        pool.free_all_blocks()
        return peak

    def used_bytes(self) -> int:
        """Device memory in use (by every process)."""
        free, total = self.cp.cuda.runtime.memGetInfo()
        return int(total) - int(free)

    def decode_graphs(self, model, ops, kv_pool, max_num_seqs: int, max_model_len: int, block_size: int):
        """Decode forward passes captured as CUDA graphs on the compute stream."""
        from minillm.cuda_graphs import DecodeGraphs
        return DecodeGraphs(model, ops, kv_pool, max_num_seqs, max_model_len, block_size, self.stream)

    def is_fatal(self, exc: BaseException) -> bool:
        """CUDA errors are sticky: after one the context cannot be trusted."""
        runtime = self.cp.cuda.runtime
        return isinstance(exc, (runtime.CUDARuntimeError, self.cp.cuda.driver.CUDADriverError))

    def release(self) -> None:
        """Wait for the device, then return CuPy's cached blocks (device and pinned) to the driver."""
        self.synchronize()
        self.cp.get_default_memory_pool().free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()


def make_device(backend: str):
    """The device object of an ops backend ('numpy' or 'cuda')."""
    return CudaDevice() if backend == "cuda" else CpuDevice()
