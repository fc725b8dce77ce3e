"""Structured outputs as users send them on stories260K (CPU): a constraint whose only sentence is
empty under min_tokens, and response_format keys that would carry a schema nobody reads."""
import pytest

from minillm import LLM, SamplingParams, StructuredOutputsParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(stories_path):
    with LLM(str(stories_path), device="cpu", max_num_seqs=8) as engine:
        yield engine


@pytest.mark.parametrize("kwargs", [dict(regex=""), dict(regex="^$"), dict(grammar='start: ""')])
def test_a_constraint_of_only_the_empty_output_stops_under_min_tokens(llm, kwargs):
    # The grammar allows only EOS and min_tokens banned it: every logit was -inf, token 0 was
    # sampled and the request ended with finish_reason "error" ("token 0 is not allowed").
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3,
                            structured_outputs=StructuredOutputsParams(**kwargs))
    plain = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3)
    empty, other = (o.outputs[0] for o in llm.generate([PROMPT, PROMPT], [params, plain]))
    assert (empty.finish_reason, empty.text) == ("stop", ""), empty.stop_reason
    assert len(other.token_ids) >= 3
