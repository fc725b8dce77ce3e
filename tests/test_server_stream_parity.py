"""A streamed response is the non-streamed one cut into deltas: for /v1/completions and
/v1/chat/completions, the deltas of each choice add up to its text, and finish_reason,
stop_reason, logprobs and usage (stream_options.include_usage) are the same, under n > 1 with a
seed, stop strings over several tokens (kept or not), min_tokens, echo, and characters that the
model writes as several byte tokens (a regex forces them). No delta holds U+FFFD where the text
has a real character.
"""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import CHAT_TEMPLATE, running_server, sse_events

from minillm.server.app import ServerOptions

MODEL = "stories"
WIDE = "ab\u4e2d\u6587x\U0001F600yz"           # CJK and an emoji: stories260K spells them in byte tokens


@pytest.fixture(scope="module")
def http(stories_path):
    with running_server(stories_path, served_model_name=MODEL,
                        options=ServerOptions(chat_template=CHAT_TEMPLATE)) as (url, _engine):
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client


def _streamed(http: httpx.Client, path: str, body: dict) -> tuple[dict, dict]:
    """(the non-streamed response, the stream folded into the same shape)."""
    # Both read the prompt from the prefix cache alike: a prompt computed in other chunks rounds the
    # last digits of its logprobs differently, whichever test ran before.
    assert http.post(path, json={**body, "stream": False}).status_code == 200
    whole = http.post(path, json={**body, "stream": False})
    assert whole.status_code == 200, whole.text
    is_chat = path.endswith("chat/completions")
    with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    choices: dict[int, dict] = {}
    usage = None
    for event in events:
        if event.get("usage") is not None:
            assert not event["choices"] and usage is None     # one usage chunk, the last, with no choices
            usage = event["usage"]
        for c in event["choices"]:
            folded = choices.setdefault(c["index"], {"text": "", "finish_reason": None, "stop_reason": None,
                                                     "logprobs": []})
            delta = (c["delta"].get("content") or "") if is_chat else c["text"]
            assert "\ufffd" not in delta, (delta, body)
            folded["text"] += delta
            if c.get("logprobs"):
                folded["logprobs"] += c["logprobs"]["content"] if is_chat else list(zip(
                    c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"], c["logprobs"]["text_offset"]))
            if c.get("finish_reason") is not None:
                assert folded["finish_reason"] is None          # once a choice
                folded["finish_reason"], folded["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    return whole.json(), {"choices": choices, "usage": usage}


def _assert_same(whole: dict, streamed: dict, is_chat: bool) -> None:
    assert sorted(streamed["choices"]) == [c["index"] for c in whole["choices"]]
    for c in whole["choices"]:
        s = streamed["choices"][c["index"]]
        assert s["text"] == (c["message"]["content"] if is_chat else c["text"])
        assert (s["finish_reason"], s["stop_reason"]) == (c["finish_reason"], c["stop_reason"])
        if c["logprobs"] is None:
            assert s["logprobs"] == []
        elif is_chat:
            assert s["logprobs"] == c["logprobs"]["content"]
        else:
            lp = c["logprobs"]
            assert s["logprobs"] == list(zip(lp["tokens"], lp["token_logprobs"], lp["text_offset"]))
    # the whole response's usage also has vLLM's details as null, which a stream's usage chunk leaves out
    assert streamed["usage"] == {key: value for key, value in whole["usage"].items() if value is not None}


COMPLETION_CASES = [
    {},
    {"n": 3, "temperature": 1.0, "seed": 5},
    {"stop": ["little girl"]},
    {"stop": ["little girl"], "include_stop_str_in_output": True},
    {"n": 2, "temperature": 1.0, "seed": 1, "stop": ["the"], "logprobs": 2},
    {"echo": True, "logprobs": 1, "stop": ["named"]},
    {"echo": True, "max_tokens": 0, "logprobs": 0},
    {"min_tokens": 10, "stop": [","]},
    {"stop_token_ids": [298], "include_stop_str_in_output": True},
    {"logit_bias": {"2": 100}, "min_tokens": 3},
]


@pytest.mark.parametrize("fields", COMPLETION_CASES, ids=[str(sorted(c)) for c in COMPLETION_CASES])
def test_completion_stream_adds_up_to_the_response(http, fields):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, **fields}
    whole, streamed = _streamed(http, "/v1/completions", body)
    _assert_same(whole, streamed, is_chat=False)


CHAT_CASES = [
    {},
    {"n": 3, "temperature": 1.0, "seed": 5},
    {"stop": ["play with"], "include_stop_str_in_output": True},
    {"logprobs": True, "top_logprobs": 2, "stop": ["ball"]},
    {"min_tokens": 6, "stop": ["."]},
]


@pytest.mark.parametrize("fields", CHAT_CASES, ids=[str(sorted(c)) for c in CHAT_CASES])
def test_chat_stream_adds_up_to_the_response(http, fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tom had a red ball."}], "max_tokens": 40,
            "temperature": 0, **fields}
    whole, streamed = _streamed(http, "/v1/chat/completions", body)
    _assert_same(whole, streamed, is_chat=True)


WIDE_CASES = [
    ({}, WIDE, None),
    ({"stop": ["\u4e2d"], "include_stop_str_in_output": True}, "ab\u4e2d", "\u4e2d"),
    ({"stop": ["x\U0001F600y"]}, "ab\u4e2d\u6587", "x\U0001F600y"),
    ({"stop": ["\U0001F600"], "include_stop_str_in_output": True}, "ab\u4e2d\u6587x\U0001F600", "\U0001F600"),
    ({"min_tokens": 3, "stop": ["a", "\u4e2d"]}, "ab", "\u4e2d"),      # 'a' comes before min_tokens
]


@pytest.mark.parametrize("fields, text, stop_reason", WIDE_CASES, ids=[str(c[0]) for c in WIDE_CASES])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_characters_of_several_byte_tokens_stream_whole(http, path, fields, text, stop_reason):
    body = {"model": MODEL, "max_tokens": 30, "temperature": 0, "structured_outputs": {"regex": WIDE}, **fields}
    body.update({"messages": [{"role": "user", "content": "Say it."}]} if "chat" in path else {"prompt": "Tom said"})
    is_chat = "chat" in path
    whole, streamed = _streamed(http, path, body)
    _assert_same(whole, streamed, is_chat)
    [choice] = whole["choices"]
    assert (choice["message"]["content"] if is_chat else choice["text"]) == text
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_reason
    assert whole["usage"]["completion_tokens"] > len(text)          # some characters took several tokens


def test_seeded_choices_are_distinct_and_repeat_whatever_runs_beside_them(http):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30, "temperature": 1.0, "n": 3, "seed": 5}
    first = [c["text"] for c in http.post("/v1/completions", json=body).json()["choices"]]
    assert len(set(first)) == 3
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Lily", "max_tokens": 200,
                                                      "temperature": 1.0, "n": 4, "stream": True}) as beside:
        next(beside.iter_lines())                           # the other request is running
        again = [c["text"] for c in http.post("/v1/completions", json=body).json()["choices"]]
    assert again == first
