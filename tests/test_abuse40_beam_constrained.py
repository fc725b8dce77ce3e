"""Beam search under an output constraint, as vLLM's offline LLM.beam_search applies
BeamSearchParams.structured_outputs: every beam's step carries the constraint with the beam's tokens
replayed into the matcher (num_output_prefix_tokens), so each step's candidates come from the masked
distribution; every beam is a sentence of the grammar (cut short only by max_tokens) and one whose
sentence is complete ends on EOS ("stop"). The server's use_beam_search with response_format or
structured_outputs (a 400 before) answers the offline search's beams. BeamSearchParams refused a
constraint; a prompt's last tokens as the output's start were not a thing the engine took."""
from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from test_server_helpers import chat_model_dir, running_server  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.beam_search import get_beam_search_score  # noqa: E402
from minillm.sampling_params import BeamSearchParams  # noqa: E402
from minillm.structured_output import StructuredOutputsParams  # noqa: E402

MODEL = "stories"
PROMPTS = ["Once upon a time", "Lily and Tom"]
MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Tim", "Sue", "Max"]}, "happy": {"type": "boolean"}},
          "required": ["name", "happy"]}
REGEX = r"(cat|dog|bird) [0-9]{1,2}"
CHOICES = ["happy", "sad", "a big red ball", "the dog"]
CONSTRAINTS = {"json": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES}}


def is_valid(kind: str, text: str) -> bool:
    """Whether text is a whole sentence of the constraint of that kind."""
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@pytest.fixture(scope="module")
def model_dir(stories_path, tmp_path_factory):
    return chat_model_dir(stories_path, tmp_path_factory.mktemp("beam_constrained_model"))


@pytest.fixture(scope="module")
def offline(model_dir):
    with LLM(str(model_dir), device="cpu", max_model_len=96) as model:
        yield model


@pytest.fixture(scope="module")
def client(model_dir):
    with running_server(model_dir, max_model_len=96) as (base, _):
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield c


def generated(tok, beam, num_prompt_tokens: int) -> list[int]:
    """A beam's own tokens, a final EOS left out."""
    ids = beam.tokens[num_prompt_tokens:]
    return ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_every_beam_is_a_whole_sentence_ended_by_eos_best_first(offline, kind):
    tok = offline.get_tokenizer()
    so = StructuredOutputsParams(**CONSTRAINTS[kind])
    params = BeamSearchParams(beam_width=3, max_tokens=40, length_penalty=0.7, structured_outputs=so)
    outputs = offline.beam_search(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs):
        num_prompt = len(tok.encode(prompt))
        assert len(output.sequences) == 3
        texts = set()
        for beam in output.sequences:
            text = tok.decode(generated(tok, beam, num_prompt))
            assert is_valid(kind, text), (kind, text)
            assert beam.finish_reason == "stop" and beam.tokens[-1] == tok.eos_token_id
            # each token's log-probability is its step's (the masked distribution's); they add up to the score's
            steps = [lp[t] for lp, t in zip(beam.logprobs, beam.tokens[num_prompt:])]
            assert sum(float(lp) for lp in steps) == pytest.approx(beam.cum_logprob, abs=1e-4)
            assert all(float(lp) > float("-inf") for lp in steps)
            texts.add(text)
        assert len(texts) == 3
        scores = [get_beam_search_score(b.tokens, b.cum_logprob, tok.eos_token_id, 0.7) for b in output.sequences]
        assert scores == sorted(scores, reverse=True)


def test_a_step_takes_its_candidates_from_the_masked_distribution(offline):
    # The second step of a beam that began "a" is the constrained request that began so: its candidates
    # are the grammar's ("a big red ball": " " alone, log-probability 0), as a plain request's next token.
    tok = offline.get_tokenizer()
    so = StructuredOutputsParams(choice=CHOICES)
    prompt = tok.encode(PROMPTS[0])
    first = offline.generate([{"prompt_token_ids": prompt}], SamplingParams(
        max_tokens=2, temperature=0, logprobs=4, structured_outputs=StructuredOutputsParams(choice=["a big red ball"])))
    a, space = first[0].outputs[0].token_ids
    step = offline.generate([{"prompt_token_ids": prompt + [a]}], SamplingParams(
        max_tokens=1, temperature=0, logprobs=4,
        structured_outputs=dataclasses.replace(so, num_output_prefix_tokens=1)))[0].outputs[0]
    assert step.token_ids == [space]
    finite = {t: float(lp) for t, lp in step.logprobs[0].items() if float(lp) > float("-inf")}
    assert finite == {space: 0.0}


def test_matchers_in_a_grammar_process_give_the_same_beams(offline, model_dir):
    # The prefix goes to the grammar process's matcher in one advance; one it refuses ends the request there too.
    so = StructuredOutputsParams(json=SCHEMA)
    params = BeamSearchParams(beam_width=3, max_tokens=40, structured_outputs=so)
    tok = offline.get_tokenizer()
    refused = StructuredOutputsParams(choice=CHOICES, num_output_prefix_tokens=2)
    with LLM(str(model_dir), device="cpu", max_model_len=96, grammar_process=True) as remote:
        assert [[(b.tokens, b.cum_logprob, b.finish_reason) for b in out.sequences]
                for out in remote.beam_search(PROMPTS, params)] == \
            [[(b.tokens, b.cum_logprob, b.finish_reason) for b in out.sequences]
             for out in offline.beam_search(PROMPTS, params)]
        [out] = remote.generate([{"prompt_token_ids": tok.encode("Once upon")}],
                                SamplingParams(max_tokens=3, structured_outputs=refused))
        assert out.outputs[0].finish_reason == "error"


def test_max_tokens_cuts_a_beam_to_a_start_of_a_sentence(offline):
    tok = offline.get_tokenizer()
    params = BeamSearchParams(beam_width=2, max_tokens=3, structured_outputs=StructuredOutputsParams(
        choice=["a big red ball", "the little dog"]))
    [output] = offline.beam_search([PROMPTS[0]], params)
    num_prompt = len(tok.encode(PROMPTS[0]))
    assert [b.finish_reason for b in output.sequences] == ["length", "length"]
    for beam in output.sequences:
        text = tok.decode(beam.tokens[num_prompt:])
        assert len(beam.tokens) == num_prompt + 3
        assert any(choice.startswith(text) and choice != text for choice in ("a big red ball", "the little dog"))


def test_ignore_eos_still_ends_a_complete_sentence_on_eos(offline):
    tok = offline.get_tokenizer()
    so = StructuredOutputsParams(choice=CHOICES)
    [output] = offline.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True,
                                                                  structured_outputs=so))
    num_prompt = len(tok.encode(PROMPTS[0]))
    for beam in output.sequences:
        assert beam.finish_reason == "stop" and beam.tokens[-1] == tok.eos_token_id
        assert tok.decode(generated(tok, beam, num_prompt)) in CHOICES


def test_an_output_start_the_grammar_refuses_ends_the_request_with_an_error(offline):
    tok = offline.get_tokenizer()
    so = StructuredOutputsParams(choice=CHOICES, num_output_prefix_tokens=2)
    [out] = offline.generate([{"prompt_token_ids": tok.encode("Once upon")}], SamplingParams(max_tokens=3,
                                                                                            structured_outputs=so))
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []


@pytest.mark.parametrize("fields, needle", [
    (dict(choice=CHOICES, num_output_prefix_tokens=-1), "num_output_prefix_tokens: must be an integer >= 0"),
    (dict(choice=CHOICES, num_output_prefix_tokens=True), "num_output_prefix_tokens: must be an integer >= 0"),
])
def test_a_bad_output_start_is_a_value_error_naming_it(fields, needle):
    with pytest.raises(ValueError, match=needle):
        StructuredOutputsParams(**fields)


def test_an_output_start_longer_than_the_prompt_is_a_value_error_naming_it(offline):
    so = StructuredOutputsParams(choice=CHOICES, num_output_prefix_tokens=50)
    with pytest.raises(ValueError, match="num_output_prefix_tokens: must be at most the prompt's length"):
        offline.generate(["Once"], SamplingParams(max_tokens=2, structured_outputs=so))
    with pytest.raises(ValueError, match="structured_outputs must leave num_output_prefix_tokens 0"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs=so)


def expected_choice(tok, beam, num_prompt_tokens: int) -> dict:
    """What a choice of the server's answer holds for an offline beam (include_stop_str_in_output false)."""
    shown = generated(tok, beam, num_prompt_tokens)
    head = tok.decode(beam.tokens[:num_prompt_tokens])
    return {"text": tok.decode(beam.tokens[:num_prompt_tokens] + shown)[len(head):], "token_ids": shown,
            "finish_reason": beam.finish_reason,
            "stop_reason": tok.eos_token_id if beam.finish_reason == "stop" else None}


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_server_completion_beams_are_the_offline_beams(client, offline, kind):
    so = StructuredOutputsParams(**CONSTRAINTS[kind])
    beams = offline.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=40, structured_outputs=so))
    reply = client.completions.create(model=MODEL, prompt=PROMPTS, n=3, max_tokens=40, temperature=0, extra_body={
        "use_beam_search": True, "structured_outputs": CONSTRAINTS[kind], "return_token_ids": True})
    tok = offline.get_tokenizer()
    for pi, output in enumerate(beams):
        for bi, beam in enumerate(output.sequences):
            choice = reply.choices[pi * 3 + bi]
            num_prompt = len(choice.prompt_token_ids)
            assert choice.prompt_token_ids == beam.tokens[:num_prompt]
            got = {"text": choice.text, "token_ids": choice.token_ids, "finish_reason": choice.finish_reason,
                   "stop_reason": choice.stop_reason}
            assert got == expected_choice(tok, beam, num_prompt)
            assert is_valid(kind, choice.text)


def test_server_chat_beams_under_response_format_are_the_offline_beams(client, offline):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, max_completion_tokens=40, temperature=0, extra_body={
            "use_beam_search": True, "return_token_ids": True},
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
    prompt = reply.prompt_token_ids
    so = StructuredOutputsParams(json=SCHEMA)
    [output] = offline.beam_search({"prompt_token_ids": prompt},
                                   BeamSearchParams(beam_width=2, max_tokens=40, structured_outputs=so))
    tok = offline.get_tokenizer()
    got = [{"text": c.message.content, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "stop_reason": c.model_extra["stop_reason"]} for c in reply.choices]
    assert got == [expected_choice(tok, beam, len(prompt)) for beam in output.sequences]
    assert all(is_valid("json", c.message.content) for c in reply.choices)


def test_server_chat_stream_beams_hold_to_the_constraint(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, max_completion_tokens=40, temperature=0, stream=True,
        extra_body={"use_beam_search": True, "structured_outputs": {"regex": REGEX}})
    texts, finishes = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1] and finishes == {0: "stop", 1: "stop"}
    assert all(is_valid("regex", text) for text in texts.values())
