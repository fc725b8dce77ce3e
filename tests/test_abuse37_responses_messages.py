"""/v1/responses and /v1/messages as the official openai and anthropic clients drive them: fields those
APIs define that were refused, or answered otherwise than Anthropic's and OpenAI's APIs answer them."""
from __future__ import annotations

import pytest
from test_server_helpers import CHAT_TEMPLATE, running_server

from minillm.server.app import ServerOptions

anthropic = pytest.importorskip("anthropic")

USER = {"role": "user", "content": "Hi"}
# The tests' template, with the reasoning effort a request sets.
TEMPLATE = "{% if reasoning_effort %}effort: {{ reasoning_effort }}\n{% endif %}" + CHAT_TEMPLATE


@pytest.fixture(scope="module")
def server(stories_path):
    options = ServerOptions(chat_template=TEMPLATE)
    with running_server(stories_path, max_model_len=256, options=options) as running:
        yield running


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key="none", max_retries=0)


def test_count_tokens_takes_an_enabled_thinking_budget_without_max_tokens(claude):
    # count_tokens takes no max_tokens: the budget was held to the 1 put in its place (a 400 "max_tokens
    # must be greater than thinking.budget_tokens" for every budget).
    plain = claude.messages.count_tokens(model="stories", messages=[USER]).input_tokens
    thinking = claude.messages.count_tokens(model="stories", messages=[USER],
                                            thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens
    assert thinking == plain > 0


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_messages_request_without_a_model_is_a_400_naming_it(http, path):
    # Anthropic's API and vLLM's require model; a request without one was served.
    response = http.post(path, json={"max_tokens": 4, "messages": [USER]})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == "model" and "model" in error["error"]["message"]


def test_output_config_effort_reaches_the_template_as_vllm_passes_it(claude):
    # It was logged as ignored: the template never saw it.
    def count(**fields) -> int:
        return claude.messages.count_tokens(model="stories", messages=[USER], **fields).input_tokens

    assert count(output_config={"effort": "high"}) > count()


def test_an_output_config_effort_vllm_refuses_is_a_400_naming_it(claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="stories", max_tokens=4, messages=[USER], output_config={"effort": "ultra"})
    assert caught.value.body["error"]["param"] == "output_config.effort"
