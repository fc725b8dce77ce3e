"""The sampler's draws against vLLM's distribution, computed here from vLLM's definitions.

vLLM's V1 sampler, in order: raw log-probabilities (logprobs_mode raw_logprobs) from the model's
logits; the allowed_token_ids mask; bad words; min_tokens and logit_bias; the repetition (prompt and
output), frequency and presence (output) penalties; greedy is the argmax of those logits; otherwise
the logits over the temperature, min_p against the likeliest token's probability, top_k, and top_p
over what is left, renormalised.

Two kinds of check. The op's rule is exact: `ops.sample` picks by one uniform per row, so midpoints
of a grid of M uniforms give each token's probability to within 1/M. The sampler with real seeded
sequences is checked statistically: seeds are fixed (the test is deterministic) and every count is
held to a Bernstein bound that a correct sampler breaks with probability below 1e-12 per check.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from minillm.device import CpuDevice
from minillm.ops import numpy as npops
from minillm.sampler import Sampler
from minillm.sampling_params import SamplingParams
from minillm.sequence import Sequence

EOS = (2,)
V = 32
# A spread-out row without ties: ten likely tokens, a tail, two masked ones.
LOGITS = np.array([2.1, -0.3, 1.7, 0.4, 2.6, -1.2, 0.9, 1.3, -2.0, 0.0, 1.1, -0.7, 3.0, -3.1, 0.6, -1.6,
                   2.3, -0.1, -np.inf, 0.2, -2.6, 1.5, -0.9, 0.75, -1.9, 1.9, -4.0, -np.inf, 0.3, -0.5,
                   -2.3, 1.0], np.float32)


# ---- the reference -----------------------------------------------------------------------------

def vllm_probs(x: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Processed logits [V] -> the probability of sampling each token (float64), as vLLM's sampler
    defines it (no ties at the k-th logit here: vLLM keeps every token tied with it)."""
    x = np.asarray(x, np.float64)
    q = np.zeros(len(x))
    if temperature < 1e-5:
        q[np.argmax(x)] = 1.0
        return q
    y = x / temperature
    q = np.exp(y - y.max())
    q /= q.sum()
    if min_p > 0:
        q[q < min_p * q.max()] = 0.0
    if 0 < top_k < len(x):
        q[x < np.sort(x)[::-1][top_k - 1]] = 0.0
    q /= q.sum()
    if top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        before = np.cumsum(q[order]) - q[order]              # mass of the likelier tokens
        drop = order[before >= top_p]
        q[drop[drop != order[0]]] = 0.0                       # the likeliest token always stays
        q /= q.sum()
    return q


def bernstein_slack(n: int, q: np.ndarray, alpha: float = 1e-12) -> np.ndarray:
    """Per token, the t with P(|count - n q| >= t) <= alpha / len(q) for count ~ Binomial(n, q)
    (Bernstein's inequality: 2 exp(-t^2 / (2 (n q (1 - q) + t / 3))))."""
    log_term = math.log(2 * len(q) / alpha)
    var = n * q * (1 - q)
    return log_term / 3 + np.sqrt(log_term ** 2 / 9 + 2 * log_term * var)


def assert_draws_follow(ids, q: np.ndarray) -> None:
    """ids drawn independently; q: [V] the probabilities. A token of probability 0 is never drawn."""
    counts = np.bincount(np.asarray(ids), minlength=len(q))
    n = counts.sum()
    assert not counts[q == 0].any(), ("drawn outside the support", np.flatnonzero(counts * (q == 0)))
    bad = np.flatnonzero(np.abs(counts - n * q) > bernstein_slack(n, q))
    assert not bad.size, [(int(t), int(counts[t]), round(n * q[t], 1)) for t in bad]


# ---- helpers -----------------------------------------------------------------------------------

def make_seq(params: SamplingParams, rng, prompt=(1, 3, 4), outputs=()) -> Sequence:
    """A sequence at the step that samples its next token after `outputs`; rng: a seed or a Generator."""
    seq = Sequence("r", 0, list(prompt), params, 0.0, rng, 1000)
    seq.token_ids += list(outputs)
    if seq.counts_outputs:
        for t in outputs:
            seq.output_counts[t] = seq.output_counts.get(t, 0) + 1
    seq.num_output_placeholders = 1          # the token being sampled, as at launch
    return seq


def sample_rows(sampler: Sampler, seqs: list[Sequence], row: np.ndarray):
    """One step: every sequence samples from a copy of row; returns (ids [B], SamplerOutput)."""
    out = sampler.sample_no_sync(np.repeat(row[None], len(seqs), axis=0), seqs)
    return npops.to_numpy(out.token_ids).tolist(), out


# ---- a draw that rounds to 1 in float32 ---------------------------------------------------------

# default_rng(0)'s draw number 14,817,372 is 0.9999999984...: 1.0 once rounded to float32.
SEED_NEAR_ONE, DRAWS_BEFORE_NEAR_ONE = 0, 14_817_372


def generator_at_near_one() -> np.random.Generator:
    rng = np.random.default_rng(SEED_NEAR_ONE)
    rng.bit_generator.advance(DRAWS_BEFORE_NEAR_ONE)
    return rng


@pytest.mark.parametrize("filters", [dict(top_p=0.9), dict(min_p=0.2), dict(top_k=3)])
def test_a_draw_just_below_1_picks_the_last_kept_token_not_the_argmax(filters):
    """probabilities 0.5, 0.3, 0.15, 0.05: each rule keeps the first three, and a draw above
    1 - 3e-8 falls on the third (the least likely kept), as any draw past 0.95 does."""
    probe = generator_at_near_one()
    assert np.float32(probe.random()) == 1.0 and probe.random() < 1.0   # the draw is real, and rounds up
    row = np.full(V, -np.inf, np.float32)
    row[:4] = np.log([0.5, 0.3, 0.15, 0.05])
    params = SamplingParams(temperature=1.0, seed=1, **filters)
    ids, _ = sample_rows(Sampler(npops, list(EOS), CpuDevice()), [make_seq(params, generator_at_near_one())], row)
    assert ids == [2]
    # the rows of a step verifying drafts take their uniforms the same way
    from minillm.spec_decode.rejection import RejectionSampler, SpecDecodeMetadata
    meta = SpecDecodeMetadata.make([[0]], [2])
    seq = make_seq(params, generator_at_near_one())
    assert RejectionSampler(npops)(np.repeat(row[None], 2, axis=0), meta, [seq]) == [[2]]


# ---- the op's rule, exactly: a grid of uniforms ------------------------------------------------

GRID = 4000


def grid_frequencies(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Each token's share of the midpoints of GRID equal cells of [0, 1), drawn by ops.sample with
    the values the sampler packs for params (sampler_temperature and sampler_top_k read -1, 0 and a
    top_k past the vocabulary as vLLM does)."""
    from minillm.sampling_metadata import sampler_temperature, sampler_top_k
    logits = np.repeat(row[None], GRID, axis=0)
    full = lambda value, dtype: np.full(GRID, value, dtype)      # noqa: E731
    ids = npops.sample(logits, full(sampler_temperature(params), np.float32),
                       full(sampler_top_k(params, len(row)), np.int32), full(params.top_p, np.float32),
                       full(params.min_p, np.float32), ((np.arange(GRID) + 0.5) / GRID).astype(np.float32))
    return np.bincount(ids, minlength=len(row)) / GRID


GRID_CASES = [
    dict(temperature=1.0), dict(temperature=0.5), dict(temperature=2.5),
    dict(top_k=1), dict(top_k=5), dict(top_k=-1), dict(top_k=0), dict(top_k=V), dict(top_k=10 * V),
    dict(top_p=0.8), dict(top_p=0.3, temperature=0.7), dict(top_p=1e-9, temperature=5.0),
    dict(min_p=0.1), dict(min_p=0.3, temperature=0.5), dict(min_p=0.05, temperature=3.0), dict(min_p=1.0),
    dict(top_k=8, top_p=0.7), dict(top_k=12, min_p=0.2, temperature=1.5),
    dict(top_k=20, top_p=0.9, min_p=0.02, temperature=0.8), dict(min_p=0.15, top_p=0.5, temperature=1.2),
    dict(temperature=1e6), dict(temperature=1e30), dict(temperature=3.4e38, top_k=6), dict(temperature=0.0),
]


@pytest.mark.parametrize("kw", GRID_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_each_tokens_share_of_the_uniforms_is_its_vllm_probability(kw):
    """Temperature, then min_p on the tempered probabilities, then top_k, then top_p over what is
    left: every token's share within 1/GRID of vLLM's probability (one interval of uniforms a token,
    in the order the op walks them), and none outside the support."""
    params = SamplingParams(**kw)
    q = vllm_probs(LOGITS, 0.0 if params.is_greedy else params.temperature, max(params.top_k, 0),
                   params.top_p, params.min_p)
    got = grid_frequencies(LOGITS, params)
    assert not np.isnan(got).any()
    assert not got[q == 0].any(), np.flatnonzero(got * (q == 0))
    np.testing.assert_allclose(got, q, atol=1.0 / GRID + 1e-6)


# ---- the sampler with seeded sequences: penalties, biases, masks, then the filters -------------

def vllm_processed(raw: np.ndarray, prompt, outputs, p: SamplingParams, bad_words=()) -> np.ndarray:
    """The model's logits [V] -> the logits vLLM's sampler takes its argmax of or tempers (float64):
    allowed_token_ids, bad words (a word's last token when its other tokens end the output),
    min_tokens (EOS and stop tokens), logit_bias, then the repetition penalty over prompt and
    output, frequency and presence over the output."""
    x = np.asarray(raw, np.float64).copy()
    if p.allowed_token_ids is not None:
        masked = np.ones(len(x), bool)
        masked[list(p.allowed_token_ids)] = False
        x[masked] = -np.inf
    for word in bad_words:
        head = tuple(word[:-1])
        if not head or (len(outputs) >= len(head) and tuple(outputs[len(outputs) - len(head):]) == head):
            x[word[-1]] = -np.inf
    if len(outputs) < p.min_tokens:
        x[list(set(p.stop_token_ids) | set(EOS))] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=len(x))
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


PROMPT = (1, 12, 4, 16, 7)
OUTPUTS = (12, 0, 12, 25, 7, 12, 9)
BAD_WORDS = ((21,), (9, 2), (25, 7, 4), (7, 16))       # token ids: (9, 2) and (25, 7, 4) are due after OUTPUTS
NUM_SEQS, NUM_STEPS = 64, 250                            # 16,000 draws a case

SEEDED_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.8, repetition_penalty=1.6, top_p=0.85),
    dict(temperature=1.3, repetition_penalty=0.6, presence_penalty=0.7, frequency_penalty=0.4, top_k=10),
    dict(temperature=0.9, presence_penalty=-1.5, frequency_penalty=-0.5, min_p=0.01),
    dict(temperature=1.1, logit_bias={5: 4.0, 12: -1.5, 13: 6.0, 31: -100.0}, top_k=9, top_p=0.9),
    dict(temperature=0.7, allowed_token_ids=[0, 2, 4, 7, 9, 12, 16, 21, 25, 27, 30], logit_bias={30: 3.0},
         repetition_penalty=1.3, min_p=0.02),
    dict(temperature=1.0, min_tokens=10, stop_token_ids=[16], frequency_penalty=0.3, top_p=0.95),
    dict(temperature=1.2, bad_words=True, top_k=15, min_p=0.01),
]


@pytest.mark.parametrize("kw", SEEDED_CASES, ids=lambda kw: ",".join(kw))
def test_seeded_draws_follow_vllms_distribution_under_every_rule(kw):
    """64 sequences seeded 9000.. draw 250 steps each from one row after a fixed prompt and output
    history; the counts are within the Bernstein bound of vLLM's probabilities."""
    from minillm.bad_words import BadWordIds
    kw = dict(kw)
    bad = BAD_WORDS if kw.pop("bad_words", False) else ()
    params = SamplingParams(max_tokens=100, **kw)
    if bad:                     # the token sequences update_from_tokenizer would have made of the words
        params._bad_word_ids = BadWordIds(bad, max(len(w) for w in bad) - 1)
    seqs = [make_seq(params, 9000 + i, PROMPT, OUTPUTS) for i in range(NUM_SEQS)]
    sampler = Sampler(npops, list(EOS), CpuDevice(), max_num_seqs=NUM_SEQS)
    ids = []
    for _ in range(NUM_STEPS):
        ids += sample_rows(sampler, seqs, LOGITS)[0]
    x = vllm_processed(LOGITS, PROMPT, OUTPUTS, params, bad)
    q = vllm_probs(x, params.temperature, max(params.top_k, 0), params.top_p, params.min_p)
    assert np.count_nonzero(q) >= 5
    assert_draws_follow(ids, q)


# ---- temperatures near 0 -------------------------------------------------------------------------

def near_tie_row() -> np.ndarray:
    """Token 10 at 1.0 and token 20 at 1.01, the rest far below: at temperature 0.01, 0.27 and 0.73."""
    row = np.full(V, -6.0, np.float32)
    row[10], row[20] = 1.0, 1.01
    return row


@pytest.mark.parametrize("temperature", [1e-30, 1e-12, 1e-6, 9.99e-6, 1e-5, 1e-3, 0.0099])
def test_a_temperature_below_0_01_samples_at_0_01_as_vllm_raises_it(temperature):
    """vLLM's SamplingParams raises a temperature in (0, 0.01) to 0.01 (_MAX_TEMP, against NaN and
    inf in the tempered logits) before it asks whether the request is greedy: 1e-6 samples as 0.01
    does, beside a near tie too, and never yields NaN; only 0 takes the argmax."""
    params = SamplingParams(temperature=temperature, seed=3)
    assert params.temperature == 0.01 and not params.is_greedy
    row = near_tie_row()
    q = vllm_probs(row, temperature=0.01)
    np.testing.assert_allclose(grid_frequencies(row, params), q, atol=1.0 / GRID + 1e-6)
    seqs = [make_seq(params, 500 + i) for i in range(40)]
    sampler = Sampler(npops, list(EOS), CpuDevice(), max_num_seqs=40)
    assert_draws_follow([t for _ in range(50) for t in sample_rows(sampler, seqs, row)[0]], q)


def test_temperature_0_and_0_01_are_kept():
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(temperature=0).temperature == 0
    assert SamplingParams(temperature=0.01).temperature == 0.01
    assert SamplingParams.from_optional(temperature=1e-4).temperature == 0.01      # the server's path
    ids, _ = sample_rows(Sampler(npops, list(EOS), CpuDevice()),
                         [make_seq(SamplingParams(temperature=0.0), None)], near_tie_row())
    assert ids == [20]


# ---- ties at the top -----------------------------------------------------------------------------

def test_ties_at_the_largest_logit_greedy_takes_the_first_and_min_p_1_keeps_them_all():
    """temperature 0 is the argmax, the lowest id among equal logits (torch.argmax's first); min_p 1
    keeps every token as likely as the likeliest (p >= 1 * p_max), so the tied ones split the draws."""
    row = LOGITS.copy()
    row[[7, 19, 28]] = row.max()                           # three ids tied with id 12 at the top
    q = vllm_probs(row, min_p=1.0)
    assert np.count_nonzero(q) == 4
    np.testing.assert_allclose(grid_frequencies(row, SamplingParams(min_p=1.0)), q, atol=1.0 / GRID + 1e-6)
    np.testing.assert_allclose(grid_frequencies(row, SamplingParams(temperature=0.0, min_p=1.0)),
                               np.eye(V)[7], atol=0)


# ---- log-probabilities -------------------------------------------------------------------------

def test_logprobs_are_the_raw_log_softmax_with_the_sampled_tokens_rank():
    """vLLM's default logprobs_mode, raw_logprobs: the model's log-softmax before masks, biases,
    penalties, temperature and filters; the sampled token (rank: entries at least as likely, vLLM's
    batched_count_greater_than) and the k likeliest of that distribution."""
    kinds = [dict(temperature=0.0, logprobs=3, repetition_penalty=2.0, logit_bias={13: 9.0}),
             dict(temperature=0.4, logprobs=5, top_k=3, allowed_token_ids=[1, 3, 5, 8, 13], seed=2),
             dict(temperature=1.0, seed=4),
             dict(temperature=3.0, logprobs=0, presence_penalty=2.0, min_p=0.3, seed=6)]
    seqs = [make_seq(SamplingParams(**kw), 70 + i, PROMPT, OUTPUTS) for i, kw in enumerate(kinds)]
    ids, out = sample_rows(Sampler(npops, list(EOS), CpuDevice()), seqs, LOGITS)
    assert out.logprob_rows == [0, 1, 3]
    entries = Sampler.logprob_dicts(npops.to_numpy(out.logprobs), out.logprob_rows, seqs, ids)
    raw = LOGITS.astype(np.float64)
    raw = raw - raw.max() - np.log(np.exp(raw - raw.max()).sum())
    assert entries[0] is not None and entries[2] is None
    assert ids[0] == 13 and ids[1] in (1, 3, 5, 8, 13)     # the processed rules chose these ...
    for b in (0, 1, 3):
        entry, token, k = entries[b], ids[b], seqs[b].params.logprobs
        top = np.argsort(-raw, kind="stable")[:k].tolist()
        assert list(entry)[0] == token and set(entry) == {token, *top}   # ... the values stay raw
        assert entry[token].rank == int((raw >= raw[token]).sum())
        for t, lp in entry.items():
            np.testing.assert_allclose(getattr(lp, "logprob", lp), raw[t], rtol=0, atol=1e-5)


# ---- seeds through the engine --------------------------------------------------------------------

def test_n_seeded_completions_differ_and_come_back_the_same_beside_any_batch(llm):
    """n = 4 with seed 7: four different completions, each the one a request of n = 1 with seed
    7 + i samples (vLLM seeds a request's i-th child so), again on a second run and beside other
    requests. (Through the engine a row's logits move by about 1e-6 with the batch, as BLAS orders a
    product's sums by its shape; a draw lands that near a boundary between two tokens about once in
    a million, and the sampler's own independence of the batch is held row by row in
    test_abuse42_sampling.)"""
    from minillm import SamplingParams as SP
    prompt = {"prompt_token_ids": [1, 403, 407, 261, 378]}
    params = SP(n=4, seed=7, temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert len({tuple(c) for c in first}) == 4
    solo = [llm.generate([prompt], SP(seed=7 + i, temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids for i in range(4)]
    assert solo == first
    others = [{"prompt_token_ids": [1] + list(range(300 + 9 * i, 304 + 10 * i))} for i in range(5)]
    batch = llm.generate(others[:2] + [prompt] + others[2:],
                         [SP(temperature=0.0, max_tokens=20), SP(temperature=1.0, max_tokens=9), params,
                          SP(temperature=0.7, seed=7, n=2, max_tokens=12), SP(temperature=1.2, top_k=5, max_tokens=30),
                          SP(temperature=0.5, max_tokens=3)], use_tqdm=False)
    assert [c.token_ids for c in batch[2].outputs] == first
