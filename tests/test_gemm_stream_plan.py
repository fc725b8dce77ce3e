"""The stream GEMM candidates the tuner is offered (no GPU needed: the plan is arithmetic)."""
from __future__ import annotations

import pytest

from minillm.ops import gemm


def problem(tokens, n, k, dtype="bfloat16", out_dtype=None, stride=None):
    return gemm.GemmProblem(tokens, n, k, k if stride is None else stride, dtype, out_dtype or dtype, False)


@pytest.mark.parametrize("tokens", [1, 8, 16, 24, 64, 128, 256])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)])
def test_every_offered_candidate_fits_and_shapes_follow_the_batch(tokens, n, k):
    p = problem(tokens, n, k)
    cands = gemm.stream_candidates(p, num_sms=132)
    assert cands and len(set(cands)) == len(cands)
    rows = []
    for c in cands:
        shape, slices = divmod(c.param, 100)
        assert gemm.stream_fits(p, shape, slices)
        assert k % (slices * gemm.STREAM_BK) == 0
        rows.append(gemm.STREAM_SHAPES[shape][0])
    tallest = 16
    while tallest < min(tokens, 128):
        tallest *= 2
    assert max(rows) == tallest and min(rows) >= tallest // 4


def test_slices_stop_once_the_blocks_give_every_multiprocessor_two():
    p = problem(1, 1024, 3072)                                # 16 columns tiles of 64: 16 blocks a slice
    slices = {c.param % 100 for c in gemm.stream_candidates(p, num_sms=132) if c.param // 100 == 0}
    assert slices == {1, 2, 3, 4, 6, 8, 12, 16}
    few = {c.param % 100 for c in gemm.stream_candidates(p, num_sms=8) if c.param // 100 == 0}
    assert few == {1}                                          # 16 blocks already give 8 multiprocessors two
    big = problem(256, 6144, 1024)                            # 32 x 64 tiles: 768 blocks; 128 x 128: 96
    by_shape = {}
    for c in gemm.stream_candidates(big, num_sms=132):
        by_shape.setdefault(c.param // 100, set()).add(c.param % 100)
    assert by_shape[2] == {1} and by_shape[7] == {1, 2, 4}      # K = 1024 does not cut in 3


@pytest.mark.parametrize("p,why", [
    (problem(8, 1000, 1024), "N off the tile width"),
    (problem(8, 1024, 1000), "K off the 64-element stage"),
    (problem(8, 1024, 1024, dtype="float32"), "float32 inputs"),
    (problem(8, 1024, 1024, out_dtype="float16"), "an output dtype other than the input's or float32"),
    (problem(8, 1024, 1024, stride=1028), "a row stride that breaks 16-byte copies"),
])
def test_problems_the_kernel_cannot_take_get_no_candidate(p, why):
    assert gemm.stream_candidates(p, num_sms=132) == [], why
    assert not any(gemm.stream_fits(p, s, 1) for s in range(len(gemm.STREAM_SHAPES))), why


def test_sliced_workspace_bound_and_names():
    p = problem(256, 16384, 2048)
    assert not gemm.stream_fits(p, 0, 16)                       # 16 x 256 x 16384 fp32 partials: past 64 MiB
    assert gemm.stream_fits(p, 0, 1)
    r = gemm.TuneResult(p, gemm.DEFAULT)
    assert r.describe(gemm.Candidate("stream", 512)) == "stream/512 (64x128 tiles, 8 warps, 3 stages, 12 K slices)"
