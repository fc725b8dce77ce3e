"""Whole graphs of small mixed steps (minillm/mixed_graphs.py) against the eager forward pass on the GPU."""
from __future__ import annotations

import numpy as np
import pytest

from minillm import LLM
from minillm.attention import AttentionMetadata

from conftest import save_tiny_model
from gpu_support import HAS_GPU, mixed_step_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.ops import cuda as ops


def _logits_both_ways(llm, lens, ctx, decodes, patch_row=None, seed=0):
    """(logits of compute_logits, logits of the eager forward, whole-graph runs, piecewise runs) of
    one step over freshly filled prefixes; patch_row's input id is filled on the device."""
    runner = llm.engine.runner
    rng = np.random.default_rng(seed)
    (pre_ids, pre_pos, pre_meta), (ids, positions, meta), used = mixed_step_inputs(
        rng, runner.block_size, lens, ctx, decodes)
    assert used <= runner.num_blocks
    with runner.device.compute():
        runner.compute_logits(pre_ids, pre_pos, pre_meta, [])
        whole, pieces = runner.mixed_graphs.num_runs, runner.piecewise.num_runs
        patch, host_ids = None, ids.copy()
        if patch_row is not None:
            patch = (np.asarray([patch_row], np.int32), np.asarray([0], np.int32),
                     ops.asarray(np.asarray([ids[patch_row]], np.int32)))
            host_ids[patch_row] = 0
        got = ops.to_numpy(runner.compute_logits(host_ids, positions, meta, list(range(len(lens))), patch))
        hidden = runner.model.forward(ops.asarray(ids), ops.asarray(positions), runner._to_device(meta),
                                      runner.kv_pool)
        last = meta.query_start_loc[1:] - 1
        want = ops.to_numpy(runner.model.compute_logits(hidden[ops.asarray(last)])).astype(np.float32)
    return got.astype(np.float32), want, runner.mixed_graphs.num_runs - whole, runner.piecewise.num_runs - pieces


def test_a_small_mixed_step_replays_one_whole_graph(stories_path):
    """Three decodes (one input on the device) beside two chunks over cached prefixes: one graph
    replay, the eager forward's logits."""
    llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=16,
              max_num_batched_tokens=512)
    got, want, whole, pieces = _logits_both_ways(llm, [1, 1, 1, 150, 40], [30, 7, 100, 60, 3], 3, patch_row=1)
    assert (whole, pieces) == (1, 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # A prompt chunk alone (no decodes), and more chunks than a graph holds (the pieces run).
    got, want, whole, pieces = _logits_both_ways(llm, [90], [1], 0, seed=1)
    assert (whole, pieces) == (1, 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    got, want, whole, pieces = _logits_both_ways(llm, [1, 20, 20, 20, 20, 20], [5, 1, 9, 4, 30, 2], 1, seed=2)
    assert (whole, pieces) == (0, 1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    llm.shutdown()


def test_bf16_mixed_steps_on_the_flash_kernel(tmp_path):
    """head_dim 64, bf16 (the tensor-core prefill kernel): a mixed step at short contexts replays its
    whole graph and gives the eager logits (whose few decode rows split their keys); a short chunk
    over a long prefix, whose keys the eager path splits, runs the pieces instead."""
    path = save_tiny_model(tmp_path / "qwen3", "qwen3", dtype="bfloat16", hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                           max_position_embeddings=8192)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=512, max_num_seqs=16,
              max_num_batched_tokens=512, max_model_len=4096)
    for lens, ctx, decodes, runs in (([1, 1, 1, 1, 200, 37], [40, 300, 5, 77, 1, 120], 4, (1, 0)),
                                     ([1, 1, 16], [20, 30, 3000], 2, (0, 1))):
        got, want, whole, pieces = _logits_both_ways(llm, lens, ctx, decodes, patch_row=0)
        assert (whole, pieces) == runs, (lens, ctx)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-2, f"relative error {err:.3g} for {lens} over {ctx}"
    llm.shutdown()


def test_engine_outputs_with_whole_graphs_equal_eager(stories_path, monkeypatch):
    """Greedy outputs of prompts chunked beside decodes: the same with small mixed steps captured
    whole as eagerly, with async scheduling on and off."""
    from minillm import SamplingParams
    rng = np.random.default_rng(8)
    prompts = [[1] + rng.integers(3, 512, int(n)).tolist() for n in (120, 7, 64, 33, 200, 3, 90, 15)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in
            LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=6,
                max_num_batched_tokens=96, enforce_eager=True).generate(prompts, params)]
    for overlap in (None, False):
        llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=6,
                  max_num_batched_tokens=96, async_scheduling=overlap)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.runner.mixed_graphs.num_runs > 0
        assert llm.engine.block_manager.num_used_blocks == 0
        llm.shutdown()


def test_decode_rows_of_no_context_are_skipped():
    """The decode kernel leaves a row whose context is 0 as it was (the padding rows of a whole
    graph) and computes the others as it would without it."""
    rng = np.random.default_rng(4)
    caches = [ops.asarray(rng.standard_normal((8, 16, 2, 64)).astype(np.float32)) for _ in range(2)]
    q = ops.asarray(rng.standard_normal((3, 4, 64)).astype(np.float32))
    tables = ops.asarray(np.asarray([[1, 2], [3, 4], [5, 6]], np.int32))
    qsl = ops.asarray(np.arange(4, dtype=np.int32))
    slots = ops.asarray(np.full(3, -1, np.int32))

    def attend(lens, out):
        meta = AttentionMetadata(qsl, ops.asarray(np.asarray(lens, np.int32)), tables, slots, 1, 32, True)
        return ops.to_numpy(ops.paged_attention(q, caches[0], caches[1], meta, 0.125, out=out, num_splits=1))

    out = ops.asarray(np.full((3, 4, 64), 7.0, np.float32))
    skipped = attend([20, 0, 31], out)
    full = attend([20, 5, 31], None)
    assert (skipped[1] == 7.0).all()
    np.testing.assert_array_equal(skipped[[0, 2]], full[[0, 2]])


def test_steps_off_the_decode_graphs_allocate_no_logits(stories_path):
    """Mixed steps with more sampling rows each time write their logits into the runner's buffer:
    no device allocation of a step's logits (one that grows makes the allocator wait for the device)."""
    import cupy
    from cupy.cuda import memory_hook

    class Allocations(memory_hook.MemoryHook):
        name = "allocations"

        def __init__(self):
            self.sizes = []

        def alloc_postprocess(self, **kw):
            self.sizes.append(kw["mem_size"])

    llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=16,
              max_num_batched_tokens=512)
    runner, vocab = llm.engine.runner, llm.engine.model_config.vocab_size
    rng = np.random.default_rng(3)
    for seed, decodes in enumerate((2, 5, 9, 14)):
        lens, ctx = [1] * decodes + [40], [20 + 3 * i for i in range(decodes)] + [8]
        (pre_ids, pre_pos, pre_meta), (ids, positions, meta), _ = mixed_step_inputs(
            rng, runner.block_size, lens, ctx, decodes)
        with runner.device.compute():
            runner.compute_logits(pre_ids, pre_pos, pre_meta, [])
            hook = Allocations()
            with hook:
                logits = runner.compute_logits(ids, positions, meta, list(range(len(lens))))
            cupy.cuda.get_current_stream().synchronize()
        assert logits.shape == (len(lens), vocab)
        assert not [s for s in hook.sizes if s >= len(lens) * vocab * 4], (decodes, hook.sizes)
    llm.shutdown()
