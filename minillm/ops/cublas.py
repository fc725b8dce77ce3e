"""cuBLAS and cuBLASLt through their C APIs (ctypes), so that matrix products capture into CUDA graphs.

CuPy refuses its own cuBLAS calls while a stream is capturing; the C API captures. One handle per
device, bound to CuPy's current stream before every call, with a workspace of our own (cuBLAS
drops the workspace whenever the stream is set, so it is set again right after). cuBLASLt takes
the stream and a workspace with every call; an LtPlan holds the descriptors of one problem and the
configurations cuBLASLt's heuristic offers for it. Workspaces are plain cudaMalloc allocations that
live as long as the process, so a captured graph never finds them given to someone else. Importing
this module needs neither CuPy nor the libraries; they are loaded on first use.
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
CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99
# The explicit algorithm ids of cublasGemmEx (cuBLAS documents them as without effect from Ampere on).
CUBLAS_GEMM_EXPLICIT_ALGOS = tuple(range(0, 24)) + tuple(range(100, 116))
WORKSPACE_BYTES = 32 << 20
LT_WORKSPACE_BYTES = 32 << 20

# cuBLASLt enums (cublasLt.h of CUDA 12 / 13; the values have not changed between them).
CUBLASLT_MATMUL_DESC_TRANSA = 3
CUBLASLT_MATMUL_DESC_TRANSB = 4
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5      # then B, C, D: 6, 7, 8
CUBLASLT_ALGO_CONFIG_ID = 0
CUBLASLT_ALGO_CONFIG_TILE_ID = 1
CUBLASLT_ALGO_CONFIG_SPLITK_NUM = 2
CUBLASLT_ALGO_CONFIG_STAGES_ID = 6
LT_MIN_ALIGNMENT_BYTES = 16     # heuristics only offer configurations that accept 16-byte aligned operands

_DATA_TYPES = {"float32": CUDA_R_32F, "float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF}
_lock = threading.Lock()
_lib = None
_lt_lib = None
_handles: dict[int, "CublasHandle"] = {}
_lt_handles: dict[int, "LtHandle"] = {}


def _loaded_cublas_path(name: str = "libcublas.so") -> str | None:
    """The library `name` already mapped into this process (CuPy's libcublas), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/" + name in path:
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
    ll = ctypes.c_longlong
    lib.cublasGemmStridedBatchedEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll,
                                               i, i, i]
    for fn in (lib.cublasCreate_v2, lib.cublasDestroy_v2, lib.cublasSetStream_v2,
               lib.cublasSetWorkspace_v2, lib.cublasGemmEx, lib.cublasGemmStridedBatchedEx):
        fn.restype = ctypes.c_int
    return lib


class LtMatmulAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: 64 opaque bytes."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class LtHeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t (96 bytes)."""

    _fields_ = [("algo", LtMatmulAlgo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _declare_lt(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    pvp = ctypes.POINTER(vp)
    lib.cublasLtCreate.argtypes = [pvp]
    lib.cublasLtMatmulDescCreate.argtypes = [pvp, i, i]
    lib.cublasLtMatmulDescDestroy.argtypes = [vp]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i, vp, sz]
    lib.cublasLtMatrixLayoutCreate.argtypes = [pvp, i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatrixLayoutDestroy.argtypes = [vp]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [pvp]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [vp]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i, vp, sz]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i,
                                                   ctypes.POINTER(LtHeuristicResult), ctypes.POINTER(i)]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [ctypes.POINTER(LtMatmulAlgo), i, vp, sz,
                                                         ctypes.POINTER(sz)]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                   ctypes.POINTER(LtMatmulAlgo), vp, sz, vp]
    for fn in (lib.cublasLtCreate, lib.cublasLtMatmulDescCreate, lib.cublasLtMatmulDescDestroy,
               lib.cublasLtMatmulDescSetAttribute, lib.cublasLtMatrixLayoutCreate, lib.cublasLtMatrixLayoutDestroy,
               lib.cublasLtMatmulPreferenceCreate, lib.cublasLtMatmulPreferenceDestroy,
               lib.cublasLtMatmulPreferenceSetAttribute, lib.cublasLtMatmulAlgoGetHeuristic,
               lib.cublasLtMatmulAlgoConfigGetAttribute, lib.cublasLtMatmul):
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


def load_lt_library() -> ctypes.CDLL:
    """Load libcublasLt once (the copy beside the loaded libcublas when there is one)."""
    global _lt_lib
    load_library()                       # libcublas loads libcublasLt: find that copy first
    with _lock:
        if _lt_lib is not None:
            return _lt_lib
        paths = [p for p in [_loaded_cublas_path("libcublasLt.so")] if p]
        paths += [str(Path(p).with_name(Path(p).name.replace("libcublas.", "libcublasLt.")))
                  for p in _candidate_paths() if "/" in p]
        paths += ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
        errors = []
        for path in paths:
            try:
                _lt_lib = _declare_lt(ctypes.CDLL(path))
                return _lt_lib
            except (OSError, AttributeError) as e:
                errors.append(f"{path}: {e}")
        raise OSError("libcublasLt not found; tried:\n  " + "\n  ".join(errors))


def raw_device_buffer(nbytes: int):
    """Device memory straight from cudaMalloc (never through a CuPy pool), freed when dropped."""
    import cupy

    return cupy.cuda.memory.Memory(nbytes)


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
                beta: float = 0.0, algo: int = CUBLAS_GEMM_DEFAULT) -> None:
        """Column-major C[m, n] = op(A) op(B) + beta * C, fp32 compute, alpha = 1."""
        self.bind_stream()
        alpha_v, beta_v = ctypes.c_float(1.0), ctypes.c_float(beta)
        status = self.lib.cublasGemmEx(
            self.handle, transa, transb, m, n, k, ctypes.byref(alpha_v), ctypes.c_void_p(a_ptr), a_type,
            lda, ctypes.c_void_p(b_ptr), b_type, ldb, ctypes.byref(beta_v), ctypes.c_void_p(c_ptr),
            c_type, ldc, CUBLAS_COMPUTE_32F, algo)
        _check(status, f"cublasGemmEx (algo {algo})")

    def gemm_strided_batched_ex(self, transa: int, transb: int, m: int, n: int, k: int, a_ptr: int,
                                a_type: int, lda: int, stride_a: int, b_ptr: int, b_type: int, ldb: int,
                                stride_b: int, c_ptr: int, c_type: int, ldc: int, stride_c: int,
                                batch: int, beta: float = 0.0) -> None:
        """batch column-major products C_i = op(A_i) op(B_i) + beta * C_i, X_i = X + i * stride_x
        (elements), fp32 compute, alpha = 1."""
        self.bind_stream()
        alpha_v, beta_v = ctypes.c_float(1.0), ctypes.c_float(beta)
        status = self.lib.cublasGemmStridedBatchedEx(
            self.handle, transa, transb, m, n, k, ctypes.byref(alpha_v), ctypes.c_void_p(a_ptr), a_type, lda,
            stride_a, ctypes.c_void_p(b_ptr), b_type, ldb, stride_b, ctypes.byref(beta_v), ctypes.c_void_p(c_ptr),
            c_type, ldc, stride_c, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        _check(status, "cublasGemmStridedBatchedEx")


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


def matmul_nt(out, x, w, beta: float = 0.0, algo: int = CUBLAS_GEMM_DEFAULT) -> None:
    """Row-major out[T, N] = x[T, K] @ w[N, K]^T (+ beta * out), fp32 accumulation.

    Row-major out is column-major out^T [N, T] = w x^T: A = w read as column-major [K, N]
    transposed, B = x read as column-major [K, T] (ld = x's row stride), C = out (ld = N).
    algo: a cublasGemmAlgo_t (CUBLAS_GEMM_DEFAULT, CUBLAS_GEMM_DEFAULT_TENSOR_OP or an explicit id).
    """
    num_tokens, k = x.shape
    n = w.shape[0]
    isz = x.dtype.itemsize
    dt = data_type(x.dtype.name)
    # out may be float32 while x and w are 16-bit: cuBLAS then writes the fp32 sums unrounded.
    get_handle().gemm_ex(CUBLAS_OP_T, CUBLAS_OP_N, n, num_tokens, k, w.data.ptr, dt, k, x.data.ptr, dt,
                         x.strides[0] // isz, out.data.ptr, data_type(out.dtype.name),
                         out.strides[0] // out.dtype.itemsize, beta, algo)


def matmul_nt_split_k(workspace_ptr: int, x, w, splits: int) -> None:
    """workspace[s] = x[:, s*Ks:(s+1)*Ks] @ w[:, s*Ks:(s+1)*Ks]^T for s < splits: fp32 [splits, T, N]
    row-major at workspace_ptr, Ks = K / splits (one strided-batched GEMM; K % splits == 0)."""
    num_tokens, k = x.shape
    n = w.shape[0]
    ks = k // splits
    dt = data_type(x.dtype.name)
    get_handle().gemm_strided_batched_ex(
        CUBLAS_OP_T, CUBLAS_OP_N, n, num_tokens, ks, w.data.ptr, dt, k, ks, x.data.ptr, dt,
        x.strides[0] // x.dtype.itemsize, ks, workspace_ptr, CUDA_R_32F, n, n * num_tokens, splits)


# ----------------------------------------------------------------------------- cuBLASLt

class LtHandle:
    """A cuBLASLt handle and its workspace (cuBLASLt takes the stream with every call)."""

    def __init__(self):
        self.lib = load_lt_library()
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = raw_device_buffer(LT_WORKSPACE_BYTES)


def get_lt_handle() -> LtHandle:
    """The cuBLASLt handle of the current device (created on first use)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    with _lock:
        handle = _lt_handles.get(dev)
    if handle is None:
        handle = LtHandle()
        with _lock:
            _lt_handles[dev] = handle
    return handle


def _set_attr(setter, obj, attr: int, value) -> None:
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), setter.__name__)


def lt_describe(lib, num_tokens: int, n: int, k: int, x_stride: int, dtype_name: str, out_dtype_name: str):
    """The operation and layout descriptors of out[T, N] = x[T, K] @ w[N, K]^T, in the column-major
    terms of matmul_nt: (matmul desc, A = w, B = x, C = D = out)."""
    dt, ot = data_type(dtype_name), data_type(out_dtype_name)
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate")
    _set_attr(lib.cublasLtMatmulDescSetAttribute, desc, CUBLASLT_MATMUL_DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T))
    _set_attr(lib.cublasLtMatmulDescSetAttribute, desc, CUBLASLT_MATMUL_DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
    layouts = []
    for dtype, rows, cols, ld in ((dt, k, n, k), (dt, k, num_tokens, x_stride), (ot, n, num_tokens, n)):
        layout = ctypes.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "cublasLtMatrixLayoutCreate")
        layouts.append(layout)
    return desc, layouts[0], layouts[1], layouts[2]


class LtPlan:
    """One problem's cuBLASLt descriptors and the configurations its heuristic offers (best first)."""

    def __init__(self, num_tokens: int, n: int, k: int, x_stride: int, dtype_name: str, out_dtype_name: str,
                 max_algos: int = 16, workspace_bytes: int = LT_WORKSPACE_BYTES):
        if not 0 <= workspace_bytes <= LT_WORKSPACE_BYTES:
            raise ValueError(f"workspace_bytes must be in [0, {LT_WORKSPACE_BYTES}], got {workspace_bytes}")
        self.lt = get_lt_handle()
        self.workspace_bytes = workspace_bytes     # the heuristic's limit and what each call is given
        lib = self.lt.lib
        self.desc, self.a_layout, self.b_layout, self.c_layout = lt_describe(
            lib, num_tokens, n, k, x_stride, dtype_name, out_dtype_name)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            _set_attr(lib.cublasLtMatmulPreferenceSetAttribute, pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                      ctypes.c_uint64(workspace_bytes))
            for i in range(4):                  # A, B, C, D
                _set_attr(lib.cublasLtMatmulPreferenceSetAttribute, pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + i,
                          ctypes.c_uint32(LT_MIN_ALIGNMENT_BYTES))
            results = (LtHeuristicResult * max_algos)()
            count = ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self.lt.handle, self.desc, self.a_layout, self.b_layout,
                                                      self.c_layout, self.c_layout, pref, max_algos, results,
                                                      ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        self.algos = [results[i].algo for i in range(count.value)
                      if results[i].state == 0 and results[i].workspaceSize <= workspace_bytes]

    def describe(self, i: int) -> str:
        """Configuration i in words: its id, tile, stages and split-K."""
        lib = self.lt.lib
        vals = []
        for attr in (CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
                     CUBLASLT_ALGO_CONFIG_SPLITK_NUM):
            v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(self.algos[i]), attr, ctypes.byref(v),
                                                              ctypes.sizeof(v), ctypes.byref(written))
            vals.append(int(v.value) if status == 0 else -1)
        return f"id {vals[0]} tile {vals[1]} stages {vals[2]} splitk {vals[3]}"

    def matmul(self, i: int, out, x, w, beta: float = 0.0) -> None:
        """out = x @ w^T (+ beta * out) with configuration i, on CuPy's current stream."""
        import cupy

        alpha_v, beta_v = ctypes.c_float(1.0), ctypes.c_float(beta)
        out_p = ctypes.c_void_p(out.data.ptr)
        status = self.lt.lib.cublasLtMatmul(
            self.lt.handle, self.desc, ctypes.byref(alpha_v), ctypes.c_void_p(w.data.ptr), self.a_layout,
            ctypes.c_void_p(x.data.ptr), self.b_layout, ctypes.byref(beta_v), out_p, self.c_layout, out_p,
            self.c_layout, ctypes.byref(self.algos[i]),
            ctypes.c_void_p(self.lt.workspace.ptr if self.workspace_bytes else None), self.workspace_bytes,
            ctypes.c_void_p(cupy.cuda.get_current_stream().ptr))
        _check(status, f"cublasLtMatmul (configuration {i})")
