"""The projection GEMMs on the GPU: candidate implementations, a per-shape autotuner, the dispatch.

    out[T, N] = x[T, K] @ w[N, K]^T (+ beta * out), fp32 accumulation     (minillm/ops/cuda.linear)

Candidates for one GemmProblem (T, N, K, x's row stride, dtypes, whether beta is set):
    gemm_ex/<algo>  cublasGemmEx with CUBLAS_GEMM_DEFAULT (-1: what linear() always ran), with
                    CUBLAS_GEMM_DEFAULT_TENSOR_OP (99), and in "full" mode with every explicit id
                    (0-23, 100-115; cuBLAS documents them as without effect from Ampere on)
    lt/<i>          cublasLtMatmul with the i-th configuration cuBLASLt's heuristic offers (its tiles,
                    stages and its own split-K), LT_WORKSPACE_BYTES of workspace
    lt0/<i>         the i-th configuration it offers with no workspace at all: such a kernel needs no
                    zeroed counter in the workspace, so no memset node before it in a graph (cuBLAS's
                    default zeroes one before every product with N >= 65,536, such as the output head)
    split_k/<s>     K cut into s slices: one strided-batched cublasGemmEx writes the s fp32 partial
                    products to a workspace [s, T, N], and splitk_reduce (cuda/gemm.cu) sums them,
                    adds beta * out and rounds once
The tuner first runs each candidate once on the real input and a copy of the weights and compares
its output with the default's (a candidate that fails or differs is left out), then times each as a
CUDA graph of calls over copies of the weights that together overflow L2 (so weights come from
HBM, as in a decode step whose layers each read their own), re-times the fastest few, and keeps the
fastest; the default stays unless another beats it by TUNE_MARGIN. The choice is cached per
problem for the life of the process.

linear() tunes a problem on its first call when it is tunable: 16-bit inputs, T <= TUNE_MAX_TOKENS
with T 1, 2, 4 or a multiple of 8 (every padded decode-graph batch), weights up to
TUNE_MAX_WEIGHT_BYTES, and the current stream not capturing. The decode graphs run every batch size
once before capturing it, so each captured GEMM uses its tuned choice. Tuning runs on a stream of
its own, after the caller's queued work, and synchronises it. A decode-sized product with weights
past that bound (an output head: tuning it at every batch size would add seconds to start-up) runs
lt0/0, cuBLASLt's first zero-workspace configuration: for Qwen3-0.6B's head on an H200 it is 3-6 %
faster than the default at every decode batch size and captures as one node, not a memset and a
kernel. MINILLM_GEMM_AUTOTUNE=0 turns all this off (the default candidate everywhere); =full adds
the explicit cublasGemmEx ids.
"""
from __future__ import annotations

import logging
import os
import statistics
import threading
from dataclasses import dataclass, field

import numpy as np

from minillm.ops import cublas

logger = logging.getLogger("minillm.gemm")

TUNE_MAX_TOKENS = 256
TUNE_MAX_WEIGHT_BYTES = 256 << 20
TUNE_MARGIN = 0.03              # another candidate must be this much faster than the default
TUNE_MAX_CALLS = 16             # calls in one timed graph (each on its own copy of the weights)
TUNE_FINALISTS = 4
TUNE_REPLAYS = 5
VALIDATE_TOL = 2e-2             # max |out - default| against max |default|: reorderings pass, mistakes do not
SPLIT_K_SLICES = (2, 3, 4, 6, 8, 12, 16)
SPLIT_K_MIN_SLICE = 64          # elements of K per slice (also keeps each slice 16-byte aligned)
SPLIT_K_WORKSPACE_BYTES = 64 << 20
_DEFAULT_L2_BYTES = 50 << 20
_TUNED_DTYPES = ("float16", "bfloat16")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class GemmProblem:
    """One GEMM shape as the dispatch sees it."""

    num_tokens: int                  # T (rows of x and out)
    n: int                           # rows of w, columns of out
    k: int                           # the reduced dimension
    x_stride: int                    # x's row stride in elements (>= k)
    dtype: str                       # x and w
    out_dtype: str
    accumulate: bool                 # beta != 0 (a bias already in out)

    @property
    def weight_bytes(self) -> int:
        """Bytes of w."""
        return self.n * self.k * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Candidate:
    """One way to compute a GemmProblem."""

    kind: str                        # "gemm_ex" | "lt" | "lt0" | "split_k"
    param: int                       # the algorithm id, the heuristic's index, or the number of slices

    @property
    def name(self) -> str:
        """kind/param, e.g. split_k/4."""
        return f"{self.kind}/{self.param}"


DEFAULT = Candidate("gemm_ex", cublas.CUBLAS_GEMM_DEFAULT)


@dataclass
class TuneResult:
    """What the tuner measured for one problem and what it kept."""

    problem: GemmProblem
    choice: Candidate
    seconds: dict[Candidate, float] = field(default_factory=dict)   # per call, each candidate timed
    rejected: dict[Candidate, str] = field(default_factory=dict)    # why a candidate was left out
    notes: list[str] = field(default_factory=list)                  # e.g. why cuBLASLt offered nothing

    def describe(self, candidate: Candidate) -> str:
        """The candidate's name, with a cuBLASLt configuration in words."""
        plan = _lt_plans.get((self.problem, candidate.kind))
        if plan is not None and candidate.param < len(plan.algos):
            return f"{candidate.name} ({plan.describe(candidate.param)})"
        return candidate.name


_lock = threading.Lock()
_mode = os.environ.get("MINILLM_GEMM_AUTOTUNE", "1").strip().lower()
_choices: dict[GemmProblem, Candidate] = {}
_results: dict[GemmProblem, TuneResult] = {}
_lt_plans: dict[tuple[GemmProblem, str], object] = {}     # by (problem, "lt" | "lt0")
_lt_errors: dict[GemmProblem, str] = {}
_LT_WORKSPACES = {"lt": cublas.LT_WORKSPACE_BYTES, "lt0": 0}
_workspaces: dict[int, object] = {}
_tune_streams: dict[int, object] = {}
_probe_hosts: dict[tuple[int, str], np.ndarray] = {}


def set_autotune(mode: str) -> None:
    """'1' (tune), 'full' (also the explicit cublasGemmEx ids) or '0' (never tune); cached choices stay."""
    global _mode
    if mode not in ("0", "1", "full"):
        raise ValueError(f"autotune mode must be '0', '1' or 'full', got {mode!r}")
    _mode = mode


def clear_cache() -> None:
    """Forget every choice (the next eager call of a tunable problem tunes it again)."""
    with _lock:
        _choices.clear()
        _results.clear()


def tune_results() -> dict[GemmProblem, TuneResult]:
    """Every problem tuned so far and what was measured."""
    with _lock:
        return dict(_results)


def problem_of(out, x, w, beta: float = 0.0) -> GemmProblem:
    """The GemmProblem of out = x @ w^T (+ beta * out)."""
    return GemmProblem(int(x.shape[0]), int(w.shape[0]), int(x.shape[1]), int(x.strides[0] // x.dtype.itemsize),
                       x.dtype.name, out.dtype.name, beta != 0.0)


def _is_decode_sized(p: GemmProblem) -> bool:
    """16-bit inputs at a padded decode-graph batch size, autotuning on."""
    t = p.num_tokens
    return (_mode != "0" and p.dtype in _TUNED_DTYPES and 1 <= t <= TUNE_MAX_TOKENS
            and (t in (1, 2, 4) or t % 8 == 0) and p.n > 0 and p.k > 0)


def is_tunable(p: GemmProblem) -> bool:
    """True when linear() tunes this problem on its first call (see the module docstring)."""
    return _is_decode_sized(p) and p.weight_bytes <= TUNE_MAX_WEIGHT_BYTES


def untuned_choice(p: GemmProblem) -> Candidate:
    """What a problem that is not tuned runs: cuBLAS's default, except a decode-sized product whose
    weights are too large to tune (an output head), which runs cuBLASLt's first configuration that
    needs no workspace, when it has one."""
    if not _is_decode_sized(p) or p.weight_bytes <= TUNE_MAX_WEIGHT_BYTES:
        return DEFAULT
    plan = lt_plan(p, "lt0")
    c = Candidate("lt0", 0) if plan is not None and plan.algos else DEFAULT
    with _lock:
        _choices[p] = c
    return c


def split_k_fits(p: GemmProblem, splits: int) -> bool:
    """True when K cuts into `splits` slices of whole multiples of SPLIT_K_MIN_SLICE and the
    partial products fit the workspace."""
    return (p.k % splits == 0 and (p.k // splits) % SPLIT_K_MIN_SLICE == 0
            and splits * p.num_tokens * p.n * 4 <= SPLIT_K_WORKSPACE_BYTES)


def lt_plan(p: GemmProblem, kind: str = "lt"):
    """The problem's cuBLASLt plan (cached) with the workspace of candidate kind "lt" or "lt0", or
    None when cuBLASLt is missing."""
    key = (p, kind)
    with _lock:
        if key in _lt_plans or p in _lt_errors:
            return _lt_plans.get(key)
    try:
        plan = cublas.LtPlan(p.num_tokens, p.n, p.k, p.x_stride, p.dtype, p.out_dtype,
                             workspace_bytes=_LT_WORKSPACES[kind])
    except (OSError, RuntimeError, AttributeError, ValueError) as e:
        with _lock:
            _lt_errors[p] = f"cuBLASLt: {e}"
        return None
    with _lock:
        _lt_plans[key] = plan
    return plan


def candidates(p: GemmProblem, explicit_algos: bool | None = None) -> list[Candidate]:
    """Every candidate for p, the default first."""
    out = [DEFAULT, Candidate("gemm_ex", cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP)]
    if explicit_algos if explicit_algos is not None else _mode == "full":
        out += [Candidate("gemm_ex", a) for a in cublas.CUBLAS_GEMM_EXPLICIT_ALGOS]
    for kind in _LT_WORKSPACES:
        plan = lt_plan(p, kind)
        if plan is not None:
            out += [Candidate(kind, i) for i in range(len(plan.algos))]
    out += [Candidate("split_k", s) for s in SPLIT_K_SLICES if split_k_fits(p, s)]
    return out


def _split_k_workspace():
    """The device's split-K workspace (cudaMalloc'd once, kept: captured graphs hold its address)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    with _lock:
        ws = _workspaces.get(dev)
        if ws is None:
            ws = _workspaces[dev] = cublas.raw_device_buffer(SPLIT_K_WORKSPACE_BYTES)
    return ws


def _split_k(out, x, w, splits: int, accumulate: bool) -> None:
    from minillm.ops.cuda import _kernel   # the kernel loader (imported here: cuda imports this module)

    ws = _split_k_workspace()
    cublas.matmul_nt_split_k(ws.ptr, x, w, splits)
    mn = int(out.size)
    vec = mn % 4 == 0
    fn = _kernel("gemm.cu", out.dtype, "splitk_reduce_vec4" if vec else "splitk_reduce_scalar")
    items = mn // 4 if vec else mn
    fn(((items + 255) // 256,), (256,), (np.uint64(out.data.ptr), np.uint64(ws.ptr), np.int64(mn),
                                        np.int32(splits), np.int32(1 if accumulate else 0)))


def run(p: GemmProblem, c: Candidate, out, x, w, beta: float = 0.0) -> None:
    """Compute out = x @ w^T (+ beta * out) with candidate c on the current stream (raises when c
    cannot run p)."""
    if c.kind == "gemm_ex":
        cublas.matmul_nt(out, x, w, beta, c.param)
    elif c.kind in _LT_WORKSPACES:
        plan = lt_plan(p, c.kind)
        if plan is None or not 0 <= c.param < len(plan.algos):
            raise RuntimeError(f"{c.name}: no such cuBLASLt configuration for {p}")
        plan.matmul(c.param, out, x, w, beta)
    elif c.kind == "split_k":
        if not split_k_fits(p, c.param) or not out.flags.c_contiguous:
            raise RuntimeError(f"{c.name} does not fit {p}")
        if beta not in (0.0, 1.0):
            raise RuntimeError(f"{c.name} adds out with beta 1 only, got {beta}")
        _split_k(out, x, w, c.param, beta != 0.0)
    else:
        raise ValueError(f"unknown candidate kind {c.kind!r}")


def _is_aligned(*arrays) -> bool:
    return all(a.data.ptr % cublas.LT_MIN_ALIGNMENT_BYTES == 0 for a in arrays)


def _is_capturing() -> bool:
    import cupy

    try:
        return bool(cupy.cuda.get_current_stream().is_capturing())
    except Exception:  # a stream that cannot say: take it as capturing (never tune there)
        return True


def choice_for(p: GemmProblem, x, w) -> Candidate:
    """The cached choice for p, tuning p now when it is tunable (the default otherwise)."""
    with _lock:
        c = _choices.get(p)
    if c is not None:
        return c
    if _is_capturing():
        return DEFAULT
    return tune(p, x, w).choice if is_tunable(p) else untuned_choice(p)


def matmul(out, x, w, beta: float = 0.0, candidate: Candidate | None = None) -> None:
    """out = x @ w^T (+ beta * out) with the given candidate, or the problem's tuned choice."""
    p = problem_of(out, x, w, beta)
    c = candidate if candidate is not None else choice_for(p, x, w)
    if candidate is None and c.kind in _LT_WORKSPACES and not _is_aligned(out, x, w):
        c = DEFAULT                      # cuBLASLt's configurations were chosen for 16-byte operands
    run(p, c, out, x, w, beta)


# ----------------------------------------------------------------------------- the tuner

def _tune_stream():
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    with _lock:
        s = _tune_streams.get(dev)
        if s is None:
            s = _tune_streams[dev] = cupy.cuda.Stream(non_blocking=True)
    return s


def tune(p: GemmProblem, x, w, explicit_algos: bool | None = None) -> TuneResult:
    """Measure every candidate for p on a random x of its shape and copies of w (x itself only
    gives the problem), cache and return the choice.

    Waits for the work queued on the current stream, runs on a stream of its own and returns
    when done; the current stream must not be capturing.
    """
    import cupy

    caller = cupy.cuda.get_current_stream()
    stream = _tune_stream()
    stream.wait_event(caller.record())
    with stream:
        try:
            result = _tune_on(stream, p, x, w, explicit_algos)
        except (RuntimeError, OSError, ValueError) as e:   # the default then; a CUDA error stays sticky
            logger.warning("gemm %s: tuning failed (%s: %s), cuBLAS's default kept", p, type(e).__name__, e)
            result = TuneResult(p, DEFAULT, notes=[f"tuning failed: {type(e).__name__}: {e}"])
        finally:
            stream.synchronize()
    with _lock:
        _choices[p] = result.choice
        _results[p] = result
    default_t, chosen_t = result.seconds.get(DEFAULT), result.seconds.get(result.choice)
    logger.debug("gemm %s: %s %.2f us (default %s us)", p, result.describe(result.choice),
                 (chosen_t or 0.0) * 1e6, f"{default_t * 1e6:.2f}" if default_t else "-")
    return result


def _weight_copies(stream, w, p: GemmProblem):
    """Copies of w that together overflow L2 (w alone when it does): ([N, K] arrays, their buffer)."""
    import cupy

    try:
        l2 = int(cupy.cuda.Device().attributes["L2CacheSize"])
    except Exception:  # attribute missing in this CuPy: the H100 / H200 figure
        l2 = _DEFAULT_L2_BYTES
    nbytes = p.weight_bytes
    count = min(TUNE_MAX_CALLS, -(-2 * l2 // nbytes))
    if count <= 1:
        return [w], None
    buf = cublas.raw_device_buffer(count * nbytes)
    rt = cupy.cuda.runtime
    copies = []
    for i in range(count):
        rt.memcpyAsync(buf.ptr + i * nbytes, w.data.ptr, nbytes, rt.memcpyDeviceToDevice, stream.ptr)
        copies.append(cupy.ndarray(w.shape, dtype=w.dtype, memptr=cupy.cuda.MemoryPointer(buf, i * nbytes)))
    return copies, buf


def _probe_input(p: GemmProblem):
    """A random x [T, K] with p's row stride (the caller's x may hold anything, even NaN, in a
    warm-up pass; the check needs finite values). Host values are drawn once per stride and dtype."""
    from minillm.ops.cuda import _host_bf16_bits, asarray

    key = (p.x_stride, p.dtype)
    with _lock:
        host = _probe_hosts.get(key)
    if host is None:
        x32 = np.random.default_rng(p.x_stride).standard_normal((TUNE_MAX_TOKENS, p.x_stride), np.float32)
        host = _host_bf16_bits(x32) if p.dtype == "bfloat16" else x32.astype(p.dtype)
        with _lock:
            _probe_hosts[key] = host
    return asarray(host[:p.num_tokens], p.dtype)[:, :p.k]


def _initial_out(p: GemmProblem, dtype):
    """What out holds before a call: 1 where a bias is added (beta = 1), else NaN (an element a
    candidate fails to write then fails the check)."""
    from minillm.ops.cuda import asarray

    fill = 1.0 if p.accumulate else np.nan
    return asarray(np.full((p.num_tokens, p.n), fill, np.float32), dtype)


def _copy(dst, src, stream) -> None:
    rt = __import__("cupy").cuda.runtime
    rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, stream.ptr)


def _max_abs_diff(a, b, stats) -> tuple[float, float]:
    """(max |a - b|, max |b|) of two packed arrays of one dtype (waits for the stream)."""
    from minillm.ops.cuda import _kernel
    import cupy

    rt = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream()
    rt.memsetAsync(stats.data.ptr, 0, stats.nbytes, stream.ptr)
    n = int(a.size)
    fn = _kernel("gemm.cu", a.dtype, "max_abs_diff")
    fn(((n + 255) // 256,), (256,), (np.uint64(stats.data.ptr), np.uint64(a.data.ptr), np.uint64(b.data.ptr),
                                     np.int64(n)))
    diff, mag = (float(v) for v in stats.get(stream=stream).view(np.float32))
    return diff, mag


def _validate(stream, p: GemmProblem, cands, x, w, beta: float, init, rejected: dict) -> list[Candidate]:
    """The candidates whose output equals the default's, within VALIDATE_TOL."""
    import cupy

    ref, out = cupy.empty_like(init), cupy.empty_like(init)
    _copy(ref, init, stream)
    run(p, DEFAULT, ref, x, w, beta)
    stats = cupy.zeros(2, dtype=cupy.uint32)
    valid = []
    for c in cands:
        _copy(out, init, stream)
        try:
            run(p, c, out, x, w, beta)
        except (RuntimeError, OSError, ValueError) as e:
            rejected[c] = str(e)
            continue
        diff, mag = _max_abs_diff(out, ref, stats)
        if not diff <= VALIDATE_TOL * max(mag, 1e-30):    # NaN fails too
            rejected[c] = f"differs from the default: max |diff| {diff:.3g}, max |out| {mag:.3g}"
            continue
        valid.append(c)
    return valid


def _capture(stream, fn, calls: int):
    """A CUDA graph of fn(0) ... fn(calls - 1) captured on stream."""
    stream.begin_capture()
    try:
        for i in range(calls):
            fn(i)
    except BaseException:
        try:
            stream.end_capture()
        except Exception:  # an invalidated capture still ends; its own error adds nothing
            pass
        raise
    return stream.end_capture()


def _time(stream, graph, calls: int, replays: int) -> float:
    """Median seconds per call over replays of graph (after one warm replay)."""
    import cupy

    graph.launch(stream)
    times = []
    for _ in range(replays):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3 / calls)
    return statistics.median(times)


def _tune_on(stream, p: GemmProblem, x, w, explicit_algos) -> TuneResult:
    result = TuneResult(p, DEFAULT)
    cands = candidates(p, explicit_algos)
    if p in _lt_errors:
        result.notes.append(_lt_errors[p])
    beta = 1.0 if p.accumulate else 0.0
    x = _probe_input(p)
    copies, _buf = _weight_copies(stream, w, p)
    init = _initial_out(p, p.out_dtype)
    valid = _validate(stream, p, cands, x, copies[0], beta, init, result.rejected)
    out = __import__("cupy").empty_like(init)
    _copy(out, init, stream)
    graphs = {}
    calls = max(2, len(copies))
    for c in valid:
        try:
            graph = _capture(stream, lambda i, c=c: run(p, c, out, x, copies[i % len(copies)], beta), calls)
            result.seconds[c] = _time(stream, graph, calls, 1)
            graphs[c] = graph
        except Exception as e:  # noqa: BLE001 -- a candidate that cannot be captured is left out
            result.rejected[c] = f"capture: {type(e).__name__}: {e}"
    if not graphs:
        return result
    finalists = sorted(graphs, key=result.seconds.get)[:TUNE_FINALISTS]
    if DEFAULT in graphs and DEFAULT not in finalists:
        finalists.append(DEFAULT)
    for c in finalists:
        result.seconds[c] = _time(stream, graphs[c], calls, TUNE_REPLAYS)
    best = min(finalists, key=result.seconds.get)
    default_t = result.seconds.get(DEFAULT)
    if default_t is None or result.seconds[best] < default_t * (1.0 - TUNE_MARGIN):
        result.choice = best
    return result
