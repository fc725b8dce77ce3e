"""Reasoning and tool-call parsers abused as real outputs break them: usage's reasoning_tokens where the
think tags are no single tokens (stories260K spells </think> in pieces that differ from its encoding)."""
from __future__ import annotations

import httpx
import pytest
from test_abuse34_parsers import TEMPLATE, grammar_of, install_script
from test_server_helpers import call_utility, running_server

from minillm.server.app import ServerOptions
from minillm.server.reasoning_parsers import ReasoningParser, count_reasoning_tokens, thinking_tag_ids
from minillm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(stories_path):
    return Tokenizer.from_pretrained(stories_path)


def tokens_before(tokenizer, token_ids: list[int], num_chars: int) -> int:
    """How many leading tokens' texts, laid end to end, fit in num_chars characters."""
    count, length = 0, 0
    for token_id in token_ids:
        length += len(tokenizer.decode([token_id]))
        if length > num_chars:
            break
        count += 1
    return count


@pytest.mark.parametrize("text, reasoning", [
    ("plan</think>answer", "plan"),
    ("<think>ab</think>c", "ab"),
    ("x<think>y<think>z</think>w<think>v", "xyz"),
    ("cutshort<think", "cutshort<think"),
    ("</think>answer", ""),
])
def test_reasoning_tokens_are_counted_by_text_where_the_tags_are_no_single_tokens(tokenizer, text, reasoning):
    assert thinking_tag_ids(tokenizer) is None
    ids = [tokenizer.get_vocab()[char] for char in text]
    assert tokenizer.decode(ids) == text        # one token a character, as a constrained model may write them
    expected = tokens_before(tokenizer, ids, text.find("</think>") if "</think>" in text else len(text))
    expected -= len("<think>") * text.partition("</think>")[0].count("<think>")
    assert expected == len(reasoning)
    assert count_reasoning_tokens(ReasoningParser("deepseek_r1"), ids, tokenizer) == expected
    assert count_reasoning_tokens(ReasoningParser("qwen3", thinking=False), ids, tokenizer) == 0


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K scripted to a reply, with --reasoning-parser deepseek_r1."""
    options = ServerOptions(chat_template=TEMPLATE, reasoning_parser="deepseek_r1")
    with running_server(stories_path, max_model_len=512, options=options, core_hook=install_script) as running:
        yield running


def test_the_servers_reasoning_tokens_stop_at_the_end_tag(server, tokenizer):
    # Every token was counted as reasoning: the tag's encoding ("▁<", "/", ..., "in", ...) was never found.
    url, engine = server
    call_utility(engine, "script", "grammar", grammar_of("plan</think>answer"))
    body = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "temperature": 0,
        "return_token_ids": True}).json()
    [choice] = body["choices"]
    assert (choice["message"]["reasoning"], choice["message"]["content"]) == ("plan", "answer")
    ids = choice["token_ids"]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == tokens_before(tokenizer, ids, 4) < len(ids)
