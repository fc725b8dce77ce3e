"""`minillm serve --reasoning-parser` and `--enable-auto-tool-choice --tool-call-parser`: the flags, and
chat replies through them on one engine served by apps with and without the parsers. stories260K writes
no tags, so its replies show the wiring (a reply without </think> is all reasoning to deepseek_r1, all
content to qwen3 with thinking off; tool_choice "auto" is served); test_output_parsers.py holds the
parsers to replies that carry tags, whole and streamed."""
from __future__ import annotations

import httpx
import pytest
from test_cli import needs_stories
from test_serve_vllm_flags import serve, started  # noqa: F401 (the started fixture)
from test_server_helpers import chat_model_dir, openai_error, running_server, sse_events

from minillm.server.app import ServerOptions, ServerThread, create_app

MESSAGES = [{"role": "user", "content": "Tom had a red ball."}]
# The keys of vLLM's ChatMessage a whole reply's message carries as null here.
NULL_MESSAGE_FIELDS = {"refusal": None, "annotations": None, "audio": None, "function_call": None}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


# ---- the command line -----------------------------------------------------------------------------

@needs_stories
def test_the_flags_reach_the_server_options(capsys, started):
    assert serve(capsys, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                 "--tool-call-parser", "hermes") == (0, "")
    assert (started["options"].reasoning_parser, started["options"].tool_call_parser) == ("qwen3", "hermes")
    assert serve(capsys) == (0, "")
    assert (started["options"].reasoning_parser, started["options"].tool_call_parser) == (None, None)


@needs_stories
def test_auto_tool_choice_without_a_parser_is_a_usage_error(capsys, started):
    status, err = serve(capsys, "--enable-auto-tool-choice")
    assert status == 2 and not started
    assert "--enable-auto-tool-choice requires --tool-call-parser" in err


@needs_stories
def test_a_parser_without_auto_tool_choice_is_taken_and_said_to_change_nothing(capsys, started):
    status, err = serve(capsys, "--tool-call-parser", "llama3_json")
    assert status == 0 and started["options"].tool_call_parser is None
    assert err.strip() == ('minillm serve: --tool-call-parser llama3_json takes effect with --enable-auto-tool-choice '
                           'only; tool_choice "auto" stays refused')


@needs_stories
@pytest.mark.parametrize("flags", [("--reasoning-parser", "granite"), ("--tool-call-parser", "pythonic")])
def test_an_unknown_parser_is_a_usage_error(capsys, started, flags):
    status, err = serve(capsys, *flags)
    assert status == 2 and f"Invalid value for '{flags[0]}'" in err


def test_server_options_refuse_unknown_parsers():
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ServerOptions(reasoning_parser="granite")
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        ServerOptions(tool_call_parser="mistral")


# ---- replies ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(stories_path, tmp_path_factory):
    """{"plain", "r1", "qwen3"}: URLs of three apps over one engine: no parsers; deepseek_r1 with the
    hermes tool parser; qwen3."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as (url, engine):
        r1 = ServerThread(create_app(engine, ServerOptions(served_model_name="stories", reasoning_parser="deepseek_r1",
                                                           tool_call_parser="hermes"))).start()
        qwen3 = ServerThread(create_app(engine, ServerOptions(served_model_name="stories",
                                                              reasoning_parser="qwen3"))).start()
        yield {"plain": url, "r1": r1.url, "qwen3": qwen3.url}
        r1.stop()
        qwen3.stop()


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"model": "stories", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, **body})


def streamed(url: str, **body) -> tuple[list[dict], str | None]:
    """The deltas of a streamed chat reply, and its finish reason."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": "stories", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "stream": True,
            **body}) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    choices = [c for e in events for c in e["choices"]]
    return [c["delta"] for c in choices], choices[-1]["finish_reason"]


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def test_a_reply_without_an_end_of_thinking_is_all_reasoning_to_deepseek_r1(servers):
    text = chat(servers["plain"]).json()["choices"][0]["message"]["content"]
    assert text
    reply = chat(servers["r1"]).json()["choices"][0]
    assert reply["message"] == {"role": "assistant", "content": None, **NULL_MESSAGE_FIELDS, "reasoning": text,
                                "reasoning_content": text}
    assert reply["finish_reason"] == "length"
    deltas, finish = streamed(servers["r1"])
    assert joined(deltas, "reasoning") == joined(deltas, "reasoning_content") == text
    assert joined(deltas, "content") == "" and finish == "length"
    assert chat(servers["plain"]).json()["choices"][0]["message"]["reasoning"] is None


def test_qwen3_with_thinking_off_gives_the_reply_as_content(servers):
    text = chat(servers["plain"]).json()["choices"][0]["message"]["content"]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(servers["qwen3"], **off).json()["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == (text, None)
    deltas, _ = streamed(servers["qwen3"], **off)
    assert joined(deltas, "content") == text and joined(deltas, "reasoning") == ""
    assert chat(servers["qwen3"]).json()["choices"][0]["message"]["reasoning"] == text   # thinking on: reasoning


def test_include_reasoning_false_leaves_the_reasoning_out(servers):
    message = chat(servers["r1"], include_reasoning=False).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, **NULL_MESSAGE_FIELDS, "reasoning": None}
    deltas, _ = streamed(servers["r1"], include_reasoning=False)
    assert all("reasoning" not in d for d in deltas)


def test_tool_choice_auto_is_served_with_a_tool_call_parser_only(servers):
    openai_error(chat(servers["plain"], tools=TOOLS), 400, "tool_choice")
    openai_error(chat(servers["qwen3"], tools=TOOLS, tool_choice="auto"), 400, "tool_choice")
    text = chat(servers["plain"], tools=TOOLS, tool_choice="none").json()["choices"][0]["message"]["content"]
    reply = chat(servers["r1"], tools=TOOLS, chat_template_kwargs={}).json()["choices"][0]
    # no <tool_call> in the reply: no calls, the reply's own finish reason
    assert reply["message"]["reasoning"] == text and "tool_calls" not in reply["message"]
    assert reply["finish_reason"] == "length"
    deltas, finish = streamed(servers["r1"], tools=TOOLS, tool_choice="auto")
    assert joined(deltas, "reasoning") == text and finish == "length"
    assert not any("tool_calls" in d for d in deltas)


def test_a_constrained_reply_is_all_content(servers):
    # response_format under a reasoning parser holds what follows </think>, which must be a token: not so here
    body = {"response_format": {"type": "json_object"}, "max_tokens": 24}
    response = chat(servers["r1"], **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"
    message = chat(servers["plain"], **body).json()["choices"][0]["message"]
    assert message["content"] and message["content"].lstrip().startswith("{") and message["reasoning"] is None
    # a forced call too: the model reasons first (test_abuse34_reasoning_switch serves one with the tokens)
    forced = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    response = chat(servers["r1"], **forced)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    message = chat(servers["plain"], **forced).json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather" and message["reasoning"] is None
