"""vLLM's serve defaults for every request: --default-chat-template-kwargs (template variables under
each request's chat_template_kwargs) and --enable-force-include-usage (every stream ends with its usage)."""
from __future__ import annotations

import httpx
import pytest
from test_cli import STORIES, minillm, needs_stories
from test_server_helpers import running_server, sse_events

from minillm.server.app import ServerOptions

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "|thinking={{ enable_thinking }}|who={{ who }}|effort={{ reasoning_effort }}|")


@pytest.fixture(scope="module")
def url(stories_path):
    """stories260K served with TEMPLATE, the qwen3 reasoning parser, thinking off and who=server by
    default, and the usage forced into every stream."""
    options = ServerOptions(chat_template=TEMPLATE, reasoning_parser="qwen3", enable_force_include_usage=True,
                            default_chat_template_kwargs={"enable_thinking": False, "who": "server"})
    with running_server(stories_path, max_model_len=256, options=options) as (base, _):
        yield base


def rendered(url: str, **body) -> str:
    """The prompt a chat request was rendered to."""
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Lily"}], "max_tokens": 1, "return_prompt_text": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["prompt_text"]


@pytest.mark.parametrize("body, shown", [
    ({}, "|thinking=False|who=server|effort=|"),
    ({"chat_template_kwargs": {"who": "client"}}, "|thinking=False|who=client|effort=|"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "|thinking=True|who=server|effort=|"),
    # the request's own effort turns thinking on over the server's default
    ({"reasoning_effort": "low"}, "|thinking=True|who=server|effort=low|"),
])
def test_default_template_kwargs_sit_under_the_requests_own(url, body, shown):
    assert rendered(url, **body).endswith(shown)


def test_default_enable_thinking_false_reaches_the_reasoning_parser(url):
    """With thinking off by default the qwen3 parser takes the reply as the answer, as when the
    request's chat_template_kwargs turn it off."""
    body = {"messages": [{"role": "user", "content": "Lily"}], "max_tokens": 4, "temperature": 0}
    message = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert message["content"] and message.get("reasoning") is None


def stream_usages(url: str, path: str, body: dict) -> list:
    """The usage field of each chunk of a stream."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        return [event.get("usage") for event in sse_events(response.iter_lines())]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Lily"}]}),
    ("/v1/completions", {"prompt": "Lily"}),
])
@pytest.mark.parametrize("options", [None, {"include_usage": False}, {"continuous_usage_stats": True}])
def test_forced_usage_ends_every_stream(url, path, body, options):
    body = {**body, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    if options is not None:
        body["stream_options"] = options
    usages = stream_usages(url, path, body)
    assert usages[-1]["completion_tokens"] == 3 and usages[-1]["prompt_tokens"] > 0
    if options == {"continuous_usage_stats": True}:        # kept as asked: every chunk carries it
        assert all(u is not None for u in usages)
    else:
        assert all(u is None for u in usages[:-1])


@needs_stories
@pytest.mark.parametrize("value, message", [
    ("[1]", "must be a JSON object"),
    ("{nope", "not valid JSON"),
    ('{"messages": []}', "may not set messages"),
])
def test_bad_default_template_kwargs_are_usage_errors(value, message):
    result = minillm("serve", str(STORIES), "--device", "cpu", "--default-chat-template-kwargs", value)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'--default-chat-template-kwargs'" in result.stderr and message in result.stderr
