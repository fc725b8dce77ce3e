"""Decode attention gives the same result at every split count, the automatic one included, and
when the captured max_seq_len is longer than every context (as under CUDA graphs)."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.attention import AttentionMetadata
from minillm.ops import numpy as npops

from gpu_support import HAS_GPU, cupy
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.ops import cuda as ops

TOL = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 2.5e-2}
BLOCK = 16


def host32(dev) -> np.ndarray:
    if dev.dtype.name == "bfloat16":
        bits = cupy.asnumpy(cupy.ascontiguousarray(dev).view(cupy.uint16)).astype(np.uint32)
        return (bits << 16).view(np.float32)
    return cupy.asnumpy(dev).astype(np.float32)


def decode_batch(rng, ctx, heads, kv_heads, head_dim, dtype, max_seq_len):
    """q, caches (device and their rounded host values) and metadata with scattered blocks."""
    per_seq = [-(-c // BLOCK) for c in ctx]
    num_blocks = sum(per_seq) + 3
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(ctx), max(per_seq)), np.int32)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    k = ops.asarray(rng.standard_normal(shape).astype(np.float32), dtype)
    v = ops.asarray(rng.standard_normal(shape).astype(np.float32), dtype)
    q = ops.asarray(rng.standard_normal((len(ctx), heads, head_dim)).astype(np.float32), dtype)
    qsl = np.arange(len(ctx) + 1, dtype=np.int32)
    host = AttentionMetadata(qsl, np.asarray(ctx, np.int32), tables, np.zeros(len(ctx), np.int32), 1,
                             max(ctx), True)
    a = ops.asarray
    dev = AttentionMetadata(a(qsl), a(np.asarray(ctx, np.int32)), a(tables), a(np.zeros(len(ctx), np.int32)), 1,
                            max_seq_len, True)
    return q, k, v, host, dev


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", [
    ("bfloat16", 16, 8, 128), ("float16", 16, 4, 64), ("float32", 8, 8, 64), ("bfloat16", 32, 4, 128)])
def test_every_split_count_gives_the_same_attention(dtype, heads, kv_heads, head_dim):
    rng = np.random.default_rng(heads + kv_heads + head_dim)
    ctx = [4096, 3001, 1500, 17]
    q, k, v, host, dev = decode_batch(rng, ctx, heads, kv_heads, head_dim, dtype, max(ctx))
    scale = head_dim ** -0.5
    ref = npops.paged_attention(host32(q), host32(k), host32(v), host, scale)
    auto = ops.decode_num_splits(len(ctx), kv_heads, max(ctx))
    assert auto > 1
    one = None
    for splits in sorted({1, 2, 3, 7, 16, 33, 64, auto}):
        out = ops.asarray(np.full(q.shape, np.nan, np.float32), dtype)
        got = host32(ops.paged_attention(q, k, v, dev, scale, out=out, num_splits=splits))
        assert np.isfinite(got).all(), f"splits={splits}: an element was not written"
        np.testing.assert_allclose(got, ref, rtol=TOL[dtype], atol=TOL[dtype], err_msg=f"splits={splits}")
        if one is None:
            one = got
        else:   # the same sums in another order: within a few roundings of the dtype of one split
            np.testing.assert_allclose(got, one, rtol=TOL[dtype], atol=TOL[dtype], err_msg=f"splits={splits}")


def test_auto_splits_of_a_graph_capture_longer_than_every_context():
    rng = np.random.default_rng(3)
    ctx = [1500, 700, 64, 1]
    q, k, v, host, dev = decode_batch(rng, ctx, 16, 8, 128, "bfloat16", max_seq_len=8192)
    assert ops.decode_num_splits(len(ctx), 8, 8192) * len(ctx) * 8 >= ops._num_multiprocessors()
    ref = npops.paged_attention(host32(q), host32(k), host32(v), host, 128 ** -0.5)
    got = host32(ops.paged_attention(q, k, v, dev, 128 ** -0.5))
    np.testing.assert_allclose(got, ref, rtol=TOL["bfloat16"], atol=TOL["bfloat16"])
