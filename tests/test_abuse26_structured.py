"""Structured outputs whose grammar refuses the sampled token (stories260K, CPU): the refused token
is not part of the output, the request ends with an error that names the cause, and a greedy request
beside it keeps its alone output; with the matchers in the engine and in a grammar process."""
import pytest

from minillm import LLM, SamplingParams, StructuredOutputsParams

PROMPT = "Once upon a time"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "grammar-process"])
def llm(request, stories_path):
    with LLM(str(stories_path), device="cpu", grammar_process=request.param) as llm:
        yield llm


def test_allowed_tokens_outside_the_grammar_end_the_request_without_token_zero(llm):
    # Every token the grammar allows was also outside allowed_token_ids: the row was all -inf, the
    # sampler took id 0, and the output held it ([0]) beside the error.
    letter = llm.get_tokenizer().encode("a", add_special_tokens=False)[-1]
    digits = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[letter],
                            structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    alone = llm.generate([PROMPT], GREEDY)[0].outputs[0]
    bad, ok = (o.outputs[0] for o in llm.generate([PROMPT, PROMPT], [digits, GREEDY]))
    assert bad.finish_reason == "error" and bad.token_ids == [] and bad.text == ""
    assert "allowed_token_ids, bad_words or min_tokens excluded them all" in bad.stop_reason
    assert ok.token_ids == alone.token_ids and ok.text == alone.text


@pytest.mark.parametrize("regex", ["<s>", "a<s>b"])
def test_a_constraint_holding_a_special_tokens_text_says_so(llm, regex):
    # The mask offers special token <s> for the forced text "<s>" and the grammar refuses it: the error
    # blamed allowed_token_ids, bad_words or min_tokens, which the request never set.
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=regex))
    out = llm.generate([PROMPT], params)[0].outputs[0]
    special = llm.get_tokenizer().encode("<s>", add_special_tokens=False)
    assert out.finish_reason == "error" and special[-1] not in out.token_ids
    assert out.text == regex[:regex.index("<")]
    assert "special token" in out.stop_reason and "excluded them all" not in out.stop_reason
