"""Legacy completions' top_logprobs keyed by token text keep the likeliest of tokens that read alike
(a grammar's byte tokens, a byte-fallback token beside a normal one), and /v1/responses refuses
unknown keys in text.format as the chat path refuses them in response_format."""
from __future__ import annotations

import pytest

from minillm.server.logprobs import TokenTexts, completion_logprobs, prompt_logprob_rows
from test_server_helpers import chat_template_server, openai_error, sse_events  # noqa: F401 (server)

# Under this grammar the first token is "n" (id 416, likeliest) or "y"; a byte token of the same
# text ranks far lower and once took the "n" entry's place in top_logprobs.
YES_NO = {"model": "stories", "prompt": "Once", "max_tokens": 1, "logprobs": 5, "temperature": 0,
          "structured_outputs": {"choice": ["yes", "no"]}}


def _by_id(http, body: dict) -> dict[int, float]:
    """The first position's top_logprobs keyed by token id (return_tokens_as_token_ids)."""
    data = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    top = data["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(name.split(":")[1]): logprob for name, logprob in top.items()}


def _expected_by_text(by_id: dict[int, float], tok) -> dict[str, float]:
    """The likeliest logprob for each token text."""
    out: dict[str, float] = {}
    for token_id, logprob in sorted(by_id.items(), key=lambda kv: -kv[1]):
        out.setdefault(tok.decode([token_id], skip_special_tokens=False), logprob)
    return out


def test_completion_top_logprobs_keep_the_likeliest_of_same_text(http, tok):
    by_id = _by_id(http, YES_NO)
    texts = [tok.decode([token_id], skip_special_tokens=False) for token_id in by_id]
    assert len(set(texts)) < len(texts), f"no two tokens read alike: {by_id}"   # the case under test
    data = http.post("/v1/completions", json=YES_NO).json()
    logprobs = data["choices"][0]["logprobs"]
    top = logprobs["top_logprobs"][0]
    assert top == _expected_by_text(by_id, tok)
    assert top[logprobs["tokens"][0]] == logprobs["token_logprobs"][0]


def test_completion_stream_top_logprobs_keep_the_likeliest_of_same_text(http, tok):
    by_id = _by_id(http, YES_NO)
    with http.stream("POST", "/v1/completions", json={**YES_NO, "stream": True}) as response:
        events = sse_events(response.iter_lines())
    tops = [top for event in events for choice in event["choices"] if choice.get("logprobs")
            for top in choice["logprobs"]["top_logprobs"]]
    assert tops[0] == _expected_by_text(by_id, tok)


def test_chat_top_logprobs_list_tokens_that_read_alike(http):
    # Chat's top_logprobs is a list: each token keeps its own entry, the chosen first.
    body = {"model": "stories", "messages": [{"role": "user", "content": "Once"}], "max_tokens": 1,
            "logprobs": True, "top_logprobs": 5, "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]}}
    top = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(top) == 5
    logprobs = [entry["logprob"] for entry in top]
    assert logprobs == sorted(logprobs, reverse=True)
    texts = [entry["token"] for entry in top]
    assert len(set(texts)) < len(texts), top


def test_echoed_completion_top_logprobs_keep_the_likeliest_of_same_text(http, tok):
    by_id = _by_id(http, YES_NO)
    data = http.post("/v1/completions", json={**YES_NO, "echo": True}).json()
    tops = data["choices"][0]["logprobs"]["top_logprobs"]
    assert tops[0] is None and len(tops) == 3   # <s>, "Once", then the completion's token
    assert tops[-1] == _expected_by_text(by_id, tok)


def test_prompt_top_logprobs_keep_the_likeliest_of_same_text(tok):
    # An echoed prompt's rows: "n" (416) and its byte-fallback twin (113) among a position's alternatives.
    prompt_ids = [1, 403, 416]
    entries = [None, {403: -0.5, 416: -2.0}, {416: -0.25, 113: -1.0, 261: -3.0}]
    rows = prompt_logprob_rows(TokenTexts(tok), prompt_ids, entries, 3, skip_special_tokens=False)
    tops = completion_logprobs(rows)["top_logprobs"]
    assert tops[2] == {"n": -0.25, " a": -3.0}
    assert tops[1] == {" Once": -0.5, "n": -2.0}


RESPONSES = {"model": "stories", "max_output_tokens": 2, "input": "hi"}
DIGIT = {"type": "string", "enum": ["1", "2"]}


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "name": "a", "schema": DIGIT, "extra": 1}, "text.format.extra"),
    ({"type": "json_schema", "name": "a", "schema": DIGIT, "json_schema": {"schema": DIGIT}}, "text.format.json_schema"),
    ({"type": "json_object", "schema": {}}, "text.format.schema"),
    ({"type": "text", "name": "a"}, "text.format.name"),
    ({"type": "json_object", "bad key!": 1}, "text.format"),
])
def test_responses_refuses_unknown_text_format_keys(http, fmt, param):
    response = http.post("/v1/responses", json={**RESPONSES, "text": {"format": fmt}})
    error = openai_error(response, 400, param)
    assert "text.format" in error["message"] and "response_format" not in error["message"], error["message"]


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "name": "a", "schema": DIGIT, "strict": True, "description": "a digit"},
    {"type": "json_object"},
    {"type": "text"},
])
def test_responses_takes_known_text_format_keys(http, fmt):
    response = http.post("/v1/responses", json={**RESPONSES, "text": {"format": fmt}})
    assert response.status_code == 200, response.text
