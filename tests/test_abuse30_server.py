"""`minillm serve` as real clients use it: Anthropic's Messages API, /metrics against vLLM's names.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

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
