"""Seeded sampling and extreme sampling parameters on the NumPy sampler.

A seeded row's tokens are a function of its own logits and its own generator (seed + index for the
index-th of n, as vLLM seeds a request's children): the rows beside it, greedy, unseeded or seeded
with other rules, and its place among them never change what it draws. (Through the whole engine a
row's logits still move by about 1e-5 with the batch, as BLAS sums a matrix product of one row and
of several in different orders: that is numerics, not the sampler's draws.)
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from minillm.device import CpuDevice
from minillm.engine import sequence_seed
from minillm.ops import numpy as npops
from minillm.sampler import Sampler
from minillm.sampling_params import SamplingParams
from minillm.sequence import Sequence

VOCAB = 512
EOS = (2,)


def seeded(params: SamplingParams, index: int = 0) -> Sequence:
    """The index-th sequence of a request, with the generator seed the engine gives it."""
    seed = sequence_seed(params.seed, index) if params.seed is not None else np.random.default_rng().integers(2**62)
    return Sequence("r", index, [1, 3, 4], params, 0.0, seed, 1000)


def step_logits(rng: np.random.Generator) -> np.ndarray:
    """A model-like row: a few likely tokens over a long tail."""
    return (rng.standard_normal(VOCAB) * 3).astype(np.float32)


def draw(sampler: Sampler, rows: list[tuple[Sequence, np.ndarray]]) -> list[int]:
    logits = np.stack([r for _, r in rows]).astype(np.float32)       # [B, V]
    return npops.to_numpy(sampler.sample_no_sync(logits, [s for s, _ in rows]).token_ids).tolist()


COMPANIONS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_k=5, seed=11), SamplingParams(temperature=1.3, top_p=0.4),
              SamplingParams(temperature=1.0, min_p=0.2, seed=-3), SamplingParams(temperature=2.0, top_k=40, top_p=0.9)]


@pytest.mark.parametrize("target", [SamplingParams(temperature=1.0, seed=1234),
                                    SamplingParams(temperature=1.0, seed=7, top_k=50, top_p=0.9, min_p=0.02),
                                    SamplingParams(temperature=0.8, seed=-5, top_p=0.5),
                                    SamplingParams(temperature=1.0, seed=2**63 - 1, n=3, top_k=3)])
def test_a_seeded_rows_tokens_do_not_depend_on_the_rows_beside_it(target):
    steps = 40
    rows = [step_logits(np.random.default_rng(100 + t)) for t in range(steps)]
    alone = {}
    for index in range(target.n):
        seq, sampler = seeded(target, index), Sampler(npops, EOS, CpuDevice(), max_num_seqs=2)
        alone[index] = [draw(sampler, [(seq, rows[t])])[0] for t in range(steps)]
    assert len({tuple(v) for v in alone.values()}) == target.n        # children draw their own streams
    pick = np.random.default_rng(5)
    sampler = Sampler(npops, EOS, CpuDevice(), max_num_seqs=2)       # grows with the batch
    children = [seeded(target, index) for index in range(target.n)]
    got = {index: [] for index in range(target.n)}
    for t in range(steps):
        # companions come and go every step, in numbers from none to a dozen, the children anywhere among them
        batch = [(seeded(COMPANIONS[int(c)]), step_logits(pick)) for c in pick.integers(0, len(COMPANIONS),
                                                                                   int(pick.integers(0, 13)))]
        for index, child in enumerate(children):
            batch.insert(int(pick.integers(0, len(batch) + 1)), (child, rows[t]))
        ids = draw(sampler, batch)
        for index, child in enumerate(children):
            got[index].append(ids[next(b for b, (s, _) in enumerate(batch) if s is child)])
    assert got == alone


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 1.0, 0.0), (0, 0.5, 0.0), (3, 1.0, 0.0), (0, 1.0, 1.0),
                                                 (2, 0.1, 0.5)])
def test_a_finite_logit_that_overflows_over_a_small_temperature_is_not_a_warning(top_k, top_p, min_p):
    """A repetition_penalty of 3.4e38 leaves a seen token's negative logit near -3.4e38 (a logit_bias
    of -3e38 too); over a temperature just above greedy's 1e-5 it is -inf, as in float32 on the GPU,
    and no RuntimeWarning leaves the engine's step (an error under -W error)."""
    row = step_logits(np.random.default_rng(0))
    row[[3, 9]] = -3.0e38
    best = int(np.argmax(row))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = npops.sample(row[None], np.float32([2e-5]), np.int32([top_k]), np.float32([top_p]),
                           np.float32([min_p]), np.float32([0.5]))
    assert ids.tolist() == [best]
