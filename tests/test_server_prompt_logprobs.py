"""vLLM's prompt_logprobs, return_token_ids and return_tokens_as_token_ids on /v1/completions and
/v1/chat/completions, streaming and not, in vLLM's shapes.

A real server on loopback (its engine core in its own process unless MINILLM_TEST_ENGINE_CORE says
otherwise, so prompt logprobs and their ranks cross the core's socket), held against the Python API
(LLM.generate) on the same model and against /tokenize. Each test runs with a healthy greedy stream
in flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import re

import pytest
from test_server_helpers import chat_template_server, openai_error, sse_events, story_streams  # noqa: F401

from minillm import LLM, SamplingParams

PROMPTS = ["Once upon a time, Lily saw a big red ball", "Tom and Sue went to the park"]
MESSAGES = [{"role": "user", "content": "Tell me a story about a dog."}]
PLACEHOLDER = re.compile(r"token_id:\d+")


@pytest.fixture(scope="module")
def llm(stories_path):
    """The Python API on the server's model: the reference for values and tokens."""
    return LLM(str(stories_path), device="cpu")


def _ok(response) -> dict:
    assert response.status_code == 200, response.text[:500]
    return response.json()


def _stream(http, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed request (200 asserted), up to [DONE]."""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()[:500]
        lines = list(response.iter_lines())
    assert [line for line in lines if line][-1] == "data: [DONE]"
    return sse_events(lines)


def _chat_prompt_ids(http) -> list[int]:
    return _ok(http.post("/tokenize", json={"messages": MESSAGES}))["tokens"]


def _check_prompt_logprobs(got: list, prompt_ids: list[int], reference) -> None:
    """got (a response's prompt_logprobs) holds LLM.generate's entries, each prompt token first."""
    want = reference.prompt_logprobs
    assert reference.prompt_token_ids == prompt_ids
    assert got[0] is None and want[0] is None and len(got) == len(want) == len(prompt_ids)
    for token, entry, expected in zip(prompt_ids[1:], got[1:], want[1:]):
        assert next(iter(entry)) == str(token)           # the prompt token itself comes first, as in vLLM
        assert set(entry) == {str(t) for t in expected}
        for t, logprob in expected.items():
            assert entry[str(t)] == {"logprob": pytest.approx(logprob.logprob, abs=1e-4), "rank": logprob.rank,
                                     "decoded_token": logprob.decoded_token}


def test_completion_prompt_logprobs_are_the_python_apis_on_each_choice(http, llm, healthy_stream):
    body = _ok(http.post("/v1/completions", json={"prompt": PROMPTS, "n": 2, "max_tokens": 3, "temperature": 0,
                                                  "prompt_logprobs": 2, "return_token_ids": True}))
    references = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice in body["choices"]:
        reference = references[choice["index"] // 2]
        _check_prompt_logprobs(choice["prompt_logprobs"], choice["prompt_token_ids"], reference)
    # The ranks of prompt tokens outside the top 2 came from the core too, not from their place here.
    ranks = [entry[str(t)]["rank"] for t, entry in zip(body["choices"][0]["prompt_token_ids"][1:],
                                                       body["choices"][0]["prompt_logprobs"][1:])]
    assert max(ranks) > 3 and min(ranks) == 1


def test_prompt_logprobs_zero_scores_each_prompt_token_alone(http, llm, healthy_stream):
    [choice] = _ok(http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0,
                                                      "prompt_logprobs": 0, "return_token_ids": True}))["choices"]
    [reference] = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    _check_prompt_logprobs(choice["prompt_logprobs"], choice["prompt_token_ids"], reference)
    assert all(len(entry) == 1 for entry in choice["prompt_logprobs"][1:])


def test_echo_with_logprobs_carries_the_prompt_logprobs_it_shows(http, healthy_stream):
    body = _ok(http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0,
                                                  "echo": True, "logprobs": 1, "return_token_ids": True}))
    [choice] = body["choices"]
    prompt_ids, entries = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) == body["usage"]["prompt_tokens"]
    shown = choice["logprobs"]["token_logprobs"][:len(prompt_ids)]
    assert shown[0] is None and entries[0] is None
    assert shown[1:] == [pytest.approx(entry[str(t)]["logprob"]) for t, entry in zip(prompt_ids[1:], entries[1:])]
    assert all(len(entry) <= 2 for entry in entries[1:])      # the token and logprobs (1) alternative


def test_chat_prompt_logprobs_are_on_the_response(http, llm, healthy_stream):
    body = _ok(http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                                                       "prompt_logprobs": 3}))
    ids = _chat_prompt_ids(http)
    [reference] = llm.generate([{"prompt_token_ids": ids}],
                               SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    _check_prompt_logprobs(body["prompt_logprobs"], ids, reference)
    # vLLM's chat choice has no prompt_logprobs; its prompt_token_ids is null unless return_token_ids asks
    assert "prompt_logprobs" not in body["choices"][0] and body["prompt_token_ids"] is None


def test_completion_token_ids_are_the_prompts_and_the_completions(http, llm, healthy_stream):
    body = _ok(http.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 8, "temperature": 0,
                                                  "return_token_ids": True}))
    references = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    for prompt, choice, reference in zip(PROMPTS, body["choices"], references):
        assert choice["prompt_token_ids"] == _ok(http.post("/tokenize", json={"prompt": prompt}))["tokens"]
        assert choice["token_ids"] == reference.outputs[0].token_ids and choice["text"] == reference.outputs[0].text
        assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                                "prompt_logprobs", "prompt_token_ids", "routed_experts"] and choice["prompt_logprobs"] is None
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])


def test_completion_stream_names_the_prompt_once_and_each_chunks_new_tokens(http, healthy_stream):
    request = {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
               "stop": [" the"], "include_stop_str_in_output": True}
    whole = _ok(http.post("/v1/completions", json=request))["choices"]
    chunks = [c for event in _stream(http, "/v1/completions", request) for c in event["choices"]]
    for choice in whole:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all(c["prompt_token_ids"] is None for c in mine[1:]) and len(mine) > 1
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
        assert "".join(c["text"] for c in mine) == choice["text"]


def test_chat_token_ids_stream_and_not(http, llm, healthy_stream):
    request = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    body = _ok(http.post("/v1/chat/completions", json=request))
    ids = _chat_prompt_ids(http)
    [reference] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8))
    [choice] = body["choices"]
    assert body["prompt_token_ids"] == ids and choice["token_ids"] == reference.outputs[0].token_ids
    assert choice["message"]["content"] == reference.outputs[0].text
    events = _stream(http, "/v1/chat/completions", request)
    assert events[0]["prompt_token_ids"] == ids and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in e for e in events[1:]) and "token_ids" not in events[0]["choices"][0]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == choice["message"]["content"]


def test_completion_logprobs_name_tokens_by_id(http, healthy_stream):
    request = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True,
               "return_token_ids": True, "return_tokens_as_token_ids": True}
    [choice] = _ok(http.post("/v1/completions", json=request))["choices"]
    logprobs = choice["logprobs"]
    every_id = choice["prompt_token_ids"] + choice["token_ids"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in every_id]
    assert all(PLACEHOLDER.fullmatch(name) for top in logprobs["top_logprobs"][1:] for name in top)
    for name, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:]):
        assert name in top
    chunks = [c for e in _stream(http, "/v1/completions", request) for c in e["choices"]]
    assert [name for c in chunks for name in c["logprobs"]["tokens"]] == logprobs["tokens"]


def test_chat_logprobs_name_tokens_by_id(http, healthy_stream):
    request = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2,
               "return_token_ids": True, "return_tokens_as_token_ids": True}
    [choice] = _ok(http.post("/v1/chat/completions", json=request))["choices"]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    for item in content:
        assert item["token"] in [t["token"] for t in item["top_logprobs"]]     # greedy: the likeliest
        assert all(PLACEHOLDER.fullmatch(t["token"]) and bytes(t["bytes"]) == t["token"].encode()
                   for t in item["top_logprobs"])
    # A token's own bytes are its text's, as in vLLM: together they spell the reply.
    assert b"".join(bytes(item["bytes"]) for item in content).decode() == choice["message"]["content"]
    events = _stream(http, "/v1/chat/completions", request)
    streamed = [item for e in events[1:] for item in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
    # (a step batched with other requests may round its values differently)
    assert [(i["token"], i["bytes"]) for i in streamed] == [(i["token"], i["bytes"]) for i in content]
    assert [i["logprob"] for i in streamed] == [pytest.approx(i["logprob"], abs=1e-4) for i in content]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPTS[0]}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
], ids=["completions", "chat"])
def test_a_stream_takes_prompt_logprobs_zero_only_and_carries_none(http, healthy_stream, path, body):
    error = openai_error(http.post(path, json={**body, "max_tokens": 2, "stream": True, "prompt_logprobs": 1}),
                         400, "prompt_logprobs")
    assert "stream" in error["message"]
    events = _stream(http, path, {**body, "max_tokens": 2, "prompt_logprobs": 0})
    assert events and all("prompt_logprobs" not in e and all("prompt_logprobs" not in c for c in e["choices"])
                          for e in events)


BAD = [
    ({"prompt_logprobs": -2}, "prompt_logprobs", "-1"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "greater than max allowed: 20"),    # the whole vocabulary
    ({"prompt_logprobs": 21}, "prompt_logprobs", "greater than max allowed: 20"),
    ({"prompt_logprobs": 10 ** 30}, "prompt_logprobs", "greater than max allowed"),
    ({"prompt_logprobs": "two"}, "prompt_logprobs", "integer"),
    ({"prompt_logprobs": "2.5"}, "prompt_logprobs", "integer"),
    ({"prompt_logprobs": 1.5}, "prompt_logprobs", "integer"),
    ({"return_token_ids": "sure"}, "return_token_ids", "boolean"),
    ({"return_tokens_as_token_ids": 2}, "return_tokens_as_token_ids", "boolean"),
]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,param,says", BAD, ids=[f"{next(iter(f))}={f[next(iter(f))]!r}" for f, _, _ in BAD])
def test_bad_values_are_400s_naming_the_field(http, healthy_stream, path, body, fields, param, says):
    error = openai_error(http.post(path, json={**body, **fields}), 400, param)
    assert says in error["message"]


def test_the_largest_prompt_logprobs_allowed_and_null_options_pass(http, healthy_stream):
    [choice] = _ok(http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 1, "prompt_logprobs": 20,
                                                      "return_token_ids": None,
                                                      "return_tokens_as_token_ids": None}))["choices"]
    assert [len(entry) for entry in choice["prompt_logprobs"][1:]] in ([20], [21])
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None      # null where not asked, as vLLM's
