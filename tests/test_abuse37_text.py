"""Text from prompt to output through the server, held to vLLM: token names of characters split over byte tokens,
streamed and whole alike."""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import chat_model_dir, running_server, sse_events

EMOJI = "😀"          # four byte-fallback tokens in stories260K's vocabulary: <0xF0> <0x9F> <0x98> <0x80>
CHOICE = f"a {EMOJI} 日本"


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    """One server on stories260K with a chat template."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, engine_core="thread") as (url, _engine):
        yield url


def _post(url: str, path: str, body: dict, stream: bool) -> list[dict]:
    """The choices of one response: the whole one's, or every streamed chunk's."""
    if not stream:
        response = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert response.status_code == 200, response.text[:500]
        return response.json()["choices"]
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()[:500]
        return [c for e in sse_events(response.iter_lines()) for c in e["choices"]]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprob_tokens_of_a_character_in_byte_tokens_as_vllm(server, stream):
    """vLLM names a byte token that leaves a character unfinished "" and the one that completes it by the
    whole character (its Logprob.decoded_token, which LLM.generate gives too); each read U+FFFD, so the
    tokens spelled "a \ufffd\ufffd\ufffd\ufffd ..." instead of the text."""
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "logprobs": 1,
            "structured_outputs": {"choice": [CHOICE]}}
    tokens = [t for c in _post(server, "/v1/completions", body, stream) if c["logprobs"]
              for t in c["logprobs"]["tokens"]]
    assert "".join(tokens) == CHOICE
    assert tokens[2:6] == ["", "", "", EMOJI], tokens
    assert not any("\ufffd" in t for t in tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprob_tokens_and_bytes_of_a_character_in_byte_tokens_as_vllm(server, stream):
    """The same in chat's logprobs, whose bytes are the token's text's (vLLM: decoded_token's UTF-8)."""
    body = {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "temperature": 0, "logprobs": True, "top_logprobs": 1, "structured_outputs": {"choice": [CHOICE]}}
    entries = [e for c in _post(server, "/v1/chat/completions", body, stream) if c.get("logprobs")
               for e in c["logprobs"]["content"]]
    assert "".join(e["token"] for e in entries) == CHOICE
    assert [(e["token"], e["bytes"]) for e in entries[2:6]] == [("", [])] * 3 + [(EMOJI, list(EMOJI.encode()))]
