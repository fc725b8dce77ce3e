"""Device work behind one small object per backend: the compute stream, read-backs, timers,
memory figures, graphs, KV block copies and release. The model runner calls these and never
branches on the backend.

    CpuDevice   everything runs on the host, synchronously; "copies" are the arrays themselves
    CudaDevice  one non-blocking compute stream; tokens come back through pinned buffers and events;
                KV blocks move between the pool and pinned host memory on a copy stream

Block copies (KV connectors) take pools laid out `[num_layers, 2, num_blocks, *block]` with the
block's own elements contiguous: on the device the KV pool, on the host a pool of the same layout.
A KV pool allocated `shared` can be exported to another process and imported there
(prefill/decode disaggregation, minillm/kv_connector/transport.py): on the CPU as a shared-memory
segment, on the GPU as a plain cudaMalloc opened by CUDA IPC.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from minillm.config import MAX_BLAS_THREADS, available_host_bytes

# vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE GiB for the KV cache, 4 GiB when it is unset or 0.
DEFAULT_CPU_KV_BYTES = 4 << 30
KV_SPACE_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"
# The variables a BLAS library reads its thread count from, in the order OpenBLAS reads them.
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class KVBudget:
    """The bytes a CPU KV pool may take and where the figure came from."""

    num_bytes: int
    source: str          # "kv_cache_memory_bytes", KV_SPACE_VARIABLE or "default"


def cpu_kv_budget(kv_cache_memory_bytes: int | None, num_ranks: int = 1) -> KVBudget:
    """One rank's CPU pool budget: kv_cache_memory_bytes, else VLLM_CPU_KVCACHE_SPACE GiB, else 4 GiB
    (the num_ranks pools together at most half the memory available); a ValueError naming the setting
    when the num_ranks pools of it (tensor parallelism: one a rank, all in this host's memory) pass
    the available memory."""
    available = available_host_bytes()
    if kv_cache_memory_bytes:
        budget = KVBudget(kv_cache_memory_bytes, "kv_cache_memory_bytes")
    elif (gib := kv_space_gib()) is not None:
        budget = KVBudget(int(gib * 2**30), KV_SPACE_VARIABLE)
    else:
        return KVBudget(DEFAULT_CPU_KV_BYTES if available is None
                        else min(DEFAULT_CPU_KV_BYTES, available // (2 * num_ranks)), "default")
    if available is not None and budget.num_bytes * num_ranks > available:
        each = f"{budget.num_bytes / 2**30:.1f} GiB"
        if num_ranks > 1:
            each += f" on each of {num_ranks} ranks ({budget.num_bytes * num_ranks / 2**30:.1f} GiB together)"
        raise ValueError(f"{budget.source} {each} exceeds the {available / 2**30:.1f} GiB of memory available; "
                         f"lower {budget.source}")
    return budget


def kv_space_gib() -> float | None:
    """VLLM_CPU_KVCACHE_SPACE as a number of GiB (None when unset, empty or 0: the default)."""
    text = os.environ.get(KV_SPACE_VARIABLE, "").strip()
    try:
        gib = float(text) if text else 0.0
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib < 0:
        raise ValueError(f"{KV_SPACE_VARIABLE} must be a number of GiB for the CPU KV cache (0 or unset: "
                         f"{DEFAULT_CPU_KV_BYTES >> 30} GiB), got {text!r}")
    return gib or None


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threads() -> int:
    """BLAS threads for the CPU backend: OPENBLAS_NUM_THREADS or OMP_NUM_THREADS when one is a
    positive number (minillm's --threads sets both; one past MAX_BLAS_THREADS, which OpenBLAS caps far
    below, as that bound: OpenBLAS takes a C int, which ctypes cuts a larger count to or refuses), else
    every usable CPU but one, which is left to the engine's own thread and the server's (as vLLM's CPU
    backend reserves one)."""
    for name in THREAD_VARIABLES:
        text = os.environ.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return min(int(text), MAX_BLAS_THREADS)
    return max(1, usable_cpus() - 1)


def set_blas_threads(num_threads: int) -> None:
    """Run BLAS calls in this process on num_threads threads."""
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=num_threads, user_api="blas")


def block_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs covering the pairs src_ids[i] -> dst_ids[i], each run
    consecutive on both sides, so a run of blocks moves in one strided copy."""
    order = np.argsort(src_ids, kind="stable")
    src, dst = np.asarray(src_ids)[order], np.asarray(dst_ids)[order]
    if not len(src):
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(src)]])
    return [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts, ends)]


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


class CpuEvent:
    """A point in a CPU "stream": the work before it is already done when it is made."""

    done = True

    def __init__(self):
        self.time = time.perf_counter()


class CpuDevice:
    """The host: synchronous work, the process's resident memory."""

    name = "cpu"
    kv_pool_fills_memory = False     # the pool is sized by a byte budget, capped by what it can use

    def __init__(self):
        self._segment = None             # the shared-memory segment of a shared KV pool
        self._shared_pool = None
        # Matrix products on BLAS threads that leave a CPU free: on a busy 2-core machine
        # OpenBLAS's default of one thread a CPU made decode steps 3-5x slower than one thread.
        set_blas_threads(cpu_threads())

    def compute(self):
        """Context in which device work is queued (nothing to enter on the CPU)."""
        return contextlib.nullcontext()

    def to_host_async(self, array) -> HostArray:
        """Start copying array to the host."""
        return HostArray(array)

    def timer(self) -> CpuTimer:
        """A timer whose first mark is now."""
        return CpuTimer()

    def empty_pinned(self, shape, dtype) -> np.ndarray:
        """A host array that copies to the device read from (plain memory on the CPU)."""
        return np.empty(shape, dtype=dtype)

    def register_host(self, array: np.ndarray):
        """Page-lock a host array that copies to the device read from (nothing to do on the CPU); returns the undo."""
        return lambda: None

    def copy_to_device_async(self, dst, src: np.ndarray, event: bool = True) -> CpuEvent | None:
        """dst[...] = src, done before it returns; the event after it (None with event=False)."""
        dst[...] = src
        return CpuEvent() if event else None

    def synchronize(self) -> None:
        """Wait for all queued work (none on the CPU)."""

    def kv_cache_budget_bytes(self, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float,
                              activation_bytes, graph_bytes: int, num_ranks: int = 1) -> int:
        """Bytes the KV pool may take (cpu_kv_budget; gpu_memory_utilization is not used on the CPU);
        num_ranks: the tensor-parallel ranks whose pools share this host's memory."""
        return cpu_kv_budget(kv_cache_memory_bytes, num_ranks).num_bytes

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

    def verify_graphs(self, model, ops, kv_pool, max_num_seqs: int, max_model_len: int, block_size: int,
                      query_len: int, decode_graphs):
        """Captured verification graphs, or None where there are none."""
        return None

    def piecewise_graphs(self, model, ops, kv_pool, max_num_tokens: int, decode_graphs):
        """Captured pieces of prefill and mixed steps, or None where there are none."""
        return None

    def mixed_graphs(self, model, ops, kv_pool, max_num_tokens: int, max_num_seqs: int, max_model_len: int,
                     block_size: int, decode_graphs):
        """Small mixed steps captured whole, or None where there are none."""
        return None

    def is_fatal(self, exc: BaseException) -> bool:
        """True when exc leaves the device unusable (no such error on the CPU)."""
        return False

    # ---- the KV pool, shared with another process --------------------------------------------
    def kv_pool_zeros(self, shape: tuple[int, ...], dtype: str, shared: bool = False) -> np.ndarray:
        """A zeroed KV pool; shared: in a shared-memory segment that export_kv_pool() describes."""
        if not shared:
            return np.zeros(shape, dtype=dtype)
        from minillm.kv_connector.transport import SharedSegment
        self._segment = SharedSegment(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        self._shared_pool = self._segment.array(shape, np.dtype(dtype))
        return self._shared_pool

    def export_kv_pool(self, pool: np.ndarray, dtype: str):
        """The KVRegion another process maps `pool` by (it must have been allocated shared)."""
        from minillm.kv_connector.transport import KVRegion
        if pool is not self._shared_pool:
            raise ValueError("only a KV pool allocated with shared=True can be exported")
        return KVRegion("shm", str(self._segment.path), tuple(pool.shape), dtype)

    def import_kv_pool(self, region) -> np.ndarray:
        """Another process's exported pool, read-only; ValueError when it cannot be mapped here."""
        from minillm.kv_connector.transport import attach_segment
        if region.kind != "shm":
            raise ValueError(f"the CPU backend reads KV from host shared memory (shm), not {region.kind}")
        return attach_segment(region)

    # ---- KV block copies (host memory on both sides here; the logic above them is the GPU's) ----
    def empty_host_like(self, pool: np.ndarray, num_blocks: int) -> np.ndarray:
        """A host pool shaped like pool with num_blocks blocks (pages are taken when first written)."""
        return np.empty(pool.shape[:2] + (num_blocks,) + pool.shape[3:], dtype=pool.dtype)

    def copy_stream(self) -> None:
        """A stream for block copies beside the compute stream (the CPU has one line of work)."""
        return None

    def record_event(self, stream=None) -> CpuEvent:
        """An event after the work queued so far on stream (default: compute); done at once here."""
        return CpuEvent()

    def wait_event(self, event, stream=None) -> None:
        """Make stream (default: compute) wait for event (work here is done when queued)."""

    def elapsed_seconds(self, start: CpuEvent, end: CpuEvent) -> float:
        """Seconds between two done events."""
        return end.time - start.time

    def copy_blocks(self, dst: np.ndarray, dst_ids: np.ndarray, src: np.ndarray, src_ids: np.ndarray,
                    stream=None) -> None:
        """dst[:, :, dst_ids] = src[:, :, src_ids]; done before it returns on the CPU."""
        dst[:, :, dst_ids] = src[:, :, src_ids]

    def release(self) -> None:
        """Give cached memory back (nothing is cached on the CPU); a shared pool's segment loses its name."""
        if self._segment is not None:
            self._segment.unlink()
        self._shared_pool = None


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
    _max_pitch: int | None = None    # the largest pitch of a 2D copy (bytes), read on first use

    def __init__(self):
        import cupy
        self.cp = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._shared_pool = None
        self._imports: list[int] = []    # pointers opened by CUDA IPC, closed at release()

    def compute(self):
        """Context in which device work is queued: the compute stream."""
        return self.stream

    def to_host_async(self, array) -> HostArray:
        """Start copying array to pinned host memory on the current stream."""
        return _CudaHostArray(self.cp, array)

    def timer(self) -> CudaTimer:
        """CUDA events on the current stream, the first recorded now."""
        return CudaTimer(self.cp)

    def empty_pinned(self, shape, dtype) -> np.ndarray:
        """A host array in page-locked memory: a copy from it never makes the host wait."""
        import cupyx
        return cupyx.empty_pinned(shape, dtype=dtype)

    def register_host(self, array: np.ndarray):
        """Page-lock a host array (shared memory, say) so copies from it are plain async copies; returns the undo."""
        rt = self.cp.cuda.runtime
        ptr = array.ctypes.data
        rt.hostRegister(ptr, array.nbytes, 0)
        return lambda: rt.hostUnregister(ptr)

    def copy_to_device_async(self, dst, src: np.ndarray, event: bool = True):
        """Queue dst[...] = src (src pinned, both packed, same bytes) on the current stream; returns
        the event after the copy (src must not be written before it is done), None with event=False
        (the caller knows when the stream is past it)."""
        if dst.nbytes != src.nbytes or not dst.flags.c_contiguous or not src.flags.c_contiguous:
            raise ValueError(f"copy_to_device_async needs packed arrays of equal size, got {dst.nbytes} "
                             f"and {src.nbytes} bytes")
        rt = self.cp.cuda.runtime
        stream = self.cp.cuda.get_current_stream()
        rt.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, rt.memcpyHostToDevice, stream.ptr)
        if not event:
            return None
        event = self.cp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def synchronize(self) -> None:
        """Wait for all work queued on the device by this process."""
        self.cp.cuda.Device().synchronize()

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes, counting what CuPy's pool holds unused as free."""
        free, total = self.cp.cuda.runtime.memGetInfo()
        return int(free) + int(self.cp.get_default_memory_pool().free_bytes()), int(total)

    def kv_cache_budget_bytes(self, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float,
                              activation_bytes, graph_bytes: int, num_ranks: int = 1) -> int:
        """Bytes the KV pool may take: the utilisation share less what is in use, a forward
        pass's activations (measured by calling activation_bytes()) and the decode graphs (each
        rank has a device of its own: num_ranks does not change it)."""
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

    def verify_graphs(self, model, ops, kv_pool, max_num_seqs: int, max_model_len: int, block_size: int,
                      query_len: int, decode_graphs):
        """Forward passes of up to query_len tokens a sequence captured as CUDA graphs, in the
        decode graphs' memory pool."""
        from minillm.cuda_graphs import VerifyGraphs
        return VerifyGraphs(model, ops, kv_pool, max_num_seqs, max_model_len, block_size, self.stream,
                            query_len, pool=decode_graphs.pool)

    def piecewise_graphs(self, model, ops, kv_pool, max_num_tokens: int, decode_graphs):
        """Prefill and mixed steps captured between their attention calls, in the decode graphs'
        memory pool."""
        from minillm.piecewise_graphs import PiecewiseGraphs
        return PiecewiseGraphs(model, ops, kv_pool, max_num_tokens, self.stream, decode_graphs.pool)

    def mixed_graphs(self, model, ops, kv_pool, max_num_tokens: int, max_num_seqs: int, max_model_len: int,
                     block_size: int, decode_graphs):
        """Mixed steps of up to a thousand tokens captured whole, attention at a fixed grid, in the
        decode graphs' memory pool."""
        from minillm.mixed_graphs import MixedGraphs
        return MixedGraphs(model, ops, kv_pool, max_num_tokens, max_num_seqs, max_model_len, block_size,
                           self.stream, decode_graphs.pool)

    def is_fatal(self, exc: BaseException) -> bool:
        """CUDA errors are sticky: after one the context cannot be trusted."""
        runtime = self.cp.cuda.runtime
        return isinstance(exc, (runtime.CUDARuntimeError, self.cp.cuda.driver.CUDADriverError))

    # ---- the KV pool, shared with another process on this GPU by CUDA IPC ----------------------
    def kv_pool_zeros(self, shape: tuple[int, ...], dtype: str, shared: bool = False):
        """A zeroed KV pool (queue it inside compute()); shared: one plain cudaMalloc of its own,
        not a slice of CuPy's pool, so its IPC handle covers exactly the pool."""
        cp = self.cp
        if not shared:
            return cp.zeros(shape, dtype=cp.dtype(dtype))
        nbytes = int(np.prod(shape)) * cp.dtype(dtype).itemsize
        memory = cp.cuda.Memory(nbytes)           # cudaMalloc; freed with the last array over it
        pool = cp.ndarray(shape, dtype=cp.dtype(dtype), memptr=cp.cuda.MemoryPointer(memory, 0))
        pool.data.memset_async(0, nbytes)         # on the current stream, as cupy.zeros does
        self._shared_pool = pool
        return pool

    def pci_bus_id(self) -> str:
        """This GPU's PCI bus id (the same in every process, whatever CUDA_VISIBLE_DEVICES says)."""
        runtime = self.cp.cuda.runtime
        return runtime.deviceGetPCIBusId(runtime.getDevice())

    def export_kv_pool(self, pool, dtype: str):
        """The KVRegion (a CUDA IPC handle) another process on this GPU opens `pool` by."""
        from minillm.kv_connector.transport import KVRegion
        if pool is not self._shared_pool:
            raise ValueError("only a KV pool allocated with shared=True can be exported")
        handle = bytes(self.cp.cuda.runtime.ipcGetMemHandle(pool.data.ptr))
        return KVRegion("cuda_ipc", handle, tuple(pool.shape), dtype, self.pci_bus_id())

    def import_kv_pool(self, region):
        """Another process's exported pool, opened by CUDA IPC; ValueError when it cannot be here."""
        cp = self.cp
        if region.kind != "cuda_ipc":
            raise ValueError(f"the GPU backend reads KV by CUDA IPC (kv_buffer_device cuda), not {region.kind}")
        here = self.pci_bus_id()
        if region.device != here:
            raise ValueError(f"the prefill engine's KV pool is on the GPU at {region.device}, this engine's on "
                             f"{here}: CUDA IPC needs both engines on one GPU")
        if not isinstance(region.handle, bytes) or len(region.handle) != 64:
            raise ValueError("the KV region's CUDA IPC handle must be 64 bytes")
        dtype = cp.dtype(region.dtype)
        try:
            ptr = cp.cuda.runtime.ipcOpenMemHandle(region.handle)
        except cp.cuda.runtime.CUDARuntimeError as exc:
            raise ValueError(f"the prefill engine's KV pool cannot be opened by CUDA IPC: {exc}") from None
        self._imports.append(ptr)
        nbytes = int(np.prod(region.shape)) * dtype.itemsize
        memory = cp.cuda.UnownedMemory(ptr, nbytes, None, cp.cuda.runtime.getDevice())
        return cp.ndarray(region.shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(memory, 0))

    # ---- KV block copies between the pool and pinned host memory ------------------------------
    def empty_host_like(self, pool, num_blocks: int) -> np.ndarray:
        """A pinned host pool shaped like pool with num_blocks blocks. Its dtype is an unsigned
        integer of pool's item size: copies move bytes, and NumPy has no bfloat16."""
        import cupyx
        dtype = np.dtype(f"u{pool.dtype.itemsize}")
        return cupyx.empty_pinned(pool.shape[:2] + (num_blocks,) + pool.shape[3:], dtype=dtype)

    def copy_stream(self):
        """A non-blocking stream for block copies, so they run beside the compute stream."""
        return self.cp.cuda.Stream(non_blocking=True)

    def record_event(self, stream=None):
        """An event after the work queued so far on stream (default: compute); timing enabled."""
        event = self.cp.cuda.Event(block=False, disable_timing=False)
        event.record(stream if stream is not None else self.stream)
        return event

    def wait_event(self, event, stream=None) -> None:
        """Make stream (default: compute) wait for event, on the device (the host goes on)."""
        (stream if stream is not None else self.stream).wait_event(event)

    def elapsed_seconds(self, start, end) -> float:
        """Seconds between two events (waits for the second if it is not done yet)."""
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end) / 1e3

    def copy_blocks(self, dst, dst_ids: np.ndarray, src, src_ids: np.ndarray, stream=None) -> None:
        """Queue dst[:, :, dst_ids] = src[:, :, src_ids] on stream (default: compute): host to
        device, device to host, or device to device (a pool opened by CUDA IPC).

        A block is num_layers * 2 rows of block_bytes, one row per (layer, K|V), the rows of one
        pool num_blocks * block_bytes apart: each run of consecutive blocks is one
        cudaMemcpy2DAsync. A host side must be pinned for the copy to be asynchronous."""
        rt = self.cp.cuda.runtime
        rows = dst.shape[0] * dst.shape[1]
        block_bytes = int(np.prod(dst.shape[3:])) * dst.dtype.itemsize
        assert src.shape[:2] == dst.shape[:2] and src.dtype.itemsize == dst.dtype.itemsize
        assert int(np.prod(src.shape[3:])) * src.dtype.itemsize == block_bytes
        to_host, from_host = isinstance(dst, np.ndarray), isinstance(src, np.ndarray)
        assert not (to_host and from_host), "copy_blocks moves blocks to or from the device"
        dst_ptr = dst.ctypes.data if to_host else dst.data.ptr
        src_ptr = src.ctypes.data if from_host else src.data.ptr
        kind = (rt.memcpyDeviceToHost if to_host else rt.memcpyHostToDevice if from_host
                else rt.memcpyDeviceToDevice)
        stream = stream if stream is not None else self.stream
        dst_pitch, src_pitch = dst.shape[2] * block_bytes, src.shape[2] * block_bytes
        if self._max_pitch is None:
            self._max_pitch = rt.deviceGetAttribute(getattr(rt, "cudaDevAttrMaxPitch", 11), rt.getDevice())
        for s, d, n in block_runs(src_ids, dst_ids):
            if max(dst_pitch, src_pitch) <= self._max_pitch:
                rt.memcpy2DAsync(dst_ptr + d * block_bytes, dst_pitch, src_ptr + s * block_bytes, src_pitch,
                                 n * block_bytes, rows, kind, stream.ptr)
                continue
            for r in range(rows):      # a pool whose rows are further apart than one 2D copy allows
                rt.memcpyAsync(dst_ptr + r * dst_pitch + d * block_bytes, src_ptr + r * src_pitch + s * block_bytes,
                               n * block_bytes, kind, stream.ptr)

    def release(self) -> None:
        """Wait for the device, close the pools opened by CUDA IPC, then return CuPy's cached blocks
        (device and pinned) to the driver."""
        self.synchronize()
        for ptr in self._imports:
            try:
                self.cp.cuda.runtime.ipcCloseMemHandle(ptr)
            except self.cp.cuda.runtime.CUDARuntimeError:
                pass    # its exporter has gone already: nothing is mapped any more
        self._imports.clear()
        self._shared_pool = None                  # its cudaMalloc goes back with the last array over it
        self.cp.get_default_memory_pool().free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()


def make_device(backend: str):
    """The device object of an ops backend ('numpy' or 'cuda')."""
    return CudaDevice() if backend == "cuda" else CpuDevice()
