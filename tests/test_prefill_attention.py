"""Which prefill attention kernel and block shape runs (minillm/ops/prefill_attention.py), on the CPU.

The choice reads only dtypes, shapes and pointers, so stand-ins for CuPy arrays do here; the kernel
itself is held to the NumPy twin in tests/test_prefill_attention_gpu.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from minillm.ops import prefill_attention as pa

H200_SMS = 132
SMEM_PER_SM = 228 * 1024            # Hopper: shared memory of one multiprocessor
SMEM_PER_BLOCK_RESERVED = 1024      # the runtime keeps 1 KB of it per resident block


def array(shape, dtype="bfloat16", ptr=1 << 20):
    """What variant() reads of a device array: dtype (name), shape and the data pointer."""
    return SimpleNamespace(shape=shape, dtype=SimpleNamespace(name=dtype), data=SimpleNamespace(ptr=ptr))


def choose(kernel="flash", heads=16, kv_heads=8, head_dim=128, dtype="bfloat16", kv_dtype=None, out_ptr=1 << 20,
           max_query_len=2048, batch=1):
    q = array((max_query_len, heads, head_dim), dtype)
    k = array((100, 16, kv_heads, head_dim), kv_dtype or dtype)
    out = array(q.shape, dtype, out_ptr)
    return pa.variant(kernel, q, k, out, max_query_len, batch, H200_SMS)


def test_fp16_and_bf16_at_head_dim_64_and_128_take_the_new_kernel():
    for dtype in ("float16", "bfloat16"):
        for head_dim in (64, 128):
            for heads, kv_heads in ((16, 16), (16, 8), (32, 8), (8, 1), (6, 2), (32, 2)):
                assert choose(dtype=dtype, head_dim=head_dim, heads=heads, kv_heads=kv_heads) is not None


def test_other_dtypes_sizes_and_groups_keep_the_old_kernels():
    assert choose(dtype="float32") is None
    assert choose(dtype="bfloat16", kv_dtype="float8_e4m3fn") is None        # an FP8 cache
    assert choose(head_dim=8) is None and choose(head_dim=256) is None and choose(head_dim=96) is None
    assert choose(heads=32, kv_heads=1) is None                              # group 32 > MAX_GROUP
    assert choose(out_ptr=(1 << 20) + 2) is None                             # out not 4-byte aligned
    assert choose(kernel="mma") is None


def test_the_flag_names_a_shape_or_fails_clearly():
    assert choose(kernel="flash-4w") is pa.VARIANTS["flash-4w"]
    assert choose(kernel="flash-8w") is pa.VARIANTS["flash-8w"]
    with pytest.raises(ValueError, match="prefill attention kernel must be one of"):
        choose(kernel="fast")


def test_auto_picks_four_warps_as_measured(monkeypatch):
    # The H200's figures put flash-4w at or ahead of flash-8w at every grid size: the default.
    for kwargs in ({"max_query_len": 2048}, {"max_query_len": 16000}, {"max_query_len": 2048, "batch": 64}):
        assert choose(**kwargs) is pa.VARIANTS["flash-4w"], kwargs
    # The threshold still works where a card favours 8 warps for small grids.
    monkeypatch.setattr(pa, "AUTO_8W_BLOCKS_PER_SM", 4)
    # 2048 tokens, GQA 2: 32 query tiles x 8 KV heads = 256 blocks, under 4 a multiprocessor.
    assert choose(max_query_len=2048) is pa.VARIANTS["flash-8w"]
    edge = pa.AUTO_8W_BLOCKS_PER_SM * H200_SMS // 8          # query tiles at the threshold, 8 KV heads
    assert choose(max_query_len=64 * edge) is pa.VARIANTS["flash-8w"]
    assert choose(max_query_len=64 * edge + 1) is pa.VARIANTS["flash-4w"]


def test_hopper_takes_the_warpgroup_kernel_where_it_runs(monkeypatch):
    monkeypatch.setattr(pa, "_capability", lambda: "90")
    hopper, four = pa.VARIANTS[pa.HOPPER], pa.VARIANTS["flash-4w"]
    assert choose(max_query_len=2048) is hopper                        # 256 blocks on 132 multiprocessors
    assert choose(max_query_len=2048, dtype="float16") is hopper
    assert choose(max_query_len=512) is hopper                         # 64 blocks: their keys split
    assert choose(max_query_len=16) is hopper
    assert choose(max_query_len=2048, head_dim=64) is four             # head_dim 128 only
    assert choose(kernel=pa.HOPPER, max_query_len=16) is hopper        # named: whatever the grid
    assert choose(kernel=pa.HOPPER, head_dim=64) is four
    monkeypatch.setattr(pa, "_capability", lambda: "100")              # sm_90a code runs on 9.0 only
    assert choose(max_query_len=2048) is four and choose(kernel=pa.HOPPER) is four
    monkeypatch.setattr(pa, "_capability", lambda: "")                 # no device (this machine)
    assert choose(kernel=pa.HOPPER) is four


def test_block_shapes_fit_the_multiprocessor():
    for v in pa.VARIANTS.values():
        assert v.rows == 128 and v.warps % v.key_groups == 0
        for head_dim in pa.HOPPER_HEAD_DIMS if v.hopper else pa.HEAD_DIMS:
            for fp8 in (False, True) if v.key_groups == 1 and not v.hopper else (False,):   # FP8: one key group
                per_block = v.smem_bytes(head_dim, fp8) + SMEM_PER_BLOCK_RESERVED
                assert v.min_blocks * per_block <= SMEM_PER_SM, (v, head_dim, fp8)
                assert v.smem_bytes(head_dim, fp8) <= 227 * 1024             # the opt-in limit of one block
        assert v.defines()["PA_STAGES"] == v.stages
    # Hopper's block: Q rows and three stages of 128-key K and V tiles, unpadded, plus 1 KB to align.
    assert pa.VARIANTS[pa.HOPPER].smem_bytes(128) == 128 * 256 + 3 * 2 * 128 * 256 + 1024
    # An FP8 block: Q, one widened K and V tile (padded fp16 rows), and two stages of K / V bytes.
    assert pa.VARIANTS["flash-4w"].smem_bytes(128, True) == (128 + 2 * 64) * 136 * 2 + 2 * 2 * 64 * 128


def test_grid_order_swaps_the_second_round_only_for_one_wave_of_two_block_shapes():
    four, eight = pa.VARIANTS["flash-4w"], pa.VARIANTS["flash-8w"]
    assert pa.grid_order(four, 32, 8, 1, H200_SMS) == (256, H200_SMS)          # 256 <= 2 x 132
    assert pa.grid_order(four, 34, 8, 1, H200_SMS) == (272, 0)                 # past one wave
    assert pa.grid_order(eight, 32, 8, 1, H200_SMS) == (256, 0)                # one block a multiprocessor
    assert pa.num_q_tiles(four, 2, 2048) == 32 and pa.num_q_tiles(four, 3, 2048) == 49
    assert pa.num_q_tiles(four, 2, 0) == 1



@pytest.mark.parametrize("value,expect", [("mma", "mma"), ("flash-8w", "flash-8w"), ("bad", "must be one of")])
def test_the_environment_sets_the_flag_or_fails_at_import(value, expect):
    env = {**os.environ, "MINILLM_PREFILL_ATTENTION": value}
    code = "import minillm.ops.cuda as ops; print(ops.PREFILL_ATTENTION)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert expect in result.stdout + result.stderr
    assert (result.returncode == 0) == (value != "bad")


def test_key_splits_fill_a_small_grid_at_a_long_context():
    # A 128-token chunk over 16,000 cached tokens: 16 blocks; about two a multiprocessor after splitting.
    assert pa.kv_splits(16, 16128, H200_SMS, 128, 16, 128) == 17
    # A grid of a multiprocessor's count or more never splits; nor a short context (4 tiles a split).
    assert pa.kv_splits(H200_SMS, 16128, H200_SMS, 2048, 16, 128) == 1
    assert pa.kv_splits(16, 7 * pa.KV_TILE, H200_SMS, 128, 16, 128) == 1
    assert pa.kv_splits(16, 8 * pa.KV_TILE, H200_SMS, 128, 16, 128) == 2
    # At most MAX_KV_SPLITS, and the partials stay within the workspace cap.
    assert pa.kv_splits(1, 10 ** 6, H200_SMS, 16, 16, 128) == pa.MAX_KV_SPLITS
    rows = pa.SPLIT_WORKSPACE_BYTES // (16 * 130 * 4 * 3)     # three splits' partials fit exactly
    assert pa.kv_splits(1, 10 ** 6, H200_SMS, rows, 16, 128) == 3


def test_a_hopper_kernel_that_does_not_build_leaves_the_flash_kernel_to_run(monkeypatch, caplog):
    from minillm.ops import cuda as ops
    calls = []

    def no_sm90a(filename, dtype, name, arch=None, **defines):
        calls.append(arch)
        raise RuntimeError("prefill_attention_wgmma.cu does not build for sm_90a:\nunsupported gpu architecture")

    monkeypatch.setattr(ops, "_kernel", no_sm90a)
    monkeypatch.setattr(pa, "_hopper_failed", [])
    with caplog.at_level("WARNING", logger="minillm"):
        assert pa.hopper_kernel("bfloat16", 128, 2) is None
        assert pa.hopper_kernel("bfloat16", 128, 2) is None          # not retried
    assert calls == ["90a"]
    assert "did not build" in caplog.text and "unsupported gpu architecture" in caplog.text
