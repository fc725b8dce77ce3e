"""Each CUDA kernel against its NumPy twin (minillm/ops/numpy.py) on fresh random inputs.

Skips without CuPy or a GPU. Inputs are drawn at several shapes: scattered block tables, context
lengths off the block size, GQA ratios 1/2/4/8, head_dim 64/128 (and 8, the tiny test model),
float32 / float16 / bfloat16. Outputs are poisoned with NaN first so an unwritten element fails.
"""
from __future__ import annotations

import numpy as np
import pytest

from minillm.attention import AttentionMetadata
from minillm.ops import numpy as npops

from gpu_support import HAS_GPU, cupy
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.ops import cuda as ops

DTYPES = ["float32", "float16", "bfloat16"]
# Elementwise ops: at most this many units in the last place of the dtype (the reference rounds
# through the same dtype; only summation order differs).
ULP = {"float32": 2e-6, "float16": 2 ** -10, "bfloat16": 2 ** -7}
ATTN_TOL = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 2.5e-2}


# ----------------------------------------------------------------------------- helpers

def host_dtype(dtype: str):
    """The NumPy dtype the reference computes in (ml_dtypes' bfloat16 for bf16)."""
    return np.dtype(dtype) if dtype != "bfloat16" else cupy.dtype("bfloat16")


def to_device(x32: np.ndarray, dtype: str):
    """float32 host values -> (device array of `dtype`, host copy of the rounded values as float32)."""
    dev = ops.asarray(x32, dtype)
    return dev, to_host32(dev)


def to_host32(dev) -> np.ndarray:
    """Device array (any float dtype) -> host float32 (bf16 through its bit pattern)."""
    if dev.dtype.name == "bfloat16":
        bits = cupy.asnumpy(cupy.ascontiguousarray(dev).view(cupy.uint16)).astype(np.uint32)
        return (bits << 16).view(np.float32)
    return cupy.asnumpy(dev).astype(np.float32)


def poisoned(shape, dtype: str):
    return ops.asarray(np.full(shape, np.nan, np.float32), dtype)


def assert_close(got: np.ndarray, ref: np.ndarray, tol: float, what: str) -> None:
    assert np.isfinite(got).all(), f"{what}: non-finite output (an element was not written?)"
    np.testing.assert_allclose(got, ref.astype(np.float32), rtol=tol, atol=tol, err_msg=what)


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


# ----------------------------------------------------------------------------- dense ops

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,n", [(1, 64, 96), (37, 1024, 512), (256, 512, 3072)])
def test_linear_matches_matmul(dtype, tokens, k, n):
    rng = np.random.default_rng(tokens * 7 + k)
    x, x32 = to_device(rng.standard_normal((tokens, k), np.float32), dtype)
    w, w32 = to_device(rng.standard_normal((n, k), np.float32) / np.sqrt(k), dtype)
    b, b32 = to_device(rng.standard_normal(n).astype(np.float32), dtype)
    ref = x32.astype(np.float64) @ w32.T.astype(np.float64)
    got = to_host32(ops.linear(x, w))
    assert rel_error(got, ref) < (1e-5 if dtype == "float32" else 5e-3)
    got_b = to_host32(ops.linear(x, w, b, out=poisoned((tokens, n), dtype)))
    assert rel_error(got_b, ref + b32) < (1e-5 if dtype == "float32" else 5e-3)
    wide = ops.linear(x, w, out_dtype=np.float32)       # the logits path: fp32 sums, unrounded
    assert wide.dtype == np.float32 and rel_error(cupy.asnumpy(wide), ref) < 1e-5


def test_linear_takes_row_strided_input():
    rng = np.random.default_rng(1)
    big, big32 = to_device(rng.standard_normal((20, 300), np.float32), "bfloat16")
    w, w32 = to_device(rng.standard_normal((64, 128), np.float32), "bfloat16")
    x = big[:, 100:228]                                  # [20, 128], row stride 300
    got = to_host32(ops.linear(x, w))
    assert rel_error(got, big32[:, 100:228].astype(np.float64) @ w32.T) < 5e-3


def test_linear_rejects_mismatched_dtypes():
    x = ops.asarray(np.ones((2, 8), np.float32), "float32")
    w = ops.asarray(np.ones((4, 8), np.float32), "bfloat16")
    with pytest.raises(ValueError, match="w dtype"):
        ops.linear(x, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 1024, 100])
def test_embedding_gathers_rows(dtype, dim):
    rng = np.random.default_rng(dim)
    table, table32 = to_device(rng.standard_normal((500, dim), np.float32), dtype)
    ids = rng.integers(0, 500, 77).astype(np.int32)
    got = to_host32(ops.embedding(ops.asarray(ids), table))
    np.testing.assert_array_equal(got, table32[ids])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 1024), (33, 1024), (300, 128), (5, 100), (9, 64)])
def test_rms_norm_and_fused_add(dtype, rows, dim):
    rng = np.random.default_rng(rows + dim)
    hd = host_dtype(dtype)
    x, _ = to_device(rng.standard_normal((rows, dim), np.float32) * 3, dtype)
    r, _ = to_device(rng.standard_normal((rows, dim), np.float32), dtype)
    w, _ = to_device(1 + 0.1 * rng.standard_normal(dim).astype(np.float32), dtype)
    xh, rh, wh = (ops.to_numpy(a).astype(hd) for a in (x, r, w))
    ref = npops.rms_norm(xh, wh, 1e-6).astype(np.float32)
    assert_close(to_host32(ops.rms_norm(x, w, 1e-6, out=poisoned((rows, dim), dtype))), ref, 2 * ULP[dtype], "rms_norm")
    ref_n, ref_s = npops.add_rms_norm(xh, rh, wh, 1e-6)
    got_n, got_s = ops.add_rms_norm(x, r, w, 1e-6)
    assert_close(to_host32(got_s), ref_s.astype(np.float32), ULP[dtype], "add_rms_norm sum")
    assert_close(to_host32(got_n), ref_n.astype(np.float32), 2 * ULP[dtype], "add_rms_norm norm")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_per_head_on_a_fused_qkv_view(dtype):
    """q / k norm straight from the fused qkv buffer: [T, H, Dh] heads packed, tokens strided."""
    rng = np.random.default_rng(17)
    tokens, heads, kv_heads, head_dim = 37, 16, 8, 128
    width = (heads + 2 * kv_heads) * head_dim
    qkv = ops.asarray(rng.standard_normal((tokens, width)).astype(np.float32), dtype)
    w = ops.asarray(rng.standard_normal(head_dim).astype(np.float32), dtype)
    for lo, h in ((0, heads), (heads * head_dim, kv_heads)):
        view = qkv[:, lo:lo + h * head_dim].reshape(tokens, h, head_dim)
        ref = npops.rms_norm(ops.to_numpy(view).astype(np.float32), ops.to_numpy(w).astype(np.float32), 1e-6)
        got = to_host32(ops.rms_norm(view, w, 1e-6))
        assert got.shape == (tokens, h, head_dim)
        assert_close(got, ref.astype(np.float32), 2 * ULP[dtype], "per-head rms_norm")


def test_rms_norm_float32_weight_and_in_place_residual():
    rng = np.random.default_rng(3)
    x, x32 = to_device(rng.standard_normal((16, 256), np.float32), "bfloat16")
    r, r32 = to_device(rng.standard_normal((16, 256), np.float32), "bfloat16")
    w = ops.asarray(rng.standard_normal(256).astype(np.float32), "float32")
    hd = host_dtype("bfloat16")
    ref_n, ref_s = npops.add_rms_norm(x32.astype(hd), r32.astype(hd), ops.to_numpy(w), 1e-5)
    normed, s = ops.add_rms_norm(x, r, w, 1e-5, out=(None, r))
    assert s is r
    assert_close(to_host32(r), ref_s.astype(np.float32), ULP["bfloat16"], "in-place residual")
    assert_close(to_host32(normed), ref_n.astype(np.float32), 2 * ULP["bfloat16"], "fp32 weight")


def _cos_sin(max_pos: int, head_dim: int) -> np.ndarray:
    inv = 1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)
    ang = np.arange(max_pos)[:, None] * inv[None]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 4, 64), (8, 4, 8)])
def test_rotary_on_fused_qkv_views(dtype, heads, kv_heads, head_dim):
    rng = np.random.default_rng(heads * head_dim)
    tokens = 45
    width = (heads + 2 * kv_heads) * head_dim
    qkv, _ = to_device(rng.standard_normal((tokens, width), np.float32), dtype)
    q = qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    positions = rng.integers(0, 4000, tokens).astype(np.int32)
    cos_sin = _cos_sin(4096, head_dim)
    hd = host_dtype(dtype)
    ref_q, ref_k = npops.rotary(ops.to_numpy(q).astype(hd), ops.to_numpy(k).astype(hd), positions, cos_sin)
    got_q, got_k = ops.rotary(q, k, ops.asarray(positions), ops.asarray(cos_sin))
    assert_close(to_host32(got_q), ref_q.astype(np.float32), ULP[dtype], "rotary q")
    assert_close(to_host32(got_k), ref_k.astype(np.float32), ULP[dtype], "rotary k")
    ops.rotary(q, k, ops.asarray(positions), ops.asarray(cos_sin), out=(q, k))   # in place
    assert_close(to_host32(q), ref_q.astype(np.float32), ULP[dtype], "rotary in place")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(8, 128, 16), (2, 64, 32), (4, 8, 16)])
def test_kv_append_scatters_by_slot(dtype, kv_heads, head_dim, block_size):
    rng = np.random.default_rng(kv_heads * head_dim)
    num_blocks, tokens = 40, 70
    pool = ops.asarray(rng.standard_normal((2, num_blocks, block_size, kv_heads, head_dim), np.float32), dtype)
    k_cache, v_cache = pool[0], pool[1]
    before_k, before_v = to_host32(k_cache), to_host32(v_cache)
    kv, kv32 = to_device(rng.standard_normal((tokens, 3 * kv_heads * head_dim), np.float32), dtype)
    k = kv[:, kv_heads * head_dim:2 * kv_heads * head_dim].reshape(tokens, kv_heads, head_dim)
    v = kv[:, 2 * kv_heads * head_dim:].reshape(tokens, kv_heads, head_dim)
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    slots[::7] = -1
    ops.kv_append(k, v, k_cache, v_cache, ops.asarray(slots))
    ref_k, ref_v = before_k.copy(), before_v.copy()
    npops.kv_append(kv32[:, kv_heads * head_dim:2 * kv_heads * head_dim].reshape(tokens, kv_heads, head_dim),
                    kv32[:, 2 * kv_heads * head_dim:].reshape(tokens, kv_heads, head_dim), ref_k, ref_v, slots)
    np.testing.assert_array_equal(to_host32(k_cache), ref_k)
    np.testing.assert_array_equal(to_host32(v_cache), ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 3072), (77, 3072), (10, 100)])
def test_silu_and_mul(dtype, tokens, inter):
    rng = np.random.default_rng(tokens + inter)
    x, _ = to_device(rng.standard_normal((tokens, 2 * inter), np.float32) * 3, dtype)
    ref = npops.silu_and_mul(ops.to_numpy(x).astype(host_dtype(dtype)))
    got = to_host32(ops.silu_and_mul(x, out=poisoned((tokens, inter), dtype)))
    assert_close(got, ref.astype(np.float32), ULP[dtype] + 1e-6, "silu_and_mul")


# ----------------------------------------------------------------------------- attention

def _paged_batch(rng, ctx_lens, q_lens, kv_heads, head_dim, block_size, dtype):
    """Caches with each sequence's history on randomly scattered blocks, plus metadata."""
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 7
    perm = rng.permutation(num_blocks)
    max_blocks = max(blocks_per_seq)
    tables = np.zeros((len(ctx_lens), max_blocks + 2), np.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, k32 = to_device(rng.standard_normal(shape, np.float32), dtype)
    v_cache, v32 = to_device(rng.standard_normal(shape, np.float32), dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=np.asarray(ctx_lens, np.int32), block_tables=tables,
                             slot_mapping=np.zeros(int(qsl[-1]), np.int32), max_query_len=int(max(q_lens)),
                             max_seq_len=int(max(ctx_lens)), is_decode_only=all(n == 1 for n in q_lens),
                             num_decode_seqs=_leading_one_token_seqs(q_lens))
    return k_cache, v_cache, k32, v32, meta


def _leading_one_token_seqs(q_lens) -> int:
    """The sequences a mixed step runs through the decode kernel (the scheduler puts them first)."""
    return next((b for b, n in enumerate(q_lens) if n != 1), len(q_lens))


def _device_meta(meta: AttentionMetadata) -> AttentionMetadata:
    a = ops.asarray
    return AttentionMetadata(a(meta.query_start_loc), a(meta.seq_lens), a(meta.block_tables),
                             a(meta.slot_mapping), meta.max_query_len, meta.max_seq_len, meta.is_decode_only,
                             meta.num_decode_seqs)


def _check_attention(rng, ctx_lens, q_lens, heads, kv_heads, head_dim, dtype, block_size=16, **kw):
    k_cache, v_cache, k32, v32, meta = _paged_batch(rng, ctx_lens, q_lens, kv_heads, head_dim, block_size, dtype)
    q, q32 = to_device(rng.standard_normal((sum(q_lens), heads, head_dim), np.float32), dtype)
    scale = head_dim ** -0.5
    ref = npops.paged_attention(q32, k32, v32, meta, scale)
    got = ops.paged_attention(q, k_cache, v_cache, _device_meta(meta), scale,
                              out=poisoned(q.shape, dtype), **kw)
    assert_close(to_host32(got), ref, ATTN_TOL[dtype], f"attention {dtype} ctx={ctx_lens} q={q_lens}")


DECODE_CASES = [  # dtype, heads, kv_heads, head_dim
    ("bfloat16", 16, 16, 128), ("bfloat16", 16, 8, 128), ("bfloat16", 16, 4, 128), ("bfloat16", 32, 4, 128),
    ("float16", 16, 8, 64), ("float32", 16, 4, 128), ("float32", 8, 8, 64), ("bfloat16", 16, 2, 64),
    ("bfloat16", 8, 4, 8), ("float32", 8, 4, 8),
]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", DECODE_CASES)
def test_decode_attention_short_and_ragged(dtype, heads, kv_heads, head_dim):
    rng = np.random.default_rng(heads * 1000 + kv_heads * 10 + head_dim)
    ctx = [1, 15, 16, 17, 100, 333, 64, 5]
    _check_attention(rng, ctx, [1] * len(ctx), heads, kv_heads, head_dim, dtype)


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", DECODE_CASES[:6])
def test_decode_attention_long_contexts_split(dtype, heads, kv_heads, head_dim):
    rng = np.random.default_rng(heads + kv_heads + head_dim)
    ctx = [2999, 1025, 4100]
    assert ops.decode_num_splits(len(ctx), kv_heads, max(ctx)) > 1     # the split path runs
    _check_attention(rng, ctx, [1] * len(ctx), heads, kv_heads, head_dim, dtype)


def test_decode_attention_forced_splits_and_block_sizes():
    rng = np.random.default_rng(11)
    for block_size, splits in ((16, 7), (32, 3), (8, 2), (64, 1)):
        _check_attention(rng, [700, 1, 129], [1, 1, 1], 16, 8, 128, "bfloat16", block_size=block_size,
                         num_splits=splits)


PREFILL_CASES = [
    ("bfloat16", 16, 8, 128), ("float16", 16, 16, 128), ("bfloat16", 16, 4, 64), ("float16", 8, 1, 64),
    ("float32", 16, 8, 128), ("float32", 8, 4, 8), ("bfloat16", 8, 4, 8), ("bfloat16", 32, 4, 128),
]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", PREFILL_CASES)
def test_prefill_chunks_with_cached_prefix(dtype, heads, kv_heads, head_dim):
    rng = np.random.default_rng(heads * 7 + head_dim)
    q_lens = [17, 1, 64, 130, 5, 100]
    prefix = [0, 40, 33, 200, 0, 1]                      # tokens already in the cache
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    _check_attention(rng, ctx, q_lens, heads, kv_heads, head_dim, dtype)


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", PREFILL_CASES[:5])
def test_mixed_step_decodes_first_then_chunks(dtype, heads, kv_heads, head_dim):
    """Leading one-token sequences through the decode kernel (one with a context long enough to
    split), the chunks after them (one of them a single token too) through the prefill kernel."""
    rng = np.random.default_rng(heads * 3 + kv_heads + head_dim)
    q_lens = [1, 1, 1, 1, 17, 64, 1, 130]
    prefix = [5, 900, 0, 3000, 0, 40, 77, 200]
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    _check_attention(rng, ctx, q_lens, heads, kv_heads, head_dim, dtype)


def test_prefill_long_chunk_tensor_core_path():
    rng = np.random.default_rng(5)
    _check_attention(rng, [1100, 700], [600, 700], 16, 8, 128, "bfloat16")


def test_attention_rejects_bad_heads():
    rng = np.random.default_rng(0)
    k_cache, v_cache, _, _, meta = _paged_batch(rng, [5], [1], 3, 64, 16, "float32")
    q = ops.asarray(np.zeros((1, 4, 64), np.float32))
    with pytest.raises(ValueError, match="KV heads"):
        ops.paged_attention(q, k_cache, v_cache, _device_meta(meta), 0.1)


# ----------------------------------------------------------------------------- sampling

def _sorted_probs(row: np.ndarray, temperature: float):
    order = np.lexsort((np.arange(row.size), -row))
    x = row[order].astype(np.float64) / temperature
    p = np.exp(x - x[0])
    return order, p / p.sum()


def _kept_lengths(p: np.ndarray, top_k, top_p, min_p, eps: float) -> set[int]:
    """Every kept-prefix length the rule can give when each p is off by about eps (top-p over the
    mass that top-k and min-p kept)."""
    n = p.size
    by_k = [int(top_k)] if 0 < top_k < n else [n]
    by_min_p = [n]
    if min_p > 0:
        thr = min_p * p[0]
        by_min_p = [int(np.count_nonzero(p >= thr * f)) for f in (1 + eps, 1.0, 1 - eps)]
    before = np.cumsum(p) - p
    lengths = set()
    for kept in {max(1, min(a, b)) for a in by_k for b in by_min_p}:
        mass = p[:kept].sum()
        by_top_p = [int(np.count_nonzero(before < (top_p + d) * mass)) for d in (-eps, 0.0, eps)] \
            if top_p < 1 else [n]
        lengths |= {max(1, min(kept, c)) for c in by_top_p}
    return lengths


def _is_clear_in_id_order(row, temperature, min_p, u, eps) -> bool:
    """The id-order rule (no top-k, no top-p): the same pick for min-p thresholds within rounding."""
    x = row.astype(np.float64) / temperature
    e = np.exp(x - x.max())
    picks = set()
    for f in ((1 + eps, 1.0, 1 - eps) if min_p > 0 else (1.0,)):
        w = np.where(e >= min_p * f, e, 0.0) if min_p > 0 else e
        cdf = np.cumsum(w)
        target = u * cdf[-1]
        idx = min(int(np.searchsorted(cdf, target, side="right")), len(row) - 1)
        low = cdf[idx - 1] if idx > 0 else 0.0
        if min(cdf[idx] - target, target - low) <= eps * cdf[-1]:
            return False
        picks.add(idx)
    return len(picks) == 1


def _is_clear(row, temperature, top_k, top_p, min_p, u, eps=3e-5) -> bool:
    """True when every kept prefix within rounding picks the same token, clear of its step edges."""
    if not 0 < top_k < row.size and top_p >= 1:
        return _is_clear_in_id_order(row, temperature, min_p, u, eps)
    _, p = _sorted_probs(row, temperature)
    picks = set()
    for kept in _kept_lengths(p, top_k, top_p, min_p, eps):
        cdf = np.cumsum(p[:kept])
        target = u * cdf[-1]
        idx = min(int(np.searchsorted(cdf, target, side="right")), kept - 1)
        low = cdf[idx - 1] if idx > 0 else 0.0
        if min(cdf[idx] - target, target - low) <= eps * cdf[-1]:
            return False
        picks.add(idx)
    return len(picks) == 1


def _clear_uniform(rng, row, temperature, top_k, top_p, min_p, u):
    """A uniform (and top-p / min-p nudged if needed) whose decisions are all clear of a boundary."""
    for _ in range(300):
        if _is_clear(row, temperature, top_k, top_p, min_p, u):
            return top_p, min_p, u
        u = np.float32(rng.random())
        top_p = np.float32(min(1.0, top_p + 0.013)) if top_p < 1 else top_p
        min_p = np.float32(min_p * 0.9)
    raise AssertionError("could not draw a sampling case clear of near-ties")


def _sample_params(rng, batch, vocab, logits):
    temperature = rng.choice([0.0, 0.5, 1.0, 1.3], batch).astype(np.float32)
    top_k = rng.choice([0, 1, 20, 500, vocab - 1], batch).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.97], batch).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.2], batch).astype(np.float32)
    uniforms = rng.random(batch).astype(np.float32)
    for b in range(batch):
        if temperature[b] > 0:
            top_p[b], min_p[b], uniforms[b] = _clear_uniform(rng, logits[b], temperature[b], top_k[b],
                                                             top_p[b], min_p[b], uniforms[b])
    return temperature, top_k, top_p, min_p, uniforms


def _check_sample(logits: np.ndarray, params) -> None:
    ref = npops.sample(logits, *params)
    got = cupy.asnumpy(ops.sample(ops.asarray(logits), *(ops.asarray(p) for p in params)))
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("batch,vocab,scale", [(16, 1000, 3.0), (24, 32000, 2.0), (4, 151936, 4.0)])
def test_sample_matches_numpy_with_fixed_uniforms(batch, vocab, scale):
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((batch, vocab)) * scale).astype(np.float32)
    _check_sample(logits, _sample_params(rng, batch, vocab, logits))


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.3])
def test_sample_in_id_order_matches_numpy(min_p):
    """Rows with neither top-k nor top-p (the common case) take the one-pass id-order path."""
    rng = np.random.default_rng(int(min_p * 100) + 5)
    batch, vocab = 32, 151936
    logits = (rng.standard_normal((batch, vocab)) * 3.0).astype(np.float32)
    temperature = rng.choice([0.6, 1.0, 1.3], batch).astype(np.float32)
    top_k = np.zeros(batch, np.int32)
    top_p = np.ones(batch, np.float32)
    mp = np.full(batch, min_p, np.float32)
    uniforms = rng.random(batch).astype(np.float32)
    for b in range(batch):
        _, mp[b], uniforms[b] = _clear_uniform(rng, logits[b], temperature[b], 0, np.float32(1.0), mp[b],
                                               uniforms[b])
    _check_sample(logits, (temperature, top_k, top_p, mp, uniforms))


def test_sample_breaks_ties_by_id():
    rng = np.random.default_rng(9)
    batch, vocab = 12, 20000
    # bf16-quantised logits tie often. Row 0 holds 15000 equal logits and a top-k cut inside them;
    # row 1 puts 6000 equal logits on top and samples the middle of the 4321st one's step. Both
    # push the search past the shared-memory sort into its radix steps (ids included).
    logits = ops.to_numpy(ops.asarray(rng.standard_normal((batch, vocab)).astype(np.float32) * 2, "bfloat16"))
    logits = logits.astype(np.float32)
    logits[0, :] = -3.0
    logits[0, rng.permutation(vocab)[:15000]] = 1.0
    logits[0, :50] = 6.0 + rng.random(50).astype(np.float32)
    tied = np.sort(rng.permutation(vocab)[:6000])
    logits[1, :] = rng.standard_normal(vocab).astype(np.float32) - 3.0
    logits[1, tied] = 5.0
    temperature, top_k, top_p, min_p, uniforms = _sample_params(rng, batch, vocab, logits)
    for r in (0, 1):   # both keep a top-k cut, so they take the ordered rule
        temperature[r], top_k[r], top_p[r], min_p[r] = 1.0, 3000 if r == 0 else vocab - 1, 1.0, 0.0
    _, _, uniforms[0] = _clear_uniform(rng, logits[0], 1.0, 3000, np.float32(1.0), np.float32(0.0),
                                       np.float32(0.37))
    _, p = _sorted_probs(logits[1], 1.0)
    uniforms[1] = np.float32((4321.5 * p[0]) / p.sum())
    _check_sample(logits, (temperature, top_k, top_p, min_p, uniforms))
    assert npops.sample(logits[1:2], *(a[1:2] for a in (temperature, top_k, top_p, min_p, uniforms)))[0] == tied[4321]


def test_greedy_is_argmax_with_first_index_on_ties():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((33, 5000)).astype(np.float32)
    logits[3, [10, 20]] = 50.0
    zeros = np.zeros(33, np.float32)
    got = cupy.asnumpy(ops.sample(ops.asarray(logits), ops.asarray(zeros), ops.asarray(np.zeros(33, np.int32)),
                                  ops.asarray(zeros + 1), ops.asarray(zeros), ops.asarray(zeros + 0.5)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=1))


def test_penalties_and_log_softmax_match_numpy():
    rng = np.random.default_rng(4)
    batch, vocab = 6, 3000
    logits = (rng.standard_normal((batch, vocab)) * 2).astype(np.float32)
    pairs = {(int(r), int(t)) for r, t in zip(rng.integers(0, batch, 900), rng.integers(0, vocab, 900))}
    rows, toks = (np.array(a, np.int32) for a in zip(*sorted(pairs)))
    counts = rng.integers(0, 4, rows.size).astype(np.int32)
    in_prompt = rng.integers(0, 2, rows.size).astype(np.int32)
    rep = rng.uniform(1.0, 1.5, batch).astype(np.float32)
    pres = rng.uniform(0, 1, batch).astype(np.float32)
    freq = rng.uniform(0, 0.5, batch).astype(np.float32)
    ref = logits.copy()
    npops.apply_penalties(ref, rows, toks, counts, in_prompt, rep, pres, freq)
    dev = ops.asarray(logits)
    ops.apply_penalties(dev, *(ops.asarray(a) for a in (rows, toks, counts, in_prompt, rep, pres, freq)))
    np.testing.assert_allclose(cupy.asnumpy(dev), ref, rtol=1e-6, atol=1e-6)
    got = cupy.asnumpy(ops.log_softmax(dev))
    np.testing.assert_allclose(got, npops.log_softmax(ref), rtol=1e-5, atol=2e-5)


# ----------------------------------------------------------------------------- capture

def _tiny_forward(ids, positions, meta, weights, pool, cos_sin):
    """embedding -> norm -> qkv -> rotary -> kv_append -> decode attention -> o -> MLP -> greedy."""
    embed, qkv_w, o_w, up_w, down_w, norm_w = weights
    heads, kv_heads, head_dim = 8, 2, 64
    t = ids.shape[0]
    h = ops.embedding(ids, embed)
    x = ops.rms_norm(h, norm_w, 1e-6)
    qkv = ops.linear(x, qkv_w)
    q = qkv[:, :heads * head_dim].reshape(t, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(t, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(t, kv_heads, head_dim)
    q, k = ops.rotary(q, k, positions, cos_sin)
    ops.kv_append(k, v, pool[0], pool[1], meta.slot_mapping)
    o = ops.paged_attention(q, pool[0], pool[1], meta, head_dim ** -0.5)
    h2 = ops.linear(o.reshape(t, heads * head_dim), o_w)
    x2, res = ops.add_rms_norm(h2, h, norm_w, 1e-6)
    y = ops.linear(ops.silu_and_mul(ops.linear(x2, up_w)), down_w)
    final, _ = ops.add_rms_norm(y, res, norm_w, 1e-6)
    logits = ops.linear(final, embed).astype(cupy.float32)
    zeros = cupy.zeros(t, cupy.float32)
    return ops.sample(logits, zeros, cupy.zeros(t, cupy.int32), zeros + 1, zeros, zeros)


def test_forward_ops_capture_into_a_cuda_graph():
    rng = np.random.default_rng(6)
    dim, vocab, batch = 256, 1000, 4
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    dt = "bfloat16"
    w = lambda *s: ops.asarray(rng.standard_normal(s).astype(np.float32) / np.sqrt(s[-1]), dt)  # noqa: E731
    weights = (w(vocab, dim), w((heads + 2 * kv_heads) * head_dim, dim), w(dim, heads * head_dim),
               w(2 * 512, dim), w(dim, 512), ops.asarray(np.ones(dim, np.float32), dt))
    ctx = np.array([700, 1500, 33, 2048], np.int32)
    _, _, _, _, meta_h = _paged_batch(rng, list(ctx), [1] * batch, kv_heads, head_dim, block_size, dt)
    pool = ops.asarray(rng.standard_normal((2, meta_h.block_tables.max() + 8, block_size, kv_heads, head_dim))
                       .astype(np.float32), dt)
    slots = np.array([meta_h.block_tables[b, (c - 1) // block_size] * block_size + (c - 1) % block_size
                      for b, c in enumerate(ctx)], np.int32)
    meta_h.slot_mapping = slots
    meta = _device_meta(meta_h)
    cos_sin = ops.asarray(_cos_sin(4096, head_dim))
    ids = ops.asarray(rng.integers(0, vocab, batch).astype(np.int32))
    positions = ops.asarray(ctx - 1)
    stream = cupy.cuda.Stream(non_blocking=True)
    mempool = cupy.cuda.MemoryPool()
    with stream, cupy.cuda.using_allocator(mempool.malloc):
        eager = cupy.asnumpy(_tiny_forward(ids, positions, meta, weights, pool, cos_sin))
        stream.begin_capture()
        captured_out = _tiny_forward(ids, positions, meta, weights, pool, cos_sin)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(captured_out), eager)
        ids[...] = ops.asarray(rng.integers(0, vocab, batch).astype(np.int32))   # new inputs, same buffer
        eager2 = cupy.asnumpy(_tiny_forward(ids, positions, meta, weights, pool, cos_sin))
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(captured_out), eager2)


def test_bfloat16_round_trip_from_uint16_bits():
    bits = np.array([0x3F80, 0xC000, 0x0000, 0x7F80], np.uint16)      # 1, -2, 0, inf
    dev = ops.asarray(bits, "bfloat16")
    assert dev.dtype.name == "bfloat16"
    np.testing.assert_array_equal(to_host32(dev), [1.0, -2.0, 0.0, np.inf])
    np.testing.assert_array_equal(cupy.asnumpy(dev.astype(cupy.float32)), [1.0, -2.0, 0.0, np.inf])
    w = ops.prepare_linear_weight(np.tile(bits[:3], (4, 1)), "bfloat16")
    assert w.shape == (4, 3) and w.flags.c_contiguous


# ----------------------------------------------------------------------------- FP8 KV cache

from minillm.fp8 import e4m3 as _e4m3, encode_e4m3  # noqa: E402

E4M3 = _e4m3()


def _fp8_scales(k_scale: float, v_scale: float):
    return ops.asarray(np.array([k_scale, v_scale], np.float32)), np.array([k_scale, v_scale], np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,head_dim", [(8, 128), (2, 64), (4, 8)])
@pytest.mark.parametrize("aligned", [True, False])
def test_kv_append_fp8_bits_equal_numpy(dtype, kv_heads, head_dim, aligned):
    """Quantised appends are the NumPy twin's E4M3 bytes exactly, saturation included (vector path
    on aligned views, element path on a view one element off)."""
    rng = np.random.default_rng(kv_heads * head_dim + aligned)
    num_blocks, block_size, tokens = 40, 16, 70
    row = kv_heads * head_dim
    pool = ops.asarray(rng.integers(0, 0x7F, (2, num_blocks, block_size, kv_heads, head_dim)).astype(np.uint8))
    before = cupy.asnumpy(pool)
    off = 0 if aligned else 1                             # one element off: no 16-byte vectors
    x = rng.standard_normal((tokens, 3 * row + 8), np.float32)
    x[:, ::17] *= 1e3                                     # past 448 * scale: saturates
    x[3, off + row + 5], x[4, off + 2 * row] = np.inf, -np.inf
    buf, buf32 = to_device(x, dtype)
    k = buf[:, off + row:off + 2 * row].reshape(tokens, kv_heads, head_dim)
    v = buf[:, off + 2 * row:off + 3 * row].reshape(tokens, kv_heads, head_dim)
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    slots[::7] = -1
    scales, scales_h = _fp8_scales(0.05, 0.3)
    ops.kv_append(k, v, pool[0], pool[1], ops.asarray(slots), scales)
    ref = before.copy()
    npops.kv_append(buf32[:, off + row:off + 2 * row].reshape(tokens, kv_heads, head_dim),
                    buf32[:, off + 2 * row:off + 3 * row].reshape(tokens, kv_heads, head_dim),
                    ref[0], ref[1], slots, scales_h)
    got = cupy.asnumpy(pool)
    np.testing.assert_array_equal(got, ref)
    assert not np.isin(got, [0x7F, 0xFF]).any(), "a finite or infinite input stored a NaN"


@pytest.mark.parametrize("dtype", DTYPES)
def test_calculate_kv_scales_equals_numpy(dtype):
    rng = np.random.default_rng(4)
    qkv, qkv32 = to_device(rng.standard_normal((33, 3 * 4 * 64), np.float32) * 5, dtype)
    k, v = (qkv[:, i * 256:(i + 1) * 256].reshape(33, 4, 64) for i in (1, 2))
    got = ops.asarray(np.zeros(2, np.float32))
    ops.calculate_kv_scales(k, v, got)
    ref = np.zeros(2, np.float32)
    npops.calculate_kv_scales(*(qkv32[:, i * 256:(i + 1) * 256].reshape(33, 4, 64) for i in (1, 2)), ref)
    np.testing.assert_array_equal(cupy.asnumpy(got), ref)
    zeros = ops.asarray(np.zeros((2, 4, 64), np.float32), dtype)
    ops.calculate_kv_scales(zeros, zeros, got)              # nothing to scale by: 1.0
    np.testing.assert_array_equal(cupy.asnumpy(got), [1.0, 1.0])


def _fp8_paged_batch(rng, ctx_lens, q_lens, kv_heads, head_dim, block_size, scales_h):
    """_paged_batch's layout with uint8 E4M3 caches (values quantised by the NumPy twin)."""
    k_cache, v_cache, k32, v32, meta = _paged_batch(rng, ctx_lens, q_lens, kv_heads, head_dim, block_size,
                                                    "float32")
    k_bits = encode_e4m3(k32, scales_h[0])                # normals and subnormals of E4M3
    v_bits = encode_e4m3(v32, scales_h[1])
    return ops.asarray(k_bits), ops.asarray(v_bits), k_bits, v_bits, meta


def _check_fp8_attention(rng, ctx_lens, q_lens, heads, kv_heads, head_dim, dtype, block_size=16, **kw):
    scales, scales_h = _fp8_scales(0.8, 1.7)
    k_cache, v_cache, k_bits, v_bits, meta = _fp8_paged_batch(rng, ctx_lens, q_lens, kv_heads, head_dim,
                                                              block_size, scales_h)
    q, q32 = to_device(rng.standard_normal((sum(q_lens), heads, head_dim), np.float32), dtype)
    scale = head_dim ** -0.5
    ref = npops.paged_attention(q32, k_bits, v_bits, meta, scale, scales_h)
    got = ops.paged_attention(q, k_cache, v_cache, _device_meta(meta), scale, scales,
                              out=poisoned(q.shape, dtype), **kw)
    assert_close(to_host32(got), ref, ATTN_TOL[dtype], f"fp8 attention {dtype} ctx={ctx_lens} q={q_lens}")


FP8_ATTN_CASES = [  # dtype, heads, kv_heads, head_dim: 16-element loads (GQA <= 2), VEC_ELEMS loads
    ("bfloat16", 16, 8, 128), ("float16", 16, 8, 128), ("bfloat16", 32, 8, 64), ("float16", 32, 8, 64),
    ("bfloat16", 16, 16, 64), ("float16", 16, 2, 128), ("bfloat16", 32, 4, 128), ("float32", 16, 8, 128),
    ("bfloat16", 8, 4, 8),
]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", FP8_ATTN_CASES)
def test_fp8_decode_attention_equals_numpy(dtype, heads, kv_heads, head_dim):
    rng = np.random.default_rng(heads * 100 + kv_heads + head_dim)
    ctx = [1, 15, 16, 17, 100, 333, 64, 5]
    _check_fp8_attention(rng, ctx, [1] * len(ctx), heads, kv_heads, head_dim, dtype)
    _check_fp8_attention(rng, [2999, 1025, 4100], [1, 1, 1], heads, kv_heads, head_dim, dtype)   # split-K


def test_fp8_decode_forced_splits_and_block_sizes():
    rng = np.random.default_rng(12)
    for block_size, splits in ((16, 7), (32, 3), (8, 2), (64, 1)):
        _check_fp8_attention(rng, [700, 1, 129], [1, 1, 1], 16, 8, 128, "bfloat16", block_size=block_size,
                             num_splits=splits)


@pytest.mark.parametrize("cache", ["fp8", "bfloat16", "float16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 8, 64), (16, 16, 64)])
def test_decode_staged_through_shared_memory_equals_register_loads(monkeypatch, cache, heads, kv_heads, head_dim):
    """Decode copies its chunks through shared memory (DEC_STAGES); the same kernel built with its
    loads in registers (DEC_MAX_STAGES=0) sums in the same order, so the outputs are the same bits:
    contexts of one token to many chunks a warp, a partial last chunk, forced splits; FP8 caches, and
    16-bit ones at GQA 1 and 2 (above, 16-bit builds keep their loads in registers: both sides alike)."""
    rng = np.random.default_rng(heads + head_dim)
    ctx = [1, 15, 16, 17, 63, 64, 65, 200, 1000, 3001]
    if cache == "fp8":
        scales, scales_h = _fp8_scales(0.8, 1.7)
        k_cache, v_cache, _, _, meta = _fp8_paged_batch(rng, ctx, [1] * len(ctx), kv_heads, head_dim, 16, scales_h)
    else:
        scales = None
        k_cache, v_cache, _, _, meta = _paged_batch(rng, ctx, [1] * len(ctx), kv_heads, head_dim, 16, cache)
    dtype = "bfloat16" if cache == "fp8" else cache
    q, _ = to_device(rng.standard_normal((len(ctx), heads, head_dim), np.float32), dtype)
    kernel = ops._kernel
    outs = []
    for extra in ({}, {"DEC_MAX_STAGES": 0}):
        def with_extra(filename, dtype, name, extra=extra, **defines):
            return kernel(filename, dtype, name, **defines, **(extra if name.startswith("paged_decode") else {}))
        monkeypatch.setattr(ops, "_kernel", with_extra)
        for splits in (None, 3):
            got = ops.paged_attention(q, k_cache, v_cache, _device_meta(meta), head_dim ** -0.5, scales,
                                      out=poisoned(q.shape, dtype), num_splits=splits)
            outs.append(to_host32(got))
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[1], outs[3])


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", FP8_ATTN_CASES)
def test_fp8_prefill_attention_equals_numpy(dtype, heads, kv_heads, head_dim):
    """The existing prefill kernels (tensor cores for fp16 / bf16 at 64 / 128, else the simple one)."""
    rng = np.random.default_rng(heads * 7 + kv_heads + head_dim)
    q_lens = [17, 1, 64, 130, 5, 100]
    prefix = [0, 40, 33, 200, 0, 1]
    _check_fp8_attention(rng, [p + n for p, n in zip(prefix, q_lens)], q_lens, heads, kv_heads, head_dim, dtype)
    q_lens = [1, 1, 1, 9, 1, 70]                          # a mixed step: decodes first
    prefix = [3000, 12, 1, 0, 40, 90]
    _check_fp8_attention(rng, [p + n for p, n in zip(prefix, q_lens)], q_lens, heads, kv_heads, head_dim, dtype)


def _e4m3_code_values() -> np.ndarray:
    """float32 values of the 256 E4M3 codes as ml_dtypes reads them (0x7F and 0xFF are NaN)."""
    return np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)


def _assert_same_floats(got: np.ndarray, want: np.ndarray, what: str, signed_zeros: bool = True) -> None:
    """Equal as floats and NaN where NaN; with signed_zeros, the same bits off NaN (a sum that
    starts at +0, as attention's does, turns -0 into +0)."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaN positions")
    if signed_zeros:
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32), err_msg=what)
    else:
        np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=what)


WIDEN_SOURCE = r"""
extern "C" __global__ void widen(const unsigned int* words, float* by_word, float* by_byte, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    e4m3x4_to_floats(words[i], by_word + 4 * i);
    for (int k = 0; k < 4; ++k) by_byte[4 * i + k] = e4m3_to_float(words[i] >> (8 * k));
}
"""


def test_e4m3_widening_is_exact_for_every_code():
    """common.cuh's widenings (cvt.rn.f16x2.e4m3x2 a pair, then fp16 to float) against ml_dtypes:
    all 256 codes in each byte of a word, subnormals, signed zeros and the NaN codes included."""
    header = (ops._source_dir() / "common.cuh").read_text()
    module = cupy.RawModule(code=header.replace("#pragma once", "") + WIDEN_SOURCE,
                            options=("-std=c++17", "-DKV_FP8=1"))
    codes = (np.arange(256)[:, None] + 64 * np.arange(4)[None, :]) % 256     # [256 words, 4 bytes]
    words = ops.asarray(np.ascontiguousarray(codes.astype("<u1")).view("<u4").ravel())
    by_word, by_byte = cupy.zeros(4 * 256, np.float32), cupy.zeros(4 * 256, np.float32)
    module.get_function("widen")((1,), (256,), (words, by_word, by_byte, np.int32(256)))
    want = _e4m3_code_values()[codes.ravel()]
    _assert_same_floats(cupy.asnumpy(by_word), want, "e4m3x4_to_floats")
    _assert_same_floats(cupy.asnumpy(by_byte), want, "e4m3_to_float")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [4, 8])          # GQA 2: 16-byte decode loads; GQA 4: VEC_ELEMS bytes
@pytest.mark.parametrize("decode", [True, False])  # paged_decode; paged_prefill_mma (fp16 / bf16) or _simple
def test_fp8_attention_reads_every_code_exactly(dtype, heads, decode):
    """One cached token whose V rows hold all 256 codes (two KV heads of 128): its softmax weight is
    1, so every query head's output is that V row, each element exactly its E4M3 value (every one
    is an fp16 and a bf16 too), NaN for the NaN codes."""
    kv_heads, head_dim, block_size = 2, 128, 16
    k_bits = np.zeros((3, block_size, kv_heads, head_dim), np.uint8)
    v_bits = np.zeros_like(k_bits)
    v_bits[1, 0] = np.arange(256, dtype=np.uint8).reshape(kv_heads, head_dim)   # block 1, slot 0
    meta = AttentionMetadata(query_start_loc=np.array([0, 1], np.int32), seq_lens=np.array([1], np.int32),
                             block_tables=np.array([[1, 2]], np.int32), slot_mapping=np.zeros(1, np.int32),
                             max_query_len=1, max_seq_len=1, is_decode_only=decode)
    q, _ = to_device(np.random.default_rng(heads).standard_normal((1, heads, head_dim), np.float32), dtype)
    scales, _ = _fp8_scales(1.0, 1.0)
    got = ops.paged_attention(q, ops.asarray(k_bits), ops.asarray(v_bits), _device_meta(meta), head_dim ** -0.5,
                              scales, out=poisoned(q.shape, dtype))
    want = np.repeat(_e4m3_code_values().reshape(kv_heads, 1, head_dim), heads // kv_heads, axis=1)
    _assert_same_floats(to_host32(got)[0], want.reshape(heads, head_dim), f"fp8 {dtype} decode={decode}",
                        signed_zeros=False)


def test_fp8_attention_needs_scales_and_matching_caches():
    rng = np.random.default_rng(0)
    scales, scales_h = _fp8_scales(1.0, 1.0)
    k_cache, v_cache, _, _, meta = _fp8_paged_batch(rng, [5], [1], 4, 64, 16, scales_h)
    q = ops.asarray(np.zeros((1, 8, 64), np.float32), "bfloat16")
    with pytest.raises(ValueError, match="kv_scales"):
        ops.paged_attention(q, k_cache, v_cache, _device_meta(meta), 0.1)
    with pytest.raises(ValueError, match="v_cache"):
        ops.paged_attention(q, k_cache, v_cache.view(cupy.int8), _device_meta(meta), 0.1, scales)


# ----------------------------------------------------------------------------- fused q/k norm + rotary + append

def _fused_inputs(rng, dtype, heads, kv_heads, head_dim, tokens=45, num_blocks=30, block_size=16):
    width = (heads + 2 * kv_heads) * head_dim
    qkv, _ = to_device(rng.standard_normal((tokens, width), np.float32) * 2, dtype)
    q = qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(tokens, kv_heads, head_dim)
    q_norm, _ = to_device(1 + 0.2 * rng.standard_normal(head_dim).astype(np.float32), dtype)
    k_norm, _ = to_device(1 + 0.2 * rng.standard_normal(head_dim).astype(np.float32), dtype)
    positions = ops.asarray(rng.integers(0, 4000, tokens).astype(np.int32))
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    slots[::5] = -1
    return q, k, v, q_norm, k_norm, positions, ops.asarray(slots), (num_blocks, block_size, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 8, 64), (8, 4, 8)])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_qk_norm_rotary_kv_append_equals_separate_kernels(dtype, heads, kv_heads, head_dim, qk_norm, fp8):
    """One launch gives the bits of rms_norm + rotary + kv_append (and the NumPy twin's values)."""
    rng = np.random.default_rng(heads + head_dim + 2 * qk_norm + fp8)
    q, k, v, q_norm, k_norm, positions, slots, cache_shape = _fused_inputs(rng, dtype, heads, kv_heads, head_dim)
    if not qk_norm:
        q_norm = k_norm = None
    cos_sin = ops.asarray(_cos_sin(4096, head_dim))
    scales, scales_h = _fp8_scales(0.02, 0.01) if fp8 else (None, None)
    cache_dtype = np.uint8 if fp8 else host_dtype(dtype)
    fresh = lambda: cupy.zeros((2,) + cache_shape, cupy.dtype(cache_dtype))    # noqa: E731
    fused_pool, split_pool = fresh(), fresh()
    got_q = ops.qk_norm_rotary_kv_append(q, k, v, q_norm, k_norm, 1e-6, positions, cos_sin, fused_pool[0],
                                         fused_pool[1], slots, scales, out=poisoned(q.shape, dtype))
    qs, ks = (ops.rms_norm(q, q_norm, 1e-6), ops.rms_norm(k, k_norm, 1e-6)) if qk_norm else (q, k)
    ref_q, ref_k = ops.rotary(qs, ks, positions, cos_sin)
    ops.kv_append(ref_k, v, split_pool[0], split_pool[1], slots, scales)
    np.testing.assert_array_equal(to_host32(got_q), to_host32(ref_q))
    np.testing.assert_array_equal(cupy.asnumpy(fused_pool.view(cupy.uint8)), cupy.asnumpy(split_pool.view(cupy.uint8)))
    # And the NumPy twin (the composition in fp32 from the same inputs), to the rounding of the dtype.
    hd = host_dtype(dtype)
    host = lambda a: ops.to_numpy(a).astype(hd) if a is not None else None      # noqa: E731
    np_pool = np.zeros((2,) + cache_shape, np.uint8 if fp8 else np.float32)
    np_q = npops.qk_norm_rotary_kv_append(host(q), host(k), host(v), host(q_norm), host(k_norm), 1e-6,
                                          cupy.asnumpy(positions), _cos_sin(4096, head_dim), np_pool[0],
                                          np_pool[1], cupy.asnumpy(slots), scales_h)
    assert_close(to_host32(got_q), np_q.astype(np.float32), 4 * ULP[dtype], "fused q vs numpy")
    if not fp8:
        assert_close(to_host32(fused_pool), np_pool, 4 * ULP[dtype], "fused cache vs numpy")


def test_fused_kernel_switch_and_fallback_give_the_same_bits():
    rng = np.random.default_rng(8)
    q, k, v, q_norm, k_norm, positions, slots, cache_shape = _fused_inputs(rng, "bfloat16", 16, 8, 128)
    cos_sin = ops.asarray(_cos_sin(4096, 128))
    scales, _ = _fp8_scales(0.02, 0.01)
    pools = []
    for fuse in (True, False):
        ops.FUSE_QK_NORM_ROTARY_KV_APPEND = fuse
        try:
            pool = cupy.zeros((2,) + cache_shape, cupy.uint8)
            got = ops.qk_norm_rotary_kv_append(q, k, v, q_norm, k_norm, 1e-6, positions, cos_sin, pool[0], pool[1],
                                               slots, scales)
            pools.append((to_host32(got), cupy.asnumpy(pool)))
        finally:
            ops.FUSE_QK_NORM_ROTARY_KV_APPEND = True
    np.testing.assert_array_equal(pools[0][0], pools[1][0])
    np.testing.assert_array_equal(pools[0][1], pools[1][1])
