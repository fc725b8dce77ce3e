"""CUDA backend: CuPy RawKernel launchers over cuda/*.cu, cuBLAS / cuBLASLt (C API) for matrix products.

Every function has the name and signature of its twin in minillm/ops/numpy.py (plus optional
`out=` buffers and a few tuning keywords). Arrays are CuPy arrays; activations and KV caches are
float32, float16 or bfloat16 (cupy.dtype("bfloat16")), fp32 accumulation everywhere; a KV cache
may instead be uint8 FP8 E4M3 bits with kv_scales [2] float32 on the device (minillm/fp8.py), for
which the kernels are built with -DKV_FP8=1. Each launcher checks dtype, contiguity and shapes and
computes the grid; kernels are compiled once per (file, dtype[, head_dim, group, KV_FP8]) through
NVRTC (CuPy picks -arch for the device, sm_90 on Hopper) and cached.

CUDA graphs: every op launches only kernels (and cuBLAS through its C API) on CuPy's current
stream, reads shapes from its arguments and host ints in AttentionMetadata, and never synchronises,
so a forward pass captures. The graph runner must (1) run every op once eagerly before capturing
(NVRTC compilation, module loading, the cuBLAS handle and the tuning of each GEMM shape in
minillm/ops/gemm.py happen on first use; a shape first seen during a capture runs cuBLAS's
default); (2) capture on a
non-default stream; (3) allocate under a private memory pool kept alive with the graph, e.g.
`with cupy.cuda.using_allocator(pool.malloc):`, or pass preallocated `out=` buffers, because
CuPy's pool hands freed blocks to later allocations and a replay writes to the captured addresses;
(4) keep static input buffers (ids, positions, metadata arrays) and copy new values into them
before each replay; (5) capture decode with meta.max_seq_len set to the longest context the graph
will see (it sizes the split-K grid; shorter sequences leave splits empty).
"""
from __future__ import annotations

import importlib.resources
import os
import threading
from pathlib import Path

import numpy as np

import minillm
from minillm.attention import AttentionMetadata
from minillm.fp8 import FP8_E4M3_MAX
from minillm.ops import gemm, prefill_attention

try:
    import cupy
except ImportError:  # the module still imports where there is no CuPy; calls then fail clearly
    cupy = None

xp = cupy
name = "cuda"

LOG2E = 1.4426950408889634
# Decode splits (flash-decoding): a split reads at least DECODE_MIN_PARTITION tokens (one pass of
# the block's four warps over 16-token chunks); the grid aims at DECODE_BLOCKS_PER_SM blocks of 128
# threads per SM, so a small batch with long contexts still fills the card. Measured on the H200 at
# batch 4, context 4096 (RESULTS.md): 16 splits 28.2 us, 33 splits 35.0 us, 64 splits 50.7 us,
# one split 183.8 us; 4 blocks a multiprocessor gives 17.
DECODE_MIN_PARTITION = 64
DECODE_BLOCKS_PER_SM = 4
DECODE_MAX_SPLITS = 64
# The decode rows of a mixed step run unsplit (no reduce kernel) when they alone make this many
# blocks a multiprocessor. Measured on the H200 (RESULTS.md, Long prompts among decoders): 64
# decodes at context ~600 beside a 16-token chunk, 512 blocks on 132 SMs, 3.70 -> 3.16 ms a step.
MIXED_DECODE_UNSPLIT_BLOCKS_PER_SM = 3
_DTYPE_IDS = {"float32": 0, "float16": 1, "bfloat16": 2}
_VEC_BYTES = 16
# Prefill attention for fp16 / bf16 caches at head_dim 64 / 128: "flash" (prefill_attention.cu, its
# block shape picked from the grid), "flash-4w" / "flash-8w" (that shape), or "mma" (paged_prefill_mma).
PREFILL_ATTENTION = os.environ.get("MINILLM_PREFILL_ATTENTION", prefill_attention.AUTO)
if PREFILL_ATTENTION not in prefill_attention.KERNELS:     # fail at start-up, not in the first prefill
    raise ValueError(f"MINILLM_PREFILL_ATTENTION must be one of {list(prefill_attention.KERNELS)}, "
                     f"got {PREFILL_ATTENTION!r}")

_lock = threading.Lock()
_modules: dict[tuple, object] = {}
_capability: list[str] = []
_kernels: dict[tuple, object] = {}
_sources: dict[str, str] = {}
_num_sms: list[int] = []


# ----------------------------------------------------------------------------- arrays, dtypes

def _require_cupy():
    if cupy is None:
        raise RuntimeError("the cuda ops backend needs CuPy (pip install minillm[cuda13])")
    return cupy


def _bf16():
    """CuPy's bfloat16 dtype, or None when this CuPy / NumPy lacks it."""
    try:
        return _require_cupy().dtype("bfloat16")
    except TypeError:
        return None


def bfloat16_dtype():
    """CuPy's bfloat16 dtype, or None when this CuPy / NumPy lacks it."""
    return _bf16()


def _resolve_dtype(dtype):
    """'bfloat16' / 'float16' / np.float32 / a dtype object -> a dtype usable by CuPy."""
    if dtype is None:
        return None
    if str(dtype) in ("bfloat16", "bf16") or getattr(dtype, "__name__", "") == "bfloat16":
        bf16 = _bf16()
        if bf16 is None:
            raise ValueError("dtype bfloat16 needs CuPy with bfloat16 support (ml_dtypes installed)")
        return bf16
    return np.dtype(dtype)


def _host_bf16_bits(host: np.ndarray) -> np.ndarray:
    """Host array -> uint16 bfloat16 bit patterns (round to nearest even; uint16 passes through)."""
    if host.dtype == np.uint16:
        return np.ascontiguousarray(host)
    if host.dtype.name == "bfloat16":
        return np.ascontiguousarray(host).view(np.uint16)
    u = np.ascontiguousarray(host, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(is_nan, ((u >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)


def asarray(a, dtype=None):
    """Host (or device) array -> contiguous CuPy array; uint16 arrays become bfloat16 bit-for-bit."""
    cp = _require_cupy()
    target = _resolve_dtype(dtype)
    bf16 = _bf16() if target is not None and target.name == "bfloat16" else None
    if isinstance(a, cp.ndarray):
        if target is None or a.dtype == target:
            return cp.ascontiguousarray(a)
        if bf16 is not None and a.dtype == np.uint16:
            return cp.ascontiguousarray(a).view(bf16)
        return cp.ascontiguousarray(a.astype(target))
    host = np.asarray(a)
    if bf16 is not None:
        return cp.asarray(_host_bf16_bits(host)).view(bf16)
    return cp.asarray(np.ascontiguousarray(host, dtype=target))


_staged: list = []      # (event, pinned buffer) of asarray_async uploads the stream may not have passed


def asarray_async(a):
    """Host array -> CuPy array through a pinned staging buffer, queued on the current stream.

    A large upload from pageable memory can make the driver wait for the stream before it copies;
    through pinned memory the host never waits. The buffer is kept until the stream passes the copy.
    """
    cp = _require_cupy()
    import cupyx
    host = np.ascontiguousarray(a)
    staging = cupyx.empty_pinned(host.shape, dtype=host.dtype)
    staging[...] = host
    out = cp.empty(host.shape, dtype=host.dtype)
    stream = cp.cuda.get_current_stream()
    out.set(staging, stream=stream)
    event = cp.cuda.Event(block=False, disable_timing=True)
    event.record(stream)
    with _lock:
        _staged[:] = [(e, b) for e, b in _staged if not e.done]
        _staged.append((event, staging))
    return out


def to_numpy(a) -> np.ndarray:
    """Backend array -> host numpy array (bfloat16 arrives as ml_dtypes.bfloat16)."""
    if cupy is not None and isinstance(a, cupy.ndarray):
        return cupy.asnumpy(a)
    return np.asarray(a)


def synchronize() -> None:
    """Wait for the work queued on CuPy's current stream."""
    _require_cupy().cuda.get_current_stream().synchronize()


def device_memory_info() -> tuple[int, int]:
    """(free_bytes, total_bytes) of the current device."""
    free, total = _require_cupy().cuda.runtime.memGetInfo()
    return int(free), int(total)


def prepare_linear_weight(w, dtype):
    """w: [N, K] (Hugging Face layout, bf16 as uint16 bits allowed) -> packed device [N, K]."""
    if w.ndim != 2:
        raise ValueError(f"linear weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    return asarray(w, dtype)


# ----------------------------------------------------------------------------- kernel loading

def _source_dir():
    """<repo>/cuda in a checkout, else the package data of minillm.cuda_src."""
    repo = Path(minillm.__file__).resolve().parent.parent / "cuda"
    if (repo / "common.cuh").exists():
        return repo
    return importlib.resources.files("minillm.cuda_src")


def _read_source(filename: str) -> str:
    """Kernel source with common.cuh inlined (NVRTC then needs no include path)."""
    if filename not in _sources:
        root = _source_dir()
        header = (root / "common.cuh").read_text().replace("#pragma once", "")
        _sources[filename] = (root / filename).read_text().replace('#include "common.cuh"', header)
    return _sources[filename]


def _kernel(filename: str, dtype, kernel_name: str, arch: str | None = None, **defines):
    """The compiled kernel `kernel_name` of `filename` for `dtype` (and -D defines), cached. arch
    names an architecture other than the device's own (CuPy's choice): "90a" for sources that use
    Hopper's warpgroup MMAs and setmaxnreg, which sm_90 code may not."""
    cp = _require_cupy()
    dtype_name = np.dtype(dtype).name
    mod_key = (filename, dtype_name, tuple(sorted(defines.items())), arch)
    key = mod_key + (kernel_name,)
    with _lock:
        fn = _kernels.get(key)
        if fn is not None:
            return fn
        mod = _modules.get(mod_key)
        if mod is None:
            options = ("-std=c++17", f"-DMINILLM_DTYPE={_DTYPE_IDS[dtype_name]}",
                       *(f"-D{k}={v}" for k, v in sorted(defines.items())))
            if arch is None:
                mod = cp.RawModule(code=_read_source(filename), options=options)
            else:
                mod = _module_for_arch(_read_source(filename), filename, options, arch)
            _modules[mod_key] = mod
        fn = mod.get_function(kernel_name)
        _kernels[key] = fn
        return fn


def _module_for_arch(source: str, filename: str, options: tuple, arch: str):
    """NVRTC's cubin of source for sm_{arch}, loaded (CuPy's RawModule picks the device's own arch)."""
    from cupy.cuda import function
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(source, filename, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, (*options, f"-arch=sm_{arch}"))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{filename} does not build for sm_{arch}:\n{nvrtc.getProgramLog(prog)}") from exc
        image = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    mod = function.Module()
    mod.load(image)
    return mod


def _compute_capability() -> str:
    """The device's compute capability as CuPy spells it ("90" on Hopper; "" without CuPy)."""
    if cupy is None:
        return ""
    if not _capability:
        _capability.append(str(cupy.cuda.Device().compute_capability))
    return _capability[0]


def _num_multiprocessors() -> int:
    if not _num_sms:
        _num_sms.append(int(_require_cupy().cuda.Device().attributes["MultiProcessorCount"]))
    return _num_sms[0]


def _ptr(a) -> np.uint64:
    """Device pointer of an array as a kernel argument (independent of CuPy's dtype table)."""
    return np.uint64(a.data.ptr)


def _i32(v) -> np.int32:
    return np.int32(v)


def _i64(v) -> np.int64:
    return np.int64(v)


# ----------------------------------------------------------------------------- argument checks

def _check_float(a, what: str) -> None:
    if a.dtype.name not in _DTYPE_IDS:
        raise ValueError(f"{what} must be float32, float16 or bfloat16, got {a.dtype}")


def _check_device(a, what: str) -> None:
    if not isinstance(a, _require_cupy().ndarray):
        raise ValueError(f"{what} must be a CuPy array, got {type(a).__name__}")


def _check_same_dtype(a, b, what_a: str, what_b: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{what_b} dtype {b.dtype} does not match {what_a} dtype {a.dtype}")


def _row_stride(a, what: str) -> int:
    """Stride of dim 0 in elements; the dims after it must be packed (C order)."""
    expect = a.dtype.itemsize
    for dim in range(a.ndim - 1, 0, -1):
        if a.shape[dim] != 1 and a.strides[dim] != expect:
            raise ValueError(f"{what} must be packed after its first dimension, got strides {a.strides}")
        expect *= a.shape[dim]
    if a.shape[0] > 1 and a.strides[0] % a.dtype.itemsize:
        raise ValueError(f"{what} row stride {a.strides[0]} is not a multiple of its item size")
    return a.strides[0] // a.dtype.itemsize if a.shape[0] > 1 else int(np.prod(a.shape[1:], dtype=np.int64))


def _check_contiguous(a, what: str) -> None:
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous, got strides {a.strides}")


def _is_vec_aligned(arrays_and_strides, elems_per_vec: int) -> bool:
    """True when every pointer is 16-byte aligned and every stride a multiple of a vector."""
    for a, stride in arrays_and_strides:
        if a.data.ptr % _VEC_BYTES or stride % elems_per_vec:
            return False
    return True


def _vec_elems(dtype) -> int:
    return _VEC_BYTES // np.dtype(dtype).itemsize


def _out(out, shape, dtype, what: str = "out"):
    """`out` checked against shape / dtype / packing, or a new array."""
    if out is None:
        return _require_cupy().empty(shape, dtype=dtype)
    _check_device(out, what)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{what} must be {tuple(shape)} {np.dtype(dtype)}, got {tuple(out.shape)} {out.dtype}")
    _check_contiguous(out, what)
    return out


def _as_device(a, dtype, what: str):
    """Device array of `dtype` (copies / casts only when needed)."""
    cp = _require_cupy()
    if isinstance(a, cp.ndarray):
        return a if a.dtype == dtype and a.flags.c_contiguous else cp.ascontiguousarray(a.astype(dtype))
    return cp.asarray(np.ascontiguousarray(np.asarray(a), dtype=dtype))


def _threads_for(units: int) -> int:
    return int(min(1024, max(32, (units + 31) // 32 * 32)))


def _log2_exact(n: int, what: str) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two, got {n}")
    return n.bit_length() - 1


# ----------------------------------------------------------------------------- dense ops

def linear(x, w, bias=None, out=None, out_dtype=None, candidate=None):
    """x: [T, K] @ w[N, K].T (+ bias[N]) -> [T, N] in x's dtype (or out_dtype), fp32 accumulation.

    The product runs the shape's tuned GEMM (minillm/ops/gemm.py: tuned on the first eager call of
    a tunable shape), or `candidate` (a gemm.Candidate) when given."""
    _check_device(x, "x")
    _check_device(w, "w")
    _check_float(x, "x")
    _check_same_dtype(x, w, "x", "w")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear needs x [T, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    _row_stride(x, "x")
    _check_contiguous(w, "w")
    num_tokens, n = x.shape[0], w.shape[0]
    dtype = x.dtype if out_dtype is None else _resolve_dtype(out_dtype)
    if dtype != x.dtype and (bias is not None or dtype != np.float32):
        raise ValueError(f"out_dtype may only be float32 and only without a bias, got {dtype}")
    out = _out(out, (num_tokens, n), dtype)
    if num_tokens == 0 or n == 0:
        return out
    beta = 0.0
    if bias is not None:
        _check_device(bias, "bias")
        _check_same_dtype(x, bias, "x", "bias")
        if bias.shape != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
        _check_contiguous(bias, "bias")
        total = num_tokens * n
        fn = _kernel("activation.cu", x.dtype, "bias_broadcast")
        fn(((total + 255) // 256,), (256,), (_ptr(out), _ptr(bias), _i64(num_tokens), _i32(n)))
        beta = 1.0                      # the bias joins the fp32 sum inside the GEMM
    if x.shape[1] == 0:
        if bias is None:
            out.fill(0)
        return out
    gemm.matmul(out, x, w, beta, candidate)
    return out


def _embedding_args(ids, table):
    """The checked ids [T] (int32, on the device) and table [V, D] of a lookup, with T, V and D."""
    _check_device(table, "table")
    _check_float(table, "table")
    _check_contiguous(table, "table")
    ids = _as_device(ids, np.int32, "ids")
    if ids.ndim != 1 or table.ndim != 2:
        raise ValueError(f"embedding needs ids [T] and table [V, D], got {tuple(ids.shape)} and {tuple(table.shape)}")
    return ids, ids.shape[0], *table.shape


def embedding(ids, table, out=None):
    """ids: [T] int32, table: [V, D] -> [T, D] (ids outside [0, V) give zero rows)."""
    ids, num_tokens, vocab, dim = _embedding_args(ids, table)
    out = _out(out, (num_tokens, dim), table.dtype)
    if num_tokens == 0:
        return out
    vec = dim % _vec_elems(table.dtype) == 0
    fn = _kernel("embedding.cu", table.dtype, "embedding_vec" if vec else "embedding_scalar")
    fn((num_tokens,), (128,), (_ptr(out), _ptr(ids), _ptr(table), _i32(vocab), _i32(dim)))
    return out


# The embedding lookup and the first layer's norm in one launch.
FUSE_EMBEDDING_NORM = True


def embedding_rms_norm(ids, table, weight, eps: float, out=None):
    """embedding then rms_norm in one launch: ids [T] int32, table [V, D] -> (rms_norm(h), h), both
    [T, D] with h = table[ids] (zero rows for ids outside [0, V)); the same bits as the two calls.
    out=(normed, h) may name preallocated packed buffers."""
    ids, num_tokens, vocab, dim = _embedding_args(ids, table)
    normed_out, h_out = out if out is not None else (None, None)
    if not FUSE_EMBEDDING_NORM:
        h = embedding(ids, table, out=h_out)
        return rms_norm(h, weight, eps, out=normed_out), h
    normed = _out(normed_out, (num_tokens, dim), table.dtype, "out[0]")
    h = _out(h_out, (num_tokens, dim), table.dtype, "out[1]")
    if num_tokens == 0:
        return normed, h
    fn, threads = _norm_kernel("embedding_rms_norm", table, weight, [(table, dim), (normed, dim), (h, dim)])
    fn((num_tokens,), (threads,), (_ptr(normed), _ptr(h), _ptr(ids), _ptr(table), _i32(vocab), _ptr(weight),
                                   _i32(dim), np.float32(eps)))
    return normed, h


def _norm_rows(x, what: str):
    """x: [..., D] -> (a 2-D view [rows, D] with a row stride, row stride in elements)."""
    if x.ndim < 1:
        raise ValueError(f"{what} must have at least one dimension")
    if x.ndim != 2:
        x = _require_cupy().ascontiguousarray(x).reshape(-1, x.shape[-1])
    return x, _row_stride(x, what)


def _norm_kernel(prefix: str, x, weight, strides):
    """The vectorised or scalar (add_)rms_norm kernel, weight in x's dtype or float32."""
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}], got {tuple(weight.shape)}")
    _check_contiguous(weight, "weight")
    if weight.dtype != x.dtype and weight.dtype != np.float32:
        raise ValueError(f"weight dtype {weight.dtype} must be {x.dtype} or float32")
    ve = _vec_elems(x.dtype)
    vec = dim % ve == 0 and _is_vec_aligned(strides, ve)
    suffix = ("_vec" if vec else "_scalar") + ("_wf32" if weight.dtype != x.dtype else "")
    threads = _threads_for(dim // ve if vec else dim)
    return _kernel("norm.cu", x.dtype, prefix + suffix), threads


def rms_norm(x, weight, eps: float, out=None):
    """x: [T, D], weight: [D] -> [T, D]: x / rms(x) * weight, computed in fp32."""
    _check_device(x, "x")
    _check_float(x, "x")
    shape = x.shape
    heads = 1
    if _is_head_strided(x):               # [T, H, D] view of a fused buffer: no copy
        heads, x2, x_stride = x.shape[1], x, x.strides[0] // x.itemsize
        rows = x.shape[0] * heads
        if x.shape[0] > 1 and x.strides[0] % x.itemsize:
            raise ValueError(f"x token stride {x.strides[0]} is not a multiple of its item size")
    else:
        x2, x_stride = _norm_rows(x, "x")
        rows = x2.shape[0]
    dim = shape[-1]
    out = _out(out, shape, x.dtype)
    out2 = out.reshape(rows, dim)
    if rows == 0:
        return out
    fn, threads = _norm_kernel("rms_norm", out2, weight, [(x2, x_stride), (x2, dim), (out2, dim)])
    fn((rows,), (threads,), (_ptr(out2), _ptr(x2), _ptr(weight), _i32(dim),
                             _i64(x_stride), np.float32(eps), _i32(heads)))
    return out


def _is_head_strided(x) -> bool:
    """x: [T, H, D] whose heads are packed (D contiguous, H after it) but whose tokens are strided."""
    return (x.ndim == 3 and x.shape[0] > 0 and x.strides[2] == x.itemsize
            and x.strides[1] == x.shape[2] * x.itemsize and not x.flags.c_contiguous)


def add_rms_norm(x, residual, weight, eps: float, out=None):
    """Fused residual add then RMSNorm: s = x + residual; returns (rms_norm(s), s), both [T, D].

    out=(normed, s_out) may name preallocated buffers; s_out may be `residual` itself (in place).
    """
    _check_device(x, "x")
    _check_device(residual, "residual")
    _check_float(x, "x")
    _check_same_dtype(x, residual, "x", "residual")
    if x.shape != residual.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    shape = x.shape
    x2, x_stride = _norm_rows(x, "x")
    r2, r_stride = _norm_rows(residual, "residual")
    normed_out, s_out = out if out is not None else (None, None)
    normed = _out(normed_out, shape, x.dtype, "out[0]")
    s = _out(s_out, shape, x.dtype, "out[1]")
    n2, s2 = normed.reshape(x2.shape), s.reshape(x2.shape)
    if x2.shape[0] == 0:
        return normed, s
    dim = x2.shape[1]
    fn, threads = _norm_kernel("add_rms_norm", x2, weight,
                               [(x2, x_stride), (r2, r_stride), (n2, dim), (s2, dim)])
    fn((x2.shape[0],), (threads,), (_ptr(n2), _ptr(s2), _ptr(x2), _ptr(r2), _ptr(weight), _i32(dim),
                                    _i64(x_stride), _i64(r_stride), np.float32(eps)))
    return normed, s


def rotary(q, k, positions, cos_sin, out=None):
    """Neox-style rotary on q: [T, Hq, Dh] and k: [T, Hk, Dh] at positions [T].

    cos_sin: [max_pos, Dh] float32, cos in the first Dh/2 columns, sin in the last Dh/2.
    Returns the rotated (q, k); out=(q_out, k_out) may be (q, k) to rotate in place.
    """
    for a, what in ((q, "q"), (k, "k"), (cos_sin, "cos_sin")):
        _check_device(a, what)
    _check_float(q, "q")
    _check_same_dtype(q, k, "q", "k")
    if q.ndim != 3 or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rotary needs q [T, Hq, Dh] and k [T, Hk, Dh], got {tuple(q.shape)}, {tuple(k.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    if head_dim % 2 or cos_sin.ndim != 2 or cos_sin.shape[1] != head_dim or cos_sin.dtype != np.float32:
        raise ValueError(f"cos_sin must be float32 [max_pos, {head_dim}] (even head_dim), "
                         f"got {cos_sin.dtype} {tuple(cos_sin.shape)}")
    _check_contiguous(cos_sin, "cos_sin")
    positions = _as_device(positions, np.int32, "positions")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got {tuple(positions.shape)}")
    q_out, k_out = out if out is not None else (None, None)
    q_out = q_out if q_out is not None else _require_cupy().empty(q.shape, q.dtype)
    k_out = k_out if k_out is not None else _require_cupy().empty(k.shape, k.dtype)
    if q_out.shape != q.shape or k_out.shape != k.shape or q_out.dtype != q.dtype or k_out.dtype != k.dtype:
        raise ValueError("out=(q_out, k_out) must match q and k in shape and dtype")
    strides = [_row_stride(a, w) for a, w in ((q, "q"), (k, "k"), (q_out, "q_out"), (k_out, "k_out"))]
    if num_tokens == 0:
        return q_out, k_out
    ve = _vec_elems(q.dtype)
    vec = (head_dim // 2) % ve == 0 and _is_vec_aligned(zip((q, k, q_out, k_out), strides), ve)
    fn = _kernel("rotary.cu", q.dtype, "rotary_vec" if vec else "rotary_scalar")
    fn((num_tokens,), (128,), (_ptr(q_out), _ptr(k_out), _ptr(q), _ptr(k), _ptr(positions), _ptr(cos_sin),
                               _i32(num_heads), _i32(k.shape[1]), _i32(head_dim), *map(_i64, strides)))
    return q_out, k_out


def is_fp8_cache(cache) -> bool:
    """True for a cache of FP8 E4M3 bits (uint8)."""
    return cache.dtype == np.uint8


def _check_caches(k_cache, v_cache, act_dtype, kv_scales):
    """Caches in the activations' dtype, or uint8 FP8 ones with kv_scales [2] float32 on the
    device; returns (kernel defines, kv_scales pointer: 0 when not FP8)."""
    _check_device(k_cache, "k_cache")
    _check_device(v_cache, "v_cache")
    _check_same_dtype(k_cache, v_cache, "k_cache", "v_cache")
    if not is_fp8_cache(k_cache):
        if k_cache.dtype != act_dtype:
            raise ValueError(f"cache dtype {k_cache.dtype} must be the activations' {act_dtype} or uint8 (FP8)")
        return {}, np.uint64(0)
    if kv_scales is None:
        raise ValueError("an FP8 (uint8) KV cache needs kv_scales [2] float32 (k_scale, v_scale)")
    _check_device(kv_scales, "kv_scales")
    if kv_scales.dtype != np.float32 or kv_scales.shape != (2,) or not kv_scales.flags.c_contiguous:
        raise ValueError(f"kv_scales must be float32 [2] packed, got {kv_scales.dtype} {tuple(kv_scales.shape)}")
    return {"KV_FP8": 1}, _ptr(kv_scales)


def kv_append(k, v, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
    """Write k, v: [T, Hk, Dh] into the caches at slot_mapping [T] (-1: skip), in place; an FP8
    cache stores e4m3(k / k_scale), e4m3(v / v_scale) with kv_scales [2] (see numpy.py)."""
    for a, what in ((k, "k"), (v, "v")):
        _check_device(a, what)
    _check_float(k, "k")
    _check_same_dtype(k, v, "k", "v")
    fp8, scales_ptr = _check_caches(k_cache, v_cache, k.dtype, kv_scales)
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [num_blocks, block_size, Hk, Dh], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if k.shape != v.shape or k.ndim != 3 or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k and v must be [T, {num_kv_heads}, {head_dim}], got {tuple(k.shape)} and {tuple(v.shape)}")
    _check_contiguous(k_cache, "k_cache")
    _check_contiguous(v_cache, "v_cache")
    slot_mapping = _as_device(slot_mapping, np.int32, "slot_mapping")
    num_tokens = k.shape[0]
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    k_stride, v_stride = _row_stride(k, "k"), _row_stride(v, "v")
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    ve = _vec_elems(k.dtype)
    # An FP8 cache takes VEC_ELEMS bytes a vector: its pointers need that alignment only.
    vec = row % ve == 0 and _is_vec_aligned([(k, k_stride), (v, v_stride)], ve) and \
        all(c.data.ptr % (ve * c.dtype.itemsize) == 0 for c in (k_cache, v_cache))
    fn = _kernel("kv_append.cu", k.dtype, "kv_append_vec" if vec else "kv_append_scalar", **fp8)
    fn((num_tokens,), (128,), (_ptr(k_cache), _ptr(v_cache), _ptr(k), _ptr(v), _ptr(slot_mapping), _i32(row),
                               _i64(num_blocks * block_size), _i64(k_stride), _i64(v_stride), scales_ptr))


def calculate_kv_scales(k, v, kv_scales) -> None:
    """vLLM's calculate_kv_scales, in place: kv_scales [2] float32 = (max|k|, max|v|) / 448 over
    k, v: [T, Hk, Dh] (NaN skipped; 1.0 where the maximum is 0 or infinite). Runs eagerly once."""
    cp = _require_cupy()
    for a, what in ((k, "k"), (v, "v"), (kv_scales, "kv_scales")):
        _check_device(a, what)
    _check_float(k, "k")
    _check_same_dtype(k, v, "k", "v")
    if k.shape != v.shape or k.ndim != 3:
        raise ValueError(f"k and v must both be [T, Hk, Dh], got {tuple(k.shape)} and {tuple(v.shape)}")
    if kv_scales.dtype != np.float32 or kv_scales.shape != (2,):
        raise ValueError(f"kv_scales must be float32 [2], got {kv_scales.dtype} {tuple(kv_scales.shape)}")
    absmax = cp.zeros(2, np.float32)
    if k.shape[0]:
        fn = _kernel("kv_append.cu", k.dtype, "kv_absmax")
        fn((k.shape[0],), (128,), (_ptr(absmax), _ptr(k), _ptr(v), _i32(k.shape[1] * k.shape[2]),
                                   _i64(_row_stride(k, "k")), _i64(_row_stride(v, "v"))))
    ok = cp.isfinite(absmax) & (absmax > 0)
    kv_scales[...] = cp.where(ok, absmax / np.float32(FP8_E4M3_MAX), np.float32(1.0))


# The fused q/k norm + rotary + KV append kernel (rotary.cu); off: the separate kernels (the
# kernel benchmark counts a decode graph's nodes both ways).
FUSE_QK_NORM_ROTARY_KV_APPEND = True


def qk_norm_rotary_kv_append(q, k, v, q_norm, k_norm, eps: float, positions, cos_sin, k_cache, v_cache,
                             slot_mapping, kv_scales=None, out=None):
    """Per-head RMSNorm of q and k (when q_norm / k_norm [Dh] are given), rotary on both, and the
    KV append of the rotated k and v; returns the rotated q [T, Hq, Dh] (see numpy.py).

    One launch where the shapes allow it (16-byte aligned views, Dh / VEC_ELEMS a power of two <= 32,
    norm weights in q's dtype); else rms_norm, rotary and kv_append one after another, which give
    the same bits."""
    if not _can_fuse(q, k, v, q_norm, k_norm, cos_sin):
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        q, k = rotary(q, k, positions, cos_sin, out=(out, None))
        kv_append(k, v, k_cache, v_cache, slot_mapping, kv_scales)
        return q
    fp8, scales_ptr = _check_caches(k_cache, v_cache, q.dtype, kv_scales)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    positions, slot_mapping = _append_targets(q, k, k_cache, v_cache, positions, slot_mapping)
    out = _out(out, q.shape, q.dtype)
    if num_tokens == 0:
        return out
    name = "qk_norm_rotary_kv_append" if q_norm is not None else "rotary_kv_append"
    fn = _kernel("rotary.cu", q.dtype, name, HEAD_DIM=head_dim, **fp8)
    norm_ptrs = (_ptr(q_norm), _ptr(k_norm)) if q_norm is not None else (np.uint64(0), np.uint64(0))
    fn((num_tokens,), (128,), (_ptr(out), _ptr(k_cache), _ptr(v_cache), _ptr(q), _ptr(k), _ptr(v), *norm_ptrs,
                               np.float32(eps), _ptr(positions), _ptr(cos_sin), _ptr(slot_mapping), scales_ptr,
                               _i32(num_heads), _i32(num_kv_heads), _i64(_row_stride(q, "q")),
                               _i64(_row_stride(k, "k")), _i64(_row_stride(v, "v")), _i64(num_heads * head_dim),
                               _i64(num_blocks * block_size)))
    return out


def _append_targets(q, k, k_cache, v_cache, positions, slot_mapping):
    """The checked (positions, slot_mapping) [T] int32 on the device of a fused append of k into
    caches [num_blocks, block_size, Hk, Dh] (ValueError naming what does not fit)."""
    num_tokens, head_dim = q.shape[0], q.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (k.shape[1], head_dim):
        raise ValueError(f"caches must both be [num_blocks, block_size, {k.shape[1]}, {head_dim}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _check_contiguous(k_cache, "k_cache")
    _check_contiguous(v_cache, "v_cache")
    positions = _as_device(positions, np.int32, "positions")
    slot_mapping = _as_device(slot_mapping, np.int32, "slot_mapping")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions and slot_mapping must be [{num_tokens}], got {tuple(positions.shape)} "
                         f"and {tuple(slot_mapping.shape)}")
    return positions, slot_mapping


def _can_fuse(q, k, v, q_norm, k_norm, cos_sin) -> bool:
    """The fused kernel covers these arguments (else the caller runs the separate kernels)."""
    if not FUSE_QK_NORM_ROTARY_KV_APPEND:
        return False
    for a in (q, k, v, cos_sin):
        _check_device(a, "q, k, v and cos_sin")
    if q.dtype.name not in _DTYPE_IDS or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return False
    head_dim, ve = q.shape[2], _vec_elems(q.dtype)
    lanes = head_dim // ve
    if head_dim % (2 * ve) or lanes > 32 or lanes & (lanes - 1):
        return False
    if cos_sin.ndim != 2 or cos_sin.shape[1] != head_dim or cos_sin.dtype != np.float32 or not cos_sin.flags.c_contiguous:
        return False
    if q_norm is not None:
        for w in (q_norm, k_norm):
            if w is None or w.dtype != q.dtype or w.shape != (head_dim,) or w.data.ptr % _VEC_BYTES:
                return False
    try:
        strides = [(a, _row_stride(a, "x")) for a in (q, k, v)]
    except ValueError:
        return False
    return _is_vec_aligned(strides, ve)


def silu_and_mul(x, out=None):
    """x: [T, 2I] = [gate | up] -> silu(gate) * up: [T, I]."""
    _check_device(x, "x")
    _check_float(x, "x")
    if x.ndim != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs x [T, 2I], got {tuple(x.shape)}")
    x_stride = _row_stride(x, "x")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = _out(out, (num_tokens, inter), x.dtype)
    if num_tokens == 0 or inter == 0:
        return out
    ve = _vec_elems(x.dtype)
    vec = inter % ve == 0 and _is_vec_aligned([(x, x_stride), (out, inter)], ve)
    items = num_tokens * (inter // ve if vec else inter)
    fn = _kernel("activation.cu", x.dtype, "silu_and_mul_vec" if vec else "silu_and_mul_scalar")
    fn(((items + 255) // 256,), (256,), (_ptr(out), _ptr(x), _i64(num_tokens), _i32(inter), _i64(x_stride)))
    return out


# ----------------------------------------------------------------------------- attention

def _attention_meta(meta: AttentionMetadata):
    """Device int32 views of the metadata arrays (host arrays are uploaded, outside capture)."""
    qsl = _as_device(meta.query_start_loc, np.int32, "query_start_loc")
    seq_lens = _as_device(meta.seq_lens, np.int32, "seq_lens")
    tables = _as_device(meta.block_tables, np.int32, "block_tables")
    if qsl.ndim != 1 or seq_lens.ndim != 1 or qsl.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"query_start_loc must be [B+1] and seq_lens [B], got {tuple(qsl.shape)} "
                         f"and {tuple(seq_lens.shape)}")
    if tables.ndim != 2 or tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables must be [B, max_blocks], got {tuple(tables.shape)}")
    return qsl, seq_lens, tables


def decode_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int | None = None) -> int:
    """Context splits per sequence: batch x kv_heads x splits blocks fill the SMs (num_sms, read
    from the device by default) about two waves over, each split at least the min partition long.

    Under CUDA graphs max_seq_len is the capture's (max_model_len); a replay over shorter contexts
    leaves the splits past ceil(len / DECODE_MIN_PARTITION) empty.
    """
    sms = num_sms if num_sms is not None else _num_multiprocessors()
    want = -(-DECODE_BLOCKS_PER_SM * sms // max(1, batch * num_kv_heads))
    cap = -(-max(1, max_seq_len) // DECODE_MIN_PARTITION)
    return int(max(1, min(want, cap, DECODE_MAX_SPLITS)))


# Stand-ins for a layer's caches and kv_scales in a KernelLaunch's arguments (bound per layer).
K_CACHE, V_CACHE, KV_SCALES = object(), object(), object()


class KernelLaunch:
    """One kernel launch with its grid and arguments fixed, except the layer's caches and scales.

    The arguments are packed once, as cuLaunchKernel reads them (each in an 8-byte slot, with an
    array of the slots' addresses), so a launch writes the three addresses of its layer and calls
    the driver; CuPy's generic call converts every argument on each call, and a step of piecewise
    graphs makes a few launches a layer from the host.
    """

    def __init__(self, fn, grid: tuple, block: tuple, args: list, shared_mem: int = 0, keep: tuple = ()):
        self.fn, self.grid, self.block, self.shared_mem = fn, grid, block, shared_mem
        self.args = args
        self._slots = [(i, a) for i, a in enumerate(args) if a is K_CACHE or a is V_CACHE or a is KV_SCALES]
        self._keep = keep                # device buffers the arguments point to
        self._values = np.zeros(len(args), np.uint64)                  # [n] argument i's bytes in slot i
        raw = self._values.view(np.uint8).reshape(len(args), 8)
        for i, a in enumerate(args):
            if a is K_CACHE or a is V_CACHE or a is KV_SCALES:
                continue
            if not isinstance(a, np.generic) or a.dtype.itemsize > 8:
                raise TypeError(f"kernel argument {i} must be a NumPy scalar of at most 8 bytes, got {type(a).__name__}")
            raw[i, :a.dtype.itemsize] = np.frombuffer(a.tobytes(), np.uint8)
        slots = np.arange(len(args), dtype=np.uint64)
        self._params = np.uint64(self._values.ctypes.data) + np.uint64(8) * slots     # [n] void*: slot addresses
        self._dims = (*grid, *(1,) * (3 - len(grid)), *block, *(1,) * (3 - len(block)))
        self._function = getattr(fn, "kernel", fn).ptr    # a RawKernel's CUfunction on this device

    def __call__(self, k_ptr, v_ptr, scales_ptr) -> None:
        values = self._values
        for i, a in self._slots:
            values[i] = k_ptr if a is K_CACHE else v_ptr if a is V_CACHE else scales_ptr
        cuda = _require_cupy().cuda
        cuda.driver.launchKernel(self._function, *self._dims, self.shared_mem, cuda.get_current_stream().ptr,
                                 self._params.ctypes.data, 0)


def _decode(out, q, k_cache, qsl, seq_lens, tables, scale: float, max_seq_len: int,
            num_splits: int | None, fp8: dict, append: list | None = None) -> list[KernelLaunch]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    batch = seq_lens.shape[0]
    splits = num_splits or decode_num_splits(batch, num_kv_heads, max_seq_len)
    defines = {"HEAD_DIM": head_dim, "GQA": num_heads // num_kv_heads, **fp8}
    cp = _require_cupy()
    part_o = cp.empty((batch, num_heads, splits, head_dim), np.float32) if splits > 1 else out
    part_ml = cp.empty((batch, num_heads, splits, 2), np.float32) if splits > 1 else out
    # paged_decode_append (decode_attention_append) takes the raw k, v, the norms, rotary table and
    # slots between q and the caches.
    fn = _kernel("paged_attention.cu", q.dtype, "paged_decode" if append is None else "paged_decode_append", **defines)
    launches = [KernelLaunch(
        fn, (splits, num_kv_heads, batch), (128,),
        [_ptr(out), _i64(out.strides[0] // out.dtype.itemsize), _ptr(part_o), _ptr(part_ml), _ptr(q),
         _i64(_row_stride(q, "q")), *(append or ()), K_CACHE, V_CACHE, _ptr(tables),
         _i64(tables.strides[0] // 4), _ptr(seq_lens), _ptr(qsl), _i32(num_kv_heads),
         _i32(_log2_exact(block_size, "block_size")), np.float32(scale * LOG2E), _i32(splits),
         _i32(DECODE_MIN_PARTITION if splits > 1 else 0), KV_SCALES], keep=(part_o, part_ml))]
    if splits > 1:
        fn = _kernel("paged_attention.cu", q.dtype, "paged_decode_reduce", **defines)
        launches.append(KernelLaunch(fn, (num_heads, batch), (128,),
                                     [_ptr(out), _i64(out.strides[0] // out.dtype.itemsize), _ptr(part_o),
                                      _ptr(part_ml), _ptr(qsl), _i32(num_heads), _i32(splits)],
                                     keep=(part_o, part_ml)))
    return launches


def _prefill(out, q, k_cache, qsl, seq_lens, tables, scale: float, max_query_len: int, max_seq_len: int,
             kv_splits: int | None, row0: int, fp8: dict) -> list[KernelLaunch]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    batch = seq_lens.shape[0]
    flash = prefill_attention.variant(PREFILL_ATTENTION, q, k_cache, out, max_query_len, batch,
                                      _num_multiprocessors())
    if flash is not None:
        return prefill_attention.launch(flash, out, q, k_cache, qsl, seq_lens, tables, scale, max_query_len,
                                        max_seq_len, kv_splits, row0)
    q_stride = _row_stride(q, "q")
    use_mma = (q.dtype.name in ("float16", "bfloat16") and head_dim in (64, 128)
               and q.data.ptr % 4 == 0 and q_stride % 2 == 0)
    rows_per_block = 64 if use_mma else 16
    defines = {"HEAD_DIM": head_dim, "GQA": num_heads // num_kv_heads, **fp8}
    fn = _kernel("paged_attention.cu", q.dtype, "paged_prefill_mma" if use_mma else "paged_prefill_simple",
                 **defines)
    grid = (max(1, -(-max_query_len // rows_per_block)), num_heads, batch)
    return [KernelLaunch(fn, grid, (128,),
                         [_ptr(out), _i64(out.strides[0] // out.dtype.itemsize), _ptr(q), _i64(q_stride),
                          K_CACHE, V_CACHE, _ptr(tables), _i64(tables.strides[0] // 4),
                          _ptr(seq_lens), _ptr(qsl), _i32(num_heads), _i32(num_kv_heads),
                          _i32(_log2_exact(block_size, "block_size")), np.float32(scale * LOG2E), KV_SCALES])]


class AttentionPlan:
    """One step's attention launches, checked once, for any layer's caches of the checked shape.

    paged_attention() builds and runs one; a step that calls attention once a layer over the same
    q and output buffers (minillm/piecewise_graphs.py) builds one and runs it per layer, passing the
    layer's cache and scale addresses, which saves the checks and argument packing each time.
    """

    def __init__(self, out, launches: list[KernelLaunch], fp8: bool, keep: tuple):
        self.out, self.launches, self.fp8 = out, launches, fp8
        self._keep = keep                # the metadata and q arrays the launches point to

    def run(self, k_cache, v_cache, kv_scales=None):
        """Attention over these caches (of the planned shape and dtype) -> out [T, Hq, Dh]."""
        return self.run_at(_ptr(k_cache), _ptr(v_cache), _ptr(kv_scales) if self.fp8 else np.uint64(0))

    def run_at(self, k_ptr: int, v_ptr: int, scales_ptr: int = 0):
        """run() with the caches and scales given by device address."""
        k, v, sc = np.uint64(k_ptr), np.uint64(v_ptr), np.uint64(scales_ptr)
        for launch in self.launches:
            launch(k, v, sc)
        return self.out


def attention_plan(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_scales=None, out=None,
                   num_splits: int | None = None, append: list | None = None) -> AttentionPlan:
    """paged_attention's checks and launches for q, meta and caches shaped like k_cache / v_cache
    (append: decode_attention_append's extra kernel arguments, decode-only steps)."""
    _check_device(q, "q")
    _check_float(q, "q")
    fp8, _ = _check_caches(k_cache, v_cache, q.dtype, kv_scales)
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_attention needs q [T, Hq, Dh] and caches [num_blocks, block_size, Hk, Dh], "
                         f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads {num_heads} x {head_dim} do not fit caches with {num_kv_heads} "
                         f"KV heads x {k_cache.shape[3]}")
    if head_dim % _vec_elems(q.dtype):
        raise ValueError(f"head_dim {head_dim} must be a multiple of {_vec_elems(q.dtype)} for {q.dtype}")
    _check_contiguous(k_cache, "k_cache")
    _check_contiguous(v_cache, "v_cache")
    if k_cache.data.ptr % _VEC_BYTES or v_cache.data.ptr % _VEC_BYTES:
        raise ValueError("k_cache and v_cache must start on a 16-byte boundary")
    if not _is_vec_aligned([(q, _row_stride(q, "q"))], _vec_elems(q.dtype)):
        q = q.copy()                                  # the kernels read q in 16-byte vectors
    qsl, seq_lens, tables = _attention_meta(meta)
    out = _out(out, q.shape, q.dtype)
    launches: list[KernelLaunch] = []
    keep = (q, qsl, seq_lens, tables)
    if num_tokens == 0 or seq_lens.shape[0] == 0:
        return AttentionPlan(out, launches, bool(fp8), keep)
    if meta.is_decode_only:
        if num_tokens != seq_lens.shape[0]:
            raise ValueError(f"decode-only batch needs one query token per sequence, got {num_tokens} "
                             f"tokens for {seq_lens.shape[0]} sequences")
        launches += _decode(out, q, k_cache, qsl, seq_lens, tables, scale, int(meta.max_seq_len), num_splits, fp8,
                            append)
    else:                                             # one-token sequences first, then the chunks
        nd = int(meta.num_decode_seqs)
        if nd:
            launches += _decode(out, q, k_cache, qsl[:nd + 1], seq_lens[:nd], tables[:nd], scale,
                                int(meta.max_seq_len),
                                num_splits or _mixed_decode_splits(nd, num_kv_heads, int(meta.max_seq_len)), fp8)
        if nd < seq_lens.shape[0]:
            launches += _prefill(out, q, k_cache, qsl[nd:], seq_lens[nd:], tables[nd:], scale, int(meta.max_query_len),
                                 int(meta.prefill_max_seq_len or meta.max_seq_len), meta.prefill_kv_splits, nd, fp8)
    return AttentionPlan(out, launches, bool(fp8), keep)


def _mixed_decode_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Key splits of a mixed step's decode rows: none once they alone make
    MIXED_DECODE_UNSPLIT_BLOCKS_PER_SM blocks a multiprocessor (no reduce beside the chunks)."""
    if num_decodes * num_kv_heads >= MIXED_DECODE_UNSPLIT_BLOCKS_PER_SM * _num_multiprocessors():
        return 1
    return decode_num_splits(num_decodes, num_kv_heads, max_seq_len)


def mixed_step_splits_keys(q, k_cache, out, meta: AttentionMetadata) -> bool:
    """True when attention_plan would split the keys of this mixed step's decode rows or chunks
    (meta on the host; q [T, Hq, Dh] and out: the buffers attention would run on)."""
    nd, batch, num_kv_heads = int(meta.num_decode_seqs), len(meta.seq_lens), k_cache.shape[2]
    if nd and _mixed_decode_splits(nd, num_kv_heads, int(meta.max_seq_len)) > 1:
        return True
    if nd == batch or meta.prefill_kv_splits == 1:
        return False
    if meta.prefill_kv_splits is not None:
        return True
    sms = _num_multiprocessors()
    flash = prefill_attention.variant(PREFILL_ATTENTION, q, k_cache, out, int(meta.max_query_len), batch - nd, sms)
    if flash is None:                                 # the older kernels never split keys
        return False
    return prefill_attention.grid_kv_splits(flash, q.shape[0], q.shape[1], q.shape[2], num_kv_heads, batch - nd,
                                            int(meta.max_query_len),
                                            int(meta.prefill_max_seq_len or meta.max_seq_len), sms) > 1


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_scales=None, out=None,
                    num_splits: int | None = None):
    """Causal attention of ragged query chunks over their paged history (which includes them).

    q: [T, Hq, Dh] (token stride free, heads packed); returns [T, Hq, Dh]. Query row i of sequence
    b sits at position seq_lens[b] - q_len_b + i and attends to positions 0..that position. GQA:
    query head h reads KV head h // (Hq // Hk). meta.is_decode_only picks the split-K decode
    kernel (num_splits forces its split count), as do the first meta.num_decode_seqs sequences of
    a mixed step; else the prefill kernel (tensor cores for fp16 / bf16 at head_dim 64 and 128:
    prefill_attention.cu, over a 16-bit or an FP8 cache, or paged_prefill_mma when PREFILL_ATTENTION
    is "mma"). Caches in q's dtype, or uint8 FP8 with kv_scales [2] on the device. A small grid of
    prefill_attention.cu blocks at a long context splits their keys (meta.prefill_kv_splits
    forces the count; 1: none).
    """
    plan = attention_plan(q, k_cache, v_cache, meta, scale, kv_scales, out, num_splits)
    return plan.run(k_cache, v_cache, kv_scales)


# Decode-only steps: q/k norm, rotary and the KV append inside the decode attention kernel.
FUSE_DECODE_APPEND = True


def decode_attention_append(q, k, v, q_norm, k_norm, eps: float, positions, cos_sin, k_cache, v_cache,
                            slot_mapping, meta: AttentionMetadata, scale: float, kv_scales=None, out=None):
    """qk_norm_rotary_kv_append, then paged_attention of the rotated q: a layer's attention in a
    decode-only step (meta.is_decode_only), from the raw q [B, Hq, Dh], k, v [B, Hk, Dh]; returns
    [B, Hq, Dh] and leaves the token's K / V in the caches (see numpy.py).

    One launch (paged_decode_append, plus the reduce when the keys are split) where the shapes
    allow it (those of the fused append kernel); else the two calls. Same cache bits and, up to the
    softmax's summation order, the same output."""
    if not (FUSE_DECODE_APPEND and meta.is_decode_only and _can_fuse(q, k, v, q_norm, k_norm, cos_sin)):
        q = qk_norm_rotary_kv_append(q, k, v, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache,
                                     slot_mapping, kv_scales)
        return paged_attention(q, k_cache, v_cache, meta, scale, kv_scales, out)
    positions, slot_mapping = _append_targets(q, k, k_cache, v_cache, positions, slot_mapping)
    no_norm = np.uint64(0)
    append = [_ptr(k), _i64(_row_stride(k, "k")), _ptr(v), _i64(_row_stride(v, "v")),
              _ptr(q_norm) if q_norm is not None else no_norm, _ptr(k_norm) if q_norm is not None else no_norm,
              np.float32(eps), _ptr(positions), _ptr(cos_sin), _ptr(slot_mapping),
              _i64(k_cache.shape[0] * k_cache.shape[1])]
    return attention_plan(q, k_cache, v_cache, meta, scale, kv_scales, out, append=append).run(
        k_cache, v_cache, kv_scales)


# ----------------------------------------------------------------------------- sampling

def _check_logits(logits, what: str = "logits"):
    _check_device(logits, what)
    if logits.ndim != 2 or logits.dtype != np.float32:
        raise ValueError(f"{what} must be float32 [B, V], got {logits.dtype} {tuple(logits.shape)}")
    _check_contiguous(logits, what)


def apply_penalties(logits, rows, token_ids, output_counts, in_prompt, repetition, presence,
                    frequency) -> None:
    """Penalise seen tokens in place, as vLLM defines it (see minillm/ops/numpy.py)."""
    _check_logits(logits)
    batch, vocab = logits.shape
    ints = [_as_device(a, np.int32, w) for a, w in ((rows, "rows"), (token_ids, "token_ids"),
                                                     (output_counts, "output_counts"), (in_prompt, "in_prompt"))]
    floats = [_as_device(a, np.float32, w) for a, w in ((repetition, "repetition"), (presence, "presence"),
                                                         (frequency, "frequency"))]
    num_entries = ints[0].shape[0]
    if any(a.shape != (num_entries,) for a in ints):
        raise ValueError("rows, token_ids, output_counts and in_prompt must all be [N]")
    if any(a.shape != (batch,) for a in floats):
        raise ValueError(f"repetition, presence and frequency must all be [{batch}]")
    if num_entries == 0:
        return
    fn = _kernel("sampling.cu", np.float32, "apply_penalties_kernel")
    fn(((num_entries + 255) // 256,), (256,), (_ptr(logits), _i32(batch), _i32(vocab), *map(_ptr, ints),
                                              *map(_ptr, floats), _i32(num_entries)))


def log_softmax(logits, out=None):
    """logits: [B, V] -> log-probabilities [B, V] in float32."""
    _check_device(logits, "logits")
    if logits.dtype != np.float32 or not logits.flags.c_contiguous:
        logits = _require_cupy().ascontiguousarray(logits.astype(np.float32))
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    out = _out(out, logits.shape, np.float32)
    if logits.shape[0] == 0:
        return out
    fn = _kernel("sampling.cu", np.float32, "log_softmax_kernel")
    fn((logits.shape[0],), (1024,), (_ptr(out), _ptr(logits), _i32(logits.shape[1])))
    return out


def sample(logits, temperature, top_k, top_p, min_p, uniforms, out=None):
    """Pick one token per row; returns ids [B] int32 (the rule of minillm/ops/numpy.py.sample).

    logits: [B, V] float32; temperature, top_p, min_p, uniforms: [B] float32; top_k: [B] int32.
    """
    _check_logits(logits)
    batch, vocab = logits.shape
    params = [_as_device(temperature, np.float32, "temperature"), _as_device(top_k, np.int32, "top_k"),
              _as_device(top_p, np.float32, "top_p"), _as_device(min_p, np.float32, "min_p"),
              _as_device(uniforms, np.float32, "uniforms")]
    for a, what in zip(params, ("temperature", "top_k", "top_p", "min_p", "uniforms")):
        if a.shape != (batch,):
            raise ValueError(f"{what} must be [{batch}], got {tuple(a.shape)}")
    out = _out(out, (batch,), np.int32)
    if batch == 0:
        return out
    if vocab == 0:
        raise ValueError("logits must have at least one column")
    fn = _kernel("sampling.cu", np.float32, "sample_kernel")
    fn((batch,), (1024,), (_ptr(out), _ptr(logits), _i32(vocab), *map(_ptr, params)))
    return out


# ----------------------------------------------------------------------------- structured outputs

_BITMASK_THREADS = 256
_MAX_GRID_Y = 65535


def apply_token_bitmask(logits, bitmask, rows) -> None:
    """Set the logits of forbidden tokens to -inf, in place, in the listed rows (see numpy.py).

    logits: [B, V] float32 packed; bitmask: [N, W] int32 packed, W >= ceil(V / 32), 1 bits
    allowed, mask i for logits row rows[i]; rows: [N] int32 (a device array when capturing),
    entries outside [0, B) skipped.
    """
    _check_logits(logits)
    _check_device(bitmask, "bitmask")
    batch, vocab = logits.shape
    num_words = (vocab + 31) // 32
    rows = _as_device(rows, np.int32, "rows")
    if rows.ndim != 1:
        raise ValueError(f"rows must be [N], got {tuple(rows.shape)}")
    num_rows = rows.shape[0]
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != num_rows or bitmask.shape[1] < num_words:
        raise ValueError(f"bitmask must be int32 [{num_rows} (one per row), >= {num_words}], got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    _check_contiguous(bitmask, "bitmask")
    if num_rows > _MAX_GRID_Y:
        raise ValueError(f"rows may name at most {_MAX_GRID_Y} rows, got {num_rows}")
    if num_rows == 0 or batch == 0 or vocab == 0:
        return
    # Enough blocks for about eight per SM over all rows, never more than the row has tokens for.
    blocks_per_row = max(1, min(-(-vocab // _BITMASK_THREADS), -(-8 * _num_multiprocessors() // num_rows)))
    fn = _kernel("token_bitmask.cu", np.float32, "apply_token_bitmask_kernel")
    fn((blocks_per_row, num_rows), (_BITMASK_THREADS,),
       (_ptr(logits), _ptr(bitmask), _ptr(rows), _i32(batch), _i32(vocab), _i32(bitmask.shape[1])))
