"""The async engine APIs (AsyncLLM: the core in its own process; AsyncLLMEngine: on a thread) held
to the offline LLMEngine: the same outputs for each output kind and prompt form, the same errors
where a request enters, and a program's ways of driving them as vLLM's AsyncLLM users do."""
from __future__ import annotations

import asyncio

import pytest
from test_abuse25_serving import async_llm, config, thread_engine  # noqa: F401 - the engines, as fixtures

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import RequestOutputKind, SamplingParams
from minillm.server.async_engine import AsyncLLMEngine
from minillm.server.async_llm import AsyncLLM

PROMPT = "Once upon a time"
PROMPT_IDS = [1, 403, 407, 261, 378]        # PROMPT as stories260K's tokenizer reads it
ENGINES = ["async_llm", "thread_engine"]
KINDS = list(RequestOutputKind)
LONG_IDS = list(range(3, 83))               # 80 prompt tokens: five chunks of 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(config):  # noqa: F811 - the fixture imported above
    engine = LLMEngine(config, log=lambda _: None)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def chunked_config(stories_path):
    """Prompts are prefilled 16 tokens a step."""
    return EngineConfig(model=str(stories_path), device="cpu", max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def chunked_offline(chunked_config):
    engine = LLMEngine(chunked_config, log=lambda _: None)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def chunked_async_llm(chunked_config):
    engine = AsyncLLM(chunked_config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def chunked_thread_engine(chunked_config):
    engine = AsyncLLMEngine.from_config(chunked_config)
    yield engine
    engine.shutdown()


def _offline_outputs(engine: LLMEngine, prompt, params: SamplingParams) -> list:
    """Every output the offline engine reports for one request alone."""
    engine.add_request("offline", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


async def _observed(engine, request_id: str, prompt, params: SamplingParams) -> list:
    """Every output the engine hands on for a request (the observer sees those a caller's queue folds)."""
    seen = []
    stream = await engine.add_request(request_id, prompt, params, observer=lambda out, _: seen.append(out))
    async for _ in stream:
        pass
    return seen


def _view(out) -> tuple:
    """What a caller reads of an output (its metrics aside)."""
    return (out.finished, out.prompt, out.prompt_token_ids, out.prompt_logprobs,
            [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs])


async def _num_unfinished(engine) -> int:
    return await engine.call_utility("get_num_unfinished_requests")


def _is_retired(engine, request_id: str) -> bool:
    """The engine has handed on the request's last output (it is done with it)."""
    if isinstance(engine, AsyncLLM):
        return request_id not in engine.processor.requests
    return request_id not in engine.engine.requests


@pytest.mark.parametrize("engine_name", ["chunked_async_llm", "chunked_thread_engine"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_a_step_that_brings_only_prompt_logprobs_is_reported_as_the_offline_engine_reports_it(
        request, chunked_offline, engine_name, kind):
    # AsyncLLM reported a request only when a sequence moved: the steps of a chunked prefill,
    # which bring prompt logprobs alone, gave a CUMULATIVE caller nothing.
    engine = request.getfixturevalue(engine_name)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, output_kind=kind)
    expected = [_view(out) for out in _offline_outputs(chunked_offline, LONG_IDS, params)]
    got = asyncio.run(_observed(engine, f"chunked-{kind.name}", LONG_IDS, params))
    assert [_view(out) for out in got] == expected
    assert kind is not RequestOutputKind.CUMULATIVE or len(expected) > 3    # the prompt's steps are there
