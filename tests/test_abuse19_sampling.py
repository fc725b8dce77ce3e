"""Sampling semantics held to an independent NumPy reference written from vLLM's definitions.

The reference (below) follows vLLM's V1 sampler: raw log-probabilities are taken from the model's
logits before any rule; then the allowed_token_ids mask, min_tokens' ban of EOS and stop tokens,
logit_bias, the repetition penalty (prompt and output tokens: positive logits divided, negative
multiplied), frequency and presence penalties (output tokens only); greedy is the argmax of those
logits (temperature below 1e-5); otherwise softmax(logits / T), min_p against the largest
probability, top_k, and top_p over what top_k and min_p left, renormalised.
"""
from __future__ import annotations

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.device import CpuDevice
from minillm.ops import numpy as npops
from minillm.sampler import Sampler
from minillm.sequence import Sequence

EOS = (2,)


# ---- the reference ---------------------------------------------------------------------------

def ref_log_softmax(x: np.ndarray) -> np.ndarray:
    """x: [..., V] -> log-probabilities in float64."""
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def ref_processed(raw: np.ndarray, prompt, outputs, p: SamplingParams, eos=EOS) -> np.ndarray:
    """raw: [V] model logits -> the logits greedy takes the argmax of (vLLM's order)."""
    x = np.asarray(raw, np.float64).copy()
    if p.allowed_token_ids is not None:
        keep = np.zeros(len(x), bool)
        keep[list(p.allowed_token_ids)] = True
        x[~keep] = -np.inf
    if len(outputs) < p.min_tokens:
        x[list(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)))] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=len(x)) if len(outputs) else np.zeros(len(x))
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def ref_distribution(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Processed logits [V] -> the probability of sampling each token."""
    q = np.zeros(len(x))
    if p.temperature < 1e-5:
        q[np.argmax(x)] = 1.0
        return q
    y = x / p.temperature
    q = np.exp(y - y.max())
    q /= q.sum()
    if p.min_p > 0:
        q[q < p.min_p * q.max()] = 0.0
    order = np.lexsort((np.arange(len(x)), -q))          # descending, ties by id
    if p.top_k > 0:
        q[order[p.top_k:]] = 0.0
    q /= q.sum()
    if p.top_p < 1.0:
        before = np.cumsum(q[order]) - q[order]
        q[order[before >= p.top_p]] = 0.0
        q /= q.sum()
    return q


def chi_square_p(counts: np.ndarray, q: np.ndarray) -> float:
    """p-value of observed counts under probabilities q (cells expecting < 5 pooled); a count in a
    cell of probability 0 gives 0."""
    from scipy import stats
    n = counts.sum()
    if counts[q == 0].any():
        return 0.0
    expected = q * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:                                       # too small to stand alone: join the smallest cell
        obs, exp = obs[:-1], exp[:-1]
        obs[np.argmin(exp)] += counts[~big].sum()
        exp[np.argmin(exp)] += expected[~big].sum()
    if len(exp) < 2:
        return 1.0
    return float(stats.chi2.sf(((obs - exp) ** 2 / exp).sum(), len(exp) - 1))


# ---- helpers -----------------------------------------------------------------------------------

def make_seq(params: SamplingParams, seed: int, prompt=(1, 2, 3)) -> Sequence:
    seq = Sequence("r", 0, list(prompt), params, 0.0, np.random.default_rng(seed), 1000)
    seq.num_output_placeholders = 1          # the token being sampled, as at launch
    return seq


# ---- temperature below 1e-5 is greedy ---------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-12, 1e-6, 9.99e-6])
@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"min_p": 0.1}])
def test_a_temperature_below_1e_5_is_the_argmax_even_beside_a_near_tie(temperature, filters):
    from minillm.spec_decode.rejection import RejectionSampler, SpecDecodeMetadata
    logits = np.zeros((1, 64), np.float32)
    logits[0, 10], logits[0, 40] = 1.0, 1.00001       # a lower id a hair below the maximum
    params = SamplingParams(temperature=temperature, **filters)
    assert params.is_greedy
    out = Sampler(npops, list(EOS), CpuDevice()).sample_no_sync(logits.copy(), [make_seq(params, 1)])
    assert out.token_ids.tolist() == [40]
    # a step verifying a draft samples its rows by the same rule
    meta = SpecDecodeMetadata.make([[10]], [2])
    ids = RejectionSampler(npops)(np.repeat(logits, 2, axis=0), meta, [make_seq(params, 1)])
    assert ids == [[40]]


# ---- top-p is taken over what top-k and min-p kept ---------------------------------------------

@pytest.mark.parametrize("probs, filters, kept", [
    ([0.3, 0.3, 0.2, 0.2], dict(top_k=2, top_p=0.45), [1, 0, 0, 0]),       # renormalised: 0.5, 0.5
    ([0.4, 0.3, 0.2, 0.1], dict(min_p=0.6, top_p=0.5), [1, 0, 0, 0]),       # renormalised: 4/7, 3/7
    ([0.4, 0.3, 0.2, 0.1], dict(top_k=3, top_p=0.75), [4, 3, 0, 0]),        # 4/9 + 3/9 reaches 0.75
])
def test_top_p_is_a_share_of_what_top_k_and_min_p_kept(probs, filters, kept):
    logits = np.log(np.array([probs], np.float32))
    args = dict(top_k=0, top_p=1.0, min_p=0.0) | filters
    ids = [npops.sample(logits, np.float32([1.0]), np.int32([args["top_k"]]), np.float32([args["top_p"]]),
                        np.float32([args["min_p"]]), np.float32([u]))[0] for u in (np.arange(400) + 0.5) / 400]
    want = np.array(kept, float) / sum(kept)
    np.testing.assert_allclose(np.bincount(ids, minlength=4) / 400, want, atol=0.01)
    q = ref_distribution(logits[0].astype(np.float64), SamplingParams(**filters))
    np.testing.assert_allclose(q, want, atol=1e-6)           # the reference says the same


# ---- the engine against the reference on stories260K -----------------------------------------

@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), device="cpu")


def model_logits(stories_path, ids) -> np.ndarray:
    """[len(ids), V]: the NumPy decoder's logits at every position of ids."""
    from test_model_parity import minillm_prompt_logits
    return minillm_prompt_logits(stories_path, list(ids))


LILY_AND = [1, 317, 269]      # "Lily and": a spread-out next token (0.22, 0.20, 0.18, 0.10, ...)
NUM_DRAWS = 1000


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.0, top_k=3, top_p=0.6),
    dict(temperature=1.5, min_p=0.05, top_p=0.5),
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),
    dict(temperature=2.0, repetition_penalty=1.5, presence_penalty=0.5, logit_bias={317: 2.0, 269: 1.0}),
    dict(temperature=0.5, top_p=0.95, frequency_penalty=2.0, allowed_token_ids=list(range(250, 512))),
], ids=lambda kw: ",".join(kw))
def test_first_token_frequencies_over_seeds_match_the_reference(llm, stories_path, kw):
    """n draws of one request (seeds 7000, 7001, ...: fixed, so the test is deterministic); the
    bound p < 1e-6 is far from chance, a token outside the reference's support fails outright."""
    params = SamplingParams(n=NUM_DRAWS, seed=7000, max_tokens=1, **kw)
    outs = llm.generate([{"prompt_token_ids": LILY_AND}], params, use_tqdm=False)[0].outputs
    counts = np.bincount([o.token_ids[0] for o in outs], minlength=512)
    q = ref_distribution(ref_processed(model_logits(stories_path, LILY_AND)[-1], LILY_AND, [], params), params)
    assert 1 < np.count_nonzero(q) and np.count_nonzero(counts) > 1
    assert chi_square_p(counts, q) > 1e-6, (np.flatnonzero(counts), np.flatnonzero(q))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_eos_back_with_ignore_eos_too(llm, temperature):
    """vLLM: min_tokens is the number of tokens generated 'before EOS or stop_token_ids can be
    generated'; ignore_eos only stops EOS from ending the output (vLLM bans every EOS id then too)."""
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, min_tokens=4, ignore_eos=True,
                            logit_bias={2: 100.0, 9: 90.0}, stop_token_ids=[9])
    out = llm.generate([{"prompt_token_ids": LILY_AND}], params, use_tqdm=False)[0].outputs[0]
    assert 2 not in out.token_ids[:4] and 9 not in out.token_ids[:4], out.token_ids
    assert out.token_ids[4] == 2 and len(out.token_ids) == 8 and out.finish_reason == "length"
