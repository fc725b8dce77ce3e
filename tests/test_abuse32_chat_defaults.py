"""`minillm chat` on a loaded model samples with the model's generation_config defaults that /set does
not cover (min_p, repetition_penalty), as `minillm generate`, LLM.chat and the server do."""
from __future__ import annotations

import dataclasses
import io

import pytest
from test_chat import STORIES, needs_stories

from minillm.chat import ChatSession, ChatSettings, EngineChatBackend
from minillm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def penalized_llm():
    from minillm.llm import LLM
    llm = LLM(str(STORIES), device="cpu", override_generation_config={"repetition_penalty": 1.8})
    yield llm
    llm.shutdown()


@needs_stories
def test_the_models_repetition_penalty_applies_to_chat_replies(penalized_llm):
    # The chat built its SamplingParams from temperature, top_p, top_k, max_tokens and seed alone:
    # a model's repetition_penalty (Qwen2.5's 1.05) or min_p was dropped, so `minillm chat MODEL`
    # sampled otherwise than `minillm generate MODEL` and `minillm chat --url` to `minillm serve MODEL`.
    backend = EngineChatBackend(penalized_llm.llm_engine, name="stories")
    session = ChatSession(backend, ChatSettings(temperature=0.0, max_tokens=64), out=io.StringIO())
    session.handle("Once upon a time")
    reply = session.conversation.turns[-1]["content"]
    prompt = {"prompt_token_ids": backend.last_prompt_ids}
    defaults = dataclasses.replace(penalized_llm.get_default_sampling_params(), temperature=0.0, max_tokens=64)
    assert defaults.repetition_penalty == 1.8
    penalized = penalized_llm.generate(prompt, defaults)[0].outputs[0].text
    plain = penalized_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=64))[0].outputs[0].text
    assert penalized != plain
    assert reply == penalized
