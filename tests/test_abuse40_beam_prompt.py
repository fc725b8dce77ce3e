"""Beam search for no token (max_tokens 0) still scores the prompt when asked: prompt_logprobs on
/v1/completions and /v1/chat/completions, and a completions echo with logprobs, are those a search of
one token returns, beside its one empty choice with finish_reason "length"."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from test_server_helpers import chat_model_dir, running_server  # noqa: E402

BEAM = {"use_beam_search": True}
MESSAGES = [{"role": "user", "content": "hi"}]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def client(stories_path, tmp_path_factory):
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("beam_prompt_model"))
    with running_server(model, engine_core="thread", max_model_len=MAX_MODEL_LEN) as (base, _):
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60) as c:
            c.model_name = c.models.list().data[0].id
            yield c


def test_completions_prompt_logprobs_of_a_search_for_no_token(client):
    # They were null: no step ran.
    def create(max_tokens):
        return client.completions.create(model=client.model_name, prompt=["Once upon", "The dog"], n=2,
                                         max_tokens=max_tokens, temperature=0,
                                         extra_body={**BEAM, "prompt_logprobs": 1})
    none, one = create(0), create(1)
    assert [(c.index, c.text, c.finish_reason) for c in none.choices] == [(0, "", "length"), (2, "", "length")]
    assert none.usage.completion_tokens == 0
    assert none.choices[0].prompt_logprobs[0] is None and len(none.choices[0].prompt_logprobs) > 1
    # The same prompt scores, to the float rounding of a batch of other rows (the CPU backend's GEMMs
    # round by batch shape): the same tokens, ranks and text, log-probabilities within 1e-5.
    for got, want in zip([c.prompt_logprobs for c in none.choices], [c.prompt_logprobs for c in one.choices[::2]],
                         strict=True):
        assert len(got) == len(want) and got[0] is None and want[0] is None
        for g, w in zip(got[1:], want[1:]):
            assert g.keys() == w.keys()
            for tok in g:
                assert {k: v for k, v in g[tok].items() if k != "logprob"} == \
                    {k: v for k, v in w[tok].items() if k != "logprob"}
                assert g[tok]["logprob"] == pytest.approx(w[tok]["logprob"], abs=1e-5)


def test_completions_echo_with_logprobs_of_a_search_for_no_token(client):
    # The echo's logprob lists were empty.
    def create(max_tokens, **kw):
        return client.completions.create(model=client.model_name, prompt="Once upon", n=2, max_tokens=max_tokens,
                                         echo=True, logprobs=1, temperature=0, extra_body=BEAM, **kw)
    [none], one = create(0).choices, create(1).choices[0]
    assert (none.text, none.finish_reason) == ("Once upon", "length")
    num_prompt = len(none.logprobs.tokens)
    assert num_prompt > 1 and none.logprobs.token_logprobs[0] is None
    assert none.logprobs.tokens == one.logprobs.tokens[:num_prompt]
    assert none.logprobs.token_logprobs == one.logprobs.token_logprobs[:num_prompt]
    assert none.logprobs.top_logprobs == one.logprobs.top_logprobs[:num_prompt]


def test_echo_of_a_prompt_that_fills_the_context_is_scored_whole(client):
    # Beside a search for no token, a prompt of max_model_len tokens fits: scored as an echo without beam search.
    prompt = list(range(300, 300 + MAX_MODEL_LEN))
    beam = client.completions.create(model=client.model_name, prompt=prompt, n=2, max_tokens=0, echo=True,
                                     logprobs=1, temperature=0, extra_body=BEAM)
    plain = client.completions.create(model=client.model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                      temperature=0)
    [got], [want] = beam.choices, plain.choices
    assert len(got.logprobs.token_logprobs) == MAX_MODEL_LEN and got.finish_reason == "length"
    assert got.logprobs.tokens == want.logprobs.tokens
    assert got.logprobs.token_logprobs[0] is None
    assert got.logprobs.token_logprobs[1:] == pytest.approx(want.logprobs.token_logprobs[1:], abs=1e-4)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_prompt_logprobs_of_a_search_for_no_token(client, field):
    def create(max_tokens):
        return client.chat.completions.create(model=client.model_name, messages=MESSAGES, n=2, temperature=0,
                                              extra_body={**BEAM, field: max_tokens, "prompt_logprobs": 0})
    none, one = create(0), create(1)
    assert [(c.index, c.message.content, c.finish_reason) for c in none.choices] == [(0, "", "length")]
    assert none.usage.completion_tokens == 0
    prompt_logprobs = none.model_extra["prompt_logprobs"]
    assert prompt_logprobs is not None and prompt_logprobs[0] is None and len(prompt_logprobs) > 1
    assert prompt_logprobs == one.model_extra["prompt_logprobs"]
