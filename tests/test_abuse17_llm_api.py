"""The offline API as a vLLM script uses it: names, prompt forms, progress bars, threads and SamplingParams helpers."""
import pytest

from minillm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(stories_path):
    """One stories260K LLM on the CPU for the module."""
    from minillm import LLM
    with LLM(str(stories_path), device="cpu", max_model_len=256) as model:
        yield model


def test_sampling_params_clone_is_independent():
    params = SamplingParams(stop=["x"], logit_bias={3: 1.0}, seed=5)
    copy = params.clone()
    copy.stop.append("y")
    copy.logit_bias[4] = 2.0
    assert params.stop == ["x"] and params.logit_bias == {3: 1.0}
    assert copy.seed == 5 and copy is not params


def test_sampling_params_from_optional():
    """vLLM's from_optional: None takes the default, except max_tokens (None: no limit)."""
    params = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                          max_tokens=None, logit_bias={"5": 250.0, 6: -1.5})
    assert (params.n, params.temperature, params.top_p, params.presence_penalty) == (1, 1.0, 1.0, 0.0)
    assert params.max_tokens is None
    assert params.logit_bias == {5: 100.0, 6: -1.5}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_optional(logit_bias={"five": 1.0})


def test_spaces_between_special_tokens_is_taken(llm):
    """lm-evaluation-harness passes spaces_between_special_tokens=False; it was a TypeError."""
    params = SamplingParams(temperature=0, max_tokens=8, spaces_between_special_tokens=False)
    assert llm.generate("Once", params)[0].outputs[0].text == llm.generate("Once", GREEDY)[0].outputs[0].text
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")
