"""The kernel profile of a benchmark run: Chrome-trace events summed by kernel and grid, grouped by kind."""
from __future__ import annotations

import pytest

from minillm.benchmarks.cli_args import BenchUsageError
from minillm.benchmarks.kernel_profile import by_kind, kernel_rows, kind_of, report
from minillm.benchmarks.throughput import parse_args


def trace(*events):
    """A Chrome trace holding the given (cat, name, dur, grid) events, and a host event that must not count."""
    evs = [{"ph": "X", "cat": c, "name": n, "dur": d, "args": {"grid": list(g)} if g else {}} for c, n, d, g in events]
    evs.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 1000.0, "args": {}})
    evs.append({"ph": "i", "cat": "kernel", "name": "paged_decode", "dur": 500.0})
    return {"traceEvents": evs}


def test_kernel_rows_sum_by_name_and_grid_longest_first():
    rows = kernel_rows(trace(("kernel", "paged_decode", 10.0, (2048, 1, 1)),
                             ("kernel", "paged_decode", 12.0, (2048, 1, 1)),
                             ("kernel", "paged_decode", 3.0, (64, 1, 1)),
                             ("kernel", "nvjet_hsh_128x64_64x4", 40.0, (8, 16, 1)),
                             ("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 2.0, ())))
    assert [(r.name, r.grid, r.count, r.total_us) for r in rows] == [
        ("nvjet_hsh_128x64_64x4", (8, 16, 1), 1, 40.0), ("paged_decode", (2048, 1, 1), 2, 22.0),
        ("paged_decode", (64, 1, 1), 1, 3.0), ("Memcpy HtoD (Pinned -> Device)", (), 1, 2.0)]


def test_kinds_follow_the_project_kernel_names():
    assert kind_of("paged_decode_append") == "decode attention"
    assert kind_of("prefill_attention_reduce") == "prefill attention"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == kind_of("splitk_reduce_vec4")
    assert kind_of("fused_qk_norm_rotary_append") == "norms, rotary, KV append, embedding"
    assert kind_of("silu_and_mul_vec") == "SiLU and multiply"
    assert kind_of("sample_kernel") == kind_of("apply_token_bitmask_kernel")
    assert kind_of("Memset (Device)") == "memsets"
    assert kind_of("some_new_kernel") == "other"


def test_report_shares_add_up_and_name_the_busy_time():
    rows = kernel_rows(trace(("kernel", "paged_decode", 300.0, (1,)), ("kernel", "cutlass_gemm", 100.0, (2,)),
                             ("kernel", "rms_norm", 100.0, (3,))))
    kinds = by_kind(rows)
    assert [k for k, _, _ in kinds][0] == "decode attention"
    assert sum(us for _, _, us in kinds) == 500.0
    text = report(rows, wall_s=0.001, steps=2, top=1)
    assert "device busy 0.00 s of the profiled run's 0.00 s (50%), 0.25 ms a step over 2 steps" in text
    assert "| decode attention | 1 | 0.000 | 60.0% | 300.0 |" in text
    assert "| decode attention | paged_decode | 1 | 1 | 0.000 | 60.0% | 300.0 |" in text
    assert text.count("| paged_decode |") == 1 and text.count("| cutlass_gemm |") == 1


def test_kernel_profile_needs_a_gpu_device():
    with pytest.raises(BenchUsageError, match="--kernel-profile: records CUDA kernels"):
        parse_args(["--device", "cpu", "--kernel-profile"])
