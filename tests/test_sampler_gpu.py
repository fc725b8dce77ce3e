"""The packed sampler inputs on the GPU: the same tokens as one upload per field, step after step,
with one step in flight on a non-blocking stream (as the runner launches them)."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.ops import numpy as npops
from minillm.sampler import Sampler
from minillm.sampling_params import SamplingParams

from test_bad_words import TableTokenizer
from test_sampling_metadata import make_seq

from gpu_support import HAS_GPU, cupy
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.device import CudaDevice
    from minillm.ops import cuda as ops

VOCAB = 151936
EOS = [0]


def mixed_params(rng, n: int) -> list[SamplingParams]:
    """Greedy and sampled rows, top-k / top-p / min-p, penalties, log-probabilities, min_tokens."""
    out = []
    for i in range(n):
        kind = i % 6
        out.append(SamplingParams(
            temperature=0.0 if kind == 0 else float(rng.choice([0.6, 1.0, 1.3])),
            top_k=int(rng.choice([-1, 20, 200])) if kind in (1, 4) else -1,
            top_p=float(rng.choice([1.0, 0.9])) if kind in (1, 2) else 1.0,
            min_p=0.05 if kind == 3 else 0.0,
            repetition_penalty=1.2 if kind == 2 else 1.0, presence_penalty=0.3 if kind == 5 else 0.0,
            frequency_penalty=0.2 if kind == 5 else 0.0, logprobs=2 if kind == 4 else None,
            min_tokens=3 if kind == 3 else 0, seed=1000 + i))
    return out


def reference_ids(ref: Sampler, logits, seqs, twins):
    """The per-field path: one host-to-device copy per parameter array."""
    ref.apply_penalties_and_bans(logits, seqs)
    f32 = lambda f: ops.asarray(np.array([f(s.params) for s in seqs], np.float32))   # noqa: E731
    uniforms = np.array([0.0 if s.params.is_greedy else t.random() for s, t in zip(seqs, twins)], np.float32)
    return ops.sample(logits, f32(lambda p: p.temperature),
                      ops.asarray(np.array([max(s.params.top_k, 0) for s in seqs], np.int32)),
                      f32(lambda p: p.top_p), f32(lambda p: p.min_p), ops.asarray(uniforms))


def test_packed_sampler_gives_the_per_field_tokens_across_steps():
    rng = np.random.default_rng(0)
    n = 48
    seqs = [make_seq(p, 1000 + i, prompt=range(i, i + 40)) for i, p in enumerate(mixed_params(rng, n))]
    twins = [np.random.default_rng(1000 + i) for i in range(n)]
    device = CudaDevice()
    sampler = Sampler(ops, EOS, device, max_num_seqs=32)      # grows past 32 on the first step
    ref = Sampler(ops, EOS, device)
    pending = None
    uploads = []
    with device.compute():
        for step in range(8):
            if step == 4:                                     # rows leave and join: a new batch
                seqs, twins = seqs[5:], twins[5:]
            logits = ops.asarray((rng.standard_normal((len(seqs), VOCAB)) * 3).astype(np.float32))
            want = reference_ids(ref, logits.copy(), seqs, twins)
            before = sampler.inputs.num_uploads
            got = sampler.sample_no_sync(logits, seqs)
            uploads.append(sampler.inputs.num_uploads - before)
            host = device.to_host_async(got.token_ids)       # read back one step later, as the engine
            if pending is not None:
                prev_host, prev_want, prev_seqs = pending
                np.testing.assert_array_equal(prev_host.result(), cupy.asnumpy(prev_want))
                for s, t in zip(prev_seqs, prev_host.result().tolist()):
                    s.output_counts[t] = s.output_counts.get(t, 0) + 1
            pending = (host, want, seqs)
        np.testing.assert_array_equal(pending[0].result(), cupy.asnumpy(pending[1]))
    assert uploads == [1] * 8                                 # one packed copy a step (sampled rows)


def test_an_unchanged_greedy_batch_uploads_nothing_and_keeps_its_tokens():
    rng = np.random.default_rng(1)
    seqs = [make_seq(SamplingParams(temperature=0.0, top_k=k), i) for i, k in enumerate([-1, 5, 0, 50])]
    sampler = Sampler(ops, EOS, CudaDevice(), max_num_seqs=8)
    for step in range(3):
        logits = (rng.standard_normal((4, 5000)) * 2).astype(np.float32)
        got = cupy.asnumpy(sampler.sample_no_sync(ops.asarray(logits), seqs).token_ids)
        np.testing.assert_array_equal(got, np.argmax(logits, axis=1))
        assert sampler.inputs.num_uploads == 1
    zeros = np.zeros(4, np.float32)
    np.testing.assert_array_equal(got, npops.sample(logits, zeros, np.array([0, 5, 0, 50], np.int32),
                                                    zeros + 1, zeros, zeros))


def test_allowed_ids_and_bad_words_give_the_per_field_tokens_and_keep_their_rules():
    rng = np.random.default_rng(2)
    tokenizer = TableTokenizer({"ab": [7, 8], " ab": [9, 8], "c": [5], " c": [6]})
    params = []
    for i, p in enumerate(mixed_params(rng, 24)):
        if i % 3 == 1:
            p = SamplingParams(temperature=p.temperature, seed=p.seed, allowed_token_ids=[5, 7, 8, 9, 100_000])
        if i % 4 == 2:
            p = SamplingParams(temperature=p.temperature, seed=p.seed, bad_words=["ab", "c"],
                               allowed_token_ids=[1, 5, 6, 7, 8, 9] if i % 8 == 2 else None)
        p.update_from_tokenizer(tokenizer, VOCAB)
        params.append(p)
    seqs = [make_seq(p, 2000 + i, prompt=range(i, i + 40)) for i, p in enumerate(params)]
    twins = [np.random.default_rng(2000 + i) for i in range(len(seqs))]
    device = CudaDevice()
    sampler, ref = Sampler(ops, EOS, device, max_num_seqs=32), Sampler(ops, EOS, device)
    with device.compute():
        for step in range(10):
            logits = ops.asarray((rng.standard_normal((len(seqs), VOCAB)) * 3).astype(np.float32))
            logits[:, [5, 6, 7, 8, 9]] += 6.0                 # the words' tokens lead, so the rules decide
            want = cupy.asnumpy(reference_ids(ref, logits.copy(), seqs, twins))
            got = cupy.asnumpy(sampler.sample_no_sync(logits, seqs).token_ids)
            np.testing.assert_array_equal(got, want)
            for s, t in zip(seqs, got.tolist()):              # read back before the next step: bad words need it
                s.output_counts[t] = s.output_counts.get(t, 0) + 1
                s.token_ids.append(t)
    for s in seqs:
        ids = s.output_token_ids
        if s.params.allowed_token_ids:
            assert set(ids) <= set(s.params.allowed_token_ids)
        if s.params.bad_words:
            assert not {5, 6} & set(ids) and not {(7, 8), (9, 8)} & set(zip(ids, ids[1:]))


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (50, 0.9)])
def test_a_row_with_every_token_masked_samples_id_0_as_the_twin(top_k, top_p):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, VOCAB)).astype(np.float32)
    logits[1] = logits[3] = -np.inf                     # every token masked (contradictory rules)
    b = len(logits)
    args = (np.array([1.0, 1.0, 0.0, 0.7], np.float32), np.full(b, top_k, np.int32),
            np.full(b, top_p, np.float32), np.zeros(b, np.float32), rng.random(b).astype(np.float32))
    want = npops.sample(logits, *args)
    got = ops.sample(ops.asarray(logits), *(ops.asarray(a) for a in args))
    assert cupy.asnumpy(got).tolist() == want.tolist()
    assert want[1] == want[3] == 0


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 1.0, 0.0), (50, 0.9, 0.0), (0, 0.9, 0.1), (20, 1.0, 0.05)])
def test_a_row_whose_largest_logit_over_the_temperature_is_inf_takes_its_argmax_as_the_twin(top_k, top_p, min_p):
    # A logit_bias packed as float32's largest value, or a tiny repetition penalty, puts a logit at
    # or near float32's top; over a temperature below 1 it is +inf, and exp(x - max) is NaN there.
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((4, VOCAB)).astype(np.float32)
    big = np.finfo(np.float32).max
    logits[0, 1234] = big
    logits[1, 77] = np.inf
    logits[2, 9] = logits[2, 99_000] = big              # two infinite weights: the first is taken
    b = len(logits)
    args = (np.array([0.5, 1.0, 0.3, 0.7], np.float32), np.full(b, top_k, np.int32),
            np.full(b, top_p, np.float32), np.full(b, min_p, np.float32), rng.random(b).astype(np.float32))
    want = npops.sample(logits, *args)
    got = ops.sample(ops.asarray(logits), *(ops.asarray(a) for a in args))
    assert want[:3].tolist() == [1234, 77, 9]
    assert cupy.asnumpy(got).tolist() == want.tolist()
