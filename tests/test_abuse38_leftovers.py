"""Leftovers of the vLLM comparison, on stories260K (CPU): logit_bias bans that leave nothing to
sample, LLM's compilation_config in vLLM's dict forms, and the positional order of the outputs."""
from __future__ import annotations

import math

import pytest

from minillm import LLM, SamplingParams
from minillm.llm import engine_config
from minillm.outputs import CompletionOutput, RequestOutput

PROMPT = "Once upon a time"
A = 261                         # "a"; the bad word "a a" is [A, A]


# ---- logit_bias of -inf -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, start, rules", [
    # Each ran and returned 3 tokens of id 0 (empty text), sampled from a row of -inf.
    (dict(logit_bias={5: -math.inf}, allowed_token_ids=[5]), "allowed_token_ids must hold a token",
     "but logit_bias values of -inf ban all of them"),
    (dict(logit_bias={5: -1e39, A: -math.inf}, allowed_token_ids=[5, A]), "allowed_token_ids must hold a token",
     "but logit_bias values of -inf ban all of them"),
    (dict(logit_bias={5: -math.inf}, allowed_token_ids=[5, 265], bad_words=["the"]),
     "allowed_token_ids must hold a token", "but logit_bias values of -inf and bad_words ban all of them"),
    (dict(logit_bias=dict.fromkeys(range(512), -math.inf)), "logit_bias must leave a token",
     "but logit_bias values of -inf ban every token"),
])
def test_logit_bias_bans_that_leave_the_first_token_nothing_are_refused(llm, kwargs, start, rules):
    with pytest.raises(ValueError, match=f"^{start}") as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=3, **kwargs))
    assert rules in str(info.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_logit_bias_bans_that_leave_a_later_token_nothing_end_the_output_with_an_error(llm):
    # "a" then "a" is the bad word, and 5 is banned by its bias: nothing is left for the second token.
    params = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[5, A], logit_bias={5: -math.inf},
                            bad_words=["a a"])
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == [A] and out.finish_reason == "error"
    assert out.stop_reason.startswith("allowed_token_ids: no allowed token is left to sample after 1 output token: "
                                      "logit_bias values of -inf and bad_words ban all of them")


def test_a_bias_of_minus_inf_on_some_allowed_tokens_leaves_the_others(llm):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=6, allowed_token_ids=[5, A],
                            logit_bias={5: -math.inf})
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == [A] * 6 and out.finish_reason == "length"
    assert params._masked_row_check is None       # bans that stay the same are checked once, not per token


# ---- compilation_config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value, is_eager", [
    # vLLM's mode 0 drops the piecewise graphs its default cudagraph_mode needs: no CUDA graphs.
    (0, True), ({"level": 0}, True), ({"mode": 0}, True), ({"mode": "none"}, True),
    ({"cudagraph_mode": "NONE"}, True), ({"mode": 0, "cudagraph_mode": "FULL_AND_PIECEWISE"}, True),
    ({"cudagraph_capture_sizes": []}, True), ({"mode": 0, "cudagraph_capture_sizes": [1, 2, 4]}, True),
    ({"cudagraph_mode": "full_and_piecewise"}, False), ({}, False), (None, False),
])
def test_compilation_config_takes_vllms_dict_forms_as_cuda_graphs_on_or_off(value, is_eager):
    # Each dict was a ValueError ("compilation_config={'level': 0} is not supported").
    assert engine_config("m", {"compilation_config": value}).enforce_eager is is_eager


@pytest.mark.parametrize("value, needle", [
    ({"mode": 3}, r"^compilation_config\['mode'\]=3 is not supported: minillm compiles no torch graphs"),
    ({"level": 2}, r"^compilation_config\['level'\]=2 is not supported"),
    ({"mode": 7}, r"^compilation_config\['mode'\] must be 0-3 or one of NONE, "),
    ({"cudagraph_mode": "FULL_DECODE_ONLY"}, r"^compilation_config\['cudagraph_mode'\]='FULL_DECODE_ONLY' is not"),
    ({"cudagraph_mode": "sometimes"}, r"^compilation_config\['cudagraph_mode'\] must be one of NONE, "),
    ({"cudagraph_capture_sizes": [1, 2]}, r"^compilation_config\['cudagraph_capture_sizes'\]=\[1, 2\] is not "
                                          r"supported: minillm chooses the batch sizes"),
    ({"max_cudagraph_capture_size": 64}, r"^compilation_config\['max_cudagraph_capture_size'\]=64 is not"),
    ({"cudagraph_capture_sizes": [0]}, r"^compilation_config\['cudagraph_capture_sizes'\] must be a list of "
                                       r"positive batch sizes"),
    ({"mode": 0, "backend": "eager"}, r"^compilation_config\['backend'\]='eager' is not supported"),
    (3, r"^compilation_config=3 is not supported: minillm compiles no torch graphs"),
    ("0", r"^compilation_config must be a compilation mode \(0\) or a dict"),
])
def test_compilation_config_keys_minillm_cannot_honour_are_refused_naming_the_key(value, needle):
    with pytest.raises(ValueError, match=needle):
        engine_config("m", {"compilation_config": value})


def test_llm_runs_with_compilation_config_mode_0(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=64, compilation_config={"level": 0}) as model:
        assert model.llm_engine.config.enforce_eager
        assert len(model.generate([PROMPT], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


# ---- the outputs' positional order -----------------------------------------------------------------

def test_completion_output_takes_vllms_positional_order():
    # vLLM's (index, text, token_ids, cumulative_logprob, logprobs, ..., finish_reason, stop_reason):
    # the fourth was minillm's finish_reason.
    out = CompletionOutput(0, "hi", [5], -1.5, [{5: -1.5}])
    assert (out.cumulative_logprob, out.logprobs, out.finish_reason) == (-1.5, [{5: -1.5}], None)
    assert not out.finished()


def test_request_output_takes_vllms_positional_order():
    # vLLM's (request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished, metrics,
    # lora_request, encoder_prompt, encoder_prompt_token_ids, num_cached_tokens).
    comp = CompletionOutput(0, "hi", [5])
    out = RequestOutput("r", "p", [1, 2], [None, {2: -0.5}], [comp], True, None, None, None, None, 1)
    assert (out.prompt_logprobs, out.outputs, out.finished, out.num_cached_tokens) == ([None, {2: -0.5}], [comp],
                                                                                      True, 1)
    later = RequestOutput("r", "p", [1, 2], None, [CompletionOutput(0, "!", [6], finish_reason="stop")], True)
    out.add(later, aggregate=True)
    assert (comp.text, comp.token_ids, comp.finish_reason) == ("hi!", [5, 6], "stop")
