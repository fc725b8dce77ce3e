"""`minillm chat --url`: the sampling settings the chat shows are the ones the server samples with."""
from __future__ import annotations

import io

import httpx
from test_chat import STORIES, needs_stories
from test_server_helpers import running_server

from minillm.chat import ChatSession, ChatSettings


@needs_stories
def test_top_k_off_is_sent_over_a_model_default_top_k():
    # The chat sent top_k only when it was positive: /set top_k -1 (or 0) showed "top_k = -1" while
    # the server went on sampling with the model's own default (here top_k 1, greedy).
    from minillm.chat_client import HttpChatBackend
    with running_server(STORIES, override_generation_config={"top_k": 1}) as (url, _):
        settings = ChatSettings(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=12, seed=3)
        out = io.StringIO()
        session = ChatSession(HttpChatBackend(url), settings, out=out)
        session.handle("Once upon")
        reply = session.conversation.turns[-1]["content"]
        fields = {"model": "stories", "prompt": "Once upon", "max_tokens": 12, "temperature": 1.0, "top_p": 1.0,
                  "seed": 3}
        sampled = httpx.post(f"{url}/v1/completions", json={**fields, "top_k": -1}).json()["choices"][0]["text"]
        greedy = httpx.post(f"{url}/v1/completions", json=fields).json()["choices"][0]["text"]
        assert sampled != greedy       # the model's top_k 1 is in force unless top_k is sent
        assert reply == sampled
