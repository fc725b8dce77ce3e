"""Piecewise CUDA graphs (minillm/piecewise_graphs.py) against the eager forward pass on the GPU."""
from __future__ import annotations

import numpy as np
import pytest

from minillm import LLM

from gpu_support import HAS_GPU, mixed_step_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.ops import cuda as ops


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
    (pre_ids, pre_pos, pre_meta), (ids, positions, meta), used = mixed_step_inputs(rng, runner.block_size, lens, ctx)
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


def test_long_prompts_chunked_through_the_pieces_equal_eager(stories_path, monkeypatch):
    """Prompts longer than the token budget, chunked beside running decodes: the same greedy
    tokens with piecewise graphs as eagerly, and the pool free after."""
    from minillm import SamplingParams
    rng = np.random.default_rng(5)
    prompts = [[1] + rng.integers(3, 512, int(n)).tolist() for n in (300, 20, 180, 5, 90, 250, 12, 60)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for mode in ("eager", "pieces", "whole"):        # whole: small mixed steps replay whole graphs
        monkeypatch.setenv("MINILLM_MIXED_GRAPHS", "1" if mode == "whole" else "0")
        llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8,
                  max_num_batched_tokens=128, enforce_eager=mode == "eager")
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runner = llm.engine.runner
        if mode == "pieces":
            assert runner.mixed_graphs is None and runner.piecewise.num_runs > 0
        if mode == "whole":
            assert runner.mixed_graphs.num_runs > 0
        assert llm.engine.block_manager.num_used_blocks == 0
        llm.shutdown()
    assert outs["pieces"] == outs["eager"] and outs["whole"] == outs["eager"]
