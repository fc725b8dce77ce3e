"""Sampled tokens follow the distribution vLLM's sampler defines, on the CPU (NumPy) backend.

The reference below is written from vLLM's V1 sampler (vllm/v1/sample/): the allowed_token_ids
mask, bad words (the last token of a word whose other tokens end the output so far), min_tokens'
ban of EOS and stop tokens, logit_bias, then the penalties (repetition over prompt and output
tokens, frequency and presence over output tokens); then the temperature, min_p against the
likeliest token's probability, top_k, and top_p over the mass top_k and min_p kept (a token is
kept while the mass strictly before it, in descending order, is below top_p).

stories260K's joint distribution of the first tokens after a prompt is computed exactly from its
logits (one forward pass per prefix) and compared with thousands of seeded samples from the engine
by a G-test. Seeds are fixed, so a run is deterministic; the bound P_MIN = 1e-7 is one a correct
sampler misses with probability below 1e-6, and each test shows the same counts fail the bound
against a distribution with one rule done wrong, so it would catch that bias. The NumPy sampler's
pick is checked exactly over a 200,000-token vocabulary, and a seed's tokens across batches,
speculation and async scheduling.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.attention import AttentionMetadata
from minillm.loader import load_model_config, load_weights
from minillm.models.decoder import DecoderModel
from minillm.ops import get_ops
from minillm.ops import numpy as npops
from minillm.tokenizer import Tokenizer

from test_spec_decode import chi2_sf

P_MIN = 1e-7
NUM_DRAWS = 4000
EOS = 2
LILY_AND = [1, 317, 269]          # "Lily and": a next token spread over many ids


# ---- the reference -------------------------------------------------------------------------------

class Logits:
    """stories260K's NumPy decoder, loaded once: the raw logits after any prefix (cached)."""

    def __init__(self, path):
        config = load_model_config(path)
        self.config = config
        self.model = DecoderModel(config, load_weights(path, config, "float32"), get_ops("numpy"), np.float32, 256)
        self.cache: dict[tuple[int, ...], np.ndarray] = {}

    def __call__(self, ids) -> np.ndarray:
        """[V] float64: the logits after ids."""
        key = tuple(ids)
        if key not in self.cache:
            self.cache[key] = self._forward(list(ids))
        return self.cache[key]

    def _forward(self, ids: list[int]) -> np.ndarray:
        c, n = self.config, len(ids)
        pool = np.zeros((c.num_layers, 2, n, 1, c.num_kv_heads, c.head_dim), np.float32)   # block size 1
        meta = AttentionMetadata(np.array([0, n], np.int32), np.array([n], np.int32),
                                 np.arange(n, dtype=np.int32)[None], np.arange(n, dtype=np.int32), n, n, False)
        hidden = self.model.forward(np.asarray(ids, np.int32), np.arange(n, dtype=np.int32), meta, pool)
        return np.asarray(self.model.compute_logits(hidden)[-1], np.float64)


def processed_logits(raw: np.ndarray, prompt, outputs, p: SamplingParams, bad_words=(), eos=EOS) -> np.ndarray:
    """raw: [V] -> the logits before the temperature, vLLM's rules in vLLM's order."""
    x = raw.copy()
    if p.allowed_token_ids is not None:
        keep = np.zeros(len(x), bool)
        keep[list(p.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for word in bad_words:
        prefix = tuple(word[:-1])
        if len(prefix) <= len(outputs) and tuple(outputs[len(outputs) - len(prefix):]) == prefix:
            x[word[-1]] = -np.inf
    if len(outputs) < p.min_tokens:
        x[[eos, *(p.stop_token_ids or [])]] = -np.inf
    for token, bias in (p.logit_bias or {}).items():
        x[int(token)] += bias
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=len(x)).astype(np.float64)
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def next_token_probs(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Processed logits [V] -> the probability of sampling each token (temperature > 0)."""
    y = x / p.temperature
    q = np.exp(y - y.max())
    q /= q.sum()
    if p.min_p > 0:
        q[q < p.min_p * q.max()] = 0.0
    if p.top_k > 0:
        q[y < np.sort(y)[-p.top_k]] = 0.0                # ties at the k-th logit stay, as vLLM's mask
    q /= q.sum()
    if p.top_p < 1.0:
        order = np.argsort(-q, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        q[order[before >= p.top_p]] = 0.0
        q /= q.sum()
    return q


def reference(logits: Logits, prompt, p: SamplingParams, bad_words=(), rules=processed_logits, probs=next_token_probs):
    """outputs so far -> the probability of each next token [V] (rules and probs: the two halves)."""
    prompt = list(prompt)
    return lambda outputs: probs(rules(logits(prompt + list(outputs)), prompt, list(outputs), p, bad_words), p)


def joint_probs(ref, num_tokens: int, floor: float) -> dict[tuple[int, ...], float]:
    """The probability of each num_tokens-tuple of outputs whose prefixes all reach floor."""
    out = {(): 1.0}
    for _ in range(num_tokens):
        grown = {}
        for prefix, mass in out.items():
            q = ref(prefix)
            for t in np.flatnonzero(q * mass >= floor):
                grown[prefix + (int(t),)] = mass * q[t]
        out = grown
    return out


def tuple_prob(ref, tokens) -> float:
    """The probability of one tuple of outputs."""
    return math.prod(float(ref(tokens[:i])[t]) for i, t in enumerate(tokens))


def g_test_p(samples: list[tuple], ref) -> float:
    """p-value of the samples (equally long tuples of outputs) under ref; cells expecting fewer
    than 5 are pooled, and a sample ref gives no chance gives 0."""
    n = len(samples)
    cells = joint_probs(ref, len(samples[0]), 5.0 / n)
    observed: dict[tuple, int] = {}
    for s in samples:
        observed[s] = observed.get(s, 0) + 1
    if any(tuple_prob(ref, s) == 0.0 for s in observed if s not in cells):
        return 0.0
    obs = np.array([observed.get(c, 0) for c in cells] + [n - sum(observed.get(c, 0) for c in cells)], np.float64)
    exp = np.array([*cells.values(), max(0.0, 1.0 - sum(cells.values()))], np.float64) * n
    if exp[-1] < 5:                                        # too small to stand alone: join the smallest cell
        i = int(np.argmin(exp[:-1]))
        obs[i] += obs[-1]
        exp[i] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    seen = obs > 0
    g = 2.0 * float(np.sum(obs[seen] * np.log(obs[seen] / exp[seen])))
    return chi2_sf(g, len(exp) - 1) if len(exp) > 1 else 1.0


@pytest.fixture(scope="module")
def logits(stories_path) -> Logits:
    return Logits(stories_path)


@pytest.fixture(scope="module")
def tokenizer(stories_path) -> Tokenizer:
    return Tokenizer.from_pretrained(stories_path)


def test_the_g_test_passes_exact_draws_and_fails_a_small_shift(logits):
    """The helper itself: draws from the reference pass, draws at a temperature 20 % off fail."""
    p, off = SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=1.2, top_k=20)
    rng = np.random.default_rng(5)
    ref = reference(logits, LILY_AND, p)
    exact = [(int(t),) for t in rng.choice(len(ref(())), NUM_DRAWS, p=ref(()))]
    assert g_test_p(exact, ref) > 1e-3
    shifted = [(int(t),) for t in rng.choice(len(ref(())), NUM_DRAWS, p=reference(logits, LILY_AND, off)(()))]
    assert g_test_p(shifted, ref) < P_MIN


# ---- the NumPy sampler over a large vocabulary -----------------------------------------------------

@pytest.mark.parametrize("top_k, min_p", [(0, 0.0), (0, 0.001), (199_999, 0.0)], ids=["plain", "min_p", "top_k"])
def test_a_token_after_a_large_running_weight_keeps_its_share(top_k, min_p):
    """65,536 likely tokens, then 134,464 that weigh 0.0035 of one each (0.7 % of the mass in all):
    a uniform in the top 0.7 % picks a tail token, the one a float64 inverse CDF names. Summed in
    float32, the running weight (65,536) moved by none of them, so the tail was never drawn."""
    vocab, head = 200_000, 65_536
    row = np.full(vocab, np.log(0.0035), np.float32)
    row[:head] = 0.0
    u = np.float32([0.3, 0.9945, 0.996, 0.998, 0.9999])
    weights = np.exp(row.astype(np.float64))
    weights[top_k or vocab:] = 0.0                        # top_k keeps the first k (ties by id)
    cdf = np.cumsum(weights)
    want = np.searchsorted(cdf, u.astype(np.float64) * cdf[-1], side="right")
    assert (want[1:] >= head).all()
    b = len(u)
    got = npops.sample(np.tile(row, (b, 1)), np.ones(b, np.float32), np.full(b, top_k, np.int32),
                       np.ones(b, np.float32), np.full(b, min_p, np.float32), u)
    assert got.tolist() == want.tolist()


# ---- the plain engine ----------------------------------------------------------------------------

def first_tokens(llm: LLM, prompt, p: SamplingParams, num_tokens: int) -> list[tuple[int, ...]]:
    """NUM_DRAWS seeded samples (one request, n of them: seeds seed, seed + 1, ...) of the first tokens."""
    outs = llm.generate([{"prompt_token_ids": list(prompt)}], p, use_tqdm=False)[0].outputs
    return [tuple(o.token_ids[:num_tokens]) for o in outs]


@pytest.fixture(scope="module")
def llm(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=128) as model:
        yield model


def without_output_penalties(raw, prompt, outputs, p, bad_words=()):
    """Wrong: presence and frequency penalties left out."""
    x = processed_logits(raw, prompt, outputs, p, bad_words)
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=len(x)).astype(np.float64)
    return x + p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def repetition_over_outputs_only(raw, prompt, outputs, p, bad_words=()):
    """Wrong: the repetition penalty skips the prompt's tokens."""
    return processed_logits(raw, [], outputs, p, bad_words)


def top_p_of_the_whole_mass(x, p):
    """Wrong: top_p measured against the whole vocabulary's mass, not what top_k and min_p kept."""
    y = x / p.temperature
    q = np.exp(y - y.max())
    q /= q.sum()
    order = np.argsort(-q, kind="stable")
    cut = order[(np.cumsum(q[order]) - q[order]) >= p.top_p]
    return next_token_probs(np.where(np.isin(np.arange(len(x)), cut), -np.inf, x), p)


FILTERS_AND_PENALTIES = SamplingParams(n=NUM_DRAWS, seed=1000, max_tokens=2, ignore_eos=True, temperature=0.9, top_k=20,
                                       top_p=0.95, min_p=0.02, repetition_penalty=1.2, presence_penalty=-2.0,
                                       frequency_penalty=-2.0)


def test_two_tokens_under_filters_and_penalties_follow_vllms_rules(llm, logits):
    """Negative presence and frequency penalties (vLLM takes [-2, 2]) make a repeated first token a
    likely second one, so the penalties of output tokens weigh on the second token."""
    p = FILTERS_AND_PENALTIES
    samples = first_tokens(llm, LILY_AND, p, 2)
    assert g_test_p(samples, reference(logits, LILY_AND, p)) > P_MIN
    assert len(set(samples)) > 10
    for wrong in (reference(logits, LILY_AND, p, rules=without_output_penalties),
                  reference(logits, LILY_AND, p, rules=repetition_over_outputs_only),
                  reference(logits, LILY_AND, SamplingParams(**{**vars_of(p), "min_p": 0.0})),
                  reference(logits, LILY_AND, p, probs=top_p_of_the_whole_mass)):
        assert g_test_p(samples, wrong) < P_MIN


def vars_of(p: SamplingParams) -> dict:
    """The fields of p that SamplingParams takes."""
    import dataclasses
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}


def bad_words_reading_the_prompt(raw, prompt, outputs, p, bad_words=()):
    """Wrong: a bad word's earlier tokens may sit in the prompt."""
    x = processed_logits(raw, prompt, outputs, p, bad_words)
    text = list(prompt) + list(outputs)
    for word in bad_words:
        if tuple(text[len(text) - len(word) + 1:]) == tuple(word[:-1]):
            x[word[-1]] = -np.inf
    return x


MASKS_AND_BIASES = dict(n=NUM_DRAWS, seed=2000, max_tokens=2, ignore_eos=True, temperature=1.3,
                        bad_words=["Tom", "Lily", "and Ben"], allowed_token_ids=[t for t in range(3, 512) if t != 392],
                        logit_bias={368: 1.5, 302: -2.0}, min_tokens=2, stop_token_ids=[410])


def test_two_tokens_under_masks_bans_and_biases_follow_vllms_rules(llm, logits, tokenizer):
    """"Tom" bans 'om' after a first 'T' (its first token generated), "Lily" bans 'Lily' always,
    "and Ben" bans nothing ('and' is the prompt's, which bad words never read); min_tokens holds
    the stop token 410 (10 % of the first token) back; 392 ('M', 18 %) is not allowed."""
    p = SamplingParams(**MASKS_AND_BIASES)
    bad = [tuple(tokenizer.encode(w, add_special_tokens=False)) for w in p.bad_words]
    assert bad == [(274, 287), (317,), (269, 368, 302)]
    samples = first_tokens(llm, LILY_AND, p, 2)
    assert g_test_p(samples, reference(logits, LILY_AND, p, bad)) > P_MIN
    assert len(set(samples)) > 100
    for wrong in (reference(logits, LILY_AND, p, bad[1:]),
                  reference(logits, LILY_AND, p, bad, rules=bad_words_reading_the_prompt),
                  reference(logits, LILY_AND, SamplingParams(**{**MASKS_AND_BIASES, "min_tokens": 0}), bad),
                  reference(logits, LILY_AND, SamplingParams(**{**MASKS_AND_BIASES, "logit_bias": {368: 1.5}}), bad)):
        assert g_test_p(samples, wrong) < P_MIN


# ---- seeds ---------------------------------------------------------------------------------------

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SEEDED_KINDS = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2),
                dict(temperature=1.2, top_k=20, presence_penalty=-0.5, frequency_penalty=0.3),
                dict(temperature=0.9, min_p=0.05, n=2), dict(temperature=0.7, logit_bias={268: 3.0}, min_tokens=5),
                dict(temperature=0.6, bad_words=["the"], allowed_token_ids=list(range(3, 400)))]


def seeded_outputs(path, prompts, params, **engine_args) -> list[list[tuple[int, ...]]]:
    llm = LLM(str(path), device="cpu", **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if "speculative_config" in engine_args:
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    return [[tuple(c.token_ids) for c in o.outputs] for o in outs]


def test_a_seed_gives_the_same_tokens_alone_in_a_batch_and_with_speculation(stories_path):
    """vLLM's per-request seed: the same tokens whatever shares the batch, with drafts verified or
    not (the n-th token takes the n-th uniform of the request's stream), scheduled synchronously or
    one step ahead; different seeds differ."""
    import json
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    prompt = [1] + golden[37:45] + golden[37:45] + golden[37:42]          # drafts from the first decode step
    params = [SamplingParams(seed=100 + i, max_tokens=24, ignore_eos=True, **SEEDED_KINDS[i % len(SEEDED_KINDS)])
              for i in range(12)]
    alone = [seeded_outputs(stories_path, [prompt], [p])[0] for p in params[:len(SEEDED_KINDS)]]
    for engine_args in (dict(), dict(speculative_config=SPEC), dict(speculative_config=SPEC, async_scheduling=True)):
        together = seeded_outputs(stories_path, [prompt] * len(params), params, **engine_args)
        assert together[:len(SEEDED_KINDS)] == alone, engine_args
    assert len({o[0] for o in together}) == len(params) and len(set(together[3])) == 2
