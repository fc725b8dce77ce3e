"""Every GEMM candidate (cublasGemmEx algorithms, cuBLASLt configurations, split-K) against NumPy,
and the tuner: it keeps a correct candidate, caches it, and the choice captures into a CUDA graph."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import HAS_GPU, cupy
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.ops import cuda as ops
    from minillm.ops import gemm

TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 5e-3}
# Qwen3-0.6B's decode projections (qkv, o, gate_up, down) and a shape off every tile size.
SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (192, 200)]


def to_host32(dev) -> np.ndarray:
    if dev.dtype.name == "bfloat16":
        bits = cupy.asnumpy(cupy.ascontiguousarray(dev).view(cupy.uint16)).astype(np.uint32)
        return (bits << 16).view(np.float32)
    return cupy.asnumpy(dev).astype(np.float32)


def operands(rng, tokens, k, n, dtype):
    x = ops.asarray(rng.standard_normal((tokens, k)).astype(np.float32), dtype)
    w = ops.asarray((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), dtype)
    return x, w, to_host32(x).astype(np.float64) @ to_host32(w).T.astype(np.float64)


def rel_error(got, ref) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def nan_out(shape, dtype):
    return ops.asarray(np.full(shape, np.nan, np.float32), dtype)


@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
@pytest.mark.parametrize("k,n", SHAPES)
def test_every_candidate_matches_numpy(tokens, k, n):
    rng = np.random.default_rng(tokens + k + n)
    x, w, ref = operands(rng, tokens, k, n, "bfloat16")
    out = nan_out((tokens, n), "bfloat16")
    p = gemm.problem_of(out, x, w)
    cands = gemm.candidates(p, explicit_algos=True)
    kinds = {c.kind for c in cands}
    assert "lt" in kinds, "cuBLASLt offered no configuration"
    if p.k % 128 == 0:
        assert "split_k" in kinds
    ran = 0
    for c in cands:
        out = nan_out((tokens, n), "bfloat16")
        try:
            gemm.run(p, c, out, x, w)
        except RuntimeError as e:
            # only an explicit cublasGemmEx id may be refused (by its status, before any work)
            assert c.kind == "gemm_ex" and c.param not in (-1, 99), f"{c.name}: {e}"
            continue
        got = to_host32(out)
        assert np.isfinite(got).all(), f"{c.name}: an element was not written"
        assert rel_error(got, ref) < TOL["bfloat16"], f"{c.name} tokens={tokens} k={k} n={n}"
        ran += 1
    assert ran >= 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_candidates_with_a_bias_and_with_float32_output(dtype):
    rng = np.random.default_rng(7)
    tokens, k, n = 64, 2048, 1024
    x, w, ref = operands(rng, tokens, k, n, dtype)
    bias32 = rng.standard_normal(n).astype(np.float32)
    bias = ops.asarray(bias32, dtype)
    want_bias = ref + to_host32(bias)
    for out_dtype in (dtype, "float32"):
        probe = nan_out((tokens, n), out_dtype)
        for accumulate in ((False, True) if out_dtype == dtype else (False,)):
            p = gemm.problem_of(probe, x, w, 1.0 if accumulate else 0.0)
            for c in gemm.candidates(p):
                got = ops.linear(x, w, bias if accumulate else None, out=nan_out((tokens, n), out_dtype),
                                 out_dtype=out_dtype if not accumulate else None, candidate=c)
                want = want_bias if accumulate else ref
                tol = 1e-5 if out_dtype == "float32" else TOL[dtype]
                assert rel_error(to_host32(got), want) < tol, f"{c.name} {out_dtype} bias={accumulate}"


def test_tuner_keeps_a_correct_candidate_and_caches_it():
    rng = np.random.default_rng(3)
    x, w, ref = operands(rng, 128, 2048, 1024, "bfloat16")
    gemm.clear_cache()
    got = to_host32(ops.linear(x, w))                      # first call of a tunable shape: tunes
    assert rel_error(got, ref) < TOL["bfloat16"]
    results = gemm.tune_results()
    assert len(results) == 1
    (p, result), = results.items()
    assert p.num_tokens == 128 and gemm.DEFAULT in result.seconds
    assert result.choice in result.seconds and all(t > 0 for t in result.seconds.values())
    assert result.seconds[result.choice] <= result.seconds[gemm.DEFAULT]
    ops.linear(x, w)
    assert gemm.tune_results() == results                  # cached: not tuned again
    untuned = ops.asarray(rng.standard_normal((100, 2048)).astype(np.float32), "bfloat16")
    ops.linear(untuned, w)                                 # T = 100 is not a decode batch size
    assert len(gemm.tune_results()) == 1


def test_the_tuned_choice_captures_into_a_graph():
    rng = np.random.default_rng(4)
    x, w, ref = operands(rng, 64, 3072, 1024, "bfloat16")
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    gemm.clear_cache()
    with stream, cupy.cuda.using_allocator(pool.malloc):
        eager = to_host32(ops.linear(x, w))                # tunes, then runs the choice
        stream.begin_capture()
        out = ops.linear(x, w)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(to_host32(out), eager)
    assert rel_error(eager, ref) < TOL["bfloat16"]


def test_a_shape_first_seen_during_a_capture_runs_the_default():
    rng = np.random.default_rng(5)
    x, w, ref = operands(rng, 32, 1024, 512, "bfloat16")
    gemm.clear_cache()
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    with stream, cupy.cuda.using_allocator(pool.malloc):
        ops.linear(x[:8], w)                                # warm the kernels: another shape, tuned
        stream.begin_capture()
        out = ops.linear(x, w)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert rel_error(to_host32(out), ref) < TOL["bfloat16"]
    assert all(p.num_tokens == 8 for p in gemm.tune_results())


def test_zero_workspace_configurations_are_correct_and_capture_as_one_kernel_node():
    """An output-head-sized product (N >= 65,536, where cuBLAS's default zeroes a workspace counter
    first): each lt0 candidate equals NumPy and captures as a single kernel node, no memset."""
    from minillm.benchmarks.kernels import graph_node_count

    rng = np.random.default_rng(9)
    tokens, k, n = 64, 1024, 65536
    x, w, ref = operands(rng, tokens, k, n, "bfloat16")
    out = cupy.empty((tokens, n), cupy.float32)
    p = gemm.problem_of(out, x, w)
    lt0 = [c for c in gemm.candidates(p) if c.kind == "lt0"]
    assert lt0, "cuBLASLt offered no configuration without a workspace"
    for c in lt0:
        out.fill(np.nan)
        gemm.run(p, c, out, x, w)
        assert rel_error(cupy.asnumpy(out), ref) < 1e-5, c.name
        nodes = graph_node_count(cupy, ops, lambda c=c: gemm.run(p, c, out, x, w))
        assert (nodes["nodes"], nodes["kernel_nodes"]) == (1, 1), (c.name, nodes)

def test_a_product_too_large_to_tune_runs_a_zero_workspace_configuration(monkeypatch):
    """A decode-sized product past TUNE_MAX_WEIGHT_BYTES (an output head) is not tuned: linear()
    runs lt0/0, equal to NumPy, and its graph is that one kernel."""
    from minillm.benchmarks.kernels import graph_node_count

    rng = np.random.default_rng(10)
    tokens, k, n = 64, 1024, 65536
    x, w, ref = operands(rng, tokens, k, n, "bfloat16")
    monkeypatch.setattr(gemm, "TUNE_MAX_WEIGHT_BYTES", 1 << 20)
    gemm.clear_cache()
    try:
        got = ops.linear(x, w, out_dtype="float32")
        p = gemm.problem_of(got, x, w)
        assert not gemm.is_tunable(p) and gemm.untuned_choice(p) == gemm.Candidate("lt0", 0)
        assert gemm.tune_results() == {}
        assert rel_error(cupy.asnumpy(got), ref) < 1e-5
        nodes = graph_node_count(cupy, ops, lambda: ops.linear(x, w, out_dtype="float32"))
        assert (nodes["nodes"], nodes["kernel_nodes"]) == (1, 1), nodes
        assert not gemm.is_tunable(gemm.problem_of(got[:3], x[:3], w))   # T = 3: not a decode size
        assert gemm.untuned_choice(gemm.problem_of(got[:3], x[:3], w)) == gemm.DEFAULT
    finally:
        gemm.clear_cache()
