"""The async engine API as a program drives it through generate(), vLLM's AsyncLLM shape: AsyncLLM
(the engine core in its own process) and AsyncLLMEngine (the core on a thread of this process)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from test_abuse25_serving import async_llm, config, thread_engine  # noqa: F401 - the engines, as fixtures
from test_server_helpers import wait_for

from minillm.engine import LLMEngine
from minillm.outputs import CompletionOutput
from minillm.sampling_params import RequestOutputKind, SamplingParams
from minillm.server.async_llm import AsyncLLM

PROMPT = "Once upon a time"
ENGINES = ["async_llm", "thread_engine"]
DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
SAMPLING = {
    "greedy-stop-logprobs": dict(temperature=0, max_tokens=40, stop=["park"], logprobs=2, prompt_logprobs=1,
                                 ignore_eos=True),
    "n-2-sampled": dict(n=2, temperature=1.0, seed=11, max_tokens=16, logprobs=1),
}


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


def _added(held: CompletionOutput | None, new: CompletionOutput) -> CompletionOutput:
    """A completion's delta added to what its earlier deltas made."""
    if held is None:
        return new
    logprobs = None if new.logprobs is None else held.logprobs + new.logprobs
    return CompletionOutput(new.index, held.text + new.text, held.token_ids + new.token_ids, new.cumulative_logprob,
                            logprobs, new.finish_reason, new.stop_reason)


def _snapshots(outputs: list, kind: RequestOutputKind) -> list[tuple]:
    """The request as each output leaves it: (finished, prompt_logprobs, {index: completion}); DELTA
    outputs added up (their prompt_logprobs come once)."""
    held: dict[int, CompletionOutput] = {}
    prompt_logprobs, shots = None, []
    for out in outputs:
        assert kind is not DELTA or prompt_logprobs is None or out.prompt_logprobs is None
        prompt_logprobs = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_logprobs
        for completion in out.outputs:
            held[completion.index] = _added(held.get(completion.index), completion) if kind is DELTA else completion
        shots.append((out.finished, prompt_logprobs, {i: (c.text, c.token_ids, c.logprobs, c.cumulative_logprob,
                                                          c.finish_reason, c.stop_reason) for i, c in held.items()}))
    return shots


def _is_retired(engine, request_id: str) -> bool:
    """The engine has handed on the request's last output (it is done with it)."""
    if isinstance(engine, AsyncLLM):
        return request_id not in engine.processor.requests
    return request_id not in engine.engine.requests


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("kind", list(RequestOutputKind), ids=lambda kind: kind.name)
def test_each_output_kind_is_reported_as_the_offline_engine_reports_it(request, offline, engine_name, sampling, kind):
    # AsyncLLM ignored output_kind: DELTA callers got cumulative outputs (the same text again each time).
    engine = request.getfixturevalue(engine_name)
    params = SamplingParams(**SAMPLING[sampling], output_kind=kind)
    expected = _snapshots(_offline_outputs(offline, params), kind)
    got = asyncio.run(_generated(engine, f"{sampling}-{kind.name}-{engine_name}", params))
    shots = _snapshots(got, kind)
    assert shots[-1] == expected[-1] and shots[-1][0]
    assert [shot for shot in shots if shot not in expected] == []     # each output is one the engine makes
    if kind is FINAL_ONLY:
        assert len(got) == 1
    if kind is DELTA:
        assert all(c.token_ids or c.finish_reason for out in got for c in out.outputs)


@pytest.mark.parametrize("engine_name", ENGINES)
def test_delta_outputs_a_slow_caller_has_not_taken_are_added_up_not_replaced(request, offline, engine_name):
    # The stream kept only a request's newest output, right for cumulative ones: a DELTA caller
    # that fell behind lost the text and tokens of every output it had not taken.
    engine = request.getfixturevalue(engine_name)
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=1, ignore_eos=True, output_kind=DELTA)
    request_id = f"slow-{engine_name}"

    async def scenario():
        outputs = engine.generate(PROMPT, params, request_id)
        first = await anext(outputs)
        # Held here, this event loop takes none of the outputs that come meanwhile.
        assert wait_for(lambda: _is_retired(engine, request_id), timeout=60)
        return [first] + [out async for out in outputs]

    got = asyncio.run(scenario())
    assert _snapshots(got, DELTA)[-1] == _snapshots(_offline_outputs(offline, params), DELTA)[-1]
    assert len(got) < 30


@pytest.mark.parametrize("kind", list(RequestOutputKind), ids=lambda kind: kind.name)
def test_a_stop_string_ends_the_request_in_the_core_whatever_the_output_kind(async_llm, offline, kind):
    # With FINAL_ONLY the core reported the request once, at max_tokens: the stop string was found
    # in the text only then, after the core had spent a step on every token up to max_tokens.
    params = SamplingParams(temperature=0, max_tokens=300, stop=["Lily"], ignore_eos=True, output_kind=kind)

    async def scenario():
        before = await async_llm.call_utility("stats")
        outputs = await _generated(async_llm, f"stop-{kind.name}", params)
        return outputs, before, await async_llm.call_utility("stats"), await _num_unfinished(async_llm)

    outputs, before, after, num_unfinished = asyncio.run(scenario())
    last = _snapshots(outputs, kind)[-1]
    assert last == _snapshots(_offline_outputs(offline, params), kind)[-1]
    finished, _, completions = last
    [(text, token_ids, _, _, finish_reason, stop_reason)] = completions.values()
    assert finished and (finish_reason, stop_reason) == ("stop", "Lily") and text.endswith("named ") and len(token_ids) < 20
    # The stop reached the core before the stats call did (one socket, in order): it has stopped.
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 300
    assert num_unfinished == 0


async def _num_output_tokens(engine, request_id: str) -> int:
    """The output tokens the engine has made for a request, as its stats row says (0 before it runs)."""
    stats = await engine.get_stats()
    return next((row.output_tokens for row in stats.requests if row.request_id == request_id), 0)


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("kind", list(RequestOutputKind), ids=lambda kind: kind.name)
def test_an_abort_ends_the_stream_being_read_with_an_aborted_output(request, engine_name, kind):
    # The stream waited for ever: the abort made the engine forget who followed the request, so its
    # last output (or, in AsyncLLM, any output) never reached the caller.
    engine = request.getfixturevalue(engine_name)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=kind)
    request_id = f"aborted-{kind.name}-{engine_name}"

    async def scenario():
        reading = asyncio.create_task(_generated(engine, request_id, params))
        while not reading.done() and await _num_output_tokens(engine, request_id) < 3:
            pass    # each stats call is answered between two steps
        engine.abort(request_id)
        outputs = await asyncio.wait_for(reading, 60)
        return outputs, await _num_unfinished(engine), await engine.get_stats()

    outputs, num_unfinished, stats = asyncio.run(scenario())
    finished, _, completions = _snapshots(outputs, kind)[-1]
    [(text, token_ids, _, _, finish_reason, stop_reason)] = completions.values()
    assert finished and (finish_reason, stop_reason) == ("abort", None)
    assert 3 <= len(token_ids) < 400 and text
    assert kind is not FINAL_ONLY or len(outputs) == 1
    assert num_unfinished == 0 and stats.num_running == stats.num_waiting == 0 and stats.kv_num_used_blocks == 0
    assert wait_for(lambda: _is_retired(engine, request_id))
