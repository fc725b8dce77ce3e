"""`minillm serve` as real clients use it: Anthropic's Messages API, /metrics against vLLM's names.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import json

from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"


def test_a_final_assistant_message_is_continued_as_anthropic_prefills(http, healthy_stream):
    # Anthropic's Messages API continues a final assistant message (a prefill): the reply goes on from
    # its text. The conversation was rendered with a new assistant turn after it instead, so the
    # prefill was a finished message the reply ignored.
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
    continued = {"model": MODEL, "messages": messages, "add_generation_prompt": False,
                 "continue_final_message": True}
    prompt_ids = http.post("/tokenize", json=continued).json()["tokens"]
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": messages}
    assert http.post("/v1/messages/count_tokens", json=body).json() == {"input_tokens": len(prompt_ids)}
    chat = http.post("/v1/chat/completions", json={**continued, "max_tokens": 4, "temperature": 0}).json()
    reply = http.post("/v1/messages", json=body).json()
    assert reply["content"] == [{"type": "text", "text": chat["choices"][0]["message"]["content"]}], reply
    usage = reply["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(prompt_ids), usage


NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
               "additionalProperties": False}


def test_messages_output_config_format_holds_the_reply_to_its_json_schema(http, healthy_stream):
    # Anthropic's structured outputs (output_config.format, what the SDK's messages.parse sends) were
    # logged as an unknown field and ignored: the reply was free text that the client failed to parse.
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": "Name?"}],
            "output_config": {"format": {"type": "json_schema", "schema": NAME_SCHEMA}}}
    reply = http.post("/v1/messages", json=body).json()
    [block] = reply["content"]
    assert block["type"] == "text" and set(json.loads(block["text"])) == {"name"}, reply
    assert reply["stop_reason"] == "end_turn", reply
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        deltas = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
    text = "".join(e["delta"]["text"] for e in deltas if e["type"] == "content_block_delta")
    assert text == block["text"]


def test_messages_output_config_errors_name_its_fields(http, healthy_stream):
    def error(output_config) -> dict:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                "output_config": output_config}
        response = http.post("/v1/messages", json=body)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert error({"format": {"type": "xml", "schema": {}}})["param"] == "output_config.format.type"
    assert error({"format": {"type": "json_schema"}})["param"] == "output_config.format.schema"
    assert error({"format": "json"})["param"] == "output_config.format"
    assert error([1])["param"] == "output_config"
    bad_schema = error({"format": {"type": "json_schema", "schema": {"type": "bogus"}}})
    assert bad_schema["param"] == "output_config.format.schema", bad_schema
    assert "response_format" not in bad_schema["message"] and "bogus" in bad_schema["message"], bad_schema
