"""Abuse of allowed_token_ids and bad_words through the Python API and the server.

Each defect found by feeding these fields odd values has its test here: a reused SamplingParams
whose bad words were cleared, and allowed_token_ids lists long enough (alone, or repeated for every
prompt of a batch) to stall the requests in flight while they were validated.
"""
from __future__ import annotations

import pytest
from test_server_helpers import chat_template_server, openai_error, story_streams  # noqa: F401

from minillm import LLM, SamplingParams
from minillm.server.limits import ServerLimits

PROMPT = "Once upon a time"
LIMIT = ServerLimits().max_allowed_token_ids


@pytest.fixture(scope="module")
def llm(stories_path):
    """The Python API on stories260K."""
    return LLM(str(stories_path), device="cpu")


def _greedy_ids(llm, params: SamplingParams) -> list[int]:
    return llm.generate([PROMPT], params)[0].outputs[0].token_ids


@pytest.mark.parametrize("cleared", [None, []])
def test_cleared_bad_words_ban_nothing(llm, cleared):
    """bad_words tokenized with update_from_tokenizer and then cleared on the same params ban nothing."""
    plain = _greedy_ids(llm, SamplingParams(max_tokens=4, temperature=0))
    word = llm.get_tokenizer().decode([plain[1]]).strip()        # a one-token word the greedy output holds
    params = SamplingParams(max_tokens=4, temperature=0, bad_words=[word])
    params.update_from_tokenizer(llm.get_tokenizer())
    assert _greedy_ids(llm, params) != plain
    params.bad_words = cleared
    assert _greedy_ids(llm, params) == plain


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_allowed_token_ids_past_the_limit_are_a_400(http, healthy_stream, path):
    """More allowed_token_ids than the server's limit: a 400 naming the field, nothing validated."""
    body = {"model": "stories", "max_tokens": 2, "allowed_token_ids": [5] * (LIMIT + 1)}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    error = openai_error(http.post(path, json=body), 400, "allowed_token_ids")
    assert str(LIMIT) in error["message"]


def test_allowed_token_ids_count_once_per_prompt(http, healthy_stream):
    """A batch of prompts repeats its allowed_token_ids for each: the limit is on them all."""
    prompts = [[1, 403]] * 4
    body = {"model": "stories", "max_tokens": 2, "prompt": prompts, "allowed_token_ids": [5] * (LIMIT // 4 + 1)}
    openai_error(http.post("/v1/completions", json=body), 400, "allowed_token_ids")
    response = http.post("/v1/completions", json={**body, "allowed_token_ids": [5, 6]})
    assert response.status_code == 200, response.text[:500]
    assert all(set(c["text"]) <= {"\x02", "\x03"} for c in response.json()["choices"])
