"""Leftovers of the vLLM comparison, on stories260K (CPU): logit_bias bans that leave nothing to
sample."""
from __future__ import annotations

import math

import pytest

from minillm import SamplingParams

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
