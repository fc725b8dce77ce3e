"""`minillm serve` under odd but legal requests, malformed HTTP, and signals, held to vLLM's server.

A real server on loopback with a chat template and max_model_len 256; each test that talks to it
runs with a healthy greedy stream in flight, and every such stream must end with the text of the
same request made alone.
"""
from __future__ import annotations

import pytest
from test_server_helpers import openai_error, sse_events
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"
MAX_MODEL_LEN = 256          # the chat_template_server's


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, **fields}


# ---- echo without generation of a prompt that fills the context -------------------------------

def _full_context_prompt(http) -> tuple[list[int], dict]:
    """A prompt of MAX_MODEL_LEN tokens whose last token is the greedy choice after the others, and
    what a one-token completion with echo says of it: its text, the last token's logprob and top."""
    head = [1] + [300, 301, 302] * ((MAX_MODEL_LEN - 2) // 3) + [300] * ((MAX_MODEL_LEN - 2) % 3)
    assert len(head) == MAX_MODEL_LEN - 1
    reply = http.post("/v1/completions", json=_completion(prompt=head, max_tokens=1, logprobs=2, echo=True,
                                                          return_token_ids=True))
    assert reply.status_code == 200, reply.text
    [choice] = reply.json()["choices"]
    return head + choice["token_ids"], {"text": choice["text"], "token_logprob": choice["logprobs"]["token_logprobs"][-1],
                                        "top": choice["logprobs"]["top_logprobs"][-1]}


def _same_logprobs(a: dict, b: dict) -> bool:
    """Two legacy logprobs objects alike: the same tokens and offsets, the numbers within float noise
    (a batch of other shape sums in another order)."""
    assert (a["tokens"], a["text_offset"]) == (b["tokens"], b["text_offset"])
    assert [x is None for x in a["token_logprobs"]] == [x is None for x in b["token_logprobs"]]
    for x, y in zip(a["token_logprobs"][1:], b["token_logprobs"][1:]):
        assert x == pytest.approx(y, abs=1e-4)
    for x, y in zip(a["top_logprobs"][1:], b["top_logprobs"][1:]):
        assert x == pytest.approx(y, abs=1e-4)
    return True


def test_echo_of_a_prompt_as_long_as_the_context_with_max_tokens_0_is_served_as_in_vllm(http, healthy_stream):
    # vLLM takes echo with max_tokens 0 for a prompt of max_model_len tokens (it fits, and nothing is
    # generated); it was a 400 here, the engine keeping room for a token a prompt.
    prompt, last = _full_context_prompt(http)
    text = last["text"]
    body = _completion(prompt=prompt, max_tokens=0, echo=True)
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    [choice] = reply.json()["choices"]
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]) == (text, "length", None)
    assert reply.json()["usage"] == {"prompt_tokens": MAX_MODEL_LEN, "completion_tokens": 0,
                                     "total_tokens": MAX_MODEL_LEN}
    # Scored: each prompt token, its last one as the model scores it after the others.
    reply = http.post("/v1/completions", json={**body, "logprobs": 2, "n": 2})
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and _same_logprobs(choices[0]["logprobs"], choices[1]["logprobs"])
    logprobs = choices[0]["logprobs"]
    assert len(logprobs["tokens"]) == MAX_MODEL_LEN and logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][-1] == pytest.approx(last["token_logprob"], abs=1e-4)
    assert logprobs["top_logprobs"][-1] == pytest.approx(last["top"], abs=1e-4)
    # The same in a stream, and vLLM's prompt_logprobs and token ids.
    reply = http.post("/v1/completions", json={**body, "logprobs": 2, "stream": True})
    [chunk] = sse_events(reply.text.splitlines())
    assert chunk["choices"][0]["text"] == text and _same_logprobs(chunk["choices"][0]["logprobs"], logprobs)
    reply = http.post("/v1/completions", json={**body, "prompt_logprobs": 1, "return_token_ids": True})
    [choice] = reply.json()["choices"]
    assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == []
    assert len(choice["prompt_logprobs"]) == MAX_MODEL_LEN
    assert choice["prompt_logprobs"][-1][str(prompt[-1])]["logprob"] == pytest.approx(last["token_logprob"], abs=1e-4)
    # One token more does not fit; nor does a completion after a full context.
    openai_error(http.post("/v1/completions", json={**body, "prompt": prompt + [300]}), 400, "prompt")
    openai_error(http.post("/v1/completions", json={**body, "max_tokens": 1}), 400, "prompt")
    openai_error(http.post("/v1/completions", json={**body, "echo": False}), 400, "max_tokens")
