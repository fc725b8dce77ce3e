"""The async engine APIs (AsyncLLM: the core in its own process; AsyncLLMEngine: on a thread) held
to the offline LLMEngine: the same outputs for each output kind and prompt form, the same errors
where a request enters, and a program's ways of driving them as vLLM's AsyncLLM users do."""
from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
from test_abuse25_serving import async_llm, config, thread_engine  # noqa: F401 - the engines, as fixtures
from test_server_helpers import wait_for

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


PROMPT_FORMS = {
    "text-dict": {"prompt": PROMPT},
    "ids-dict": {"prompt_token_ids": PROMPT_IDS},
    "ids-dict-with-text": {"prompt_token_ids": PROMPT_IDS, "prompt": PROMPT},
    "salted-text-dict": {"prompt": PROMPT, "cache_salt": "tenant-a"},
    "salted-ids-dict": {"prompt_token_ids": PROMPT_IDS, "cache_salt": "tenant-a", "multi_modal_data": None},
    "ids-array": np.array(PROMPT_IDS),
}


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("form", PROMPT_FORMS)
def test_vllms_prompt_dicts_are_taken_as_the_offline_engine_takes_them(request, offline, engine_name, form):
    # AsyncLLM passed a dict on to the core as it was: its outputs had no prompt text and no prompt
    # token ids, and with prompt_logprobs the reader thread failed indexing them (the engine died).
    engine = request.getfixturevalue(engine_name)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    expected = [_view(out) for out in _offline_outputs(offline, PROMPT_FORMS[form], params)]
    got = asyncio.run(_observed(engine, f"form-{form}-{engine_name}", PROMPT_FORMS[form], params))
    assert [_view(out) for out in got] == expected and engine.is_healthy


BAD_PROMPTS = {
    "unknown-key": {"prompt": PROMPT, "bogus": 1},
    "multi-modal": {"prompt": PROMPT, "multi_modal_data": {"image": object()}},
    "text-no-string": {"prompt": 5},
    "no-prompt": {"cache_salt": "x"},
    "empty-ids": {"prompt_token_ids": []},
    "ids-no-list": {"prompt_token_ids": "1 2 3"},
    "ids-2d-array": {"prompt_token_ids": np.array([[1, 2]])},
    "ids-past-vocab": {"prompt_token_ids": [1, 10**6]},
    "salt-no-string": {"prompt": PROMPT, "cache_salt": 5},
    "salt-twice": None,    # a dict's salt and another one as the argument
    "lone-surrogate": "Once \ud800",
    "number": 5,
}


def _add(engine, request_id: str, prompt, params: SamplingParams, form: str):
    """engine.add_request; the "salt-twice" case gives a salted dict and a different salt."""
    if form == "salt-twice":
        return engine.add_request(request_id, {"prompt": PROMPT, "cache_salt": "a"}, params, cache_salt="b")
    return engine.add_request(request_id, prompt, params)


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("form", BAD_PROMPTS)
def test_a_malformed_prompt_is_the_offline_engines_value_error_and_nothing_is_queued(
        request, offline, engine_name, form):
    # AsyncLLM: a value msgpack cannot carry was "cannot be sent to the engine core", a lone
    # surrogate a TypeError from the tokenizer; the offline engine names the prompt's fault.
    engine = request.getfixturevalue(engine_name)
    with pytest.raises(ValueError) as offline_error:
        _add(offline, "bad", BAD_PROMPTS[form], GREEDY, form)
    request_id = f"bad-{form}-{engine_name}"

    async def scenario():
        with pytest.raises(ValueError) as error:
            await _add(engine, request_id, BAD_PROMPTS[form], GREEDY, form)
        return str(error.value), await _num_unfinished(engine)

    message, num_unfinished = asyncio.run(scenario())
    assert message == str(offline_error.value) and num_unfinished == 0
    assert _is_retired(engine, request_id) and engine.is_healthy and not offline.has_unfinished_requests()


def _params_with(**changes) -> SamplingParams:
    """Greedy params with fields set after construction, as a caller may set them."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("engine_name", ["offline", *ENGINES])
@pytest.mark.parametrize("value", ["delta", 7, None])
def test_an_output_kind_that_is_none_is_a_value_error_naming_it_and_nothing_is_queued(request, engine_name, value):
    engine = request.getfixturevalue(engine_name)
    params = _params_with(output_kind=value)
    if engine_name == "offline":
        with pytest.raises(ValueError, match="^output_kind must be"):
            engine.add_request("kind", PROMPT, params)
        assert not engine.has_unfinished_requests()
        return

    async def scenario():
        with pytest.raises(ValueError, match="^output_kind must be"):
            await engine.add_request(f"kind-{value}-{engine_name}", PROMPT, params)
        return await _num_unfinished(engine)

    assert asyncio.run(scenario()) == 0 and _is_retired(engine, f"kind-{value}-{engine_name}")


@pytest.mark.parametrize("engine_name", ENGINES)
def test_an_output_kind_set_as_its_number_is_that_kind_for_a_slow_caller_too(request, offline, engine_name):
    # AsyncLLM's API side took 1 for CUMULATIVE (the core took it for DELTA); AsyncLLMEngine's stream
    # did too, and kept only the newest of the deltas a slow caller had not taken.
    engine = request.getfixturevalue(engine_name)
    request_id = f"kind-number-{engine_name}"
    expected = _offline_outputs(offline, PROMPT, _params_with(output_kind=RequestOutputKind.DELTA))

    async def scenario():
        outputs = engine.generate(PROMPT, _params_with(output_kind=1), request_id)
        first = await anext(outputs)
        # Held here, this event loop takes none of the outputs that come meanwhile.
        assert wait_for(lambda: _is_retired(engine, request_id), timeout=60)
        return [first] + [out async for out in outputs]

    got = asyncio.run(scenario())
    assert "".join(out.outputs[0].text for out in got) == "".join(out.outputs[0].text for out in expected)
    assert sum(len(out.outputs[0].token_ids) for out in got) == 40


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("changes", [dict(stop="park"), dict(stop=["park"], include_stop_str_in_output=True),
                                     dict(logprobs=2), dict(n=2, temperature=1.0, seed=3)],
                         ids=["stop-string", "stop-list-included", "logprobs", "n-2"])
def test_params_set_after_construction_are_read_as_the_offline_engine_reads_them(request, offline, engine_name,
                                                                                  changes):
    # AsyncLLM's API side read the caller's params unvalidated: a stop string set after
    # construction never ended the text (the core had it, the detokenizer did not).
    engine = request.getfixturevalue(engine_name)
    expected = _offline_outputs(offline, PROMPT, _params_with(**changes))[-1]
    got = asyncio.run(_observed(engine, f"changed-{'-'.join(changes)}-{engine_name}", PROMPT, _params_with(**changes)))
    assert _view(got[-1]) == _view(expected)


async def _end(engine, request_id: str, ending: str) -> None:
    """Run a long request with this id and end it as a caller may: a stop string the API side finds,
    an abort while its stream is read, or the caller leaving generate() early."""
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, stop=["Lily"] if ending == "stop" else None)
    async with contextlib.aclosing(engine.generate(PROMPT, long, request_id)) as outputs:
        first = await anext(outputs)
        if ending == "abort":
            engine.abort(request_id)
        if ending != "left":
            last = [out async for out in outputs][-1] if not first.finished else first
            assert last.outputs[0].finish_reason == ("stop" if ending == "stop" else "abort")


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("ending", ["stop", "abort", "left"])
def test_a_request_id_is_free_again_once_its_caller_has_seen_it_end(request, offline, engine_name, ending):
    # The id stayed "already in use" until the core's last word on it: AsyncLLM refused it after a
    # stop string or an abort whose final output the caller had read; AsyncLLMEngine after an abort
    # (vLLM's AsyncLLM takes an id again at once).
    engine = request.getfixturevalue(engine_name)
    request_id = f"again-{ending}-{engine_name}"
    expected = _offline_outputs(offline, PROMPT, GREEDY)[-1]

    async def scenario():
        await _end(engine, request_id, ending)
        return [out async for out in engine.generate(PROMPT, GREEDY, request_id)]

    got = asyncio.run(scenario())
    assert _view(got[-1])[1:] == _view(expected)[1:] and got[-1].request_id == request_id
    assert wait_for(lambda: _is_retired(engine, request_id))


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_request_id_is_refused_while_its_caller_follows_it(request, engine_name):
    engine = request.getfixturevalue(engine_name)
    request_id = f"followed-{engine_name}"

    async def scenario():
        long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        async with contextlib.aclosing(engine.generate(PROMPT, long, request_id)) as outputs:
            await anext(outputs)
            with pytest.raises(ValueError, match="already in use"):
                await engine.add_request(request_id, PROMPT, GREEDY)
            return await anext(outputs)

    assert not asyncio.run(scenario()).finished


VLLM_OPTIONS = {
    "at-what-minillm-does": dict(lora_request=None, priority=0, trace_headers=None,
                                 tokenization_kwargs={"add_special_tokens": True}),
    "no-special-tokens": dict(tokenization_kwargs={"add_special_tokens": False}),
}
BAD_OPTIONS = {
    "lora": dict(lora_request="adapter"),
    "priority": dict(priority=3),
    "priority-str": dict(priority="high"),
    "tokenization-key": dict(tokenization_kwargs={"truncation": True}),
    "trace-headers": dict(trace_headers={"traceparent": "x"}),
}


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("options", VLLM_OPTIONS)
def test_vllms_per_request_arguments_are_taken_as_the_offline_engine_takes_them(request, offline, engine_name,
                                                                                 options):
    # generate() and add_request() took none of them: a TypeError for a call vLLM's AsyncLLM takes.
    engine = request.getfixturevalue(engine_name)
    offline.add_request("offline", PROMPT, GREEDY, **VLLM_OPTIONS[options])
    expected = []
    while offline.has_unfinished_requests():
        expected += offline.step()

    async def scenario():
        return [out async for out in engine.generate(PROMPT, GREEDY, f"options-{options}-{engine_name}",
                                                     **VLLM_OPTIONS[options])]

    assert _view(asyncio.run(scenario())[-1]) == _view(expected[-1])


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("options", BAD_OPTIONS)
def test_a_per_request_argument_minillm_does_not_do_is_the_offline_engines_value_error(request, offline,
                                                                                      engine_name, options):
    engine = request.getfixturevalue(engine_name)
    with pytest.raises(ValueError) as offline_error:
        offline.add_request("offline", PROMPT, GREEDY, **BAD_OPTIONS[options])
    request_id = f"bad-options-{options}-{engine_name}"

    async def scenario():
        with pytest.raises(ValueError) as error:
            await anext(engine.generate(PROMPT, GREEDY, request_id, **BAD_OPTIONS[options]))
        return str(error.value), await _num_unfinished(engine)

    assert asyncio.run(scenario()) == (str(offline_error.value), 0) and _is_retired(engine, request_id)
