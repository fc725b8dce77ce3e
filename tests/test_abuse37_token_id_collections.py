"""Token-id fields given as a set or a NumPy array, as vLLM's SamplingParams takes them."""
import numpy as np
import pytest

from minillm import LLM, SamplingParams


@pytest.mark.parametrize("ids", [np.array([7, 5]), {5, 7}, frozenset([7, 5]), np.array([5, 7], dtype=np.int32)],
                         ids=["int64 array", "set", "frozenset", "int32 array"])
def test_stop_token_ids_and_allowed_token_ids_take_sets_and_arrays(ids):
    # both were "must be a list": vLLM iterates whatever collection it is given
    params = SamplingParams(stop_token_ids=ids, allowed_token_ids=ids)
    assert sorted(params.stop_token_ids) == [5, 7] and all(type(t) is int for t in params.stop_token_ids)
    assert sorted(params.allowed_token_ids) == [5, 7] and all(type(t) is int for t in params.allowed_token_ids)


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
@pytest.mark.parametrize("ids", [np.array([[5, 7]]), {5, "x"}, np.array([-1, 5])], ids=["2-D", "str", "negative"])
def test_a_bad_collection_is_still_a_value_error_naming_the_field(field, ids):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: ids})


def test_an_array_of_allowed_ids_constrains_generation(stories_path):
    llm = LLM(str(stories_path), device="cpu", max_model_len=64)
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=6, temperature=1.0, seed=1,
                                                           allowed_token_ids=np.array([5, 7, 9])), use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= {5, 7, 9}
