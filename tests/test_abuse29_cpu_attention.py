"""The NumPy paged_attention in query tiles: the same results as the chunk in one piece, in bounded memory."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minillm.attention import AttentionMetadata
from minillm.fp8 import decode_e4m3, encode_e4m3
from minillm.ops import numpy as npops

ONE_PIECE = {"ATTENTION_SCORE_BYTES": 1 << 40, "ATTENTION_KV_BYTES": 1 << 40}


def ragged_batch(rng, q_lens, ctxs, num_heads=8, num_kv_heads=2, head_dim=16, block_size=4, fp8=False):
    """q, caches (blocks shuffled), kv_scales and metadata of chunks q_lens over contexts ctxs."""
    block_counts = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(block_counts) + 3
    k_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)).astype(np.float32)
    kv_scales = None
    if fp8:
        kv_scales = np.array([0.01, 0.02], np.float32)
        k_cache, v_cache = encode_e4m3(k_cache, kv_scales[0]), encode_e4m3(v_cache, kv_scales[1])
    ids = rng.permutation(num_blocks).astype(np.int32)
    table = np.zeros((len(ctxs), max(block_counts) + 2), np.int32)          # padded with 0, as the runner does
    starts = np.cumsum([0] + block_counts)
    for b, n in enumerate(block_counts):
        table[b, :n] = ids[starts[b]:starts[b] + n]
    qsl = np.cumsum([0] + list(q_lens)).astype(np.int32)
    q = (rng.standard_normal((qsl[-1], num_heads, head_dim)) * 2).astype(np.float32)
    meta = AttentionMetadata(qsl, np.asarray(ctxs, np.int32), table, np.full(qsl[-1], -1, np.int32),
                             max(q_lens), max(ctxs), all(n == 1 for n in q_lens))
    return q, k_cache, v_cache, kv_scales, meta


def float64_attention(q, k_cache, v_cache, kv_scales, meta, scale):
    """Each sequence, head by head, in float64: the definition paged_attention computes."""
    if kv_scales is not None:
        k_cache, v_cache = decode_e4m3(k_cache, kv_scales[0]), decode_e4m3(v_cache, kv_scales[1])
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = q.shape[1] // num_kv_heads
    out = np.zeros(q.shape, np.float64)
    qsl = meta.query_start_loc
    for b, ctx in enumerate(meta.seq_lens):
        pos = np.arange(ctx)
        blocks, offsets = meta.block_tables[b, pos // block_size], pos % block_size
        keys, vals = k_cache[blocks, offsets].astype(np.float64), v_cache[blocks, offsets].astype(np.float64)
        q_len = qsl[b + 1] - qsl[b]
        for i in range(q_len):
            visible = ctx - q_len + i + 1
            for h in range(q.shape[1]):
                s = keys[:visible, h // group] @ q[qsl[b] + i, h].astype(np.float64) * scale
                p = np.exp(s - s.max())
                out[qsl[b] + i, h] = p @ vals[:visible, h // group] / p.sum()
    return out


CASES = {
    # Hq 8 over Hk 2: GQA groups of 4
    "one prompt": dict(q_lens=[37], ctxs=[37]),
    "a chunk after a cached prefix": dict(q_lens=[29], ctxs=[90]),
    "ragged chunks and decodes": dict(q_lens=[1, 1, 7, 13, 7, 1], ctxs=[9, 30, 20, 13, 20, 30]),
    "equal shapes computed together": dict(q_lens=[5, 5, 5, 5], ctxs=[41, 41, 41, 41]),
    "FP8 cache": dict(q_lens=[1, 23, 6], ctxs=[17, 50, 6], fp8=True),
    "no GQA": dict(q_lens=[11, 3], ctxs=[40, 3], num_heads=4, num_kv_heads=4),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("budgets", [{"ATTENTION_SCORE_BYTES": 1, "ATTENTION_KV_BYTES": 1},
                                     {"ATTENTION_SCORE_BYTES": 3000, "ATTENTION_KV_BYTES": 20000}],
                         ids=["one query a tile", "a few queries a tile"])
def test_tiles_equal_the_chunk_in_one_piece(monkeypatch, case, budgets):
    rng = np.random.default_rng(len(case))
    q, k_cache, v_cache, kv_scales, meta = ragged_batch(rng, **CASES[case])
    scale = q.shape[-1] ** -0.5
    for name, value in ONE_PIECE.items():
        monkeypatch.setattr(npops, name, value, raising=False)
    whole = npops.paged_attention(q, k_cache, v_cache, meta, scale, kv_scales)
    for name, value in budgets.items():
        monkeypatch.setattr(npops, name, value, raising=False)
    tiled = npops.paged_attention(q, k_cache, v_cache, meta, scale, kv_scales)
    assert tiled.dtype == np.float32 and tiled.shape == q.shape
    # Equal up to float32 rounding: BLAS sums a tile's products as it sums the whole chunk's, not bit for bit.
    np.testing.assert_allclose(tiled, whole, rtol=1e-5, atol=1e-6)
    ref = float64_attention(q, k_cache, v_cache, kv_scales, meta, scale)
    np.testing.assert_allclose(whole, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tiled, ref, rtol=1e-5, atol=1e-5)


PEAK_PROBE = """
import sys, tracemalloc
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_abuse29_cpu_attention import ragged_batch, npops
q, k_cache, v_cache, _, meta = ragged_batch(np.random.default_rng(0), [512], [1024], num_heads=4, num_kv_heads=2,
                                            head_dim=8, block_size=16)
npops.ATTENTION_SCORE_BYTES = npops.ATTENTION_KV_BYTES = 256 << 10
tracemalloc.start()
out = npops.paged_attention(q, k_cache, v_cache, meta, 8 ** -0.5)
print(tracemalloc.get_traced_memory()[1], bool(np.isfinite(out).all()))
"""


def test_a_long_chunk_takes_a_tile_of_scores_not_the_whole_chunk():
    """A chunk of 512 queries (Hq 4) over 1,024 keys: its scores in one piece are 8 MiB, and each
    elementwise step held a second copy; in tiles of 256 KiB the call's peak stays under 1 MiB.
    Measured in a process of its own: tracemalloc counts every thread's allocations, and a test
    process runs other tests' engines beside this one."""
    result = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(Path(__file__).parent)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    peak, finite = result.stdout.split()
    whole_scores = 4 * 512 * 1024 * 4
    assert int(peak) < 1 << 20, f"peak {int(peak) / 2**20:.1f} MiB (the chunk's scores in one piece: {whole_scores / 2**20:.0f} MiB)"
    assert finite == "True"
