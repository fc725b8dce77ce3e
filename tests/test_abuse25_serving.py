"""The programmatic serving layer taken at its edges: what a program embedding AsyncLLM (the engine
core in its own process) or AsyncLLMEngine (the core on a thread) may call it with never fails the
engine loop or the other requests; bad input is a ValueError/TypeError naming what is wrong."""
from __future__ import annotations

import asyncio
import time

import pytest
from test_engine_core import inproc_core

from minillm.config import EngineConfig
from minillm.engine_core import messages as m
from minillm.sampling_params import SamplingParams
from minillm.server.async_engine import AsyncLLMEngine
from minillm.server.async_llm import AsyncLLM
from minillm.server.errors import RemoteError

PROMPT = "Once upon a time"


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


async def _text(engine, request_id: str, params: SamplingParams) -> str:
    stream = await engine.add_request(request_id, PROMPT, params)
    outputs = [out async for out, _ in stream]
    return outputs[-1].outputs[0].text


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("call, message", [
    (lambda e: e.add_request(5, PROMPT, GREEDY), "^request_id must be a string, got 5$"),
    (lambda e: e.add_request(None, PROMPT, GREEDY), "^request_id must be a string, got None$"),
    (lambda e: e.add_request("salt", PROMPT, GREEDY, cache_salt=5), "^cache_salt must be a non-empty string"),
    (lambda e: e.add_request("arrival", PROMPT, GREEDY, arrival_time="x"), "^arrival_time must be a finite number"),
    (lambda e: e.add_request("params", PROMPT, {"max_tokens": 3}), "^params must be a SamplingParams, got dict$"),
], ids=["request-id-int", "request-id-none", "cache-salt-int", "arrival-time-str", "params-dict"])
def test_a_field_of_the_wrong_type_is_a_value_error_and_the_core_serves_on(async_llm, call, message):
    # Each went down as a message the core's decoder refused: the core died and every request with it.
    async def scenario():
        with pytest.raises(ValueError, match=message):
            await call(async_llm)
        return await _text(async_llm, "after", GREEDY)

    assert asyncio.run(scenario())
    assert async_llm.is_healthy


@pytest.mark.parametrize("engine_name", ["async_llm", "thread_engine"])
def test_abort_takes_a_list_of_ids_and_ignores_ids_that_are_no_strings(request, engine_name):
    # AsyncLLM: an int id killed the core (its decoder refused the message), a list was a TypeError
    # (unhashable); AsyncLLMEngine: a list failed its engine thread. vLLM's abort takes both.
    engine = request.getfixturevalue(engine_name)

    async def scenario():
        await engine.add_request("long", PROMPT, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        engine.abort(123)
        engine.abort(None)
        engine.abort([5, "long", b"x"])
        while await engine.call_utility("get_num_unfinished_requests"):    # the abort reached the loop
            await asyncio.sleep(0.01)
        return await _text(engine, "after-abort", GREEDY)

    assert asyncio.run(scenario()) and engine.is_healthy


def test_a_utility_whose_result_is_no_plain_data_fails_the_call_not_the_core(async_llm):
    # The core encoded the Tokenizer in its reply: a TypeError in its loop, which ended serving.
    with pytest.raises(RemoteError, match="TypeError: .*Tokenizer"):
        asyncio.run(async_llm.call_utility("get_tokenizer"))
    assert asyncio.run(async_llm.call_utility("get_num_unfinished_requests")) == 0
    assert asyncio.run(_text(async_llm, "after-utility", GREEDY)) and async_llm.is_healthy
    with pytest.raises(TypeError, match="^method must be a string, got 5$"):
        asyncio.run(async_llm.call_utility(5))
    assert async_llm.is_healthy


@pytest.mark.parametrize("engine_name", ["async_llm", "thread_engine"])
@pytest.mark.parametrize("method", ["step", "shutdown", "add_request"])
def test_the_loops_own_methods_are_no_utilities(request, engine_name, method):
    # "step" took a step's outputs from their callers (a token lost from a running request's text);
    # "shutdown" shut the engine down under its loop (the next add killed the core).
    engine = request.getfixturevalue(engine_name)

    async def scenario():
        expected = await _text(engine, f"alone-{method}", GREEDY)
        stream = await engine.add_request(f"running-{method}", PROMPT, GREEDY)
        with pytest.raises((AttributeError, RemoteError), match=f"no utility '{method}'"):
            await engine.call_utility(method)
        outputs = [out async for out, _ in stream]
        return expected, outputs[-1].outputs[0].text, await _text(engine, f"next-{method}", GREEDY)

    expected, running, after = asyncio.run(scenario())
    assert running == expected == after and engine.is_healthy


def test_a_command_the_core_cannot_decode_is_dropped_and_the_core_serves_on(config):
    with inproc_core(config) as c:
        ids = c.core.engine.tokenizer.encode(PROMPT, add_special_tokens=True)
        c.commands.send(c.encoder.encode(m.AbortRequests([5])))        # an id that is no string
        c.commands.send(c.encoder.encode(m.AddRequest("kept", ids, {"max_tokens": 3}, time.time())))
        assert c.input_sock.poll(30_000)
        replies = []
        while not any(isinstance(r, m.AddResults) for r in replies):
            assert c.proc.run_once()          # raised msgspec.ValidationError, which ended the core
            while c.outputs.poll(0):
                replies.append(c.decoder.decode(c.outputs.recv()))
        assert [r for r in replies if isinstance(r, m.AddResults)][0].results == [("kept", None)]
