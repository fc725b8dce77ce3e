"""N-gram speculation beside every sampling rule on stories260K (CPU): outputs are the plain engine's.

Each request repeats itself, so drafts are proposed and accepted (the acceptance counters say so),
and with speculation its tokens, text, finish_reason, stop_reason, log-probabilities and prompt
log-probabilities are those without it: under penalties (which count accepted drafts), logit_bias,
allowed_token_ids, multi-token bad words, stop strings and stop tokens held off by min_tokens, EOS
proposed inside a draft while min_tokens bans it, seeded sampling with n > 1, DELTA outputs,
prefix-cache hits and preemptions in a small pool. Constrained requests (JSON schema, regex, choice,
GBNF grammar) draft too, and their outputs beside drafting requests are the plain ones.
"""
import json

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.sampling_params import RequestOutputKind, StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
EOS = 2


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def repeat(golden) -> list[int]:
    """A passage and then its start again: the greedy output copies the passage on."""
    return [1] + golden[1:30] + golden[1:8]


@pytest.fixture(scope="module")
def loop(golden) -> list[int]:
    return [1] + golden[60:70] * 3


@pytest.fixture(scope="module")
def plain(stories_path):
    return LLM(str(stories_path), device="cpu")


@pytest.fixture(scope="module")
def spec(stories_path):
    return LLM(str(stories_path), device="cpu", speculative_config=SPEC)


def outcome(c) -> tuple:
    """What must be equal exactly: tokens, text, finish and stop reasons, logprob ids and ranks."""
    ranks = None if c.logprobs is None else [[(t, v.rank) for t, v in d.items()] for d in c.logprobs]
    return tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason, ranks


def values(entries) -> list[float]:
    return [float(v) for d in entries if d is not None for v in d.values()]


def assert_same(got, want) -> None:
    assert [outcome(c) for c in got.outputs] == [outcome(c) for c in want.outputs]
    for g, w in zip(got.outputs, want.outputs):
        if w.logprobs is not None:
            np.testing.assert_allclose(values(g.logprobs), values(w.logprobs), rtol=1e-4, atol=1e-4)
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None)
    if want.prompt_logprobs is not None:
        assert [None if d is None else list(d) for d in got.prompt_logprobs] == \
               [None if d is None else list(d) for d in want.prompt_logprobs]
        np.testing.assert_allclose(values(got.prompt_logprobs), values(want.prompt_logprobs), rtol=1e-4, atol=1e-4)


def accepted(llm: LLM) -> int:
    return llm.engine.stats().spec_decode.num_accepted_tokens


def rules(golden) -> dict[str, tuple[str, SamplingParams]]:
    """Requests under one rule each (prompt 'repeat' or 'loop'), each one accepting drafts."""
    greedy = dict(temperature=0, max_tokens=40)
    return {
        "repetition_penalty": ("loop", SamplingParams(repetition_penalty=1.05, ignore_eos=True, logprobs=1, **greedy)),
        "frequency_penalty": ("repeat", SamplingParams(frequency_penalty=0.5, ignore_eos=True, **greedy)),
        # four tokens and a strong penalty: which one wins a row depends on the drafts before it
        "frequency_penalty_of_drafts": ("repeat", SamplingParams(frequency_penalty=2.0, allowed_token_ids=golden[8:12],
                                                                 ignore_eos=True, logprobs=1, **greedy)),
        "seeded_frequency_penalty_of_drafts": ("repeat", SamplingParams(
            temperature=0.8, seed=1, frequency_penalty=0.5, allowed_token_ids=golden[8:12], ignore_eos=True,
            max_tokens=40)),
        "presence_penalty": ("loop", SamplingParams(presence_penalty=0.8, ignore_eos=True, logprobs=2, **greedy)),
        "seeded_penalties_n3": ("repeat", SamplingParams(temperature=0.5, seed=7, n=3, frequency_penalty=0.2,
                                                         presence_penalty=0.1, logprobs=1, max_tokens=40)),
        "logit_bias": ("repeat", SamplingParams(logit_bias={golden[10]: -5.0, golden[12]: 3.0}, ignore_eos=True,
                                                **greedy)),
        "allowed_token_ids": ("repeat", SamplingParams(allowed_token_ids=sorted(set(golden[1:30])), ignore_eos=True,
                                                       **greedy)),
        "bad_words": ("repeat", SamplingParams(bad_words=[" girl", "Lily was"], ignore_eos=True, logprobs=1,
                                               **greedy)),
        "seeded_allowed_min_p": ("repeat", SamplingParams(temperature=1.0, seed=12, min_p=0.05, top_k=10,
                                                          allowed_token_ids=sorted(set(golden[:40])),
                                                          ignore_eos=True, max_tokens=40)),
        "stop_string_after_min_tokens": ("repeat", SamplingParams(stop=["She loved"], min_tokens=12, **greedy)),
        "stop_token_after_min_tokens": ("repeat", SamplingParams(stop_token_ids=[golden[15]], min_tokens=20,
                                                                 logprobs=0, **greedy)),
        "prompt_logprobs": ("repeat", SamplingParams(prompt_logprobs=3, logprobs=3, ignore_eos=True, **greedy)),
    }


RULES = ["repetition_penalty", "frequency_penalty", "frequency_penalty_of_drafts", "seeded_frequency_penalty_of_drafts",
         "presence_penalty", "seeded_penalties_n3", "logit_bias",
         "allowed_token_ids", "bad_words", "seeded_allowed_min_p", "stop_string_after_min_tokens",
         "stop_token_after_min_tokens", "prompt_logprobs"]


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_with_accepted_drafts_gives_the_plain_output(plain, spec, golden, repeat, loop, rule):
    kind, params = rules(golden)[rule]
    prompt = repeat if kind == "repeat" else loop
    want = plain.generate([prompt], params, use_tqdm=False)[0]
    before = accepted(spec)
    got = spec.generate([prompt], params, use_tqdm=False)[0]
    assert accepted(spec) > before
    assert_same(got, want)


def drafts_of(llm: LLM, monkeypatch) -> list[tuple]:
    """(sequence, its outputs then, drafts) of every proposal the engine's drafter makes from now on."""
    seen = []
    drafter = llm.engine.scheduler.drafter
    propose = drafter.propose

    def spy(seq, max_num_tokens):
        drafts = propose(seq, max_num_tokens)
        seen.append((seq, seq.num_output_tokens, drafts))   # drafts[j] proposes output index n + j
        return drafts
    monkeypatch.setattr(drafter, "propose", spy)
    return seen


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_inside_a_draft_is_banned_below_min_tokens_and_ends_the_output_past_it(plain, spec, golden, ignore_eos,
                                                                                   monkeypatch):
    """The prompt has EOS after its passage, so a draft proposes EOS where the copy of the passage ends
    (output index 20, the draft's last token); a logit bias makes EOS the greedy token wherever
    min_tokens lets it be: the row verifying it counts the drafts before it among the outputs."""
    prompt = [1] + golden[1:28] + [EOS] + golden[1:8]
    seen = drafts_of(spec, monkeypatch)
    for min_tokens in (20, 21):
        params = SamplingParams(temperature=0, max_tokens=30, min_tokens=min_tokens, ignore_eos=ignore_eos,
                                logit_bias={EOS: 100.0})
        want = plain.generate([prompt], params, use_tqdm=False)[0]
        seen.clear()
        got = spec.generate([prompt], params, use_tqdm=False)[0]
        assert_same(got, want)
        tokens = want.outputs[0].token_ids
        assert tokens.index(EOS) == min_tokens
        assert (want.outputs[0].finish_reason == "stop") != ignore_eos
        # a draft held EOS at output index 20 after other drafts: accepted at min_tokens 20, banned at 21
        assert any(EOS in d[1:] and n + d.index(EOS) == 20 for _, n, d in seen)


def test_constrained_requests_draft_beside_unconstrained_ones(stories_path, golden, repeat, loop, monkeypatch):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"]}
    grammar = 'root ::= " Once upon a time" (" Once upon a time")*'
    constrained = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex="( [a-z]+){1,8}\\."),
                   StructuredOutputsParams(choice=["Lily was sad", "Once upon a time"]),
                   StructuredOutputsParams(grammar=grammar)]
    requests = [(repeat, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1))]
    for i, so in enumerate(constrained):
        requests.append((repeat if i % 2 else [1] + golden[1:10] * 3, SamplingParams(
            temperature=0 if i % 2 else 0.8, seed=i, max_tokens=30, logprobs=2, structured_outputs=so)))
    requests.append((loop, SamplingParams(temperature=0.7, seed=5, max_tokens=30, ignore_eos=True)))
    prompts, params = [p for p, _ in requests], [s for _, s in requests]
    want = LLM(str(stories_path), device="cpu").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC, async_scheduling=True)
    seen = drafts_of(llm, monkeypatch)
    got = llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert_same(g, w)
    assert accepted(llm) > 0
    # every sequence looked for drafts, the constrained ones too (their drafts are held to the grammar)
    assert len({id(seq) for seq, _, _ in seen}) == 6
    assert sum(seq.structured_output is not None for seq in {seq for seq, _, _ in seen}) == 4
    assert got[4].outputs[0].text.startswith(" Once upon a time Once upon a time")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_small_pool_with_prefix_hits_n_and_seeds_gives_the_plain_outputs(stories_path, golden, async_scheduling):
    """Preemptions, prefix-cache hits (repeated prompts), n > 1 and seeded sampling with penalties:
    every completion is the plain engine's in the same pool."""
    # the greedy text from BOS, then its start again: the output copies it on
    prompts = [[1] + golden[1:20 + 3 * i] + golden[1:3 + i] for i in range(10)]
    prompts += [prompts[0], prompts[3], prompts[3][:-1]]

    def params(i: int) -> SamplingParams:
        if i % 3 == 0:
            return SamplingParams(temperature=0.8, seed=i, n=2, frequency_penalty=0.2, logprobs=1, ignore_eos=True,
                                  max_tokens=24)
        if i % 3 == 1:
            return SamplingParams(temperature=0, bad_words=[" the"], stop=["."], repetition_penalty=1.05,
                                  max_tokens=30)
        return SamplingParams(temperature=0.6, seed=i, presence_penalty=0.4, min_tokens=8, stop_token_ids=[267],
                              logit_bias={golden[5]: 1.5}, max_tokens=30)
    kw = dict(device="cpu", block_size=4, num_kv_blocks=40, max_model_len=96, async_scheduling=async_scheduling)
    all_params = [params(i) for i in range(len(prompts))]
    want = LLM(str(stories_path), **kw).generate(prompts, all_params, use_tqdm=False)
    llm = LLM(str(stories_path), speculative_config=SPEC, **kw)
    got = llm.generate(prompts, all_params, use_tqdm=False)
    for g, w in zip(got, want):
        assert_same(g, w)
    stats = llm.engine.stats()
    assert stats.spec_decode.num_accepted_tokens > 50 and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_delta_outputs_add_up_to_the_plain_output(plain, spec, repeat):
    """DELTA reports of steps that accept several tokens: their text, tokens and logprobs add up to the
    plain completion, a stop string cut where it is without speculation, for each of n = 2."""
    params = dict(max_tokens=50, stop=["red ball", "park."], n=2, temperature=0.7, seed=9, logprobs=1)
    want = plain.generate([repeat], SamplingParams(**params), use_tqdm=False)[0]
    before = accepted(spec)
    engine = spec.engine
    engine.add_request("delta", repeat, SamplingParams(output_kind=RequestOutputKind.DELTA, **params))
    tokens, texts, logprobs, ends = {}, {}, {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                tokens.setdefault(c.index, []).extend(c.token_ids)
                texts[c.index] = texts.get(c.index, "") + c.text
                logprobs.setdefault(c.index, []).extend(c.logprobs or [])
                if c.finish_reason is not None:
                    ends[c.index] = (c.finish_reason, c.stop_reason)
    assert accepted(spec) > before
    for c in want.outputs:
        assert (tokens[c.index], texts[c.index], ends[c.index]) == (c.token_ids, c.text,
                                                                    (c.finish_reason, c.stop_reason))
        assert [list(d) for d in logprobs[c.index]] == [list(d) for d in c.logprobs]
    assert any(c.finish_reason == "stop" for c in want.outputs)
