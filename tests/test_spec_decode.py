"""Speculative decoding parts on the CPU: config, n-gram proposer, rejection sampling, stats.

The distribution tests follow issue 16: 4,000 seeded samples at temperature 0.8 with and without
speculation pass a chi-square test at p > 0.01, and a deliberately broken acceptance rule fails it.
The two arms draw from disjoint seeds: with the same seeds the outputs are equal token for token
(test_same_seed_gives_the_plain_samplers_tokens), which would make the test say nothing.
"""
import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.ops import numpy as npops
from minillm.sampler import Sampler
from minillm.sampling_params import SamplingParams
from minillm.sequence import Sequence
from minillm.spec_decode import (NgramProposer, RejectionSampler, SpecDecodeMetadata, SpecDecodeStats,
                                 SpeculativeConfig, TokenHistory, draft_row_views, rejection_sample)
from minillm.spec_decode import metrics as spec_metrics
from minillm.spec_decode import rejection as rejection_mod
from minillm.spec_decode.ngram import find_ngram_proposal

from test_bad_words import TableTokenizer

NUM_SAMPLES = 4000


# ----------------------------------------------------------------------------- chi-square

def _gammaincc(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x): a series below a + 1, a continued fraction above."""
    if x <= 0.0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        ap = a
        for _ in range(10000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with df degrees of freedom."""
    return _gammaincc(df / 2.0, x / 2.0)


def chi2_two_sample_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Homogeneity test of two count vectors over the same bins; sparse bins are pooled into one."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = a.sum(), b.sum()
    pooled = a + b
    dense = pooled * min(na, nb) / (na + nb) >= 5.0       # expected count >= 5 in both arms
    if (~dense).any():
        a = np.append(a[dense], a[~dense].sum())
        b = np.append(b[dense], b[~dense].sum())
        pooled = a + b
    keep = pooled > 0
    a, b, pooled = a[keep], b[keep], pooled[keep]
    ea, eb = pooled * na / (na + nb), pooled * nb / (na + nb)
    stat = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    return chi2_sf(stat, len(pooled) - 1)


@pytest.mark.parametrize("x", [0.01, 0.5, 1.0, 3.841458820694124, 7.0, 25.0, 80.0])
def test_chi2_sf_matches_closed_forms(x):
    assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10, abs=1e-300)
    assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10, abs=1e-300)
    # df = 4: exp(-x/2) (1 + x/2)
    assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-10, abs=1e-300)
    assert chi2_sf(0.0, 3) == 1.0


def test_chi2_sf_matches_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 3, 7, 20, 63):
        for x in (0.3, df * 0.5, df, df + 3 * math.sqrt(2 * df), 4 * df + 30):
            assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-300)


def test_two_sample_pvalue_sees_a_shift_and_not_noise():
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.3, 0.2, 0.08, 0.02])
    same = chi2_two_sample_pvalue(rng.multinomial(4000, p), rng.multinomial(4000, p))
    shifted = chi2_two_sample_pvalue(rng.multinomial(4000, p), rng.multinomial(4000, [0.45, 0.25, 0.2, 0.08, 0.02]))
    assert same > 0.01 and shifted < 1e-4


# ----------------------------------------------------------------------------- config

def test_config_from_the_dict_llm_takes():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 4, 2)
    assert SpeculativeConfig.from_dict(c.to_dict()) == c


def test_config_from_the_json_the_cli_takes():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3, 3)
    assert SpeculativeConfig.from_any(json.dumps(c.to_dict())) == c
    assert SpeculativeConfig.from_any(None) is None
    assert SpeculativeConfig.from_any(c) is c


def test_config_lookup_defaults_follow_vllm():
    assert SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_min == 5
    assert SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_max == 5
    only_min = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=3)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (3, 3)
    # vLLM's older spellings: model="ngram" and method="[ngram]"
    assert SpeculativeConfig.from_dict({"model": "ngram", "num_speculative_tokens": 1}).method == "ngram"
    assert SpeculativeConfig.from_dict({"method": "[ngram]", "num_speculative_tokens": 1}).method == "ngram"


def test_config_is_frozen():
    c = SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_speculative_tokens = 3


@pytest.mark.parametrize("d,field", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 10**9}, "num_speculative_tokens"),      # buffers of 60 TiB
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "method"),
    ({"num_speculative_tokens": 2, "model": "some/draft-model"}, "model"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "prompt_lookup": 3}, "prompt_lookup"),
])
def test_config_errors_name_the_field(d, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(d)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"ngram"'])
def test_config_rejects_json_that_is_not_an_object(text):
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_json(text)


# ----------------------------------------------------------------------------- n-gram proposer

def proposer(k=4, lo=2, hi=3, max_model_len=None) -> NgramProposer:
    cfg = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
    return NgramProposer(cfg, max_model_len)


def reference_proposal(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The rule by its definition: longest suffix n-gram with an earlier copy; its earliest copy."""
    total = len(tokens)
    for n in range(min(hi, total - 1), lo - 1, -1):
        suffix = tokens[total - n:]
        for s in range(0, total - n):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def test_proposer_follows_the_matched_ngram():
    # [4, 2, 3] cannot be found; [2, 3] is, and only three tokens follow it.
    assert proposer(k=4, lo=2, hi=3).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_longest_match_wins_over_an_earlier_shorter_one():
    tokens = [9, 2, 3, 7, 1, 2, 3, 8, 5, 1, 2, 3]
    assert proposer(k=3, lo=2, hi=3).propose(tokens) == [8, 5, 1]     # [1, 2, 3] at 4
    assert proposer(k=3, lo=2, hi=2).propose(tokens) == [7, 1, 2]     # [2, 3] first at 1


def test_earliest_copy_of_the_longest_ngram_is_followed():
    # Three copies of [1, 2]; the first has the most tokens after it (vLLM's choice).
    assert proposer(k=2, lo=2, hi=2).propose([1, 2, 5, 1, 2, 6, 1, 2]) == [5, 1]
    # A short loop still yields k proposals from its first turn.
    assert proposer(k=5, lo=2, hi=2).propose([7, 3, 4, 3, 4, 3, 4, 3, 4]) == [3, 4, 3, 4, 3]


def test_max_bound_caps_the_ngram_length():
    tokens = [1, 2, 10, 9, 9, 5, 6, 1, 2, 11, 5, 6, 1, 2]
    assert proposer(k=2, lo=2, hi=4).propose(tokens) == [11, 5]       # [5, 6, 1, 2] at 5
    assert proposer(k=2, lo=2, hi=2).propose(tokens) == [10, 9]       # only [1, 2]: first at 0


def test_min_bound_and_nothing_found():
    tokens = [5, 1, 8, 9, 3, 1]                                        # only the 1-gram [1] recurs
    assert proposer(k=3, lo=2, hi=3).propose(tokens) == []
    assert proposer(k=3, lo=1, hi=3).propose(tokens) == [8, 9, 3]
    assert proposer(lo=1, hi=3).propose([1, 2, 3, 4]) == []            # nothing recurs
    assert proposer(lo=3, hi=3).propose([1, 1]) == []                  # shorter than the minimum
    assert proposer(lo=1, hi=1).propose([1]) == []
    assert proposer(lo=1, hi=1).propose([]) == []


def test_overlapping_copies_count():
    assert proposer(k=5, lo=2, hi=3).propose([1, 1, 1, 1]) == [1]      # [1, 1, 1] at 0, one token after


def test_k_and_limits_cap_the_proposal():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert proposer(k=8, lo=2, hi=2).propose(tokens) == [3, 4, 5, 6, 7, 8, 1, 2]
    assert proposer(k=3, lo=2, hi=2).propose(tokens) == [3, 4, 5]
    p = proposer(k=3, lo=2, hi=2)
    assert p.propose(tokens, max_num_tokens=2) == [3, 4]
    assert p.propose(tokens, max_num_tokens=0) == []
    # max_model_len leaves room for the drafts and the one token sampled after them.
    assert proposer(k=3, lo=2, hi=2, max_model_len=len(tokens) + 3).propose(tokens) == [3, 4]
    assert proposer(k=3, lo=2, hi=2, max_model_len=len(tokens) + 1).propose(tokens) == []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), lo=st.integers(1, 4), extra=st.integers(0, 3),
       k=st.integers(1, 6), limit=st.one_of(st.none(), st.integers(0, 7)))
def test_proposer_matches_the_definition(tokens, lo, extra, k, limit):
    p = proposer(k=k, lo=lo, hi=lo + extra)
    got = p.propose(np.array(tokens, dtype=np.int32), max_num_tokens=limit)
    want = reference_proposal(tokens, lo, lo + extra, min(k, limit) if limit is not None else k)
    assert got == want
    assert len(got) <= k and (limit is None or len(got) <= limit)


def test_proposal_on_a_long_context_is_a_slice_of_it():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, 8192).astype(np.int32)
    tokens[-4:] = tokens[1000:1004]          # the tail recurs once, far back
    got = find_ngram_proposal(tokens, 2, 4, 5)
    np.testing.assert_array_equal(got, tokens[1004:1009])


def test_token_history_syncs_by_appending():
    h = TokenHistory(capacity=2)
    ids = [5, 6, 7]
    np.testing.assert_array_equal(h.sync(ids), [5, 6, 7])
    buf = h._buf
    ids += [8]
    np.testing.assert_array_equal(h.sync(ids), [5, 6, 7, 8])
    ids += list(range(100))
    np.testing.assert_array_equal(h.sync(ids), ids)                     # grew past its capacity
    np.testing.assert_array_equal(h.sync(ids, num_tokens=50), ids[:50])  # resolved prefix only
    assert len(h) == 50 and h._buf is not buf
    np.testing.assert_array_equal(h.sync([1, 2, 3]), [1, 2, 3])         # a rewritten list is recopied
    np.testing.assert_array_equal(h.sync([1, 2, 4, 9]), [1, 2, 4, 9])
    assert proposer(k=2, lo=1, hi=2).propose(h.sync([3, 4, 3])) == [4, 3]


# ----------------------------------------------------------------------------- rejection sampling

def make_seq(params: SamplingParams, seed: int, prompt=(1, 2, 3)) -> Sequence:
    return Sequence("r", 0, list(prompt), params, 0.0, np.random.default_rng(seed), 1000)


def plain_sample(logits: np.ndarray, seqs) -> list[int]:
    """The plain sampler as the engine runs it: each sequence counts the token being sampled as an
    output placeholder during the call (the scheduler's launch), and the ids are read back."""
    for s in seqs:
        s.num_output_placeholders += 1
    ids = npops.to_numpy(Sampler(npops, []).sample_no_sync(np.array(logits, np.float32), seqs).token_ids)
    for s in seqs:
        s.num_output_placeholders -= 1
    return ids.astype(np.int64).tolist()


def run_spec(seqs, rows: list[np.ndarray], drafts: list[list[int]], sampler=None) -> list[list[int]]:
    """rows: per sequence its [d + 1, V] logits; drafts: per sequence its d draft ids."""
    meta = SpecDecodeMetadata.make(drafts, [len(d) + 1 for d in drafts])
    logits = np.concatenate(rows).astype(np.float32)
    return (sampler or RejectionSampler(npops))(logits, meta, seqs)


def test_metadata_lays_rows_out_sequence_by_sequence():
    # three sequences: a prefill chunk of 5 (no drafts), a verify chunk of 3 (2 drafts), a decode
    meta = SpecDecodeMetadata.make([[], [7, 8], []], [5, 3, 1])
    np.testing.assert_array_equal(meta.logits_indices, [4, 5, 6, 7, 8])
    np.testing.assert_array_equal(meta.draft_token_ids, [7, 8])
    np.testing.assert_array_equal(meta.num_draft_tokens, [0, 2, 0])
    np.testing.assert_array_equal(meta.row_starts, [0, 1, 4])
    # a chunk longer than its verified tail: its drafts sit at its end
    np.testing.assert_array_equal(SpecDecodeMetadata.make([[4]], [6]).logits_indices, [4, 5])
    with pytest.raises(ValueError, match="at least 3"):
        SpecDecodeMetadata.make([[1, 2]], [2])


def test_num_accepted_stops_at_the_first_mismatch():
    # rows: seq0 drafts [4, 5] + bonus; seq1 no drafts; seq2 drafts [1, 2, 3] + bonus
    sampled = np.array([4, 5, 9, 2, 1, 7, 3, 0], np.int32)
    drafts = np.array([4, 5, 1, 2, 3], np.int32)
    got = rejection_mod.num_accepted_drafts(sampled, drafts, np.array([2, 0, 3], np.int32))
    np.testing.assert_array_equal(got, [2, 0, 1])        # seq2: 2 != 7 at draft 1; draft 2 matches but is past it
    out = rejection_mod.split_outputs(sampled, drafts, np.array([2, 0, 3]), got)
    assert out == [[4, 5, 9], [2], [1, 7]]


def test_greedy_accepts_only_the_argmax():
    rng = np.random.default_rng(1)
    vocab = 50
    rows = [rng.standard_normal((4, vocab)), rng.standard_normal((1, vocab)), rng.standard_normal((3, vocab))]
    am = [r.argmax(axis=1).tolist() for r in rows]
    wrong = (am[2][1] + 1) % vocab
    drafts = [am[0][:3], [], [am[2][0], wrong]]
    seqs = [make_seq(SamplingParams(temperature=0.0), s) for s in range(3)]
    out = run_spec(seqs, rows, drafts)
    assert out[0] == am[0]                    # all three accepted, then the bonus argmax
    assert out[1] == am[1]                    # no drafts: the argmax
    assert out[2] == [am[2][0], am[2][1]]     # second draft rejected: the argmax replaces it
    assert all(s.rng.bit_generator.state == make_seq(s.params, i).rng.bit_generator.state
               for i, s in enumerate(seqs))   # greedy draws nothing


FILTERS = [dict(), dict(top_k=3), dict(top_p=0.6), dict(min_p=0.1), dict(top_k=5, top_p=0.8, min_p=0.05)]


@pytest.mark.parametrize("filters", FILTERS)
def test_without_drafts_it_is_the_plain_sampler(filters):
    rng = np.random.default_rng(2)
    batch, vocab = 64, 40
    logits = (rng.standard_normal((batch, vocab)) * 2).astype(np.float32)
    temps = rng.choice([0.0, 0.5, 0.8, 1.3], batch)
    plain = [make_seq(SamplingParams(temperature=float(t), **filters), 100 + b) for b, t in enumerate(temps)]
    spec = [make_seq(SamplingParams(temperature=float(t), **filters), 100 + b) for b, t in enumerate(temps)]
    want = plain_sample(logits.copy(), plain)
    got = run_spec(spec, [logits[b:b + 1] for b in range(batch)], [[] for _ in range(batch)])
    assert [g[0] for g in got] == want and all(len(g) == 1 for g in got)


def test_same_seed_gives_the_plain_samplers_tokens():
    """The first token is the plain sampler's draw with the same uniform, accepted or not."""
    rng = np.random.default_rng(3)
    vocab = 12
    row = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    params = SamplingParams(temperature=0.8)
    plain_seqs = [make_seq(params, s) for s in range(500)]
    want = plain_sample(np.tile(row, (500, 1)), plain_seqs)
    seqs = [make_seq(params, s) for s in range(500)]
    draft = int(np.argsort(-row)[1])
    got = run_spec(seqs, [np.stack([row, row]) for _ in seqs], [[draft] for _ in seqs])
    assert [g[0] for g in got] == want
    assert 0 < sum(len(g) == 2 for g in got) < 500        # both outcomes occurred


class MarkovModel:
    """A toy target: the next token's logits depend on the previous token only."""

    def __init__(self, vocab: int, seed: int, scale: float = 1.5):
        rng = np.random.default_rng(seed)
        self.table = (rng.standard_normal((vocab, vocab)) * scale).astype(np.float32)   # [V, V]

    def logits(self, tokens: list[int]) -> np.ndarray:
        return self.table[tokens[-1]]

    def verify_rows(self, tokens: list[int], drafts: list[int]) -> np.ndarray:
        """[d + 1, V]: the logits after tokens + drafts[:j] for j = 0..d."""
        return np.stack([self.logits(tokens + drafts[:j]) for j in range(len(drafts) + 1)])


@pytest.mark.parametrize("filters", FILTERS[:3])
def test_seeded_output_is_the_same_with_and_without_speculation(filters):
    """Unused draws are given back, so the n-th token always uses the n-th uniform of the stream."""
    model = MarkovModel(10, seed=4, scale=1.2)
    params = SamplingParams(temperature=1.0, **filters)
    plain = make_seq(params, 77)
    tokens = list(plain.token_ids)
    for _ in range(120):
        tokens += plain_sample(model.logits(tokens)[None], [plain])
    spec = make_seq(params, 77)
    out = list(spec.token_ids)
    draft_rng = np.random.default_rng(5)
    accepted = rejected = 0
    while len(out) < len(tokens):
        d = int(draft_rng.integers(0, 5))
        # Drafts from the plain run's future, one of them corrupted at times: both outcomes occur.
        drafts = tokens[len(out):len(out) + d]
        if drafts and draft_rng.random() < 0.5:
            j = int(draft_rng.integers(len(drafts)))
            drafts[j] = (drafts[j] + 1) % 10
        new = run_spec([spec], [model.verify_rows(out, drafts)], [drafts])[0]
        accepted += len(new) - 1
        rejected += len(drafts) - (len(new) - 1)
        out += new
    assert out[:len(tokens)] == tokens
    assert accepted > 30 and rejected > 10


def test_results_do_not_depend_on_the_batch():
    model = MarkovModel(16, seed=6)
    params = SamplingParams(temperature=0.9, top_p=0.9)
    alone = run_spec([make_seq(params, 9)], [model.verify_rows([3], [4, 5])], [[4, 5]])
    others = [make_seq(SamplingParams(temperature=t), s) for s, t in ((1, 0.0), (2, 1.2))]
    batch = run_spec([others[0], make_seq(params, 9), others[1]],
                     [model.verify_rows([1], [2]), model.verify_rows([3], [4, 5]), model.verify_rows([7], [])],
                     [[2], [4, 5], []])
    assert batch[1] == alone[0]


def test_rejection_sample_checks_its_shapes():
    logits = np.zeros((3, 5), np.float32)
    one = np.ones(1, np.float32)
    with pytest.raises(ValueError, match="logits rows"):
        rejection_sample(npops, logits, np.array([1], np.int32), np.array([1], np.int32), one,
                         np.zeros(1, np.int32), one, 0 * one, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(npops, logits, np.array([1], np.int32), np.array([2], np.int32), one,
                         np.zeros(1, np.int32), one, 0 * one, np.zeros(3, np.float32))


def test_a_filtered_out_draft_is_never_accepted():
    row = np.array([3.0, 2.9, 2.8, -1.0, 0.0], np.float32)
    seqs = [make_seq(SamplingParams(temperature=1.0, top_k=2), s) for s in range(300)]
    out = run_spec(seqs, [np.stack([row, row])] * 300, [[2]] * 300)
    assert all(len(o) == 1 and o[0] in (0, 1) for o in out)


# ----------------------------------------------------------------------------- distribution

def softmax(x: np.ndarray, temperature: float) -> np.ndarray:
    z = x.astype(np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def textbook_verify(accept_prob):
    """Rejection sampling written out (no filters): accept x with accept_prob(p(x)), else draw from
    p with x removed. accept_prob = identity is the exact rule; anything else is a broken one."""
    def verify(logits, meta, seqs):
        outs, row, first_draft = [], 0, 0
        for b, s in enumerate(seqs):
            d = int(meta.num_draft_tokens[b])
            drafts = meta.draft_token_ids[first_draft:first_draft + d].tolist()
            first_draft += d
            out = []
            for j in range(d + 1):
                p = softmax(logits[row + j], s.params.temperature)
                if j == d:
                    out.append(int(s.rng.choice(len(p), p=p)))
                    break
                x = drafts[j]
                if s.rng.random() < accept_prob(p[x]):
                    out.append(x)
                    continue
                q = p.copy()
                q[x] = 0.0
                out.append(int(s.rng.choice(len(q), p=q / q.sum())))
                break
            outs.append(out)
            row += d + 1
        return outs
    return verify


def always_accept_everything(monkeypatch):
    """Break the production rule: every draft counts as accepted."""
    monkeypatch.setattr(rejection_mod, "num_accepted_drafts",
                        lambda sampled, drafts, num_drafts: np.asarray(num_drafts, np.int32))
    return RejectionSampler(npops)


FIRST_ROW = (np.random.default_rng(2024).standard_normal(12) * 1.5).astype(np.float32)
FIRST_DRAFT = int(np.argsort(-FIRST_ROW)[1])        # the second likeliest token


def first_token_counts(verify, seed0: int, filters=None) -> np.ndarray:
    """4,000 seeded samples of the first token after a fixed row with the fixed draft."""
    params = SamplingParams(temperature=0.8, **(filters or {}))
    seqs = [make_seq(params, seed0 + i) for i in range(NUM_SAMPLES)]
    out = run_spec(seqs, [np.stack([FIRST_ROW, FIRST_ROW])] * NUM_SAMPLES, [[FIRST_DRAFT]] * NUM_SAMPLES,
                   sampler=verify)
    return np.bincount([o[0] for o in out], minlength=len(FIRST_ROW))


def plain_first_token_counts(seed0: int, filters=None) -> np.ndarray:
    params = SamplingParams(temperature=0.8, **(filters or {}))
    seqs = [make_seq(params, seed0 + i) for i in range(NUM_SAMPLES)]
    ids = plain_sample(np.tile(FIRST_ROW, (NUM_SAMPLES, 1)), seqs)
    return np.bincount(ids, minlength=len(FIRST_ROW))


def test_first_token_distribution_matches_the_plain_sampler():
    plain = plain_first_token_counts(seed0=10_000)
    spec = first_token_counts(RejectionSampler(npops), seed0=0)
    p = chi2_two_sample_pvalue(spec, plain)
    assert p > 0.01, (p, spec, plain)
    # the draft has real mass, so acceptance and rejection both happen often
    assert 0.1 < softmax(FIRST_ROW, 0.8)[FIRST_DRAFT] < 0.5


def test_textbook_rule_agrees_and_broken_rules_fail(monkeypatch):
    plain = plain_first_token_counts(seed0=10_000)
    assert chi2_two_sample_pvalue(first_token_counts(textbook_verify(lambda p: p), seed0=20_000), plain) > 0.01
    sqrt_rule = first_token_counts(textbook_verify(lambda p: p ** 0.5), seed0=20_000)
    assert chi2_two_sample_pvalue(sqrt_rule, plain) < 0.01
    broken = first_token_counts(always_accept_everything(monkeypatch), seed0=0)
    assert chi2_two_sample_pvalue(broken, plain) < 0.01


@pytest.mark.parametrize("filters", FILTERS[1:])
def test_first_token_distribution_with_filters(filters):
    plain = plain_first_token_counts(seed0=30_000, filters=filters)
    spec = first_token_counts(RejectionSampler(npops), seed0=40_000, filters=filters)
    assert chi2_two_sample_pvalue(spec, plain) > 0.01


def joint_counts(model: MarkovModel, drafts: list[int], seed0: int, verify=None) -> np.ndarray:
    """4,000 seeded (first, second) token pairs after token 0, verifying two drafts in one step;
    a sequence that gets one token samples its second in a plain step, as the engine would."""
    vocab = model.table.shape[0]
    params = SamplingParams(temperature=0.8)
    seqs = [make_seq(params, seed0 + i, prompt=[0]) for i in range(NUM_SAMPLES)]
    rows = [model.verify_rows([0], drafts)] * NUM_SAMPLES
    outs = run_spec(seqs, rows, [list(drafts)] * NUM_SAMPLES, sampler=verify)
    short = [b for b, o in enumerate(outs) if len(o) < 2]
    if short:
        second = plain_sample(np.stack([model.logits([0, outs[b][0]]) for b in short]), [seqs[b] for b in short])
        for b, t in zip(short, second):
            outs[b].append(t)
    pairs = np.array([o[0] * vocab + o[1] for o in outs])
    return np.bincount(pairs, minlength=vocab * vocab)


def plain_joint_counts(model: MarkovModel, seed0: int) -> np.ndarray:
    vocab = model.table.shape[0]
    seqs = [make_seq(SamplingParams(temperature=0.8), seed0 + i, prompt=[0]) for i in range(NUM_SAMPLES)]
    first = plain_sample(np.tile(model.logits([0]), (NUM_SAMPLES, 1)), seqs)
    second = plain_sample(np.stack([model.logits([0, t]) for t in first]), seqs)
    return np.bincount(np.array(first) * vocab + np.array(second), minlength=vocab * vocab)


def test_joint_distribution_of_two_drafted_tokens(monkeypatch):
    model = MarkovModel(6, seed=8, scale=1.0)
    d0 = int(np.argsort(-model.logits([0]))[0])
    d1 = int(np.argsort(-model.logits([0, d0]))[1])
    plain = plain_joint_counts(model, seed0=50_000)
    spec = joint_counts(model, [d0, d1], seed0=60_000)
    assert chi2_two_sample_pvalue(spec, plain) > 0.01
    # both drafts accepted in a fair share of samples, so the second position is really tested
    assert spec[d0 * 6 + d1] > 200
    assert chi2_two_sample_pvalue(joint_counts(model, [d0, d1], 60_000, textbook_verify(lambda p: p ** 0.5)),
                                  plain) < 0.01
    broken = joint_counts(model, [d0, d1], 60_000, always_accept_everything(monkeypatch))
    assert chi2_two_sample_pvalue(broken, plain) < 0.01


# ----------------------------------------------------------------------------- stats

def test_stats_accumulate_as_vllm_counts():
    s = SpecDecodeStats(num_spec_tokens=3)
    assert s.acceptance_rate is None and s.mean_acceptance_length is None and s.acceptance_rate_per_pos is None
    s.observe_draft(3, 2)
    s.observe_draft(3, 0)
    s.observe_draft(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.num_accepted_tokens_per_pos == [2, 2, 0]
    assert s.acceptance_rate == pytest.approx(4 / 8)
    assert s.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert s.acceptance_rate_per_pos == pytest.approx([2 / 3, 2 / 3, 0.0])
    t = SpecDecodeStats(num_spec_tokens=3)
    t.observe_draft(1, 1)
    s.merge(t)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 9, 5)
    assert s.num_accepted_tokens_per_pos == [3, 2, 0]
    d = s.to_dict()
    assert json.loads(json.dumps(d)) == d and d["mean_acceptance_length"] == pytest.approx(1 + 5 / 4)


def test_stats_reject_impossible_observations():
    s = SpecDecodeStats(num_spec_tokens=2)
    for drafts, accepted in ((0, 0), (3, 1), (2, 3), (2, -1)):
        with pytest.raises(ValueError):
            s.observe_draft(drafts, accepted)
    with pytest.raises(ValueError, match="merge"):
        s.merge(SpecDecodeStats(num_spec_tokens=3))
    with pytest.raises(ValueError, match="num_spec_tokens"):
        SpecDecodeStats(num_spec_tokens=0)
    assert s.num_drafts == 0


def test_stats_counter_names_mirror_vllm():
    names = [n for n, _, _ in spec_metrics.COUNTERS] + [spec_metrics.PER_POSITION_COUNTER[0]]
    assert names == ["minillm:spec_decode_num_drafts", "minillm:spec_decode_num_draft_tokens",
                     "minillm:spec_decode_num_accepted_tokens", "minillm:spec_decode_num_accepted_tokens_per_pos"]
    s = SpecDecodeStats(num_spec_tokens=2)
    assert all(isinstance(getattr(s, attr), int) for _, _, attr in spec_metrics.COUNTERS)


def test_stats_from_a_verified_step():
    """The counts a step hands the stats: drafts and accepted per sequence with drafts."""
    model = MarkovModel(8, seed=11)
    drafts = [[1, 2, 3], [], [4]]
    seqs = [make_seq(SamplingParams(temperature=0.0), s) for s in range(3)]
    greedy_next = int(np.argmax(model.logits([5])))
    drafts[2] = [greedy_next]
    out = run_spec(seqs, [model.verify_rows([5], d) for d in drafts], drafts)
    stats = SpecDecodeStats(num_spec_tokens=3)
    for d, o in zip(drafts, out):
        if d:
            stats.observe_draft(len(d), len(o) - 1)
    assert stats.num_drafts == 2 and stats.num_draft_tokens == 4
    assert stats.num_accepted_tokens_per_pos[0] >= 1                  # the argmax draft was accepted


# ----------------------------------------------------------------------------- per-row rules

def appended(seq: Sequence, tokens: list[int]) -> Sequence:
    """A copy of seq that generated `tokens` as well (what the row of draft len(tokens) assumes),
    launched for one plain step: the token its row samples is its one output placeholder."""
    other = make_seq(seq.params, 0, prompt=seq.prompt_token_ids)
    other.token_ids = list(seq.token_ids) + list(tokens)
    other.num_output_placeholders = 1
    other.output_counts = dict(seq.output_counts)
    for t in tokens:
        other.output_counts[t] = other.output_counts.get(t, 0) + 1
    return other


def test_penalties_and_bans_of_each_row_see_the_drafts_before_it():
    rng = np.random.default_rng(12)
    vocab = 20
    penalised = make_seq(SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                                        frequency_penalty=0.4, min_tokens=4, stop_token_ids=[9]), 1, prompt=[3, 4])
    penalised.token_ids += [5, 6]
    penalised.output_counts = {5: 1, 6: 1}
    plain = make_seq(SamplingParams(temperature=0.7), 2, prompt=[1])
    drafts = [[5, 7, 9], [2]]
    seqs = [penalised, plain]
    for seq, d in zip(seqs, drafts):
        seq.num_output_placeholders = len(d) + 1    # launched: up to d + 1 tokens come back
    rows = sum(len(d) + 1 for d in drafts)
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    sampler = Sampler(npops, eos_token_ids=[0])
    got = logits.copy()
    views = draft_row_views(seqs, drafts)
    sampler._apply_penalties(got, views)
    sampler._block_early_stops(got, views)
    r = 0
    for seq, d in zip(seqs, drafts):
        for j in range(len(d) + 1):
            want = logits[r:r + 1].copy()
            as_if = [appended(seq, d[:j])]
            sampler._apply_penalties(want, as_if)
            sampler._block_early_stops(want, as_if)
            np.testing.assert_array_equal(got[r], want[0])
            r += 1
    assert np.isinf(got[1, 9]) and np.isinf(got[1, 0])       # 3 outputs before < min_tokens 4: stop ids banned
    assert not np.isinf(got[2, 9])                           # 4 outputs before: allowed again
    assert penalised.output_counts == {5: 1, 6: 1}           # the sequence itself is untouched
    # each view counts the outputs before its row plus the one it samples (the sampler's rule)
    assert [v.num_output_tokens for v in views] == [3, 4, 5, 6, 1, 2]


def test_allowed_ids_and_bad_words_of_each_row_see_the_drafts_before_it():
    rng = np.random.default_rng(13)
    vocab = 20
    tokenizer = TableTokenizer({"ab": [5, 7], " ab": [5, 7]})
    params = SamplingParams(temperature=1.0, allowed_token_ids=[2, 5, 7, 9], bad_words=["ab"])
    params.update_from_tokenizer(tokenizer, vocab)
    seq = make_seq(params, 1, prompt=[5])                    # the prompt's 5 starts no word: not an output
    seq.token_ids += [3]
    drafts = [5, 9, 5]
    seq.num_output_placeholders = len(drafts) + 1
    logits = (rng.standard_normal((len(drafts) + 1, vocab)) * 2).astype(np.float32)
    sampler = Sampler(npops, eos_token_ids=[0])
    got = logits.copy()
    sampler.apply_penalties_and_bans(got, draft_row_views([seq], [drafts]))
    for j in range(len(drafts) + 1):
        want = logits[j:j + 1].copy()
        sampler.apply_penalties_and_bans(want, [appended(seq, drafts[:j])])
        np.testing.assert_array_equal(got[j], want[0])
    assert [np.flatnonzero(np.isfinite(row)).tolist() for row in got] == [[2, 5, 7, 9], [2, 5, 9], [2, 5, 7, 9],
                                                                         [2, 5, 9]]
    assert seq.output_token_ids == [3]                       # the sequence itself is untouched

