"""What the GPU test modules share: CuPy (a module importing this skips without it) and whether a
CUDA GPU is there."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.attention import AttentionMetadata

cupy = pytest.importorskip("cupy")
try:
    HAS_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no driver
    HAS_GPU = False


def mixed_step_inputs(rng, block_size: int, lens: list[int], ctx: list[int], num_decode_seqs: int = 0):
    """The prefix-filling step and the step itself of a ragged batch, each (ids, positions, host
    metadata), and the blocks used: sequence b has ctx[b] tokens in the cache and lens[b] new ones,
    the first num_decode_seqs of them one each (as the scheduler orders a mixed step)."""
    width = -(-max(c + n for c, n in zip(ctx, lens)) // block_size)
    tables = np.zeros((len(lens), width), np.int32)
    nxt = 1
    for b, (n, c) in enumerate(zip(lens, ctx)):
        blocks = -(-(c + n) // block_size)
        tables[b, :blocks] = np.arange(nxt, nxt + blocks)
        nxt += blocks

    def step(starts, counts, decodes=0):
        pos = [np.arange(s, s + n) for s, n in zip(starts, counts)]
        slots = [tables[b, p // block_size] * block_size + p % block_size for b, p in enumerate(pos)]
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        ends = np.asarray([s + n for s, n in zip(starts, counts)], np.int32)
        meta = AttentionMetadata(qsl, ends, tables, np.concatenate(slots).astype(np.int32), max(counts),
                                 int(ends.max()), False, num_decode_seqs=decodes,
                                 prefill_max_seq_len=int(ends[decodes:].max()) if decodes else 0)
        ids = rng.integers(1, 512, int(qsl[-1])).astype(np.int32)
        return ids, np.concatenate(pos).astype(np.int32), meta

    return step([0] * len(ctx), ctx), step(ctx, lens, num_decode_seqs), nxt


def scattered_block_tables(rng, ctx_lens, block_size: int, spare_blocks: int, spare_columns: int = 0):
    """(block tables [B, max blocks + spare_columns] int32, number of blocks): each sequence's
    ceil(ctx / block_size) blocks drawn at random from a pool with spare_blocks more than needed."""
    per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(per_seq) + spare_blocks
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(ctx_lens), max(per_seq) + spare_columns), np.int32)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[used:used + n]
        used += n
    return tables, num_blocks
