"""What a check of the chat server against vLLM's left: a whole reply's message and usage carry every
key vLLM's model_dump gives (null where there is nothing), a "thinking" content part is read as text,
an echo repeats the last message as the template got it, and a developer's tools and any message's
task reach the template."""
from __future__ import annotations

import json

import httpx
import pytest
from test_abuse35_api_leftovers import stream_events
from test_server_helpers import chat_model_dir, openai_error, running_server

from minillm import LLM, SamplingParams
from minillm.server.app import ServerOptions

# vLLM's ChatMessage, dumped: an empty tool_calls is left out (vllm-project/vllm#44105), reasoning is
# null unless a reasoning parser split some off.
MESSAGE_KEYS = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
# vLLM's UsageInfo, dumped, in its order.
USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
              "completion_tokens_details"]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
# What the template sees of each message: its role, task, tools and content, one line each.
SHOW_KEYS = ("{% for m in messages %}{{ m.role }}|{{ m.task }}|{% if m.tools is defined %}{{ m.tools | tojson }}{% endif %}|{{ m.content }}\n"
             "{% endfor %}")
# A template that loops over a message's content: vLLM's "auto" hands it the parts as a list.
LOOP_PARTS = ("{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
              "{% for p in m.content %}[{{ p.type }}={{ p.text }}]{% endfor %}{% endif %};{% endfor %}")


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """A server of stories260K with a chat template that renders a request's own template, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    options = ServerOptions(trust_request_chat_template=True)
    with running_server(model, max_model_len=256, options=options) as running:
        yield running[0]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "stories", **body}, timeout=60)


def ok(url: str, path: str, body: dict) -> dict:
    reply = post(url, path, body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def prompt_text(url: str, messages: list[dict], template: str, **body) -> str:
    """The prompt the request's template rendered for messages."""
    reply = ok(url, "/v1/chat/completions", {"messages": messages, "chat_template": template, "max_tokens": 1,
                                             "return_prompt_text": True, **body})
    return reply["prompt_text"]


# ---- the whole reply's message ------------------------------------------------------------------------------

def test_a_whole_reply_message_has_vllms_keys_in_its_order(url):
    # The message had only role and content.
    message = ok(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 3})["choices"][0]["message"]
    assert list(message) == MESSAGE_KEYS
    assert message["role"] == "assistant" and isinstance(message["content"], str) and message["content"]
    assert all(message[key] is None for key in MESSAGE_KEYS[2:])


def test_a_forced_calls_message_has_its_tool_calls_before_the_reasoning(url):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    message = ok(url, "/v1/chat/completions", body)["choices"][0]["message"]
    assert list(message) == MESSAGE_KEYS[:6] + ["tool_calls", "reasoning"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_streamed_reply_keeps_its_deltas_as_they_were(url):
    # vLLM sends chunks exclude_unset: none of a whole message's null keys.
    events = stream_events(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 3})
    deltas = [choice["delta"] for event in events for choice in event["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(delta) <= {"role", "content"} for delta in deltas)


# ---- usage ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "Once upon a time"}),
], ids=["chat", "completions"])
def test_a_whole_replys_usage_has_vllms_keys_in_its_order(url, path, body):
    # prompt_tokens_details (and completion_tokens_details) were left out; vLLM's model_dump has them null.
    usage = ok(url, path, {**body, "max_tokens": 3})["usage"]
    assert list(usage) == USAGE_KEYS
    assert usage["prompt_tokens_details"] is None and usage["completion_tokens_details"] is None
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["completion_tokens"] == 3
    # a stream's usage chunk is sent exclude_unset: the three counts only
    events = stream_events(url, path, {**body, "max_tokens": 3, "stream_options": {"include_usage": True}})
    assert set(events[-1]["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


# ---- "thinking" content parts --------------------------------------------------------------------------------

def test_a_thinking_part_is_read_as_text(url):
    # A 400 before; vLLM's chat_utils reads its thinking as a text part's text (content, not reasoning).
    messages = [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "closed": True},
                                             {"type": "text", "text": "y"}]}]
    assert prompt_text(url, messages, SHOW_KEYS) == "user|||x\ny\n"
    assert prompt_text(url, messages, LOOP_PARTS) == "user:[text=x][text=y];"


@pytest.mark.parametrize("part, field", [
    ({"type": "thinking"}, "thinking"),
    ({"type": "thinking", "thinking": 5}, "thinking"),
], ids=["missing", "not-a-string"])
def test_a_thinking_part_without_its_text_is_a_400_naming_it(url, part, field):
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    openai_error(post(url, "/v1/chat/completions", body), 400, f"messages.0.content.0.{field}")


def test_llm_chat_reads_a_thinking_part_as_text(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=128) as llm:
        messages = [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}, "y"]}]
        [out] = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=SHOW_KEYS)
    assert out.prompt == "user|||x\ny\n"


# ---- echo ----------------------------------------------------------------------------------------------------

def test_an_echo_repeats_the_last_message_as_the_template_got_it(url):
    # The echo joined every part ("\nb"); vLLM echoes its parsed content: the string format drops the
    # empty part, the "openai" format (a template that loops over the parts) keeps it.
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "b"}]}]
    body = {"messages": messages, "echo": True, "add_generation_prompt": False, "max_tokens": 2, "temperature": 0}
    for template, echoed in [(SHOW_KEYS, "b"), (LOOP_PARTS, "\nb")]:
        whole = ok(url, "/v1/chat/completions", {**body, "chat_template": template})["choices"][0]["message"]
        assert whole["content"].startswith(echoed), (template, whole)
        events = stream_events(url, "/v1/chat/completions", {**body, "chat_template": template})
        assert events[0]["choices"][0]["delta"]["content"] == ""    # the role's chunk, then the echo's (vLLM's)
        assert events[1]["choices"][0]["delta"] == {"content": echoed}
        assert whole["content"] == "".join(c["delta"].get("content", "") for e in events for c in e["choices"])


# ---- message keys the template gets --------------------------------------------------------------------------

def test_a_developers_tools_and_any_messages_task_reach_the_template(url):
    # Both were dropped; vLLM passes a developer message's tools (null where it has none) and a task
    # on any role, and no tools of another role's message.
    messages = [{"role": "developer", "content": "d", "tools": TOOLS, "task": "t"},
                {"role": "developer", "content": "e"},
                {"role": "user", "content": "u", "tools": TOOLS, "task": "v"}]
    lines = [line.split("|") for line in prompt_text(url, messages, SHOW_KEYS).splitlines()]
    assert lines[0][:2] == ["developer", "t"] and json.loads(lines[0][2]) == TOOLS and lines[0][3] == "d"
    assert lines[1] == ["developer", "", "", "e"]
    assert lines[2] == ["user", "v", "", "u"]


@pytest.mark.parametrize("message, param", [
    ({"role": "developer", "content": "d", "tools": [{"type": "function", "function": {"description": "no name"}}]},
     "messages.0.tools.0.function.name"),
    ({"role": "developer", "content": "d", "tools": "get_weather"}, "messages.0.tools"),
    ({"role": "user", "content": "u", "task": 5}, "messages.0.task"),
], ids=["tool-without-name", "tools-not-a-list", "task-not-a-string"])
def test_a_bad_developer_tools_or_task_is_a_400_naming_it(url, message, param):
    body = {"messages": [message], "max_tokens": 1}
    openai_error(post(url, "/v1/chat/completions", body), 400, param)
