"""The async engine API as a program drives it through generate(), vLLM's AsyncLLM shape: AsyncLLM
(the engine core in its own process) and AsyncLLMEngine (the core on a thread of this process)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import SamplingParams
from minillm.server.async_engine import AsyncLLMEngine
from minillm.server.async_llm import AsyncLLM

PROMPT = "Once upon a time"
ENGINES = ["async_llm", "thread_engine"]


@pytest.fixture(scope="module")
def config(stories_path):
    return EngineConfig(model=str(stories_path), device="cpu")


@pytest.fixture(scope="module")
def async_llm(config):
    engine = AsyncLLM(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def thread_engine(config):
    engine = AsyncLLMEngine.from_config(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(config):
    engine = LLMEngine(config, log=lambda _: None)
    yield engine
    engine.shutdown()


def _offline_outputs(engine: LLMEngine, params: SamplingParams) -> list:
    """Every output the offline engine reports for one request alone."""
    engine.add_request("offline", PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


async def _generated(engine, request_id: str, params: SamplingParams) -> list:
    return [out async for out in engine.generate(PROMPT, params, request_id)]


async def _num_unfinished(engine) -> int:
    return await engine.call_utility("get_num_unfinished_requests")


@pytest.mark.parametrize("engine_name", ENGINES)
def test_generate_yields_the_requests_outputs_and_leaving_early_aborts_it(request, offline, engine_name):
    engine = request.getfixturevalue(engine_name)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def scenario():
        outputs = await _generated(engine, f"whole-{engine_name}", params)
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        async with contextlib.aclosing(engine.generate(PROMPT, long, f"left-{engine_name}")) as outs:
            await anext(outs)
        return outputs, await _num_unfinished(engine)

    outputs, num_unfinished = asyncio.run(scenario())
    assert [out.finished for out in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].outputs[0].text == _offline_outputs(offline, params)[-1].outputs[0].text
    assert num_unfinished == 0
