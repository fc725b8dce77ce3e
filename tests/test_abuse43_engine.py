"""The engine's lifecycle as a production user drives it, on stories260K (CPU).

Requests aborted at every stage (waiting for their grammar, queued, mid-prefill of a chunked prompt,
decoding, preempted, finished; twice, and with an unknown id), through LLMEngine and through the
async engines the server runs (the engine on a thread, the engine core in its own process); clients
that leave their streams mid-way, many at once, under a KV pool that preempts all the time; prefix
hits on blocks whose first owner is being aborted; reset_prefix_cache while requests are queued but
hold no blocks; shutdown while generate() runs on another thread, and a new engine in the same
process after it. After each, the engine serves every other request exactly as alone (greedy) and
its block pool goes back to all free.

Where a stage must hold still, the engine's steps are frozen from inside it (stage_hooks): a frozen
engine still takes commands (aborts, utility calls) between the steps it skips, so what a test
sends lands at that stage whatever the machine's load.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import pytest
from test_server_helpers import wait_for

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.server.async_engine import start_async_engine

MAX_MODEL_LEN = 32
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
REGEX = "[a-z ]{1,12}"
DEADLINE_S = 120                # what a wait on the engine's state allows, on a busy machine


def make_engine(path, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw), log=lambda msg: None)


def constrained(max_tokens: int = 8) -> SamplingParams:
    from minillm.sampling_params import StructuredOutputsParams
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(regex=REGEX))


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def alone(stories_path):
    """alone(prompt, params) -> [token ids of each completion], the request run by itself on a roomy
    engine without prefix caching."""
    engine = make_engine(stories_path, num_kv_blocks=256, enable_prefix_caching=False)
    outputs = {}

    def run(prompt, params):
        key = (tuple(prompt), repr(params))
        if key not in outputs:
            engine.add_request("alone", prompt, params)
            outputs[key] = token_ids(drain(engine)["alone"])
        return outputs[key]
    yield run
    engine.shutdown()


def token_ids(out) -> list[list[int]]:
    return [list(c.token_ids) for c in out.outputs]


def drain(engine: LLMEngine) -> dict:
    """Step until nothing is left; {request id: final output}."""
    done = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} reported after it finished"
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests(), "the engine did not drain"
    return done


def assert_pool_free(engine: LLMEngine) -> None:
    """Every block is free (cached-free ones included) and no sequence is left in the queues."""
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and not any(bm.ref_counts)
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    stats = engine.stats(cells=1)
    assert (stats.kv_num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)


def hold_compiles(engine: LLMEngine) -> threading.Event:
    """Hold every grammar compile of engine until the returned event is set."""
    manager = engine._structured_output_manager()
    compile_, gate = manager._compile, threading.Event()

    def held(*args):
        gate.wait(DEADLINE_S)
        return compile_(*args)
    manager._compile = held
    return gate


def wait_until(predicate, what: str):
    """Poll predicate() until it is truthy (DEADLINE_S at most); its value."""
    value = wait_for(predicate, timeout=DEADLINE_S, interval=0.005)
    assert value, f"timed out waiting for {what}"
    return value


# ---- reset_prefix_cache: refused only while blocks are in use, as vLLM's BlockPool ----------------

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_reset_prefix_cache_forgets_the_cache_while_requests_wait_holding_no_blocks(stories_path, golden, alone,
                                                                                    async_scheduling):
    # It was refused while any request was unfinished: a request queued, or waiting for its grammar,
    # kept a benchmark's reset (or one after new weights) from happening for as long as requests came.
    engine = make_engine(stories_path, block_size=4, num_kv_blocks=16, async_scheduling=async_scheduling)
    try:
        gate = hold_compiles(engine)
        prompt = golden[:17]
        engine.add_request("warm", prompt, GREEDY)
        drain(engine)
        assert engine.block_manager.key_to_block
        engine.add_request("grammar", golden[40:50], constrained())
        engine.step()                           # it waits for its grammar, holding no blocks
        engine.add_request("queued", prompt, GREEDY)
        assert engine.get_num_unfinished_requests() == 2 and engine.block_manager.num_used_blocks == 0
        assert engine.reset_prefix_cache() is True
        assert not engine.block_manager.key_to_block and engine.block_manager.num_cached_free_blocks == 0
        gate.set()
        done = drain(engine)
        assert done["queued"].num_cached_tokens == 0 and token_ids(done["queued"]) == alone(prompt, GREEDY)
        assert done["grammar"].outputs[0].finish_reason in ("stop", "length")
        assert re.fullmatch(REGEX, done["grammar"].outputs[0].text)
        assert_pool_free(engine)
        # While a request holds blocks nothing is forgotten, as in vLLM.
        engine.add_request("running", prompt, GREEDY)
        engine.step()
        keys = dict(engine.block_manager.key_to_block)
        assert engine.block_manager.num_used_blocks and engine.reset_prefix_cache() is False
        assert engine.block_manager.key_to_block == keys
        assert token_ids(drain(engine)["running"]) == alone(prompt, GREEDY)
        assert engine.reset_prefix_cache() is True
    finally:
        engine.shutdown()


def test_reset_prefix_cache_of_the_async_engine_goes_through_while_a_request_waits_for_its_grammar(
        stories_path, golden, alone):
    gates = []
    engine = start_async_engine(EngineConfig(model=str(stories_path), device="cpu", max_model_len=MAX_MODEL_LEN,
                                             block_size=4, num_kv_blocks=16), "thread",
                                lambda core: gates.append(hold_compiles(core)))
    prompt = golden[:17]

    async def scenario():
        warm = await last(engine.generate(prompt, GREEDY, "warm"))
        held = asyncio.create_task(last(engine.generate(golden[40:50], constrained(), "grammar")))
        await until_stats(engine, lambda s: s.num_waiting == 1 and s.kv_num_cached_blocks > 0)
        assert await engine.call_utility("reset_prefix_cache") is True
        assert (await engine.get_stats()).kv_num_cached_blocks == 0
        gates[0].set()
        assert re.fullmatch(REGEX, (await held).outputs[0].text)
        again = await last(engine.generate(prompt, GREEDY, "again"))
        assert again.num_cached_tokens == 0 and token_ids(again) == token_ids(warm) == alone(prompt, GREEDY)
        await until_stats(engine, lambda s: (s.num_running, s.num_waiting, s.kv_num_used_blocks) == (0, 0, 0))
    try:
        asyncio.run(scenario())
    finally:
        for gate in gates:
            gate.set()
        engine.shutdown()


async def last(outputs):
    """The last of an async stream of outputs."""
    out = None
    async for out in outputs:
        pass
    return out


async def until_stats(engine, predicate):
    """Poll the engine's stats until predicate(stats) holds (DEADLINE_S at most); those stats."""
    deadline = time.monotonic() + DEADLINE_S
    while not predicate(stats := await engine.get_stats(cells=1)):
        assert time.monotonic() < deadline, f"timed out; the engine's stats: {stats}"
        await asyncio.sleep(0.005)
    return stats


# ---- shutdown while generate() runs, and a new engine after it ---------------------------------------

def test_shutdown_from_another_thread_stops_a_running_generate_then_a_new_llm_serves_as_alone(stories_path, golden,
                                                                                              alone):
    # LLM.shutdown() released the weights and the KV pool under a generate() stepping on another
    # thread: that step failed inside the model (StepError: 'NoneType' object has no attribute
    # 'compute_logits'), or generate() returned its requests cut short as if aborted by a caller.
    llm = LLM(str(stories_path), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=4, num_gpu_blocks_override=16)
    engine = llm.llm_engine
    gate = hold_compiles(engine)        # the constrained request never finishes before the shutdown
    steps_after_shutdown, step = [], engine.step

    def recording_step():
        if engine.is_shut_down:
            steps_after_shutdown.append(engine.metrics.num_steps)
        return step()
    engine.step = recording_step
    result = {}

    def run():
        try:
            result["outputs"] = llm.generate([golden[40:50], golden[:12]], [constrained(), GREEDY], use_tqdm=False)
        except Exception as exc:      # noqa: BLE001 - the test reads it
            result["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: engine.metrics.num_steps >= 2, "generate() to step")
        llm.shutdown()
    finally:
        gate.set()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "generate() did not return after the shutdown"
    assert "outputs" not in result, [o.outputs[0].finish_reason for o in result["outputs"]]
    error = result["error"]
    assert type(error) is RuntimeError and "LLM.shutdown() was called while generate() ran" in str(error)
    assert engine.is_shut_down and not steps_after_shutdown
    with pytest.raises(RuntimeError, match="the engine is shut down"):
        llm.generate(golden[:12], GREEDY, use_tqdm=False)
    llm.shutdown()                      # a second shutdown does nothing
    # A new LLM in the same process, on the same model, serves as before.
    with LLM(str(stories_path), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=4,
             num_gpu_blocks_override=16) as again:
        outputs = again.generate([golden[:12], golden[40:50]], [GREEDY, constrained()], use_tqdm=False)
        assert token_ids(outputs[0]) == alone(golden[:12], GREEDY)
        assert re.fullmatch(REGEX, outputs[1].outputs[0].text)
        assert_pool_free(again.llm_engine)
