"""SamplingParams and LLM.generate take what vLLM's take, and the sampler carries it safely: logit
biases of any size (a ban by -1e9 or -inf, a forced token by 1e9 or inf), an infinite logit under
every sampling rule, priorities as any sequence of integers. stories260K on the CPU."""
import math
import pickle

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.ops import numpy as npops
from minillm.sampling_metadata import SamplingInputBuffer
from minillm.server.protocol import logit_bias_ids

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=128, scheduling_policy="priority") as model:
        yield model


def repr_id(value) -> str:
    """A short test id: 10**400 as '1e400'."""
    return f"{'-' if value < 0 else ''}1e{len(str(abs(value))) - 1}" if isinstance(value, int) and abs(value) > 2**64 \
        else repr(value)


def gen(llm, **kw):
    return llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)[0].outputs[0].token_ids


def test_the_numpy_sampler_takes_an_infinite_logit_under_every_rule():
    logits = np.zeros((1, 64), np.float32)
    logits[0, 7], logits[0, 40] = 3.0, np.inf
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 0.9, 0.0),
                                             (1.0, 0, 1.0, 0.1), (0.5, 0, 0.9, 0.1), (0.5, 3, 0.9, 0.1)]:
        for u in (0.0, 0.5, 0.999):
            ids = npops.sample(logits.copy(), np.float32([temperature]), np.int32([top_k]), np.float32([top_p]),
                               np.float32([min_p]), np.float32([u]))
            assert ids.tolist() == [40], (temperature, top_k, top_p, min_p, u)
    # a finite logit that the temperature scales past float32's range is the same
    logits[0, 40] = 3e38
    ids = npops.sample(logits, np.float32([0.1]), np.int32([0]), np.float32([0.9]), np.float32([0.1]),
                       np.float32([0.5]))
    assert ids.tolist() == [40]


def test_a_repetition_penalty_that_scales_a_logit_past_float32_samples_under_top_p_and_min_p(llm):
    """repetition_penalty 1.2e-38 (taken: float32's smallest normal) divides a repeated token's positive
    logit into inf; under top_p with min_p the NumPy sampler then raised inside the engine's step."""
    out = gen(llm, temperature=0.5, top_p=0.9, min_p=0.1, repetition_penalty=1.2e-38, seed=1, max_tokens=8,
              ignore_eos=True)
    assert len(out) == 8


@pytest.mark.parametrize("bias", [200, 1e9, -1e9, -1e30, 1e39, -1e300, float("-inf"), float("inf"), 10**400,
                                  -10**400, np.float64(-1e9), np.float32(-3e38), np.int64(10**12)], ids=repr_id)
def test_logit_bias_takes_any_size_as_vllms_sampling_params_does(bias):
    params = SamplingParams(logit_bias={13: bias})
    value = params.logit_bias[13]
    huge = type(bias) is int and abs(bias) > 2**1024
    assert type(value) is float and value == ((math.inf if bias > 0 else -math.inf) if huge else float(bias))
    assert params.clone().logit_bias == params.logit_bias == pickle.loads(pickle.dumps(params)).logit_bias


@pytest.mark.parametrize("bias", [float("nan"), np.float64("nan"), np.float32("nan"), "5", None, True, 1j])
def test_a_logit_bias_that_is_no_number_is_named(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={13: bias})


@pytest.mark.parametrize("bias", [-1e9, -1e39, float("-inf"), -10**400], ids=repr_id)
def test_a_huge_negative_bias_bans_the_token_as_in_vllm(llm, bias):
    greedy = gen(llm, temperature=0, max_tokens=6, ignore_eos=True)
    assert gen(llm, temperature=0, max_tokens=6, ignore_eos=True, logit_bias={greedy[0]: bias})[0] != greedy[0]
    # banned at every step, under sampling too
    out = gen(llm, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True,
              logit_bias={t: bias for t in set(greedy)})
    assert not set(out) & set(greedy)


@pytest.mark.parametrize("bias", [1e9, 1e37, 1e39, float("inf"), 10**400], ids=repr_id)
@pytest.mark.parametrize("rule", [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.05),
                                  dict(temperature=0.7, top_k=5), dict(temperature=0.7, top_p=0.9),
                                  dict(temperature=0.7, min_p=0.1), dict(temperature=0.5, top_p=0.9, min_p=0.1),
                                  dict(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5)])
def test_a_huge_positive_bias_forces_the_token_under_every_rule(llm, bias, rule):
    """A bias past float32's range is float32's largest value in the sampler (1e37 at temperature 0.05
    is past it too): every rule takes the token (the NumPy sampler raised or took another token)."""
    assert gen(llm, seed=5, max_tokens=5, ignore_eos=True, logit_bias={300: bias}, **rule) == [300] * 5


def test_the_packed_biases_are_float32_and_carry_an_overflowing_bias_as_a_ban_or_float32s_largest():
    """The sampler uploads biases as float32 words: -1e300 (past its range) goes up as -inf, 1e39 as
    float32's largest value, 1e9 and -1e30 as themselves, rather than failing to pack (struct's
    OverflowError)."""
    from minillm.device import make_device
    from minillm.sequence import Sequence

    params = SamplingParams(logit_bias={1: 1e39, 2: -1e300, 3: 1e9, 4: -1e30, 5: float("-inf"), 6: float("inf")})
    seq = Sequence("r", 0, [1, 2, 3], params, 0.0, np.random.default_rng(0), 16)
    seq.num_output_placeholders = 1
    meta = SamplingInputBuffer(npops, make_device("numpy"), 4, [2]).prepare([seq], 512)
    rows, tokens, values = meta.logit_bias
    largest = float(np.finfo(np.float32).max)
    assert values.dtype == np.float32 and tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert values.tolist() == [largest, -np.inf, np.float32(1e9), np.float32(-1e30), -np.inf, largest]


def test_the_server_still_clamps_biases_to_100_as_vllms_server_does():
    assert logit_bias_ids({"5": 1e9, "6": -1e9, "7": 3.5}) == {5: 100.0, 6: -100.0, 7: 3.5}
    # from_optional, vLLM's server path, clamps an infinite bias too (-inf was refused)
    params = SamplingParams.from_optional(logit_bias={"5": float("-inf"), 6: 10**400, 7: -2.5})
    assert params.logit_bias == {5: -100.0, 6: 100.0, 7: -2.5}


def test_async_llm_carries_a_bias_of_any_size_to_its_engine_core(stories_path):
    """The bias goes to the core as a float (10**400 as inf: msgpack carries no integer past 64 bits)."""
    import asyncio

    from minillm.config import EngineConfig
    from minillm.server.async_llm import AsyncLLM

    async def last(engine, request_id, params):
        return [out async for out in engine.generate(PROMPT, params, request_id)][-1].outputs[0].token_ids

    engine = AsyncLLM(EngineConfig(model=str(stories_path), device="cpu"))
    try:
        forced = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1, seed=1, max_tokens=4, ignore_eos=True,
                                logit_bias={300: 10**400})
        assert asyncio.run(last(engine, "forced", forced)) == [300] * 4
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        first = asyncio.run(last(engine, "greedy", greedy))[0]
        banned = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={first: -10**400})
        assert asyncio.run(last(engine, "banned", banned))[0] != first
    finally:
        engine.shutdown()


def test_n_above_1_with_greedy_sampling_is_taken_and_gives_equal_completions(llm):
    """vLLM refuses it ('n must be 1 when using greedy sampling'); minillm keeps serving it, as
    OpenAI's API does (its server's tests and the engine's rely on n equal greedy completions)."""
    outs = llm.generate([PROMPT], SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    assert len(outs) == 2 and outs[0].token_ids == outs[1].token_ids


@pytest.mark.parametrize("priority", [(1, 0), np.array([1, 0]), np.array([1, 0], np.int8), [np.int32(1), 0],
                                      range(1, -1, -1)])
def test_generate_takes_priority_as_any_sequence_of_integers(llm, priority):
    plain = llm.generate(["Lily", "Tom"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    outs = llm.generate(["Lily", "Tom"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False,
                        priority=priority)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("priority", [np.array([1.0, 0.0]), np.array([True, False]), [np.True_, 0],
                                      [np.float64(1.0), 0], np.array([[1], [0]]), np.array(["1", "0"]),
                                      (1.0, 0)])
def test_generate_names_a_priority_of_floats_or_bools(llm, priority):
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["Lily", "Tom"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False,
                     priority=priority)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("given, kept", [(None, []), ((), []), (("cat", "dog"), ["cat", "dog"]), (["cat"], ["cat"])])
def test_bad_words_is_a_list_as_in_vllm(given, kept):
    """vLLM's __post_init__ makes bad_words a list ([] for None), as stop and stop_token_ids: code
    that extends params.bad_words or takes its len() raised TypeError on None."""
    assert SamplingParams.from_fields({"bad_words": given}).bad_words == kept
    params = SamplingParams(bad_words=given)
    assert type(params.bad_words) is list and params.bad_words == kept
    params.bad_words.append("owl")
    params.validate()
    assert params.bad_words == kept + ["owl"]


@pytest.mark.parametrize("bias", [1e39, float("inf")], ids=repr_id)
@pytest.mark.parametrize("rule", [dict(temperature=0), dict(temperature=1.0), dict(temperature=1.0, top_p=0.9)])
def test_an_infinite_bias_on_a_token_allowed_token_ids_masks_leaves_it_masked(llm, bias, rule):
    """The mask's -inf plus an infinite bias was NaN, and the sampler took that token, outside the set."""
    out = gen(llm, seed=1, max_tokens=5, allowed_token_ids=[265, 376], logit_bias={300: bias, 376: bias}, **rule)
    assert out == [376] * 5


def test_an_infinite_bias_on_a_token_the_grammar_forbids_leaves_it_forbidden(llm):
    from minillm.sampling_params import StructuredOutputsParams

    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = [SamplingParams(temperature=0, max_tokens=5, structured_outputs=choice, logit_bias={300: bias})
              for bias in (float("inf"), 1e39, 5.0)]
    texts = [o.outputs[0].text for o in llm.generate([PROMPT] * 3, params, use_tqdm=False)]
    assert texts == [texts[2]] * 3 and texts[2] in choice.choice
