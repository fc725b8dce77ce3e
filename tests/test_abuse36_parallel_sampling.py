"""Parallel sampling (n > 1) on a real server as vLLM's clients use it: bounds, choice indices, seeds, usage."""
from __future__ import annotations

import pytest

from test_server_helpers import openai_error
from test_server_helpers import chat_template_server  # noqa: F401 (the server fixture)

MODEL = "stories"
PROMPTS = ["Once upon a time", "The little dog"]


@pytest.mark.parametrize("n", [0, -3])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_below_one_is_refused_without_the_offline_bound(http, path, n):
    # n 0 was refused with SamplingParams' offline range ("an integer in [1, 4096]"), a bound the
    # server does not take (--max-n is 128): the client was told n=4096 would do. vLLM: "at least 1".
    body = {"model": MODEL, "n": n, "max_tokens": 2}
    body.update({"prompt": PROMPTS} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    error = openai_error(http.post(path, json=body), 400, param="n")
    assert error["message"] == f"n must be at least 1, got {n}", error


def test_choices_of_several_prompts_are_indexed_and_seeded_as_vllm_does(http):
    # vLLM: choice prompt_index * n + i; the i-th completion of a seeded request samples with seed + i;
    # usage counts each prompt's tokens once and every choice's completion tokens.
    n, seed = 3, 41
    body = {"model": MODEL, "prompt": PROMPTS, "n": n, "seed": seed, "max_tokens": 8}
    reply = http.post("/v1/completions", json=body).json()
    choices = reply["choices"]
    assert [c["index"] for c in choices] == list(range(n * len(PROMPTS)))
    prompt_tokens = completion_tokens = 0
    for pi, prompt in enumerate(PROMPTS):
        for i in range(n):
            solo = http.post("/v1/completions", json={**body, "prompt": prompt, "n": 1, "seed": seed + i}).json()
            assert choices[pi * n + i]["text"] == solo["choices"][0]["text"], (pi, i)
            completion_tokens += solo["usage"]["completion_tokens"]
        prompt_tokens += solo["usage"]["prompt_tokens"]
    assert len({c["text"] for c in choices[:n]}) > 1, choices     # the n samples differ
    assert reply["usage"]["prompt_tokens"] == prompt_tokens
    assert reply["usage"]["completion_tokens"] == completion_tokens
