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
    for eager in (False, True):
        llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=16,
                  enforce_eager=eager, speculative_config=spec)
        gpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert gpu == cpu, f"enforce_eager={eager}"
        stats = llm.engine.stats().spec_decode
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert llm.engine.block_manager.num_used_blocks == 0
        llm.shutdown()
