"""/v1/completions and /v1/chat/completions abused the way vLLM clients use them, with a greedy
stream in flight throughout: a prompt and max_tokens past the context are a 400 in vLLM's words
(clients parse "maximum context length is N tokens ... your prompt contains N input tokens"), and
every malformed field is a 400 naming it."""
from __future__ import annotations

import json
import re

import pytest
from test_server_helpers import chat_template_server, openai_error, story_streams  # noqa: F401 (fixtures)

USER = {"role": "user", "content": "Once upon"}

# vLLM's serving layer: the request's output tokens past what the context leaves the prompt
VLLM_OVERFLOW = re.compile(
    r"This model's maximum context length is (?P<limit>\d+) tokens\. However, you requested (?P<out>\d+) output "
    r"tokens and your prompt contains (?P<inp>\d+) input tokens, for a total of (?P<total>\d+) tokens "
    r"\((?P=inp) \+ (?P=out) = (?P=total) > (?P=limit)\)\. Please reduce the length of the input prompt or the "
    r"number of requested output tokens\.")


def post(http, path: str, body: dict):
    return http.post(path, json={"model": "stories", **body})


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 300}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [USER], "max_tokens": 300}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [USER], "max_completion_tokens": 300}, "max_completion_tokens"),
], ids=["completions", "chat", "chat_max_completion_tokens"])
def test_max_tokens_past_the_context_is_vllms_400(http, healthy_stream, path, body, param):
    error = openai_error(post(http, path, body), 400, param, "context_length_exceeded")
    match = VLLM_OVERFLOW.fullmatch(error["message"])
    assert match, error["message"]
    assert (int(match["limit"]), int(match["out"])) == (256, 300)
    assert int(match["total"]) == int(match["inp"]) + 300


def test_a_prompt_that_fills_the_context_is_vllms_400(http, healthy_stream):
    error = openai_error(post(http, "/v1/completions", {"prompt": [1] * 256, "max_tokens": 1}), 400, "prompt",
                         "context_length_exceeded")
    assert error["message"] == ("This model's maximum context length is 256 tokens. However, your request has "
                                "256 input tokens. Please reduce the length of the input messages.")


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["Once", [1, 2]]}, "prompt"),
    ({"prompt": [1, 512]}, "prompt"),
    ({"prompt": [[1, -3]]}, "prompt"),
    ({"prompt": "Once", "suffix": "end"}, "suffix"),
    ({"prompt": "Once", "best_of": 3, "n": 2}, "best_of"),
    ({"prompt": "Once", "logprobs": 21}, "logprobs"),
    ({"prompt": "Once", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "Once", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "Once", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
    ({"prompt": "Once", "seed": 2 ** 64}, "seed"),
    ({"prompt": "Once", "user": 5}, "user"),
    ({"prompt": "Once", "stream": True, "stream_options": {"include_usage": [1]}}, "stream_options.include_usage"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [USER, {"role": "assistant", "content": "a"}], "continue_final_message": True},
     "continue_final_message"),
])
def test_bad_fields_are_400s_naming_them(http, healthy_stream, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    openai_error(post(http, path, {"max_tokens": 2, **body}), 400, param)


def test_streamed_choices_of_several_prompts_are_numbered_prompt_index_times_n(http, healthy_stream):
    body = {"prompt": ["Once upon", "Tom had", "The dog"], "n": 3, "max_tokens": 3, "stream": True, "seed": 1,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/completions", json={"model": "stories", **body}) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    texts = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == list(range(9))
    alone = post(http, "/v1/completions", {**body, "prompt": "Tom had", "stream": False, "stream_options": None})
    # the second prompt's choices are 3..5, each the completion the prompt alone gets with the same seed
    assert [texts[3 + c["index"]] for c in alone.json()["choices"]] == [c["text"] for c in alone.json()["choices"]]
    assert all(chunk["usage"] is not None for chunk in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 27
