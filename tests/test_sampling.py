"""Every sampling parameter changes what it should, and only that."""
import warnings
import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.ops import numpy as npops

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), device="cpu")


def gen(llm, prompt=PROMPT, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0].outputs


def test_seed_reproducible_across_batch_compositions(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=30, ignore_eos=True)
    alone = llm.generate([PROMPT], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 40, 17)]
    batch = llm.generate(["Lily", PROMPT, "The cat", "Tom had"], [others[0], p, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone


def test_different_seeds_differ_and_n_gives_distinct_completions(llm):
    a = gen(llm, temperature=1.0, seed=1, max_tokens=30, ignore_eos=True)[0].token_ids
    b = gen(llm, temperature=1.0, seed=2, max_tokens=30, ignore_eos=True)[0].token_ids
    assert a != b
    two = gen(llm, temperature=1.0, seed=1, n=2, max_tokens=30, ignore_eos=True)
    assert [c.index for c in two] == [0, 1] and two[0].token_ids == a and two[1].token_ids == b


def test_seeds_take_vllms_signed_64_bit_range_and_minus_one_is_none(llm):
    assert SamplingParams(seed=-1).seed is None
    for seed in (-2**63, -5, 2**63 - 1):
        assert SamplingParams(seed=seed).seed == seed
    for seed in (2**63, -2**63 - 1, 2**64 - 1, "7", 1.0):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"):
            SamplingParams(seed=seed)
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    params.seed = -1                                       # set after construction: unseeded all the same
    unseeded = [llm.generate([PROMPT], params)[0].outputs[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]
    # A negative seed, and a largest one with n > 1 (its later sequences' seeds wrap), are reproducible.
    for seed, n in ((-5, 1), (2**63 - 1, 3)):
        runs = [[c.token_ids for c in gen(llm, temperature=1.0, seed=seed, n=n, max_tokens=20, ignore_eos=True)]
                for _ in range(2)]
        assert runs[0] == runs[1] and len({tuple(ids) for ids in runs[0]}) == n
    assert gen(llm, temperature=1.0, seed=-5, max_tokens=20, ignore_eos=True)[0].token_ids != \
        gen(llm, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)[0].token_ids


def test_top_k_1_equals_greedy(llm):
    greedy = gen(llm, temperature=0, max_tokens=30, ignore_eos=True)[0].token_ids
    assert gen(llm, temperature=1.5, top_k=1, seed=3, max_tokens=30, ignore_eos=True)[0].token_ids == greedy
    assert gen(llm, temperature=1.5, min_p=1.0, seed=3, max_tokens=30, ignore_eos=True)[0].token_ids == greedy
    assert gen(llm, temperature=1.5, top_p=1e-6, seed=3, max_tokens=30, ignore_eos=True)[0].token_ids == greedy
    hot = gen(llm, temperature=1.5, seed=3, max_tokens=30, ignore_eos=True)[0].token_ids
    assert hot != greedy                              # the filters above were not a no-op


def test_stop_string_spanning_tokens_is_cut(llm):
    tok = llm.get_tokenizer()
    full = gen(llm, temperature=0, max_tokens=40)[0]
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    # a stop string made of the end of one token and the start of the next
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) - len(pieces[i - 1]) >= 3
             and len(pieces[i + 1]) - len(pieces[i]) >= 3)
    stop = pieces[i][-2:] + pieces[i + 1][len(pieces[i]):len(pieces[i]) + 2]
    cut = gen(llm, temperature=0, max_tokens=40, stop=[stop])[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    kept = gen(llm, temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True)[0]
    assert kept.text.endswith(stop)


def test_stop_token_ids(llm):
    full = gen(llm, temperature=0, max_tokens=40, ignore_eos=True)[0]
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    out = gen(llm, temperature=0, max_tokens=40, stop_token_ids=[target])[0]
    assert out.token_ids == full.token_ids[:first + 1] and out.stop_reason == target
    assert out.finish_reason == "stop"


def test_logit_bias_moves_only_its_rows_tokens(llm):
    greedy = gen(llm, temperature=0, max_tokens=12, ignore_eos=True)[0].token_ids
    # -100 on greedy's first token: the next best is taken there
    banned = gen(llm, temperature=0, max_tokens=1, logit_bias={greedy[0]: -100.0})[0].token_ids
    assert banned != greedy[:1]
    # +100 forces a token at any temperature and seed
    for seed in (1, 2):
        assert gen(llm, temperature=1.0, seed=seed, max_tokens=4, logit_bias={300: 100.0})[0].token_ids == [300] * 4
    # a bias on a token the row never prefers changes nothing; neighbours in the batch are untouched
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                          logit_bias={300: 100.0})])
    assert outs[0].outputs[0].token_ids == greedy and outs[1].outputs[0].token_ids == [300] * 12
    with pytest.raises(ValueError, match="logit_bias keys must be token ids in"):
        gen(llm, logit_bias={512: 1.0})                      # stories260K's vocabulary is 512


def test_allowed_token_ids_keep_greedy_output_inside_the_set(llm):
    greedy = gen(llm, temperature=0, max_tokens=24, ignore_eos=True)[0].token_ids
    allowed = sorted(set(greedy[4:12]) - {greedy[0]})          # no EOS among them: it runs to max_tokens
    out = gen(llm, temperature=0, max_tokens=24, allowed_token_ids=allowed)[0]
    assert set(out.token_ids) <= set(allowed) and out.token_ids[0] != greedy[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    sampled = gen(llm, temperature=1.5, seed=4, max_tokens=24, allowed_token_ids=allowed)[0].token_ids
    assert set(sampled) <= set(allowed)
    # a set that holds every token greedy takes changes nothing
    assert gen(llm, temperature=0, max_tokens=24, ignore_eos=True,
               allowed_token_ids=sorted(set(greedy)))[0].token_ids == greedy


# stories260K's greedy story names Lily (one token) and a girl ("g", "ir", "l").
BAD_WORDS = ["Lily", "girl"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_never_appear_in_the_output(stories_path, async_scheduling):
    llm = LLM(str(stories_path), device="cpu", async_scheduling=async_scheduling)
    tok = llm.get_tokenizer()
    lily, girl = (tok.encode(w, add_special_tokens=False) for w in BAD_WORDS)
    assert len(lily) == 1 and len(girl) == 3
    greedy = gen(llm, temperature=0, max_tokens=40, ignore_eos=True)[0].token_ids
    out = gen(llm, temperature=0, max_tokens=40, ignore_eos=True, bad_words=BAD_WORDS)[0]
    for ids, word in ((greedy, True), (out.token_ids, False)):
        windows = {tuple(ids[i:i + 3]) for i in range(len(ids) - 2)}
        assert (lily[0] in ids, tuple(girl) in windows) == (word, word)
    assert out.token_ids[:5] == greedy[:5] and girl[:2] == out.token_ids[5:7]   # "g", "ir", then not "l"
    assert "Lily" not in out.text and "girl" not in out.text


def test_allowed_ids_and_bad_words_leave_the_rest_of_the_batch_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [PROMPT, "Tom had", PROMPT, "The cat"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    constrained = [SamplingParams(temperature=0, max_tokens=30, bad_words=BAD_WORDS, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=5, max_tokens=30, allowed_token_ids=[265, 286, 376])]
    outs = llm.generate(prompts, [plain, constrained[0], plain, constrained[1]])
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [alone[0], alone[2]]
    assert set(outs[3].outputs[0].token_ids) <= {265, 286, 376}


@pytest.mark.parametrize("fields, says", [
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(allowed_token_ids=[5, -1]), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(allowed_token_ids=[5, True]), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(allowed_token_ids=[5, 512]), "allowed_token_ids must be token ids in [0, 512), got [512]"),
    (dict(allowed_token_ids=[5, 2**31]), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(allowed_token_ids=[7, 2**31 - 1, 9]), "allowed_token_ids must be token ids in [0, 512), got [2147483647]"),
    (dict(bad_words="Lily"), "bad_words must be a list of strings"),
    (dict(bad_words=["Lily", 3]), "bad_words must be a list of strings"),
    (dict(bad_words=["Lily", " "]), "bad_words entries must tokenize to at least one token"),
])
def test_bad_allowed_token_ids_and_bad_words_are_value_errors_naming_the_field(llm, fields, says):
    with pytest.raises(ValueError) as info:
        gen(llm, max_tokens=4, **fields)
    assert str(info.value).startswith(says)
    assert not llm.llm_engine.has_unfinished_requests()


def test_min_tokens_holds_back_eos(eos_model_path):
    llm = LLM(str(eos_model_path), device="cpu")
    full = gen(llm, temperature=0, max_tokens=450)[0]
    assert full.finish_reason == "stop" and full.token_ids[-1] == 1
    longer = gen(llm, temperature=0, max_tokens=450, min_tokens=len(full.token_ids) + 5)[0]
    assert len(longer.token_ids) >= len(full.token_ids) + 5
    assert 1 not in longer.token_ids[:len(full.token_ids) + 4]


def test_logprobs_match_log_softmax(llm, stories_path):
    from test_model_parity import minillm_prompt_logits
    out = gen(llm, temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)[0]
    prompt = llm.get_tokenizer().encode(PROMPT)
    logits = minillm_prompt_logits(stories_path, prompt + out.token_ids[:-1])
    ref = npops.log_softmax(logits)[len(prompt) - 1:]
    assert len(out.logprobs) == 6
    for row, token, lp in zip(ref, out.token_ids, out.logprobs):
        assert abs(lp[token] - row[token]) < 1e-4
        top3 = set(np.argsort(-row)[:3].tolist())
        assert top3 <= set(lp) and len(lp) <= 4
    assert abs(out.cumulative_logprob - sum(lp[t] for lp, t in zip(out.logprobs, out.token_ids))) < 1e-4


def rank_bounds(row: np.ndarray, token: int, tol: float = 1e-4) -> tuple[int, int]:
    """The rank vLLM gives token in a log-softmax row (the entries at least as likely, itself
    included), as bounds that allow for rounding between two computations of the row."""
    return int((row > row[token] + tol).sum()) + 1, int((row >= row[token] - tol).sum())


def test_a_rank_counts_the_entries_at_least_as_likely_as_vllm_does():
    from minillm.sampler import token_rank
    row = np.array([-1.0, -0.5, -0.5, -3.0], np.float32)                # [V]
    assert [token_rank(row, row[t]) for t in range(4)] == [3, 2, 2, 4]    # ties count as ahead


def test_logprob_rank_is_the_tokens_place_in_the_vocabulary(llm, stories_path):
    """vLLM's Logprob.rank for a sampled token, inside the top ones asked for or below them."""
    from test_model_parity import minillm_prompt_logits
    greedy = gen(llm, temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)[0]
    assert all(list(lp) == [t] and lp[t].rank == 1 for t, lp in zip(greedy.token_ids, greedy.logprobs))
    hot = gen(llm, temperature=5.0, seed=1, max_tokens=12, logprobs=2, ignore_eos=True)[0]
    prompt = llm.get_tokenizer().encode(PROMPT)
    rows = npops.log_softmax(minillm_prompt_logits(stories_path, prompt + hot.token_ids[:-1]))[len(prompt) - 1:]
    for row, token, lp in zip(rows, hot.token_ids, hot.logprobs):
        low, high = rank_bounds(row, token)
        assert low <= lp[token].rank <= high
        assert [e.rank for e in sorted(lp.values(), reverse=True)[:2]] == [1, 2]       # the top two
    assert max(lp[t].rank for t, lp in zip(hot.token_ids, hot.logprobs)) > 10     # far below the top two


def test_repetition_penalty_changes_greedy_output(llm):
    plain = gen(llm, temperature=0, max_tokens=60, ignore_eos=True)[0].token_ids
    penal = gen(llm, temperature=0, max_tokens=60, ignore_eos=True, repetition_penalty=1.8)[0].token_ids
    assert plain != penal
    assert len(set(penal)) >= len(set(plain))
    pres = gen(llm, temperature=0, max_tokens=60, ignore_eos=True, presence_penalty=2.0)[0].token_ids
    freq = gen(llm, temperature=0, max_tokens=60, ignore_eos=True, frequency_penalty=2.0)[0].token_ids
    assert pres != plain and freq != plain


def test_penalties_follow_their_definition():
    logits = np.array([[2.0, -2.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0]], np.float32)
    rows = np.array([0, 0, 0, 1], np.int32)
    tokens = np.array([0, 1, 2, 3], np.int32)
    counts = np.array([0, 3, 1, 2], np.int32)      # token 0 only in the prompt
    in_prompt = np.array([1, 0, 0, 0], np.int32)
    rep = np.array([2.0, 1.0], np.float32)
    pres = np.array([0.5, 0.25], np.float32)
    freq = np.array([0.1, 0.5], np.float32)
    npops.apply_penalties(logits, rows, tokens, counts, in_prompt, rep, pres, freq)
    expect = np.array([[1.0, -4.0 - 0.3 - 0.5, 0.5 - 0.1 - 0.5, 0.5],
                       [1.0, 1.0, 1.0, 1.0 - 1.0 - 0.25]], np.float32)
    np.testing.assert_allclose(logits, expect, rtol=1e-6)


def test_sample_distribution_respects_top_k_top_p_min_p():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]], np.float32))
    n = 4000

    def freq(**kw):
        args = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | kw
        ids = [npops.sample(logits, np.float32([args["temperature"]]), np.int32([args["top_k"]]),
                            np.float32([args["top_p"]]), np.float32([args["min_p"]]),
                            np.float32([u]))[0] for u in rng.random(n)]
        return np.bincount(ids, minlength=4) / n

    np.testing.assert_allclose(freq(), [0.4, 0.3, 0.2, 0.1], atol=0.03)
    np.testing.assert_allclose(freq(top_k=2), [4 / 7, 3 / 7, 0, 0], atol=0.03)
    np.testing.assert_allclose(freq(top_p=0.65), [4 / 7, 3 / 7, 0, 0], atol=0.03)
    np.testing.assert_allclose(freq(min_p=0.45), [4 / 9, 3 / 9, 2 / 9, 0], atol=0.03)
    hot = freq(temperature=100.0)
    assert hot.min() > 0.2                          # temperature flattens the distribution


def test_detokenize_false_gives_the_same_tokens_without_text(llm):
    kw = dict(temperature=0.8, seed=11, max_tokens=20, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    full, bare = (llm.generate([PROMPT], SamplingParams(detokenize=d, **kw))[0] for d in (True, False))
    assert full.outputs[0].text and bare.outputs[0].text == ""
    assert bare.outputs[0].token_ids == full.outputs[0].token_ids
    for got, want in zip(bare.outputs[0].logprobs + bare.prompt_logprobs[1:],
                         full.outputs[0].logprobs + full.prompt_logprobs[1:]):
        assert {t: (float(lp), lp.rank) for t, lp in got.items()} == {t: (float(lp), lp.rank) for t, lp in want.items()}
        assert all(lp.decoded_token is None for lp in got.values())
        assert all(isinstance(lp.decoded_token, str) for lp in want.values())


@pytest.mark.parametrize("fields, says", [
    (dict(detokenize=False, stop=["Lily"]), "stop strings are only supported when detokenize is true"),
    (dict(detokenize="no"), "detokenize must be true or false"),
])
def test_detokenize_is_a_boolean_and_excludes_stop_strings(fields, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(**fields)
    assert SamplingParams(detokenize=False, stop_token_ids=[2]).stop_token_ids == [2]


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 0.9)])
def test_a_row_with_every_token_masked_samples_id_0_without_a_warning(top_k, top_p):
    logits = np.full((2, 64), -np.inf, np.float32)
    logits[1, 7] = 1.0                                  # a healthy row beside it
    one = np.ones(2, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = npops.sample(logits, one, np.full(2, top_k, np.int32), np.full(2, top_p, np.float32),
                           np.zeros(2, np.float32), np.full(2, 0.5, np.float32))
    assert ids.tolist() == [0, 7]
