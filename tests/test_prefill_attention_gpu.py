"""cuda/prefill_attention.cu against its NumPy twin (minillm/ops/numpy.py:paged_attention).

Skips without CuPy or a GPU. Fresh random inputs at every shape: chunk lengths 1, 17, 64, 129 and
2048 over cached prefixes of 0, 5, 1000 and 14000 tokens, alone and in ragged batches that mix
them; head_dim 64 and 128; bfloat16 and float16; GQA groups 1, 2, 3, 4, 8 and 16; block sizes 1
to 256 with the history on scattered blocks; both block shapes of the kernel ("flash": 4 warps of
32 rows; "flash-8w": 8 warps in two key groups) and, on Hopper at head_dim 128, the warpgroup kernel
of prefill_attention_wgmma.cu ("flash-wgmma"; elsewhere that name runs flash-4w's shape, and so
does a forced key split). Outputs are poisoned with NaN first, so an element
the kernel does not write fails. The twin runs once per case; both shapes are held to it. The same
cases over FP8 E4M3 caches (scaled), through "flash" (flash-4w's shape) and the older kernel.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from minillm.attention import AttentionMetadata
from minillm.ops import numpy as npops
from minillm.ops import prefill_attention

from gpu_support import HAS_GPU, cupy
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.ops import cuda as ops

# Elementwise tolerance (as tests/test_kernels_gpu.py) and a bound on the relative error of the whole
# output: P goes through the dtype before P V, and the output is rounded to it.
ATTN_TOL = {"float16": 4e-3, "bfloat16": 2.5e-2}
REL_TOL = {"float16": 2e-3, "bfloat16": 1e-2}


def to_host32(dev) -> np.ndarray:
    """Device array (float16 / bfloat16) -> host float32 (bf16 through its bit pattern)."""
    if dev.dtype.name == "bfloat16":
        bits = cupy.asnumpy(cupy.ascontiguousarray(dev).view(cupy.uint16)).astype(np.uint32)
        return (bits << 16).view(np.float32)
    return cupy.asnumpy(dev).astype(np.float32)


def paged_batch(rng, q_lens, prefixes, kv_heads, head_dim, block_size, dtype):
    """Caches (as the dtype's values in float32) with each sequence's history on randomly scattered
    blocks, and host metadata."""
    ctx = [p + n for p, n in zip(prefixes, q_lens)]
    blocks_per_seq = [-(-c // block_size) for c in ctx]
    num_blocks = sum(blocks_per_seq) + 7
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(ctx), max(blocks_per_seq) + 3), np.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k32 = rounded(rng.standard_normal(shape, np.float32), dtype)
    v32 = rounded(rng.standard_normal(shape, np.float32), dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=np.asarray(ctx, np.int32), block_tables=tables,
                             slot_mapping=np.zeros(int(qsl[-1]), np.int32), max_query_len=int(max(q_lens)),
                             max_seq_len=int(max(ctx)), is_decode_only=False)
    return k32, v32, meta


def rounded(x32: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded through `dtype` (on the device, as the kernels will see them)."""
    return to_host32(ops.asarray(x32, dtype))


def device_meta(meta: AttentionMetadata) -> AttentionMetadata:
    a = ops.asarray
    return AttentionMetadata(a(meta.query_start_loc), a(meta.seq_lens), a(meta.block_tables),
                             a(meta.slot_mapping), meta.max_query_len, meta.max_seq_len, meta.is_decode_only)


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


@functools.lru_cache(maxsize=None)
def batch_and_reference(dtype, head_dim, heads, kv_heads, block_size, q_lens, prefixes, fused_qkv):
    """Random inputs of one case and the twin's output on them (computed once for every kernel)."""
    rng = np.random.default_rng([head_dim, heads, kv_heads, block_size, *q_lens, *prefixes])
    k32, v32, meta = paged_batch(rng, q_lens, prefixes, kv_heads, head_dim, block_size, dtype)
    tokens = sum(q_lens)
    width = (heads + 2 * kv_heads) * head_dim if fused_qkv else heads * head_dim
    q_rows = rounded(rng.standard_normal((tokens, width), np.float32), dtype)   # [T, width]
    q32 = q_rows[:, :heads * head_dim].reshape(tokens, heads, head_dim)
    ref = npops.paged_attention(q32, k32, v32, meta, head_dim ** -0.5)
    return k32, v32, q_rows, meta, ref


def hopper_runs(head_dim: int) -> bool:
    """Whether the warpgroup kernel (flash-wgmma) runs at head_dim on this card."""
    return (head_dim in prefill_attention.HOPPER_HEAD_DIMS
            and ops._compute_capability() in prefill_attention.HOPPER_CAPABILITIES)


def check_prefill(monkeypatch, kernel, dtype, head_dim, heads, kv_heads, block_size, q_lens, prefixes,
                  fused_qkv=False, kv_splits=None, num_decode_seqs=0, launches=None):
    """Run one ragged batch through `kernel` (its keys split kv_splits ways; None: as chosen) and
    hold it to the twin; the first num_decode_seqs one-token sequences go to the decode kernel (as
    the runner builds a mixed step's metadata: with the chunks' longest context). launches: a list
    that gets the kernels the step's plan launches."""
    monkeypatch.setattr(ops, "PREFILL_ATTENTION", kernel)
    k32, v32, q_rows, meta, ref = batch_and_reference(dtype, head_dim, heads, kv_heads, block_size, tuple(q_lens),
                                                      tuple(prefixes), fused_qkv)
    tokens = q_rows.shape[0]
    k_cache, v_cache = ops.asarray(k32, dtype), ops.asarray(v32, dtype)
    # With fused_qkv, q is a view of the fused projection as the model passes it (tokens strided).
    q = ops.asarray(q_rows, dtype)[:, :heads * head_dim].reshape(tokens, heads, head_dim)
    chosen = prefill_attention.variant(kernel, q, k_cache, q, meta.max_query_len, len(q_lens), ops._num_multiprocessors())
    expect = prefill_attention.VARIANTS.get(kernel, chosen)
    if kernel == prefill_attention.HOPPER and not hopper_runs(head_dim):
        expect = prefill_attention.VARIANTS["flash-4w"]                  # where it cannot run
    assert chosen is expect and chosen is not None
    out = ops.asarray(np.full((tokens, heads, head_dim), np.nan, np.float32), dtype)
    dmeta = device_meta(meta)
    dmeta.prefill_kv_splits, dmeta.num_decode_seqs = kv_splits, num_decode_seqs
    if num_decode_seqs:
        dmeta.prefill_max_seq_len = int(np.max(meta.seq_lens[num_decode_seqs:], initial=0))
    plan = ops.attention_plan(q, k_cache, v_cache, dmeta, head_dim ** -0.5, out=out)
    got = to_host32(plan.run(k_cache, v_cache))
    if launches is not None:
        launches.extend(launch.fn for launch in plan.launches)
    what = (f"{kernel} {dtype} hd{head_dim} {heads}/{kv_heads} bs{block_size} q={q_lens} prefix={prefixes} "
            f"splits={kv_splits} decode={num_decode_seqs}")
    assert np.isfinite(got).all(), f"{what}: non-finite output (an element was not written?)"
    np.testing.assert_allclose(got, ref, rtol=ATTN_TOL[dtype], atol=ATTN_TOL[dtype], err_msg=what)
    assert rel_error(got, ref) < REL_TOL[dtype], what
    return chosen


CASES = [  # dtype, head_dim, heads, kv_heads, block_size, chunk lengths, cached prefixes
    ("bfloat16", 128, 16, 8, 16, [2048], [0]),                          # Qwen3-0.6B: one causal chunk
    ("bfloat16", 128, 4, 2, 16, [2048], [14000]),                       # a chunk over a long prefix
    ("float16", 128, 2, 1, 16, [129], [14000]),
    ("bfloat16", 128, 16, 8, 16, [1, 17, 64, 129], [0, 5, 1000, 14000]),
    ("float16", 64, 8, 1, 32, [1, 17, 64, 129], [0, 5, 1000, 5]),      # GQA 8
    ("bfloat16", 64, 4, 4, 16, [129, 64, 17, 1], [1000, 0, 5, 14000]),  # GQA 1
    ("float16", 128, 16, 4, 64, [17, 129, 1, 64], [5, 0, 1000, 0]),     # GQA 4
    ("bfloat16", 128, 16, 8, 8, [300, 1, 77], [1000, 14000, 0]),
    ("float16", 128, 16, 8, 16, [2048, 1, 17], [1000, 5, 0]),
    ("float16", 64, 32, 4, 1, [33, 5, 1], [10, 0, 3]),                  # one token a block
    ("bfloat16", 128, 16, 1, 256, [100, 129], [300, 0]),               # GQA 16
    ("float16", 64, 6, 2, 16, [129, 1, 64], [5, 0, 1000]),              # GQA 3: rows left idle
    ("bfloat16", 64, 4, 4, 128, [64, 64, 64], [0, 64, 1000]),           # chunks on tile edges
    ("bfloat16", 128, 16, 8, 16, [17, 0, 5], [3, 40, 0]),               # a sequence with no query rows
]


@pytest.mark.parametrize("kernel", sorted(prefill_attention.VARIANTS))
@pytest.mark.parametrize("dtype,head_dim,heads,kv_heads,block_size,q_lens,prefixes", CASES)
def test_prefill_matches_twin(monkeypatch, kernel, dtype, head_dim, heads, kv_heads, block_size, q_lens, prefixes):
    check_prefill(monkeypatch, kernel, dtype, head_dim, heads, kv_heads, block_size, q_lens, prefixes)


@pytest.mark.parametrize("kernel", sorted(prefill_attention.VARIANTS))
def test_prefill_reads_q_from_the_fused_qkv_view(monkeypatch, kernel):
    check_prefill(monkeypatch, kernel, "bfloat16", 128, 16, 8, 16, [129, 17, 1], [5, 1000, 0], fused_qkv=True)


def test_many_blocks_of_work_beyond_one_wave(monkeypatch):
    """More blocks than two per multiprocessor (the work order without the first-wave swap)."""
    q_lens, prefixes = [700, 650, 129, 1, 513], [0, 300, 1000, 40, 7]
    blocks, first_wave = prefill_attention.grid_order(prefill_attention.VARIANTS["flash-4w"], -(-700 // 64), 8,
                                                      len(q_lens), ops._num_multiprocessors())
    assert first_wave == 0 and blocks > 2 * ops._num_multiprocessors()
    check_prefill(monkeypatch, "flash-4w", "bfloat16", 128, 16, 8, 16, q_lens, prefixes)


def test_paged_attention_runs_the_auto_choice(monkeypatch):
    """The default flag ("flash") through paged_attention, on a small grid and a large one (with
    the threshold that sends small grids to flash-8w, so both shapes run through the default; on
    Hopper the warpgroup kernel takes both)."""
    monkeypatch.setattr(prefill_attention, "AUTO_8W_BLOCKS_PER_SM", 4)
    small = check_prefill(monkeypatch, "flash", "bfloat16", 128, 16, 8, 16, [129, 1], [40, 7])
    large = check_prefill(monkeypatch, "flash", "bfloat16", 128, 16, 8, 16, [1500] * 6, [0, 10, 20, 30, 40, 50])
    if hopper_runs(128):
        assert small is large is prefill_attention.VARIANTS[prefill_attention.HOPPER]
    else:
        assert (small, large) == (prefill_attention.VARIANTS["flash-8w"], prefill_attention.VARIANTS["flash-4w"])


SPLIT_CASES = [  # key splits, dtype, head_dim, heads, kv_heads, block_size, chunk lengths, prefixes
    (3, "bfloat16", 128, 16, 8, 16, [129, 17, 1], [5, 1000, 0]),          # some blocks have fewer tiles than splits
    (7, "bfloat16", 128, 16, 8, 16, [128], [16000]),                      # a small chunk at a long context
    (17, "float16", 64, 8, 1, 32, [64, 1, 129], [14000, 5, 300]),         # GQA 8, idle splits
    (2, "float16", 128, 6, 2, 16, [300, 2], [1000, 14000]),               # GQA 3: rows left idle
    (32, "bfloat16", 64, 4, 4, 1, [33, 5], [2000, 0]),                    # one token a block
]


@pytest.mark.parametrize("kernel", sorted(prefill_attention.VARIANTS))
@pytest.mark.parametrize("splits,dtype,head_dim,heads,kv_heads,block_size,q_lens,prefixes", SPLIT_CASES)
def test_key_splits_match_twin(monkeypatch, kernel, splits, dtype, head_dim, heads, kv_heads, block_size, q_lens,
                               prefixes):
    """Blocks that split their keys write partials every row of which the reduce merges."""
    check_prefill(monkeypatch, kernel, dtype, head_dim, heads, kv_heads, block_size, q_lens, prefixes,
                  kv_splits=splits)


@pytest.mark.parametrize("splits", [None, 1, 5])
def test_mixed_step_with_key_splits(monkeypatch, splits):
    """Decode rows first (the decode kernel), then chunks whose rows start after them (the reduce's
    first row), as a mixed step of decodes beside a long prompt's chunk runs them."""
    check_prefill(monkeypatch, "flash", "bfloat16", 128, 16, 8, 16, [1, 1, 1, 128, 40], [700, 0, 16000, 16000, 9],
                  kv_splits=splits, num_decode_seqs=3)


def kernel_names(fns) -> list[str]:
    return [getattr(getattr(fn, "kernel", fn), "name", "?") for fn in fns]


def test_many_decodes_beside_a_fresh_chunk_launch_two_kernels(monkeypatch):
    """64 decode rows at contexts near 600 fill the card unsplit (no reduce), and a fresh 16-token
    chunk splits no keys although the decodes' contexts are long: one decode and one prefill
    launch (measured faster on the H200: RESULTS.md). Eight decodes keep their splits, and a
    chunk at a long context its key splits. Each equals the twin."""
    fns = []
    check_prefill(monkeypatch, "flash", "bfloat16", 128, 16, 8, 16, [1] * 64 + [16], list(range(600, 664)) + [0],
                  num_decode_seqs=64, launches=fns)
    assert len(fns) == 2, kernel_names(fns)
    fns = []
    check_prefill(monkeypatch, "flash", "bfloat16", 128, 16, 8, 16, [1] * 8 + [16], [4000] * 8 + [0],
                  num_decode_seqs=8, launches=fns)
    assert len(fns) == 3, kernel_names(fns)                 # decode, its reduce, prefill
    fns = []
    check_prefill(monkeypatch, "flash", "bfloat16", 128, 16, 8, 16, [1] * 64 + [128], list(range(600, 664)) + [16000],
                  num_decode_seqs=64, launches=fns)
    assert len(fns) == 3, kernel_names(fns)                 # decode, prefill, its key-split reduce


def test_a_small_chunk_at_a_long_context_splits_its_keys():
    """The automatic choice: 2 query tiles x 8 KV heads = 16 blocks at 16,128 keys split ~17 ways on
    the H200 (two blocks a multiprocessor); a 2,048-token chunk alone does not split."""
    sms = ops._num_multiprocessors()
    v = prefill_attention.VARIANTS["flash-4w"]
    assert prefill_attention.kv_splits(16, 16128, sms, 128, 16, 128) == -(-2 * sms // 16)
    assert prefill_attention.kv_splits(256, 2048, sms, 2048, 16, 128) == 1
    blocks, _ = prefill_attention.grid_order(v, prefill_attention.num_q_tiles(v, 2, 128), 8, 1, sms)
    assert blocks == 16


# ----------------------------------------------------------------------------- FP8 caches

FP8_SCALES = (0.05, 0.02)           # k_scale, v_scale: standard normal K / V use E4M3 up to ~200


@functools.lru_cache(maxsize=None)
def fp8_batch_and_reference(dtype, head_dim, heads, kv_heads, block_size, q_lens, prefixes):
    """batch_and_reference's inputs with the caches as E4M3 bytes (quantised by the twin's rule) and
    the twin's output over them (it reads the bytes as their value times the scale)."""
    from minillm.fp8 import encode_e4m3
    k32, v32, q_rows, meta, _ = batch_and_reference(dtype, head_dim, heads, kv_heads, block_size, q_lens, prefixes,
                                                    False)
    k_bits, v_bits = encode_e4m3(k32, FP8_SCALES[0]), encode_e4m3(v32, FP8_SCALES[1])
    tokens = q_rows.shape[0]
    ref = npops.paged_attention(q_rows.reshape(tokens, heads, head_dim), k_bits, v_bits, meta, head_dim ** -0.5,
                                np.asarray(FP8_SCALES, np.float32))
    return k_bits, v_bits, q_rows, meta, ref


def check_fp8_prefill(monkeypatch, kernel, dtype, head_dim, heads, kv_heads, block_size, q_lens, prefixes,
                      kv_splits=None, num_decode_seqs=0):
    """One ragged batch over FP8 caches through `kernel`, held to the twin; returns the block shape of
    prefill_attention.cu that ran it (None: the older kernel)."""
    monkeypatch.setattr(ops, "PREFILL_ATTENTION", kernel)
    k_bits, v_bits, q_rows, meta, ref = fp8_batch_and_reference(dtype, head_dim, heads, kv_heads, block_size,
                                                                tuple(q_lens), tuple(prefixes))
    tokens = q_rows.shape[0]
    k_cache, v_cache = ops.asarray(k_bits), ops.asarray(v_bits)
    scales = ops.asarray(np.asarray(FP8_SCALES, np.float32))
    q = ops.asarray(q_rows, dtype).reshape(tokens, heads, head_dim)
    chosen = prefill_attention.variant(kernel, q, k_cache, q, meta.max_query_len, len(q_lens), ops._num_multiprocessors())
    out = ops.asarray(np.full((tokens, heads, head_dim), np.nan, np.float32), dtype)
    dmeta = device_meta(meta)
    dmeta.prefill_kv_splits, dmeta.num_decode_seqs = kv_splits, num_decode_seqs
    if num_decode_seqs:
        dmeta.prefill_max_seq_len = int(np.max(meta.seq_lens[num_decode_seqs:], initial=0))
    plan = ops.attention_plan(q, k_cache, v_cache, dmeta, head_dim ** -0.5, scales, out=out)
    got = to_host32(plan.run(k_cache, v_cache, scales))
    what = f"fp8 {kernel} {dtype} hd{head_dim} {heads}/{kv_heads} bs{block_size} q={q_lens} prefix={prefixes}"
    assert np.isfinite(got).all(), f"{what}: non-finite output (an element was not written?)"
    np.testing.assert_allclose(got, ref, rtol=ATTN_TOL[dtype], atol=ATTN_TOL[dtype], err_msg=what)
    assert rel_error(got, ref) < REL_TOL[dtype], what
    return chosen


FP8_CASES = [case for case in CASES if case[0] != "float32"]


@pytest.mark.parametrize("kernel", ["flash", prefill_attention.OLD_KERNEL])
@pytest.mark.parametrize("dtype,head_dim,heads,kv_heads,block_size,q_lens,prefixes", FP8_CASES)
def test_fp8_prefill_matches_twin(monkeypatch, kernel, dtype, head_dim, heads, kv_heads, block_size, q_lens,
                                  prefixes):
    """An FP8 cache through prefill_attention.cu (its bytes widened to fp16 tiles) and through the
    older kernel: each equals the twin at every shape the 16-bit cases cover."""
    chosen = check_fp8_prefill(monkeypatch, kernel, dtype, head_dim, heads, kv_heads, block_size, q_lens, prefixes)
    assert chosen is (prefill_attention.VARIANTS["flash-4w"] if kernel == "flash" else None), chosen


@pytest.mark.parametrize("splits,dtype,head_dim,heads,kv_heads,block_size,q_lens,prefixes", SPLIT_CASES)
def test_fp8_key_splits_match_twin(monkeypatch, splits, dtype, head_dim, heads, kv_heads, block_size, q_lens,
                                   prefixes):
    """v_scale reaches the split partials before the reduce merges them."""
    chosen = check_fp8_prefill(monkeypatch, "flash", dtype, head_dim, heads, kv_heads, block_size, q_lens,
                               prefixes, kv_splits=splits)
    assert chosen is prefill_attention.VARIANTS["flash-4w"]


def test_fp8_mixed_step_and_the_block_shapes(monkeypatch):
    """Decode rows first, then chunks, over an FP8 cache; an FP8 cache takes flash-4w's shape (one key
    group) whatever the grid, and the older kernel when flash-8w is asked for by name."""
    check_fp8_prefill(monkeypatch, "flash", "bfloat16", 128, 16, 8, 16, [1, 1, 1, 128, 40], [700, 0, 16000, 16000, 9],
                      num_decode_seqs=3)
    q = ops.asarray(np.zeros((4, 16, 128), np.float32), "bfloat16")
    k8 = ops.asarray(np.zeros((8, 16, 8, 128), np.uint8))
    sms = ops._num_multiprocessors()
    monkeypatch.setattr(prefill_attention, "AUTO_8W_BLOCKS_PER_SM", 4)
    assert prefill_attention.variant("flash", q, k8, q, 4, 1, sms) is prefill_attention.VARIANTS["flash-4w"]
    assert prefill_attention.variant("flash-4w", q, k8, q, 4, 1, sms) is prefill_attention.VARIANTS["flash-4w"]
    assert prefill_attention.variant("flash-8w", q, k8, q, 4, 1, sms) is None
