"""N-gram speculative decoding under abuse on stories260K (CPU), configured as vLLM users write it.

Greedy output with speculation is the output without it, token for token (with log-probabilities
and their ranks), for many repetitive prompts and several k / prompt_lookup bounds; a stop token, a
stop string or min_tokens that falls inside an accepted draft ends the output exactly there; drafts
never run past max_model_len; the blocks a sequence holds stay within what its tokens and k drafts
need after every step, also through preemptions; the acceptance
counters add up; bad configurations are ValueErrors naming the field.
"""
import json
import math

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.sampling_params import RequestOutputKind


def spec(k: int, lo: int | None = None, hi: int | None = None) -> dict:
    d = {"method": "ngram", "num_speculative_tokens": k}
    if lo is not None:
        d["prompt_lookup_min"] = lo
    if hi is not None:
        d["prompt_lookup_max"] = hi
    return d


SPEC = spec(6, 1, 3)


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def prompts(golden) -> list[list[int]]:
    """24 prompts that repeat a passage 1-3 times and then start it again (drafts find them)."""
    rng = np.random.default_rng(30)
    out = []
    for _ in range(24):
        s, n, r = int(rng.integers(1, 150)), int(rng.integers(2, 12)), int(rng.integers(1, 4))
        out.append([1] + golden[s:s + n] * r + golden[s:s + int(rng.integers(1, n + 1))])
    return out


def params_for(i: int) -> SamplingParams:
    """Greedy, with logprobs, stop rules and min_tokens on some."""
    return SamplingParams(temperature=0, max_tokens=4 + (7 * i) % 37, ignore_eos=i % 2 == 0,
                          logprobs=i % 3 if i % 3 else None, stop=[" the"] if i % 5 == 1 else None,
                          stop_token_ids=[13] if i % 7 == 2 else None, min_tokens=5 if i % 4 == 3 else 0,
                          include_stop_str_in_output=i % 10 == 1)


def summary(outputs) -> list[tuple]:
    return [(tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason) for o in outputs for c in o.outputs]


def assert_same_logprobs(got, want) -> None:
    for g, w in zip(got, want):
        for a, b in zip(g.outputs, w.outputs):
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs is None:
                continue
            assert len(a.logprobs) == len(a.token_ids) == len(b.logprobs)
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                assert [x[t].rank for t in x] == [y[t].rank for t in x]
                np.testing.assert_allclose([x[t] for t in x], [y[t] for t in x], rtol=1e-4, atol=1e-5)
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


def assert_pool_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


@pytest.fixture(scope="module")
def plain(stories_path, prompts):
    return LLM(str(stories_path), device="cpu").generate(prompts, [params_for(i) for i in range(len(prompts))],
                                                         use_tqdm=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("config", [spec(1, 1, 1), spec(3, 1, 3), spec(8, 1, 2), spec(64, 1, 5), spec(5, 3, 3),
                                    spec(2, hi=4), spec(4)])
def test_greedy_equals_plain_for_every_config(stories_path, prompts, plain, config, async_scheduling):
    llm = LLM(str(stories_path), device="cpu", speculative_config=config, async_scheduling=async_scheduling)
    got = llm.generate(prompts, [params_for(i) for i in range(len(prompts))], use_tqdm=False)
    assert summary(got) == summary(plain)
    assert_same_logprobs(got, plain)
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0
    assert stats.num_draft_tokens <= stats.num_drafts * config["num_speculative_tokens"]
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens <= stats.num_draft_tokens
    assert_pool_free(llm)


def steps_of(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """The tokens each step of the engine gave a lone request (DELTA outputs)."""
    engine = llm.engine
    engine.add_request("r", prompt, params)
    chunks = []
    while engine.has_unfinished_requests():
        chunks += [o.outputs[0].token_ids for o in engine.step() if o.outputs[0].token_ids]
    return chunks


@pytest.fixture(scope="module")
def long_draft(stories_path, golden):
    """A prompt, its 40 greedy tokens, and the step that accepted the most drafts (start, length)."""
    prompt = [1] + golden[1:30] + golden[1:8]
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    chunks = steps_of(llm, prompt, params)
    starts = np.cumsum([0] + [len(c) for c in chunks])
    best = max(range(len(chunks)), key=lambda i: len(chunks[i]))
    assert len(chunks[best]) >= 4            # three drafts accepted in one step at least
    return prompt, [t for c in chunks for t in c], int(starts[best]), len(chunks[best])


def test_a_stop_token_inside_an_accepted_draft_ends_the_output_there(stories_path, long_draft):
    prompt, tokens, start, length = long_draft
    # the first of the step's tokens whose id did not occur before in the output: a draft accepted
    # with at least one accepted token after it in the same step
    cut = next(i for i in range(start + 1, start + length - 1) if tokens[i] not in tokens[:i])
    stop = tokens[cut]
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop],
                            output_kind=RequestOutputKind.DELTA)
    chunks = steps_of(llm, prompt, params)
    assert [t for c in chunks for t in c] == tokens[:cut + 1]
    assert chunks[-1] == tokens[start:cut + 1]           # the stopping step gave nothing after the stop
    final = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                  stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert (final.token_ids, final.finish_reason, final.stop_reason) == (tokens[:cut + 1], "stop", stop)
    assert llm.engine.stats().generation_tokens_total == 2 * (cut + 1)
    assert_pool_free(llm)
    # min_tokens past the stop: the stop token is banned until then (as vLLM masks it), the drafts
    # that hold it are rejected, and the output is the plain engine's
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop], min_tokens=cut + 2)
    kept = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    want = LLM(str(stories_path), device="cpu").generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (kept.token_ids, kept.finish_reason, kept.stop_reason) == \
           (want.token_ids, want.finish_reason, want.stop_reason)
    assert kept.token_ids[:cut] == tokens[:cut] and stop not in kept.token_ids[:cut + 2]
    assert_pool_free(llm)


def test_a_stop_string_inside_an_accepted_draft_ends_the_text_there(stories_path, tok, long_draft):
    prompt, tokens, start, length = long_draft
    plain = LLM(str(stories_path), device="cpu")
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC)
    tried = 0
    for cut in range(start + 1, start + length - 1):
        text_before = tok.decode(tokens[:cut])
        piece = tok.decode(tokens[:cut + 1])[len(text_before):].strip()
        if len(piece) < 2 or piece in text_before:
            continue
        for include in (False, True):
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[piece],
                                    include_stop_str_in_output=include)
            want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
                   (want.token_ids, want.text, "stop", piece)
            assert len(got.token_ids) == cut + 1 and got.text.endswith(piece) == include
        tried += 1
    assert tried > 0
    assert_pool_free(llm)


def test_max_tokens_inside_a_run_of_drafts(stories_path, long_draft):
    """max_tokens ending where a draft would have been accepted: exactly max_tokens tokens, 'length'."""
    prompt, tokens, start, length = long_draft
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC)
    for n in range(start + 1, start + length):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == (tokens[:n], "length")
    assert_pool_free(llm)


def test_acceptance_counters_add_up_for_a_lone_request(stories_path, long_draft):
    """Every output token is the first token, one per verify or decode step, or an accepted draft."""
    prompt, tokens, _, _ = long_draft
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC)
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    s = engine.stats()
    spec_stats = s.spec_decode
    assert s.generation_tokens_total == 40
    # step 1 is the prompt; every later step samples one token plus what it accepted
    assert 40 == num_steps + spec_stats.num_accepted_tokens
    assert spec_stats.num_drafts <= num_steps - 1
    assert spec_stats.num_accepted_tokens_per_pos == sorted(spec_stats.num_accepted_tokens_per_pos, reverse=True)
    assert spec_stats.mean_acceptance_length == pytest.approx(1 + spec_stats.num_accepted_tokens / spec_stats.num_drafts)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_and_seeded_sampling_give_the_plain_samples(stories_path, golden, async_scheduling):
    """The n-th token of a seeded sequence uses the n-th uniform of its stream with or without drafts,
    so n > 1 seeded samples (and their log-probabilities) are the plain ones exactly."""
    prompt = [1] + golden[37:45] * 3
    params = [SamplingParams(temperature=t, n=3, seed=s, max_tokens=30, top_k=k, top_p=p, logprobs=1,
                             presence_penalty=pp)
              for s, t, k, p, pp in [(1, 0.7, 0, 1.0, 0.0), (2, 1.0, 5, 1.0, 0.5), (3, 0.5, 0, 0.8, 0.0)]]
    want = LLM(str(stories_path), device="cpu", async_scheduling=async_scheduling).generate(
        [prompt] * 3, params, use_tqdm=False)
    llm = LLM(str(stories_path), device="cpu", async_scheduling=async_scheduling, speculative_config=SPEC)
    got = llm.generate([prompt] * 3, params, use_tqdm=False)
    assert summary(got) == summary(want)
    assert_same_logprobs(got, want)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 20
    assert_pool_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_never_run_past_max_model_len(stories_path, golden, async_scheduling):
    max_len, block_size = 64, 4
    prompts = [[1] + (golden[5:15] * 7)[:max_len - 1 - j] for j in range(1, 14)]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    want = LLM(str(stories_path), device="cpu", max_model_len=max_len, block_size=block_size).generate(
        prompts, params, use_tqdm=False)
    llm = LLM(str(stories_path), device="cpu", max_model_len=max_len, block_size=block_size,
              async_scheduling=async_scheduling, speculative_config=spec(16, 1, 4))
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: o for o in engine.step() if o.finished})
        for seq in engine.scheduler.running:
            assert seq.num_computed_tokens <= max_len
            assert len(seq.token_ids) + seq.num_output_placeholders <= max_len
            assert len(seq.block_table) <= max_len // block_size
    assert summary([got[str(i)] for i in range(len(prompts))]) == summary(want)
    assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == max_len
               and o.outputs[0].finish_reason == "length" for o in got.values())
    assert engine.stats().spec_decode.num_accepted_tokens > 0
    assert_pool_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_held_stay_within_tokens_and_k_through_preemption(stories_path, prompts, plain, async_scheduling,
                                                                 monkeypatch):
    """After each step a running sequence holds no more blocks than its tokens and k drafts need (the
    blocks of rejected drafts are reused for its next tokens, not piled up); the pool's counts add
    up; preempted sequences come back with the plain tokens."""
    k, block_size = 6, 4
    llm = LLM(str(stories_path), device="cpu", speculative_config=spec(k, 1, 3), async_scheduling=async_scheduling,
              block_size=block_size, num_kv_blocks=36, max_model_len=96)
    engine, bm = llm.engine, llm.engine.block_manager
    preempted_with_drafts = []
    preempt = engine.scheduler._preempt

    def spy(seq):
        preempted_with_drafts.append(bool(seq.spec_token_ids))
        preempt(seq)
    monkeypatch.setattr(engine.scheduler, "_preempt", spy)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params_for(i))
    got = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: o for o in engine.step() if o.finished})
        held = set()
        for seq in engine.scheduler.running:
            need = math.ceil((len(seq.token_ids) + seq.num_output_placeholders + k) / block_size)
            assert len(seq.block_table) <= need
            held.update(seq.block_table)
        # the blocks in use are exactly those the running sequences hold
        assert sum(1 for r in bm.ref_counts if r) == len(held) == bm.num_used_blocks
    # preemptions happened, never of a sequence with drafts in flight (such a step is read back first)
    assert len(preempted_with_drafts) > 3 and not any(preempted_with_drafts)
    assert summary([got[str(i)] for i in range(len(prompts))]) == summary(plain)
    assert_pool_free(llm)


@pytest.mark.parametrize("bad,field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 10 ** 9}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 3, "prompt_lookup_max": -1}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 3, "prompt_lookup_max": 2.5}, "prompt_lookup_max"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"method": "suffix", "num_speculative_tokens": 3}, "method"),
    ({"method": None, "num_speculative_tokens": 3}, "method"),
    ({"model": "org/draft-model", "num_speculative_tokens": 3}, "model"),
    ({"num_speculative_tokens": 3, "ngram_prompt_lookup_max": 3}, "ngram_prompt_lookup_max"),
    ({"num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ("[3]", "speculative_config"),
])
def test_bad_configs_are_value_errors_naming_the_field(stories_path, bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="unused", speculative_config=bad)
    with pytest.raises(ValueError, match=field):
        LLM(str(stories_path), device="cpu", speculative_config=bad)
