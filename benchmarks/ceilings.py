"""The card's own ceilings, measured: device copy bandwidth and bf16 matrix rate."""
from __future__ import annotations


def measure_copy_bandwidth(nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), after warm-up."""
    import cupy as cp

    src = cp.empty(nbytes // 2, dtype=cp.uint8)
    dst = cp.empty_like(src)
    dst[...] = src
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        dst[...] = src
    stop.record()
    stop.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, stop) / 1e3
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * (nbytes // 2) * repeats / seconds


def measure_matmul_rate(n: int = 8192, repeats: int = 10) -> float:
    """bf16 FLOP/s of an n x n x n cuBLAS GEMM with fp32 accumulation, after warm-up."""
    import cupy as cp

    bf16 = cp.dtype("bfloat16")
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(bf16)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(bf16)
    cp.matmul(a, b)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        cp.matmul(a, b)
    stop.record()
    stop.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, stop) / 1e3
    return 2 * n**3 * repeats / seconds
