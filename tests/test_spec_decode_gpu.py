"""Rejection sampling on the CUDA backend against the NumPy backend, draft for draft, and the
engine with speculation on the GPU against the CPU engine.

rejection_sample verifies through ops.sample, so the two backends must agree exactly once every
row's uniform is clear of a rounding boundary (the same guard the sampling kernel's test uses).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from minillm import LLM
from minillm.ops import numpy as npops
from minillm.sampling_params import SamplingParams
from minillm.sequence import Sequence
from minillm.spec_decode import RejectionSampler, SpecDecodeMetadata, rejection_sample

from gpu_support import HAS_GPU
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.ops import cuda as ops
    from test_kernels_gpu import _clear_uniform


def _case(rng, batch: int, vocab: int, max_drafts: int):
    """Logits rows, drafts (often the rows' likeliest tokens, so some are accepted) and params."""
    num_drafts = rng.integers(0, max_drafts + 1, batch).astype(np.int32)
    rows = int((num_drafts + 1).sum())
    logits = (rng.standard_normal((rows, vocab)) * 3.0).astype(np.float32)
    starts = np.cumsum(num_drafts + 1) - (num_drafts + 1)
    drafts = []
    for b in range(batch):
        for j in range(num_drafts[b]):
            top = np.argsort(-logits[starts[b] + j])[:3]
            drafts.append(int(top[rng.integers(0, 3)]) if rng.random() < 0.8 else int(rng.integers(vocab)))
    temperature = rng.choice([0.0, 0.5, 1.0], batch).astype(np.float32)
    top_k = rng.choice([0, 0, 20, 500], batch).astype(np.int32)
    top_p = rng.choice([1.0, 1.0, 0.9], batch).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05], batch).astype(np.float32)
    uniforms = rng.random(rows).astype(np.float32)
    for b in np.flatnonzero(temperature > 0):
        # Clearing one row may nudge the sequence's top-p / min-p: clear its rows until none moves.
        moved = True
        while moved:
            before = (top_p[b], min_p[b])
            for r in range(starts[b], starts[b] + num_drafts[b] + 1):
                top_p[b], min_p[b], uniforms[r] = _clear_uniform(rng, logits[r], temperature[b], top_k[b],
                                                                 top_p[b], min_p[b], uniforms[r])
            moved = (top_p[b], min_p[b]) != before
    return logits, np.array(drafts, np.int32), num_drafts, (temperature, top_k, top_p, min_p, uniforms)


@pytest.mark.parametrize("batch,vocab,max_drafts", [(16, 32000, 4), (8, 151936, 6), (64, 1000, 2)])
def test_rejection_sample_matches_numpy(batch, vocab, max_drafts):
    rng = np.random.default_rng(vocab + batch)
    logits, drafts, num_drafts, params = _case(rng, batch, vocab, max_drafts)
    want = rejection_sample(npops, logits, drafts, num_drafts, *params)
    got = rejection_sample(ops, ops.asarray(logits), drafts, num_drafts, *params)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert want[1].sum() > 0 and (want[1] < num_drafts).any()     # accepted and rejected drafts


def test_greedy_verification_on_the_gpu():
    rng = np.random.default_rng(3)
    vocab = 32000
    drafts = [[1, 2, 3], [], [4, 5]]
    logits = rng.standard_normal((sum(len(d) + 1 for d in drafts), vocab)).astype(np.float32)
    am = logits.argmax(axis=1)
    drafts[0] = [int(am[0]), int(am[1]), int((am[2] + 1) % vocab)]
    drafts[2] = [int(am[5]), int(am[6])]
    meta = SpecDecodeMetadata.make(drafts, [len(d) + 1 for d in drafts])
    seqs = [Sequence("r", 0, [1], SamplingParams(temperature=0.0), 0.0, np.random.default_rng(s), 100)
            for s in range(3)]
    out = RejectionSampler(ops)(ops.asarray(logits), meta, seqs)
    assert out == [[int(am[0]), int(am[1]), int(am[2])], [int(am[4])], [int(am[5]), int(am[6]), int(am[7])]]


def test_engine_with_speculation_on_the_gpu_equals_the_cpu_greedy(stories_path):
    """fp32 on the GPU (graphs for plain decode steps, the prefill path for verification, async
    scheduling) gives the CPU engine's greedy tokens without speculation."""
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    prompts = [golden[:12 + i] if i % 2 else [1] + golden[1 + i: 9 + i] * 2 for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(str(stories_path), device="cpu").generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    for eager, overlap in ((False, True), (False, False), (True, True)):
        llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=16,
                  enforce_eager=eager, async_scheduling=overlap, speculative_config=spec)
        gpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert gpu == cpu, f"enforce_eager={eager} async_scheduling={overlap}"
        stats = llm.engine.stats().spec_decode
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert llm.engine.block_manager.num_used_blocks == 0
        graphs = llm.engine.runner.verify_graphs
        assert (graphs is None) == eager
        if not eager:                    # the verification steps replayed graphs
            assert graphs.num_runs > 0
        llm.shutdown()


def test_verify_graphs_equal_the_eager_forward(stories_path):
    """A ragged step (chunks of 1..k+1 tokens, a batch that is not a captured size, one sequence
    whose input id is filled on the device) gives the eager forward's logits through the graphs."""
    from minillm.attention import AttentionMetadata

    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=16,
              speculative_config=spec)
    runner = llm.engine.runner
    graphs = runner.verify_graphs
    assert graphs.query_len == 5 and graphs.capacity == 16
    rng = np.random.default_rng(7)
    bs = runner.block_size
    lens = [5, 1, 3, 5, 2]                               # query tokens per sequence
    ctx = [rng.integers(1, 40) for _ in lens]            # tokens before them
    ids, positions, slots, tables = [], [], [], np.zeros((len(lens), 4), np.int32)
    next_block = 1
    for b, (n, c) in enumerate(zip(lens, ctx)):
        blocks = -(-(c + n) // bs)
        tables[b, :blocks] = np.arange(next_block, next_block + blocks)
        next_block += blocks
        pos = np.arange(c, c + n)
        ids.append(rng.integers(1, 512, n))
        positions.append(pos)
        slots.append(tables[b, pos // bs] * bs + pos % bs)
    ids = np.concatenate(ids).astype(np.int32)
    positions = np.concatenate(positions).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    seq_lens = np.asarray([c + n for c, n in zip(ctx, lens)], np.int32)
    meta = AttentionMetadata(qsl, seq_lens, tables, np.concatenate(slots).astype(np.int32), max(lens),
                             int(seq_lens.max()), False)
    # History: fill every sequence's context with the eager path first (one prefill of its prefix).
    pre = [(b, c) for b, c in enumerate(ctx)]
    pre_ids = np.concatenate([rng.integers(1, 512, c) for _, c in pre]).astype(np.int32)
    pre_pos = np.concatenate([np.arange(c) for _, c in pre]).astype(np.int32)
    pre_slots = np.concatenate([tables[b, np.arange(c) // bs] * bs + np.arange(c) % bs for b, c in pre])
    pre_meta = AttentionMetadata(np.concatenate([[0], np.cumsum(ctx)]).astype(np.int32), np.asarray(ctx, np.int32),
                                 tables, pre_slots.astype(np.int32), max(ctx), max(ctx), False)
    with runner.device.compute():
        runner.compute_logits(pre_ids, pre_pos, pre_meta, [])
    patch_row, patch_id = 6, 77                          # sequence 2's first input comes from the device
    patch = (np.asarray([patch_row], np.int32), np.asarray([0], np.int32), ops.asarray(np.asarray([patch_id], np.int32)))
    host_ids = ids.copy()
    host_ids[patch_row] = 0
    runs = graphs.num_runs
    with runner.device.compute():
        got = ops.to_numpy(runner.compute_logits(host_ids, positions, meta, list(range(len(lens))), patch,
                                                 np.arange(len(ids), dtype=np.int32)))
    assert graphs.num_runs == runs + 1
    ids[patch_row] = patch_id
    with runner.device.compute():
        hidden = runner.model.forward(ops.asarray(ids), ops.asarray(positions), runner._to_device(meta), runner.kv_pool)
        want = ops.to_numpy(runner.model.compute_logits(hidden))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # A step that samples only each chunk's last row gathers those rows.
    last = qsl[1:] - 1
    with runner.device.compute():
        got_last = ops.to_numpy(runner.compute_logits(ids, positions, meta, list(range(len(lens)))))
    np.testing.assert_allclose(got_last, want[last], rtol=1e-4, atol=1e-4)
    llm.shutdown()
