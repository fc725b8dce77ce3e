"""Sampling semantics held to an independent NumPy reference written from vLLM's definitions.

The reference (below) follows vLLM's V1 sampler: raw log-probabilities are taken from the model's
logits before any rule; then the allowed_token_ids mask, min_tokens' ban of EOS and stop tokens,
logit_bias, the repetition penalty (prompt and output tokens: positive logits divided, negative
multiplied), frequency and presence penalties (output tokens only); greedy is the argmax of those
logits (temperature 0: one in (0, 0.01) is raised to 0.01); otherwise softmax(logits / T), min_p
against the largest probability, top_k, and top_p over what top_k and min_p left, renormalised.
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
    order = np.lexsort((np.arange(len(x)), -x))          # descending logit, ties by id
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
    from test_spec_decode import chi2_sf          # no SciPy: the test extra does not install it
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
    return float(chi2_sf(float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1))


# ---- helpers -----------------------------------------------------------------------------------

def make_seq(params: SamplingParams, seed: int, prompt=(1, 2, 3)) -> Sequence:
    seq = Sequence("r", 0, list(prompt), params, 0.0, np.random.default_rng(seed), 1000)
    seq.num_output_placeholders = 1          # the token being sampled, as at launch
    return seq


# ---- temperature 0 is greedy (vLLM raises one in (0, 0.01) to 0.01: test_abuse43_sampling) -------

@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"min_p": 0.1}])
def test_temperature_0_is_the_argmax_even_beside_a_near_tie(filters):
    from minillm.spec_decode.rejection import RejectionSampler, SpecDecodeMetadata
    logits = np.zeros((1, 64), np.float32)
    logits[0, 10], logits[0, 40] = 1.0, 1.00001       # a lower id a hair below the maximum
    params = SamplingParams(temperature=0.0, **filters)
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


def step_logits(stories_path, prompt, out) -> np.ndarray:
    """[len(out), V]: the logits each output token was sampled from (the model's, unprocessed)."""
    return model_logits(stories_path, list(prompt) + list(out[:-1]))[len(prompt) - 1:]


ONCE = [1, 403, 407, 261, 378]     # "Once upon a time"
GREEDY_COMBOS = [
    dict(repetition_penalty=1.5), dict(repetition_penalty=0.7), dict(presence_penalty=2.0),
    dict(presence_penalty=-2.0), dict(frequency_penalty=0.8), dict(frequency_penalty=-2.0),
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    dict(repetition_penalty=3.4e38), dict(repetition_penalty=1.2, logit_bias={300: 3.0, 432: -5.0}),
    dict(min_tokens=20, stop_token_ids=[13, 400], frequency_penalty=0.3),
    dict(repetition_penalty=1.4, allowed_token_ids=list(range(250, 512))),
    dict(logit_bias={t: 100.0 for t in range(512)}, presence_penalty=1.0),
]


def test_greedy_is_the_argmax_of_the_processed_logits_under_every_penalty(llm, stories_path):
    params = [SamplingParams(**({"temperature": 0.0, "max_tokens": 32, "ignore_eos": True} | c)) for c in GREEDY_COMBOS]
    outs = llm.generate([{"prompt_token_ids": ONCE}] * len(params), params, use_tqdm=False)
    plain = llm.generate([{"prompt_token_ids": ONCE}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    for p, out in zip(params, outs):
        ids = out.outputs[0].token_ids
        assert len(ids) == 32
        for i, (raw, t) in enumerate(zip(step_logits(stories_path, ONCE, ids), ids)):
            x = ref_processed(raw, ONCE, ids[:i], p)
            assert x[t] >= x.max() - 1e-3, (p, i, t, int(np.argmax(x)))
    assert sum(out.outputs[0].token_ids != plain for out in outs) >= len(params) - 1   # all but the +100 bias moved


def check_logprob_entry(entry: dict, token: int, row: np.ndarray, num_top: int) -> None:
    """One position's {id: Logprob} against a log-softmax row: the token present, the num_top
    likeliest (ranked 1..num_top) and nothing else, every value and rank as the row says."""
    top = np.argsort(-row, kind="stable")[:num_top].tolist()
    assert token in entry and set(top) <= set(entry) and len(entry) == len(set(top) | {token})
    for t, lp in entry.items():
        assert abs(lp.logprob - row[t]) < 1e-4 and np.isfinite(lp.logprob)
        assert int((row > row[t] + 1e-5).sum()) + 1 <= lp.rank <= int((row >= row[t] - 1e-5).sum()), (t, lp)
    assert sorted(lp.rank for t, lp in entry.items() if t != token or token in top)[:num_top] == \
        list(range(1, num_top + 1))


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0, logprobs=0, prompt_logprobs=0),
    dict(temperature=0.0, logprobs=3, prompt_logprobs=2, repetition_penalty=1.5, logit_bias={300: 5.0}),
    dict(temperature=1.3, seed=4, logprobs=5, top_k=10, presence_penalty=1.0, prompt_logprobs=3),
    dict(temperature=0.9, seed=9, n=3, logprobs=2, min_p=0.1, frequency_penalty=0.5),
    dict(temperature=2.0, seed=9, logprobs=1, allowed_token_ids=[5, 300, 400], prompt_logprobs=1),
    dict(temperature=1.0, seed=2, n=2, logprobs=20, prompt_logprobs=20, top_p=0.8),
], ids=lambda kw: ",".join(kw))
def test_logprobs_are_the_raw_log_softmax_with_the_sampled_token_and_its_rank(llm, stories_path, kw):
    """vLLM's default logprobs_mode (raw_logprobs): the model's log-softmax before penalties,
    biases, masks, temperature and filters; each position holds the sampled (prompt) token and the
    top k; prompt_logprobs start with None."""
    prompt = LILY_AND + [261]
    params = SamplingParams(max_tokens=10, ignore_eos=True, **kw)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    if params.prompt_logprobs is not None:
        rows = ref_log_softmax(model_logits(stories_path, prompt))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            check_logprob_entry(out.prompt_logprobs[i], prompt[i], rows[i - 1], params.prompt_logprobs)
    else:
        assert out.prompt_logprobs is None
    assert len(out.outputs) == params.n
    for c in out.outputs:
        rows = ref_log_softmax(step_logits(stories_path, prompt, c.token_ids))
        assert len(c.logprobs) == len(c.token_ids) == 10
        for entry, token, row in zip(c.logprobs, c.token_ids, rows):
            check_logprob_entry(entry, token, row, params.logprobs)
        assert abs(c.cumulative_logprob - sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids))) < 1e-3
    if params.n > 1:
        assert len({tuple(c.token_ids) for c in out.outputs}) == params.n


# ---- seeds ------------------------------------------------------------------------------------

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def seeded_prompts(stories_path):
    """8 token-id prompts, half sharing a 40-token prefix, and a seeded request for each."""
    import json
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    prompts = [golden[:40] + golden[100 + i:101 + i + i % 5] if i % 2 else [1] + golden[1 + 3 * i:4 + 4 * i]
               for i in range(8)]
    kinds = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2),
             dict(temperature=1.2, top_k=20, presence_penalty=0.5, frequency_penalty=0.3),
             dict(temperature=0.9, min_p=0.05, n=2)]
    params = [SamplingParams(seed=100 + i, max_tokens=32, ignore_eos=True, **kinds[i % 4]) for i in range(8)]
    return prompts, params


def token_ids(outputs) -> list[list[tuple[int, ...]]]:
    return [[tuple(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def seeded_alone(stories_path, seeded_prompts):
    alone = LLM(str(stories_path), device="cpu", enable_prefix_caching=False)
    return [token_ids(alone.generate([{"prompt_token_ids": p}], sp, use_tqdm=False))[0]
            for p, sp in zip(*seeded_prompts)]


@pytest.mark.parametrize("engine_args", [
    dict(async_scheduling=False),
    dict(num_kv_blocks=24, block_size=4, max_model_len=96, async_scheduling=True),
    dict(num_kv_blocks=24, block_size=4, max_model_len=96, speculative_config=SPEC),
    dict(max_num_batched_tokens=16, max_num_seqs=5, async_scheduling=True),
], ids=["batch", "preempted-async", "preempted-ngram", "chunked-async"])
def test_a_seeded_request_samples_the_same_tokens_however_it_is_scheduled(stories_path, seeded_prompts,
                                                                          seeded_alone, engine_args):
    llm = LLM(str(stories_path), device="cpu", **engine_args)
    prompts, params = seeded_prompts
    together = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
    if "speculative_config" in engine_args:
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    assert together == seeded_alone
    # n > 1: distinct samples; different seeds: different samples
    assert len(set(together[3])) == 2 and len({c[0] for c in together}) == len(prompts)


@pytest.fixture(scope="module")
def server(stories_path):
    from test_server_helpers import running_server
    with running_server(stories_path, served_model_name="stories") as running:
        yield running


def test_a_seeded_request_samples_the_same_on_the_server_as_through_llm(llm, http):
    """The same seed, sampling fields and prompt: the server (its engine core wherever it runs,
    streamed or not) gives the LLM API's tokens and log-probabilities."""
    fields = dict(temperature=0.9, top_p=0.9, top_k=30, min_p=0.02, seed=42, n=3, presence_penalty=0.3,
                  frequency_penalty=0.2, repetition_penalty=1.1, ignore_eos=True, max_tokens=20)
    want = llm.generate(["Lily and"], SamplingParams(logprobs=2, **fields), use_tqdm=False)[0].outputs
    body = dict(model="stories", prompt="Lily and", logprobs=2, return_token_ids=True, **fields)
    got = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["token_ids"] for c in sorted(got, key=lambda c: c["index"])] == [c.token_ids for c in want]
    for c in got:
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"],
                                   [e[t].logprob for e, t in zip(want[c["index"]].logprobs, want[c["index"]].token_ids)],
                                   atol=1e-5)
    streamed: dict[int, list[int]] = {}
    import json
    with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    assert [streamed[i] for i in range(3)] == [c.token_ids for c in want]


# ---- edge values -------------------------------------------------------------------------------

def test_edge_values_sample_what_the_reference_says_without_nan(llm, stories_path):
    """Values at the ends of their ranges: near-zero temperature and top_p, top_k 1, min_p 1 are the
    argmax; a bias of +-100 on every token changes nothing; the largest repetition penalty and
    presence penalties of +-2 sample inside the reference's support; logprobs stay finite."""
    base = dict(max_tokens=12, ignore_eos=True, seed=5, logprobs=1)
    greedy = llm.generate([{"prompt_token_ids": LILY_AND}], SamplingParams(temperature=0, **base),
                          use_tqdm=False)[0].outputs[0].token_ids
    hot = llm.generate([{"prompt_token_ids": LILY_AND}], SamplingParams(temperature=1.0, **base),
                       use_tqdm=False)[0].outputs[0].token_ids
    cases = [(dict(temperature=1e-5), greedy), (dict(temperature=0.0), greedy), (dict(top_p=1e-9), greedy),
             (dict(top_k=1), greedy), (dict(min_p=1.0), greedy),
             (dict(logit_bias={t: 100.0 for t in range(512)}), hot),
             (dict(logit_bias={t: -100.0 for t in range(512)}), hot),
             (dict(repetition_penalty=3.4e38), None), (dict(presence_penalty=2.0, frequency_penalty=-2.0), None),
             (dict(presence_penalty=-2.0, top_k=3, min_p=0.5), None), (dict(temperature=3.4e38), None)]
    params = [SamplingParams(**({"temperature": 1.0} | base | c)) for c, _ in cases]
    outs = llm.generate([{"prompt_token_ids": LILY_AND}] * len(cases), params, use_tqdm=False)
    for (case, want), p, out in zip(cases, params, outs):
        c = out.outputs[0]
        assert all(np.isfinite(e[t].logprob) for e, t in zip(c.logprobs, c.token_ids)), case
        if want is not None:
            assert c.token_ids == want, case
        for i, (raw, t) in enumerate(zip(step_logits(stories_path, LILY_AND, c.token_ids), c.token_ids)):
            assert ref_distribution(ref_processed(raw, LILY_AND, c.token_ids[:i], p), p)[t] > 0, (case, i, t)
