"""cuBLAS through its C API (ctypes), so that matrix products capture into CUDA graphs.

CuPy refuses its own cuBLAS calls while a stream is capturing; the C API captures. One handle per
device, bound to CuPy's current stream before every call, with a workspace of our own (cuBLAS
drops the workspace whenever the stream is set, so it is set again right after). Importing this
module needs neither CuPy nor libcublas; the library is loaded on first use.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from pathlib import Path

CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20

_DATA_TYPES = {"float32": CUDA_R_32F, "float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF}
_lock = threading.Lock()
_lib = None
_handles: dict[int, "CublasHandle"] = {}


def _loaded_cublas_path() -> str | None:
    """The libcublas already mapped into this process (CuPy's), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libcublas.so" in path:
                    return path
    except OSError:
        pass
    return None


def _candidate_paths() -> list[str]:
    """Where a libcublas may live: CUDA's pip wheels, CUDA_PATH / CUDA_HOME, /usr/local/cuda."""
    found = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        found.append(load_nvidia_dynamic_lib("cublas").abs_path)
    except Exception:  # no cuda-pathfinder, or it found nothing: try the usual places
        pass
    for site in sys.path:
        found += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcublas.so*")), reverse=True)
        found += sorted(glob.glob(os.path.join(site, "nvidia", "cublas", "lib", "libcublas.so*")), reverse=True)
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    for root in filter(None, roots):
        found += sorted(glob.glob(str(Path(root) / "lib64" / "libcublas.so*")), reverse=True)
    return found + ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasDestroy_v2.argtypes = [vp]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    for fn in (lib.cublasCreate_v2, lib.cublasDestroy_v2, lib.cublasSetStream_v2,
               lib.cublasSetWorkspace_v2, lib.cublasGemmEx):
        fn.restype = ctypes.c_int
    return lib


def load_library() -> ctypes.CDLL:
    """Load libcublas once (the copy CuPy loaded when there is one)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        errors = []
        paths = [p for p in [_loaded_cublas_path()] if p] + _candidate_paths()
        for path in paths:
            try:
                _lib = _declare(ctypes.CDLL(path))
                return _lib
            except OSError as e:
                errors.append(f"{path}: {e}")
        raise OSError("libcublas not found; tried:\n  " + "\n  ".join(errors))


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


class CublasHandle:
    """A cuBLAS handle with its own workspace, following CuPy's current stream."""

    def __init__(self):
        import cupy

        self.lib = load_library()
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate_v2")
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)   # lives as long as the handle
        self.stream_ptr = None

    def bind_stream(self) -> None:
        """Point the handle at CuPy's current stream (and re-attach the workspace)."""
        import cupy

        ptr = cupy.cuda.get_current_stream().ptr
        if ptr == self.stream_ptr:
            return
        _check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(ptr)), "cublasSetStream_v2")
        _check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                              ctypes.c_size_t(WORKSPACE_BYTES)), "cublasSetWorkspace_v2")
        self.stream_ptr = ptr

    def gemm_ex(self, transa: int, transb: int, m: int, n: int, k: int, a_ptr: int, a_type: int,
                lda: int, b_ptr: int, b_type: int, ldb: int, c_ptr: int, c_type: int, ldc: int,
                beta: float = 0.0) -> None:
        """Column-major C[m, n] = op(A) op(B) + beta * C, fp32 compute, alpha = 1."""
        self.bind_stream()
        alpha_v, beta_v = ctypes.c_float(1.0), ctypes.c_float(beta)
        status = self.lib.cublasGemmEx(
            self.handle, transa, transb, m, n, k, ctypes.byref(alpha_v), ctypes.c_void_p(a_ptr), a_type,
            lda, ctypes.c_void_p(b_ptr), b_type, ldb, ctypes.byref(beta_v), ctypes.c_void_p(c_ptr),
            c_type, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        _check(status, "cublasGemmEx")


def get_handle() -> CublasHandle:
    """The handle of the current device (created on first use)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    with _lock:
        handle = _handles.get(dev)
    if handle is None:
        handle = CublasHandle()
        with _lock:
            _handles[dev] = handle
    return handle


def data_type(dtype_name: str) -> int:
    """cudaDataType of a dtype name ('float32', 'float16', 'bfloat16')."""
    if dtype_name not in _DATA_TYPES:
        raise ValueError(f"cuBLAS GEMM supports float32, float16 and bfloat16, got {dtype_name}")
    return _DATA_TYPES[dtype_name]


def matmul_nt(out, x, w, beta: float = 0.0) -> None:
    """Row-major out[T, N] = x[T, K] @ w[N, K]^T (+ beta * out), fp32 accumulation.

    Row-major out is column-major out^T [N, T] = w x^T: A = w read as column-major [K, N]
    transposed, B = x read as column-major [K, T] (ld = x's row stride), C = out (ld = N).
    """
    num_tokens, k = x.shape
    n = w.shape[0]
    isz = x.dtype.itemsize
    dt = data_type(x.dtype.name)
    # out may be float32 while x and w are 16-bit: cuBLAS then writes the fp32 sums unrounded.
    get_handle().gemm_ex(CUBLAS_OP_T, CUBLAS_OP_N, n, num_tokens, k, w.data.ptr, dt, k, x.data.ptr, dt,
                         x.strides[0] // isz, out.data.ptr, data_type(out.dtype.name),
                         out.strides[0] // out.dtype.itemsize, beta)
