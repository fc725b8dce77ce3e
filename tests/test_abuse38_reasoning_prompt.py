"""A prompt that closed the thinking block itself (a template ending in <think></think>, as Qwen3's with
enable_thinking false and DeepSeek-V3.1's with thinking false end): vLLM asks the reasoning parser
whether the prompt ended the reasoning (is_reasoning_end); here the prompt must end in </think>, and
then the whole reply is the answer. stories260K spells the tags in several tokens, so the prompt is read as text."""
from __future__ import annotations

import json

import httpx
import pytest
from test_abuse34_parsers import grammar_of, install_script
from test_server_helpers import call_utility, running_server

from minillm.server.app import ServerOptions
from minillm.server.reasoning_parsers import reasoning_ended_in_prompt

# DeepSeek-V3.1's switch: the generation prompt closes an empty thinking block unless thinking is true.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}{% if thinking %}<think>{% else %}<think></think>{% endif %}{% endif %}")


@pytest.mark.parametrize("prompt, ended", [
    ("user: hi\nassistant: <think></think>", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", True),
    ("user: hi\nassistant: <think>", False),
    ("<think>old</think>done\nuser: hi\nassistant: <think>\n", False),     # an earlier turn's finished block
    ("<think>old</think>done\nuser: hi\nassistant:", False),              # an agent loop's history (Qwen3)
    ("<|im_start|>assistant\n<think>\nplan\n</think>\n\n<tool_call>{}</tool_call><|im_end|>\n"
     "<|im_start|>user\n<tool_response>4</tool_response><|im_end|>\n<|im_start|>assistant\n", False),
    ("user: hi\nassistant: </think>", True),                              # DeepSeek-V3.1's thinking false
    ("</think>x<think>", False),
    ("user: hi\nassistant:", False),
    ("", False),
])
def test_the_prompts_last_think_tag_decides(prompt, ended):
    assert reasoning_ended_in_prompt(prompt) is ended


@pytest.mark.parametrize("prompt, ended", [
    ("user: q\nassistant: <think>x</think> and the dog", True),      # the continued message closed it
    ("user: q\nassistant: <think>x", False),
    ("<think>x</think>\nuser: q\nassistant: <think>y", False),
])
def test_a_continued_message_is_read_to_its_last_think_tag(prompt, ended):
    assert reasoning_ended_in_prompt(prompt, continues_message=True) is ended


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K scripted to a reply, with --reasoning-parser deepseek_r1 and TEMPLATE."""
    options = ServerOptions(chat_template=TEMPLATE, reasoning_parser="deepseek_r1")
    with running_server(stories_path, max_model_len=512, options=options, core_hook=install_script) as running:
        yield running


def post(url: str, path: str, **body) -> dict:
    response = httpx.post(f"{url}{path}", timeout=60, json={"model": "stories", "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat(url: str, content: str = "hi", **body) -> dict:
    return post(url, "/v1/chat/completions", messages=[{"role": "user", "content": content}], max_tokens=100, **body)


def streamed_chat(url: str, **body) -> tuple[str, str, dict]:
    """(content, reasoning, final usage) of a streamed chat completion."""
    content, reasoning, usage = "", "", None
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **body}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    content += choice["delta"].get("content") or ""
                    reasoning += choice["delta"].get("reasoning") or ""
    return content, reasoning, usage


def test_a_prompt_that_closed_the_thinking_makes_the_whole_reply_content(server):
    # It came back as reasoning "hello" and content null, its 1+ tokens counted as reasoning.
    url, engine = server
    call_utility(engine, "script", "grammar", grammar_of("hello"))
    body = chat(url)
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == ("hello", None)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    content, reasoning, usage = streamed_chat(url, stream_options={"include_usage": True,
                                                                   "continuous_usage_stats": True})
    assert (content, reasoning, usage["completion_tokens_details"]) == ("hello", "", {"reasoning_tokens": 0})


def test_an_open_think_after_an_earlier_finished_block_still_reasons(server):
    # The template's open <think> is the prompt's last tag: the earlier turn's </think> does not end this one.
    url, engine = server
    call_utility(engine, "script", "grammar", grammar_of("plan</think>answer"))
    body = chat(url, "<think>old</think>done", chat_template_kwargs={"thinking": True})
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == ("answer", "plan")
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    content, reasoning, _ = streamed_chat(url, chat_template_kwargs={"thinking": True})
    assert (content, reasoning) == ("answer", "plan")
    # Thinking off: the whole reply, </think> and all, is the answer, as vLLM's stream and whole reply give it.
    assert chat(url)["choices"][0]["message"]["content"] == "plan</think>answer"


def test_the_prompt_the_engine_gets_decides_after_truncation(server):
    # truncate_prompt_tokens keeps the prompt's last tokens: a </think> cut off no longer ends the reasoning.
    url, engine = server
    call_utility(engine, "script", "grammar", grammar_of("hello"))
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "<think>x</think> and the little dog was very happy"}]
    whole = dict(messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert post(url, "/v1/chat/completions", **whole)["choices"][0]["message"]["content"] == "hello"
    cut = post(url, "/v1/chat/completions", truncate_prompt_tokens=3, **whole)["choices"][0]["message"]
    assert (cut["content"], cut["reasoning"]) == (None, "hello")


def test_a_structure_after_a_closed_prompt_holds_the_reply_from_its_first_token(server):
    # Thinking open, a structure waits for </think>, which must then be one token (a 400 here); the
    # closed prompt needs no tag at all: the reply is the structure, whole as the content.
    url, engine = server
    call_utility(engine, "script", "grammar", grammar_of('{"a": 1}'))
    fmt = {"type": "json_object"}
    refused = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
        "response_format": fmt, "chat_template_kwargs": {"thinking": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format", refused.text
    message = chat(url, response_format=fmt)["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == ('{"a": 1}', None)


def test_responses_and_messages_give_the_reply_as_text(server):
    url, engine = server
    call_utility(engine, "script", "grammar", grammar_of("hello"))
    response = post(url, "/v1/responses", input="hi", max_output_tokens=50)
    assert [item["type"] for item in response["output"]] == ["message"], response["output"]
    assert response["output"][0]["content"][0]["text"] == "hello"
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    reply = post(url, "/v1/messages", max_tokens=50, messages=[{"role": "user", "content": "hi"}])
    assert reply["content"] == [{"type": "text", "text": "hello"}], reply
    thinking = post(url, "/v1/messages", max_tokens=50, messages=[{"role": "user", "content": "hi"}],
                    chat_template_kwargs={"thinking": True})
    assert [(block["type"], block.get("thinking")) for block in thinking["content"]] == [("thinking", "hello")]
