"""The GEMM tuner's rules on the CPU: which shapes it tunes, which split-K cuts fit, and the
cuBLASLt descriptors built through ctypes (where libcublasLt can be loaded; it needs no GPU)."""
from __future__ import annotations

import ctypes

import pytest

from minillm.ops import cublas, gemm


def problem(tokens=256, n=1024, k=2048, dtype="bfloat16", out_dtype="bfloat16", accumulate=False):
    return gemm.GemmProblem(tokens, n, k, k, dtype, out_dtype, accumulate)


@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16, 24, 64, 80, 128, 256])
def test_every_decode_graph_batch_size_is_tunable(tokens):
    from minillm.cuda_graphs import graph_batch_sizes
    assert tokens in graph_batch_sizes(256)
    assert gemm.is_tunable(problem(tokens))


@pytest.mark.parametrize("kw", [dict(tokens=3), dict(tokens=100), dict(tokens=264), dict(tokens=4096),
                                dict(dtype="float32", out_dtype="float32"), dict(n=151936, k=1024)])
def test_prefill_sizes_float32_and_huge_weights_are_not(kw):
    assert not gemm.is_tunable(problem(**kw))


def test_autotune_off_tunes_nothing():
    try:
        gemm.set_autotune("0")
        assert not gemm.is_tunable(problem())
    finally:
        gemm.set_autotune("1")
    assert gemm.is_tunable(problem())
    with pytest.raises(ValueError):
        gemm.set_autotune("yes")


def test_split_k_cuts_whole_aligned_slices_that_fit_the_workspace():
    o_proj = problem(256, 1024, 2048)
    assert [s for s in gemm.SPLIT_K_SLICES if gemm.split_k_fits(o_proj, s)] == [2, 4, 8, 16]
    down = problem(256, 1024, 3072)
    assert [s for s in gemm.SPLIT_K_SLICES if gemm.split_k_fits(down, s)] == [2, 3, 4, 6, 8, 12, 16]
    gate_up = problem(256, 6144, 1024)        # 16 slices of [256, 6144] fp32 would overflow 64 MB
    assert [s for s in gemm.SPLIT_K_SLICES if gemm.split_k_fits(gate_up, s)] == [2, 4, 8]
    assert not gemm.split_k_fits(problem(8, 64, 96), 2)      # 48-element slices


def test_candidate_names_and_the_default():
    assert gemm.DEFAULT.name == "gemm_ex/-1"
    assert gemm.Candidate("split_k", 4).name == "split_k/4"
    assert len(cublas.CUBLAS_GEMM_EXPLICIT_ALGOS) == 40


def test_heuristic_result_matches_the_header_layout():
    assert ctypes.sizeof(cublas.LtMatmulAlgo) == 64
    assert ctypes.sizeof(cublas.LtHeuristicResult) == 96
    assert cublas.LtHeuristicResult.workspaceSize.offset == 64
    assert cublas.LtHeuristicResult.state.offset == 72
    assert cublas.LtHeuristicResult.wavesCount.offset == 76


def test_lt_descriptors_build_through_ctypes():
    try:
        lib = cublas.load_lt_library()
    except OSError as e:
        pytest.skip(f"no libcublasLt here: {str(e).splitlines()[0]}")
    for dtype, out_dtype in (("bfloat16", "bfloat16"), ("float16", "float32")):
        desc, a, b, c = cublas.lt_describe(lib, 256, 1024, 2048, 2048, dtype, out_dtype)
        assert all(d.value for d in (desc, a, b, c))
        for layout in (a, b, c):
            assert lib.cublasLtMatrixLayoutDestroy(layout) == 0
        assert lib.cublasLtMatmulDescDestroy(desc) == 0
    with pytest.raises(RuntimeError, match="status"):     # a wrong attribute size is refused, not ignored
        desc = cublas.lt_describe(lib, 8, 8, 8, 8, "bfloat16", "bfloat16")[0]
        cublas._set_attr(lib.cublasLtMatmulDescSetAttribute, desc, cublas.CUBLASLT_MATMUL_DESC_TRANSA,
                         ctypes.c_int8(1))
