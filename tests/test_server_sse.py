"""The streamed chunks written from templates are byte for byte the JSON the generic encoder writes."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.server.serving import (
    ChunkFormat, content_choice_json, json_dumps, json_text, sse, text_choice_json,
)

# Text a detokenizer can hand out: any characters but lone surrogates (which no UTF-8 decode makes).
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
AWKWARD = ["", " hello", 'quote " and back\\slash', "new\nline\ttab\r\x00\x01\x1f", "\u2028\u2029", "é中文😀",
           "</script>", "\x7f"]


@pytest.mark.parametrize("text", AWKWARD)
def test_json_text_is_what_json_dumps_writes(text):
    assert json_text(text) == json_dumps(text)
    assert json.loads(json_text(text)) == text


@given(TEXT)
@settings(max_examples=300, deadline=None)
def test_token_choices_match_the_generic_encoding(text):
    assert text_choice_json(3, text) == json_dumps(
        {"index": 3, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None})
    assert content_choice_json(0, text) == json_dumps(
        {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None, "stop_reason": None})


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("object_name", ["text_completion", "chat.completion.chunk"])
@pytest.mark.parametrize("model", ["stories", 'a "quoted"/model\\name', "模型"])
def test_chunk_format_matches_sse_of_the_whole_chunk(include_usage, object_name, model):
    chunks = ChunkFormat("cmpl-0123abcd", object_name, 1_764_600_000, model, include_usage)
    for text in AWKWARD:
        choice = {"index": 1, "text": text, "logprobs": None, "finish_reason": "stop", "stop_reason": None}
        chunk = {"id": "cmpl-0123abcd", "object": object_name, "created": 1_764_600_000, "model": model,
                 "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        assert chunks.event(json_dumps(choice)) == sse(chunk)
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        assert chunks.event(json_dumps(choice), usage) == sse({**chunk, "usage": usage})
        ids = [1, 403, 407]       # vLLM's return_token_ids: a chat's first chunks carry the prompt's
        assert chunks.event(json_dumps(choice), None, ids) == sse({**chunk, "prompt_token_ids": ids})
        assert chunks.event(json_dumps(choice), usage, ids) == sse({**chunk, "usage": usage, "prompt_token_ids": ids})
