"""LLM.generate and SamplingParams given what careless callers give: NumPy ids, values past float32."""
import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.sampling_params import short_repr

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(stories_path):
    llm = LLM(str(stories_path), device="cpu", max_model_len=64)
    yield llm
    llm.shutdown()


def test_short_repr_of_numpy_integers_is_their_value():
    assert short_repr(np.int64(7)) == repr(np.int64(7))
    assert short_repr(np.uint64(2**64 - 1)) == repr(np.uint64(2**64 - 1))


def test_numpy_arrays_of_ids_are_prompts_as_their_lists_are(llm):
    ids = [1, 403, 407]
    want = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    for prompts in (np.array(ids), [np.array(ids, dtype=np.int32)], [np.int64(t) for t in ids],
                    {"prompt_token_ids": np.array(ids)}):
        outs = llm.generate(prompts, GREEDY)
        assert len(outs) == 1 and outs[0].outputs[0].token_ids == want and outs[0].prompt_token_ids == ids
    batch = llm.generate(np.array([ids, ids]), GREEDY)         # a 2-D array is a batch of rows
    assert [o.outputs[0].token_ids for o in batch] == [want, want]
    assert llm.llm_engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("prompts, needle", [
    (np.array([1.0, 2.0]), "prompt must be a 1-D array of integer token ids"),
    (np.array(5), "prompt must be a 1-D array of integer token ids"),
    ([np.zeros((2, 2), dtype=np.int64)], "prompt must be a 1-D array of integer token ids"),
    ({"prompt_token_ids": np.array([[1, 2]])}, "prompt_token_ids must be a 1-D array"),
    (np.array([1, 9999]), r"prompt token ids must be integers in \[0, 512\)"),
    (np.array([], dtype=np.int64), "prompt must be a non-empty string or a non-empty list"),
])
def test_bad_numpy_prompts_are_value_errors_naming_the_prompt(llm, prompts, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate(prompts, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("field, value", [("temperature", 1e39), ("temperature", 1e300),
                                          ("repetition_penalty", 1e39), ("repetition_penalty", 1e-40)])
def test_values_the_float32_sampler_cannot_hold_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"{field} must be .*float32"):
        SamplingParams(**{field: value})


def test_the_largest_float32_temperature_still_samples_past_masked_tokens(llm):
    # A temperature just under float32's largest value is still uniform over the tokens min_tokens
    # leaves open (it was NaN past it, and the masked rows fell back to the argmax).
    params = SamplingParams(temperature=3.4e38, min_tokens=6, max_tokens=6, seed=0)
    hot = llm.generate("Once upon", params)[0].outputs[0].token_ids
    greedy = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    assert hot != greedy


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    ids = [1] + [3 + (7 * i) % 400 for i in range(99)]                # 100 tokens, past max_model_len 64
    params = SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=20)
    got = llm.generate([ids], params)[0]
    want = llm.generate([ids[-20:]], SamplingParams(temperature=0, max_tokens=6))[0]
    assert got.prompt_token_ids == ids[-20:] and got.outputs[0].token_ids == want.outputs[0].token_ids
    # -1 keeps as many as the context holds, which leaves no room to generate (as vLLM refuses it)
    with pytest.raises(ValueError, match="leaves no room"):
        llm.generate([ids], SamplingParams(max_tokens=2, truncate_prompt_tokens=-1))
    assert llm.generate([ids[:10]], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=-1))


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "8"])
def test_a_bad_truncate_prompt_tokens_is_refused_by_name(value):
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1, or -1"):
        SamplingParams(truncate_prompt_tokens=value)
