"""Piecewise CUDA graphs (minillm/piecewise_graphs.py) against the eager forward pass on the GPU."""
from __future__ import annotations

import numpy as np
import pytest

from minillm import LLM
from minillm.attention import AttentionMetadata

from gpu_support import HAS_GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.ops import cuda as ops


def _mixed_step(rng, block_size: int, lens: list[int], ctx: list[int]):
    """ids, positions, host metadata and the prefix-filling step of a ragged batch: sequence b has
    ctx[b] tokens in the cache and lens[b] new ones."""
    width = -(-max(c + n for c, n in zip(ctx, lens)) // block_size)
    tables = np.zeros((len(lens), width), np.int32)
    nxt = 1
    for b, (n, c) in enumerate(zip(lens, ctx)):
        blocks = -(-(c + n) // block_size)
        tables[b, :blocks] = np.arange(nxt, nxt + blocks)
        nxt += blocks

    def step(starts, counts):
        pos = [np.arange(s, s + n) for s, n in zip(starts, counts)]
        slots = [tables[b, p // block_size] * block_size + p % block_size for b, p in enumerate(pos)]
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        ends = np.asarray([s + n for s, n in zip(starts, counts)], np.int32)
        meta = AttentionMetadata(qsl, ends, tables, np.concatenate(slots).astype(np.int32), max(counts),
                                 int(ends.max()), False)
        ids = rng.integers(1, 512, int(qsl[-1])).astype(np.int32)
        return ids, np.concatenate(pos).astype(np.int32), meta

    return step([0] * len(ctx), ctx), step(ctx, lens), nxt


def test_a_mixed_step_equals_the_eager_forward(stories_path):
    """Decodes beside prefill chunks (over cached prefixes and from scratch), a token count between
    two captured sizes, one input id filled on the device: the eager forward's hidden states."""
    llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=16,
              max_num_batched_tokens=512)
    runner = llm.engine.runner
    pieces = runner.piecewise
    assert pieces.sizes[-1] == 512 and 300 not in pieces.sizes
    rng = np.random.default_rng(11)
    lens = [1, 1, 150, 1, 97, 1, 40]                     # 291 tokens: the 512 chain, padded
    ctx = [30, 7, 60, 100, 1, 19, 3]
    (pre_ids, pre_pos, pre_meta), (ids, positions, meta), used = _mixed_step(rng, runner.block_size, lens, ctx)
    assert used <= 128
    with runner.device.compute():
        runner.compute_logits(pre_ids, pre_pos, pre_meta, [])           # the cached prefixes
        patch_row, patch_id = 1, 321                                      # sequence 1's input is on the device
        patch = (np.asarray([patch_row], np.int32), np.asarray([0], np.int32),
                 ops.asarray(np.asarray([patch_id], np.int32)))
        host_ids = ids.copy()
        host_ids[patch_row] = 0
        runs = pieces.num_runs
        rows = list(range(len(lens)))
        got = ops.to_numpy(runner.compute_logits(host_ids, positions, meta, rows, patch))
        assert pieces.num_runs == runs + 1
        ids[patch_row] = patch_id
        hidden = runner.model.forward(ops.asarray(ids), ops.asarray(positions), runner._to_device(meta),
                                      runner.kv_pool)
        last = meta.query_start_loc[1:] - 1
        want = ops.to_numpy(runner.model.compute_logits(hidden[ops.asarray(last)]))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    llm.shutdown()


def test_long_prompts_chunked_through_the_pieces_equal_eager(stories_path):
    """Prompts longer than the token budget, chunked beside running decodes: the same greedy
    tokens with piecewise graphs as eagerly, and the pool free after."""
    from minillm import SamplingParams
    rng = np.random.default_rng(5)
    prompts = [[1] + rng.integers(3, 512, int(n)).tolist() for n in (300, 20, 180, 5, 90, 250, 12, 60)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8,
                  max_num_batched_tokens=128, enforce_eager=eager)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if not eager:
            assert llm.engine.runner.piecewise.num_runs > 0
        assert llm.engine.block_manager.num_used_blocks == 0
        llm.shutdown()
    assert outs[False] == outs[True]
