"""Hostile structured-output requests on stories260K (CPU): constraints that are valid but large,
unsatisfiable or slow to compile must give a clean answer (an error naming the field, or a finished
request), never a failure in the middle of the output or a stalled engine."""
import pytest

from minillm import LLM, SamplingParams, StructuredOutputsParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(stories_path):
    with LLM(str(stories_path), device="cpu", max_num_seqs=16) as engine:
        yield engine


def test_a_choice_of_thousands_of_entries_is_generated_whole(llm):
    # Past 2,000 alternatives the first token used to be refused (llguidance's row limit): finish
    # "error" after one byte.
    choices = [f"c{i}" for i in range(5000)] + ["c1", "zebra crossing"]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(choice=choices))
              for t, s in [(0.0, None), *((1.0, seed) for seed in range(8))]]
    for out in llm.generate([PROMPT] * len(params), params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
        assert completion.text in choices


@pytest.mark.parametrize("kwargs,field", [
    (dict(regex=r"[^\s\S]"), "regex"),
    (dict(json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "json"),
    (dict(grammar='start: start "a"'), "grammar"),
])
def test_a_constraint_nothing_satisfies_ends_its_request_saying_so(llm, kwargs, field):
    # These pass the entry check (no tokenizer there) and fail on the compile pool; the message
    # used to call them "too large to match: NoExtensionBias". A healthy request beside them is
    # untouched.
    bad = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(**kwargs))
    good = SamplingParams(temperature=0.0, max_tokens=8)
    alone = llm.generate([PROMPT], [good])[0].outputs[0]
    failed, healthy = (o.outputs[0] for o in llm.generate([PROMPT, PROMPT], [bad, good]))
    assert failed.finish_reason == "error" and failed.text == ""
    assert failed.stop_reason.startswith(f"structured_outputs.{field}: no output satisfies the"), failed.stop_reason
    assert (healthy.finish_reason, healthy.token_ids) == (alone.finish_reason, alone.token_ids)
