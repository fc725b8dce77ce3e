"""Request ids in the engine: an aborted request's id is free at once (vLLM's engines take it again
at once), its last report still comes out and is never taken for the new request of that id; an
add that fails half way leaves no trace. On the offline LLMEngine and the engine on a thread."""
from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from core_hooks import install
from test_server_helpers import wait_for

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import SamplingParams
from minillm.server.async_engine import AsyncLLMEngine
from minillm.server.errors import RequestFailedError

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make_engine(path, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 64)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw), log=lambda _: None)


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def alone(stories_path):
    """alone(prompt, params) -> the final output of the request run by itself."""
    engine = make_engine(stories_path)
    cache = {}

    def run(prompt, params):
        key = (tuple(prompt), repr(params))
        if key not in cache:
            engine.add_request("alone", prompt, params)
            cache[key] = drain(engine)["alone"][-1]
        return cache[key]
    yield run
    engine.shutdown()


def drain(engine: LLMEngine, limit: int = 2000) -> dict[str, list]:
    """Step until nothing is left: {request id: [its reports, in order]}."""
    reports: dict[str, list] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return reports
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"the engine did not finish in {limit} steps")


def view(out) -> list:
    return [(list(c.token_ids), c.finish_reason) for c in out.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_aborted_id_is_taken_again_at_once_and_its_last_report_comes_first(stories_path, golden, alone,
                                                                               async_scheduling):
    engine = make_engine(stories_path, async_scheduling=async_scheduling, max_num_batched_tokens=8)
    try:
        engine.add_request("x", golden[:20], SamplingParams(temperature=0, max_tokens=30, n=2, prompt_logprobs=1))
        engine.add_request("other", golden[:5], SHORT)
        engine.step()                             # the first prompt chunk runs (on the device still, async)
        engine.abort_request("x")
        new = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, prompt_logprobs=1)
        engine.add_request("x", golden[30:36], new)      # vLLM's engines take the id again at once
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("x", golden[:3], SHORT)     # the new request holds it now
        reports = drain(engine)
        old, *rest = reports["x"]
        assert old.finished and [c.finish_reason for c in old.outputs] == ["abort", "abort"]
        assert old.prompt_token_ids == golden[:20]
        assert rest and all(out.prompt_token_ids == golden[30:36] for out in rest)
        assert [out.finished for out in rest] == [False] * (len(rest) - 1) + [True]
        want = alone(golden[30:36], new)
        assert view(rest[-1]) == view(want)
        assert rest[-1].prompt_logprobs == [None if e is None else {k: pytest.approx(v, abs=1e-4) for k, v in e.items()}
                                            for e in want.prompt_logprobs]      # batched apart: float rounding
        assert view(reports["other"][-1]) == view(alone(golden[:5], SHORT))
        assert not engine.requests and engine.block_manager.num_used_blocks == 0
    finally:
        engine.shutdown()


def test_an_id_aborted_and_taken_again_twice_before_a_step_reports_each_request_once_in_order(stories_path,
                                                                                            golden, alone):
    engine = make_engine(stories_path)
    try:
        engine.add_request("x", golden[:4], LONG)
        engine.step()
        for prompt in (golden[10:14], golden[20:24]):
            engine.abort_request("x")
            engine.add_request("x", prompt, SHORT)
        assert engine.get_num_unfinished_requests() == 1
        reports = drain(engine)["x"]
        finals = [out for out in reports if out.finished]
        assert [out.prompt_token_ids for out in finals] == [golden[:4], golden[10:14], golden[20:24]]
        assert [view(out)[0][1] for out in finals] == ["abort", "abort", "length"]
        assert reports.index(finals[1]) == 1           # the aborted ones' reports come before the live one's
        assert view(finals[2]) == view(alone(golden[20:24], SHORT))
    finally:
        engine.shutdown()


def test_an_id_whose_step_failed_is_free_at_once(stories_path, golden, alone):
    engine = make_engine(stories_path)
    install(engine)
    try:
        engine.add_request("x", golden[:4], LONG)
        engine.step()
        engine.fail_next_step_for([golden[:4]])
        with pytest.raises(Exception, match="injected kernel fault"):
            engine.step()
        engine.add_request("x", golden[8:12], SHORT)
        reports = drain(engine)["x"]
        assert reports[0].finished and reports[0].prompt_token_ids == golden[:4]
        assert view(reports[-1]) == view(alone(golden[8:12], SHORT))
    finally:
        engine.shutdown()


class Interrupt(BaseException):
    """An interrupt (as KeyboardInterrupt) raised inside add_request."""


@pytest.mark.parametrize("failing", [1, 2, 3])
def test_an_add_interrupted_half_way_leaves_no_trace(stories_path, golden, alone, monkeypatch, failing):
    engine = make_engine(stories_path)
    try:
        calls = []
        real_add = engine.scheduler.add

        def add(seq):
            calls.append(seq)
            if len(calls) == failing:          # one of the request's three sequences
                raise Interrupt()
            real_add(seq)
        monkeypatch.setattr(engine.scheduler, "add", add)
        with pytest.raises(Interrupt):
            engine.add_request("x", golden[:4], SamplingParams(temperature=0, max_tokens=6, n=3, ignore_eos=True))
        monkeypatch.undo()
        assert "x" not in engine.requests and not engine.has_unfinished_requests()
        assert len(engine.scheduler.waiting) == 0 and engine.get_num_unfinished_requests() == 0
        assert all(seq.is_finished for seq in calls)
        assert drain(engine) == {}
        engine.add_request("x", golden[:4], SHORT)     # the id is free, the engine serves on
        assert view(drain(engine)["x"][-1]) == view(alone(golden[:4], SHORT))
    finally:
        engine.shutdown()


def test_an_add_interrupted_over_an_aborted_id_leaves_the_aborted_ones_report(stories_path, golden, monkeypatch):
    engine = make_engine(stories_path)
    try:
        engine.add_request("x", golden[:4], LONG)
        engine.step()
        engine.abort_request("x")

        def add(seq):
            raise Interrupt()
        monkeypatch.setattr(engine.scheduler, "add", add)
        with pytest.raises(Interrupt):
            engine.add_request("x", golden[8:12], SHORT)
        monkeypatch.undo()
        reports = drain(engine)
        assert [(out.prompt_token_ids, view(out)[0][1]) for out in reports["x"]] == [(golden[:4], "abort")]
        assert not engine.requests and engine.block_manager.num_used_blocks == 0
    finally:
        engine.shutdown()


# ---- the engine on a thread ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def thread_engine(stories_path):
    engine = AsyncLLMEngine.from_config(EngineConfig(model=str(stories_path), device="cpu"), install)
    yield engine
    engine.shutdown()


async def _collect(stream) -> list:
    return [out async for out, _ in stream]


def run(scenario):
    """Run a scenario; a stream that never ends fails it (in a minute) instead of hanging the run."""
    return asyncio.run(asyncio.wait_for(scenario(), 60))


def test_thread_engine_an_aborted_id_taken_again_at_once_gets_only_its_own_outputs(thread_engine, golden, alone):
    async def scenario():
        old = await thread_engine.add_request("t", golden[:4], LONG)
        first, _ = await anext(aiter(old))
        assert not first.finished
        thread_engine.abort("t")
        new = await thread_engine.add_request("t", golden[8:12], SHORT)
        again = await thread_engine.add_request("t2", golden[8:12], SHORT)
        thread_engine.abort("t2")
        third = await thread_engine.add_request("t2", golden[:4], SHORT)
        return [first] + await _collect(old), await _collect(new), await _collect(again), await _collect(third)

    old, new, again, third = run(scenario)
    assert old[-1].finished and view(old[-1])[0][1] == "abort"
    assert all(out.prompt_token_ids == golden[:4] for out in old)
    assert all(out.prompt_token_ids == golden[8:12] for out in new)
    assert view(new[-1]) == view(alone(golden[8:12], SHORT))
    assert again[-1].finished and all(out.prompt_token_ids == golden[8:12] for out in again)
    assert view(third[-1]) == view(alone(golden[:4], SHORT))
    assert wait_for(lambda: not thread_engine._streams)


def test_thread_engine_an_id_whose_step_failed_taken_again_gets_only_its_own_outputs(thread_engine, golden,
                                                                                      alone):
    async def scenario():
        old = await thread_engine.add_request("f", golden[:4], LONG)
        await anext(aiter(old))
        await thread_engine.call_utility("fail_next_step_for", [golden[:4]])
        with pytest.raises(RequestFailedError):
            await _collect(old)
        return await _collect(await thread_engine.add_request("f", golden[8:12], SHORT))

    new = run(scenario)
    assert all(out.prompt_token_ids == golden[8:12] for out in new)
    assert view(new[-1]) == view(alone(golden[8:12], SHORT))
    assert wait_for(lambda: not thread_engine._streams)


def test_thread_engine_an_add_its_caller_left_does_not_take_the_next_ones_outputs(thread_engine, golden, alone):
    async def scenario():
        old = await thread_engine.add_request("c", golden[:4], LONG)
        await anext(aiter(old))
        thread_engine.abort("c")
        left = asyncio.ensure_future(thread_engine.add_request("c", golden[20:24], LONG))
        await asyncio.sleep(0)                  # the add is queued; its caller leaves before the answer
        left.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await left
        last = await _collect(await thread_engine.add_request("c", golden[8:12], SHORT))
        return await _collect(old), last

    old, last = run(scenario)
    assert old[-1].finished and view(old[-1])[0][1] == "abort"
    assert all(out.prompt_token_ids == golden[8:12] for out in last)
    assert view(last[-1]) == view(alone(golden[8:12], SHORT))


# ---- a caller that leaves generate() after its request's id was taken again ---------------------

@pytest.fixture(scope="module")
def async_llm(stories_path):
    from minillm.server.async_llm import AsyncLLM
    engine = AsyncLLM(EngineConfig(model=str(stories_path), device="cpu"))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("engine_name", ["thread_engine", "async_llm"])
def test_leaving_generate_after_an_abort_leaves_the_next_request_of_the_id_alone(request, engine_name, golden,
                                                                                  alone):
    engine = request.getfixturevalue(engine_name)

    async def scenario():
        left = engine.generate(golden[:4], LONG, "g")
        await anext(left)
        engine.abort("g")
        new = await engine.add_request("g", golden[8:12], SHORT)   # another caller takes the id
        await left.aclose()          # the first caller leaves without reading its last output
        return await _collect(new)

    new = run(scenario)
    assert all(out.prompt_token_ids == golden[8:12] for out in new)
    assert view(new[-1]) == view(alone(golden[8:12], SHORT))
