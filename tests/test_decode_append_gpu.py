"""The decode kernel that does the layer's q/k norm, rotary and KV append itself
(ops.decode_attention_append, paged_decode_append) against the two launches it replaces and the
NumPy twin; and embedding_rms_norm against embedding then rms_norm.

The cache must hold the same bits as after qk_norm_rotary_kv_append; the output equals
paged_attention over that cache to the softmax's summation order (the new token is folded first).
Cases: GQA 1/2/4, head_dim 64/128, bf16 / fp16 / fp32, with and without q/k norm, FP8 caches,
forced key splits (the token's split is the last non-empty one, or the only one), a context of one
token (only the new one), padding rows (seq_len 0, slot -1) and a slot outside the pool.
"""
from __future__ import annotations

import numpy as np
import pytest

from minillm.attention import AttentionMetadata
from minillm.ops import numpy as npops

from gpu_support import HAS_GPU, cupy, scattered_block_tables
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.ops import cuda as ops

BLOCK = 16
TOL = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 2.5e-2}


def host32(dev) -> np.ndarray:
    if dev.dtype.name == "bfloat16":
        bits = cupy.asnumpy(cupy.ascontiguousarray(dev).view(cupy.uint16)).astype(np.uint32)
        return (bits << 16).view(np.float32)
    return cupy.asnumpy(dev).astype(np.float32)


def host_dtype(dtype: str):
    return np.dtype(dtype) if dtype != "bfloat16" else cupy.dtype("bfloat16")


def cos_sin(max_pos: int, head_dim: int) -> np.ndarray:
    inv = 1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)
    ang = np.arange(max_pos)[:, None] * inv[None]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


def decode_step(rng, ctx, heads, kv_heads, head_dim, dtype, fp8, padding=()):
    """A decode-only step over scattered blocks: raw q/k/v views of one qkv buffer, norms, caches
    holding ctx[b] - 1 tokens of history, and metadata (rows in `padding`: seq_len 0, slot -1)."""
    tables, num_blocks = scattered_block_tables(rng, ctx, BLOCK, spare_blocks=3, spare_columns=1)
    slots = np.array([tables[b, (c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for b, c in enumerate(ctx)], np.int32)
    seq_lens = np.asarray(ctx, np.int32)
    for b in padding:
        seq_lens[b], slots[b] = 0, -1
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    if fp8:
        k_cache = ops.asarray(rng.integers(0, 0x7F, shape).astype(np.uint8))     # finite E4M3 codes
        v_cache = ops.asarray(rng.integers(0, 0x7F, shape).astype(np.uint8))
    else:
        k_cache = ops.asarray(rng.standard_normal(shape).astype(np.float32), dtype)
        v_cache = ops.asarray(rng.standard_normal(shape).astype(np.float32), dtype)
    batch = len(ctx)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = ops.asarray(rng.standard_normal((batch, width)).astype(np.float32) * 2, dtype)
    q = qkv[:, :heads * head_dim].reshape(batch, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(batch, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(batch, kv_heads, head_dim)
    q_norm = ops.asarray(1 + 0.2 * rng.standard_normal(head_dim).astype(np.float32), dtype)
    k_norm = ops.asarray(1 + 0.2 * rng.standard_normal(head_dim).astype(np.float32), dtype)
    positions = np.maximum(seq_lens - 1, 0).astype(np.int32)
    meta = AttentionMetadata(np.arange(batch + 1, dtype=np.int32), seq_lens, tables, slots, 1,
                             int(max(ctx)), True, batch)
    return q, k, v, q_norm, k_norm, positions, k_cache, v_cache, meta


def device_meta(meta: AttentionMetadata) -> AttentionMetadata:
    a = ops.asarray
    return AttentionMetadata(a(meta.query_start_loc), a(meta.seq_lens), a(meta.block_tables),
                             a(meta.slot_mapping), meta.max_query_len, meta.max_seq_len, meta.is_decode_only,
                             meta.num_decode_seqs)


def run_both(case, qk_norm: bool, fp8: bool, num_splits=None, **step):
    """(fused output, its caches), (separate launches' output, their caches), NumPy twin output, live rows."""
    dtype, heads, kv_heads, head_dim = case
    rng = np.random.default_rng(heads * 100 + kv_heads * 10 + head_dim + 7 * qk_norm + 3 * fp8)
    q, k, v, q_norm, k_norm, positions, k_cache, v_cache, meta = decode_step(
        rng, step.pop("ctx"), heads, kv_heads, head_dim, dtype, fp8, **step)
    if not qk_norm:
        q_norm = k_norm = None
    table = cos_sin(8192, head_dim)
    scales_h = np.array([0.05, 0.3], np.float32) if fp8 else None
    scales = ops.asarray(scales_h) if fp8 else None
    dmeta, pos, cs = device_meta(meta), ops.asarray(positions), ops.asarray(table)
    scale = head_dim ** -0.5
    fused_k, fused_v = k_cache.copy(), v_cache.copy()
    nan = ops.asarray(np.full(q.shape, np.nan, np.float32), dtype)
    got = ops.decode_attention_append(q, k, v, q_norm, k_norm, 1e-6, pos, cs, fused_k, fused_v, dmeta.slot_mapping,
                                      dmeta, scale, scales, out=nan.copy())
    sep_k, sep_v = k_cache.copy(), v_cache.copy()
    rq = ops.qk_norm_rotary_kv_append(q, k, v, q_norm, k_norm, 1e-6, pos, cs, sep_k, sep_v, dmeta.slot_mapping,
                                      scales)
    ref = ops.paged_attention(rq, sep_k, sep_v, dmeta, scale, scales, out=nan.copy(), num_splits=num_splits)
    hd = host_dtype(dtype)
    host = (lambda a: ops.to_numpy(a).astype(hd) if a is not None else None)          # noqa: E731
    cache = (lambda c: cupy.asnumpy(c) if fp8 else ops.to_numpy(c).astype(np.float32))  # noqa: E731
    np_k, np_v = cache(k_cache), cache(v_cache)
    # The twin has no padding rows: they read one token there (their slot -1 stores nothing).
    twin_meta = AttentionMetadata(meta.query_start_loc, np.maximum(meta.seq_lens, 1), meta.block_tables,
                                  meta.slot_mapping, 1, meta.max_seq_len, True, meta.num_decode_seqs)
    twin = npops.decode_attention_append(host(q), host(k), host(v), host(q_norm), host(k_norm), 1e-6, positions,
                                         table, np_k, np_v, meta.slot_mapping, twin_meta, scale, scales_h)
    live = np.asarray(meta.seq_lens) > 0
    return (host32(got), fused_k, fused_v), (host32(ref), sep_k, sep_v), twin.astype(np.float32), live


def check(case, qk_norm, fp8, num_splits=None, **step):
    dtype = case[0]
    if num_splits is not None:
        ops_splits, ops.decode_num_splits = ops.decode_num_splits, lambda *a, **k: num_splits
    try:
        (got, fk, fv), (ref, sk, sv), twin, live = run_both(case, qk_norm, fp8, num_splits, **step)
    finally:
        if num_splits is not None:
            ops.decode_num_splits = ops_splits
    view = (lambda c: cupy.asnumpy(c.view(cupy.uint8)))                                 # noqa: E731
    np.testing.assert_array_equal(view(fk), view(sk), err_msg="k cache bits")
    np.testing.assert_array_equal(view(fv), view(sv), err_msg="v cache bits")
    assert np.isfinite(got[live]).all(), "a live row was not written"
    np.testing.assert_allclose(got[live], ref[live], rtol=TOL[dtype], atol=TOL[dtype], err_msg="vs two launches")
    np.testing.assert_allclose(got[live], twin[live], rtol=TOL[dtype], atol=TOL[dtype], err_msg="vs NumPy twin")
    # Padding rows (seq_len 0) store nothing (the cache bits above); their output is the reduce's
    # when the keys are split, as with the two launches, and is never read.


CASES = [("bfloat16", 16, 8, 128), ("float16", 16, 16, 128), ("bfloat16", 32, 8, 64), ("float32", 8, 4, 128),
         ("bfloat16", 16, 4, 128), ("float16", 8, 8, 64)]
CTX = [1, 2, 15, 16, 17, 100, 333, 64, 1000]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_decode_equals_the_two_launches(case, qk_norm):
    check(case, qk_norm, False, ctx=CTX, padding=(4,))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "float32"])
def test_fused_decode_with_an_fp8_cache(case):
    check(case, True, True, ctx=CTX)


@pytest.mark.parametrize("splits", [2, 5, 17])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_decode_with_forced_key_splits(splits, fp8):
    """Only the split holding the new token appends it; every split normalises and rotates q."""
    check(("bfloat16", 16, 8, 128), True, fp8, num_splits=splits, ctx=[1, 63, 64, 65, 700, 1500, 3000])


def test_fused_decode_leaves_a_slot_outside_the_pool_unwritten():
    """A slot past the pool (as kv_append treats it) is not stored, and the token still attends to itself."""
    rng = np.random.default_rng(3)
    q, k, v, q_norm, k_norm, positions, k_cache, v_cache, meta = decode_step(rng, [40, 7], 16, 8, 128,
                                                                              "bfloat16", False)
    slots = np.asarray(meta.slot_mapping).copy()
    slots[1] = k_cache.shape[0] * BLOCK + 5
    meta = AttentionMetadata(meta.query_start_loc, meta.seq_lens, meta.block_tables, slots, 1, 40, True, 2)
    before = cupy.asnumpy(k_cache.view(cupy.uint16)).copy()
    dmeta = device_meta(meta)
    out = ops.decode_attention_append(q, k, v, q_norm, k_norm, 1e-6, ops.asarray(positions),
                                      ops.asarray(cos_sin(64, 128)), k_cache, v_cache, dmeta.slot_mapping, dmeta,
                                      128 ** -0.5)
    after = cupy.asnumpy(k_cache.view(cupy.uint16))
    changed = np.argwhere((before != after).any(axis=(2, 3)))
    assert [tuple(x) for x in changed] == [divmod(int(slots[0]), BLOCK)]    # row 0's slot only
    assert np.isfinite(host32(out)).all()


def test_switch_off_runs_the_two_launches():
    """FUSE_DECODE_APPEND = False gives the separate kernels' output bits exactly."""
    case = ("bfloat16", 16, 8, 128)
    ops.FUSE_DECODE_APPEND = False
    try:
        (got, fk, _), (ref, sk, _), _, live = run_both(case, True, False, ctx=CTX)
    finally:
        ops.FUSE_DECODE_APPEND = True
    np.testing.assert_array_equal(got[live], ref[live])
    np.testing.assert_array_equal(cupy.asnumpy(fk.view(cupy.uint16)), cupy.asnumpy(sk.view(cupy.uint16)))


# ----------------------------------------------------------------------------- embedding + first norm

@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("dim", [1024, 1001, 64])      # 1001: the scalar kernels
@pytest.mark.parametrize("weight_f32", [False, True])
def test_embedding_rms_norm_equals_the_two_kernels(dtype, dim, weight_f32):
    rng = np.random.default_rng(dim + weight_f32)
    vocab = 300
    table = ops.asarray(rng.standard_normal((vocab, dim)).astype(np.float32), dtype)
    weight = ops.asarray(1 + 0.1 * rng.standard_normal(dim).astype(np.float32), "float32" if weight_f32 else dtype)
    ids = rng.integers(0, vocab, 77).astype(np.int32)
    ids[[3, 9]] = [-1, vocab]                                     # outside the table: zero rows
    d_ids = ops.asarray(ids)
    normed, h = ops.embedding_rms_norm(d_ids, table, weight, 1e-6)
    ref_h = ops.embedding(d_ids, table)
    ref = ops.rms_norm(ref_h, weight, 1e-6)
    np.testing.assert_array_equal(host32(h), host32(ref_h))
    np.testing.assert_array_equal(host32(normed), host32(ref))
    assert not host32(h)[[3, 9]].any()
    hd = host_dtype(dtype)
    twin, twin_h = npops.embedding_rms_norm(np.clip(ids, 0, vocab - 1), ops.to_numpy(table).astype(hd),
                                            ops.to_numpy(weight), 1e-6)
    ok = np.ones(len(ids), bool)
    ok[[3, 9]] = False
    np.testing.assert_allclose(host32(normed)[ok], twin.astype(np.float32)[ok], rtol=1e-2, atol=1e-2)
