"""Prompt log-probabilities through an engine core (AsyncLLM) are vLLM's Logprobs, as offline."""
from __future__ import annotations

import asyncio

import pytest

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.server.async_llm import AsyncLLM


@pytest.fixture(scope="module")
def async_llm(stories_path):
    engine = AsyncLLM(EngineConfig(model=str(stories_path), device="cpu"))
    yield engine
    engine.shutdown()


async def _final(engine, prompt, params, request_id):
    async for out in engine.generate(prompt, params, request_id):
        last = out
    return last


def _plain(entries):
    return [None if e is None else [(t, round(float(lp), 4), lp.rank, lp.decoded_token) for t, lp in e.items()]
            for e in entries]


@pytest.mark.parametrize("detokenize", [True, False])
def test_prompt_logprobs_through_a_core_carry_ranks_and_decoded_tokens_as_offline(async_llm, stories_path, detokenize):
    # Through an engine core only the prompt token's own value came back as a Logprob (with no decoded
    # token); the alternatives were bare floats, so entry[t].rank / .decoded_token raised AttributeError.
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, detokenize=detokenize)
    prompt = "Once upon a time there was a girl"
    got = asyncio.run(_final(async_llm, prompt, params, f"p-{detokenize}")).prompt_logprobs
    with LLM(str(stories_path), device="cpu") as llm:
        expected = llm.generate(prompt, params)[0].prompt_logprobs
    assert _plain(got) == _plain(expected)
    assert got[0] is None and all(lp.rank is not None for e in got[1:] for lp in e.values())
    assert all((lp.decoded_token is not None) == detokenize for e in got[1:] for lp in e.values())
