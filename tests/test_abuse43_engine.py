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
from test_abuse30_engine import assert_pool_invariants, drain as drain_checked
from test_server_helpers import wait_for

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sequence import SequenceStatus
from minillm.server.async_engine import start_async_engine
from minillm.server.errors import EngineDeadError, EngineShutDownError

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
    return drain_checked(engine, check=False)


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


# ---- aborts at every stage through the async engines ---------------------------------------------

def in_stage(engine: LLMEngine, request_id: str, stage: str) -> bool:
    """Whether the engine's request of that id (its first completion) is at stage now, between steps."""
    req = engine.requests.get(request_id)
    if req is None:
        return False
    seq = req.seqs[0]
    waiting, running = seq.status is SequenceStatus.WAITING, seq.status is SequenceStatus.RUNNING
    if stage == "grammar":
        return waiting and seq.structured_output is not None and not seq.structured_output.is_ready
    if stage == "queued":           # stepped past at least once (frozen only after a step)
        return waiting and req.metrics.first_scheduled_time is None
    if stage == "mid-prefill":
        return running and 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    if stage == "decoding":
        return running and seq.num_output_tokens >= 2
    if stage == "preempted":
        return waiting and seq.num_preemptions > 0
    raise ValueError(stage)


def stage_hooks(engine: LLMEngine) -> None:
    """core_hook: utilities to freeze the engine's steps once a request reaches a stage (run_until,
    is_frozen, thaw) and to hold grammar compiles until open_grammar_compiles(). A frozen engine
    skips its steps but takes commands between them."""
    real_step, gate = engine.step, hold_compiles(engine)
    state = {"target": None, "frozen": False}
    thawed = threading.Event()

    def step():
        if state["frozen"]:
            thawed.wait(0.005)          # the loop calls again at once: no spin while frozen
            return []
        outputs = real_step()
        if state["target"] is not None and in_stage(engine, *state["target"]):
            state["target"], state["frozen"] = None, True
            thawed.clear()
        return outputs

    def run_until(request_id: str, stage: str) -> None:
        """Step on (thawed) until the request is at stage after a step, then freeze."""
        state["target"], state["frozen"] = (request_id, stage), False
        thawed.set()

    def thaw() -> None:
        state["target"], state["frozen"] = None, False
        thawed.set()

    engine.step = step
    engine.run_until, engine.thaw, engine.open_grammar_compiles = run_until, thaw, gate.set
    engine.is_frozen = lambda: state["frozen"]


# The victim's prompt (a slice of golden) and params at each stage (None: constrained, its grammar held).
VICTIMS = {
    "grammar": (slice(40, 50), None),
    "queued": (slice(60, 72), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    "mid-prefill": (slice(80, 102), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
    "decoding": (slice(100, 108), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
    "preempted": (slice(110, 120), SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)),
    "finished": (slice(120, 130), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
}
OTHERS = {"a": (slice(0, 9), SamplingParams(temperature=0, max_tokens=22, ignore_eos=True)),
          "b": (slice(3, 20), SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, n=2))}
# Where the victim comes after others: they run (frozen at that stage) when it is added. Queued: a and b
# fill the three sequence slots. Preempted: a alone runs; the victim, admitted after it, is the one
# preempted once both have grown past the pool (8 blocks each at their ends, 10 in the pool); b comes
# after the abort.
BEFORE = {"queued": (["a", "b"], ("b", "decoding")), "preempted": (["a"], ("a", "decoding"))}


@pytest.fixture(params=["thread", "process"])
def staged(request, stories_path):
    """An async engine (on a thread, or the engine core in its own process) with stage_hooks, on a pool
    that preempts: 10 blocks of 4 tokens, 6 tokens a step, 3 sequences at most."""
    config = EngineConfig(model=str(stories_path), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=4,
                          num_kv_blocks=10, max_num_batched_tokens=6, max_num_seqs=3)
    engine = start_async_engine(config, request.param, stage_hooks)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("stage", VICTIMS)
def test_an_abort_at_each_stage_ends_only_its_request_and_the_pool_goes_back_to_free(staged, golden, alone, stage):
    engine = staged
    where, params = VICTIMS[stage]
    prompt, params = golden[where], params or constrained()
    before, frozen_at = BEFORE.get(stage, ([], None))

    async def scenario():
        if stage != "grammar":
            await engine.call_utility("open_grammar_compiles")
        streams = {}

        def start(request_id):
            part, own = (where, params) if request_id == "victim" else OTHERS[request_id]
            streams[request_id] = asyncio.create_task(collect(engine.generate(golden[part], own, request_id)))
        for request_id in before:
            start(request_id)
        if frozen_at is not None:
            await engine.call_utility("run_until", *frozen_at)
            await until(lambda: engine.call_utility("is_frozen"), f"{frozen_at[0]} to reach {frozen_at[1]}")
        elif stage != "finished":
            await engine.call_utility("run_until", "victim", stage)
        start("victim")
        if frozen_at is not None:               # added while the engine is frozen, then stepped on
            await until_stats(engine, lambda s: any(r.request_id == "victim" for r in s.requests))
            await engine.call_utility("run_until", "victim", stage)
        for request_id in OTHERS.keys() - set(before) - ({"b"} if stage == "preempted" else set()):
            start(request_id)
        if stage == "finished":
            await streams["victim"]
        else:
            await until(lambda: engine.call_utility("is_frozen"), f"the victim to reach {stage}")
        engine.abort(["victim", "victim", "no-such-request"])
        engine.abort("victim")
        await engine.call_utility("thaw")
        if stage == "preempted":
            start("b")
        outputs = {request_id: await stream for request_id, stream in streams.items()}
        await engine.call_utility("open_grammar_compiles")
        again = await collect(engine.generate(prompt, params, "victim"))       # its id is free again
        return outputs, again, await idle_stats(engine)

    outputs, again, stats = asyncio.run(scenario())
    victim = outputs.pop("victim")[-1]
    want = alone(prompt, params) if stage != "grammar" else None
    if stage == "finished":
        assert token_ids(victim) == want and victim.outputs[0].finish_reason == "length"
    else:
        assert [c.finish_reason for c in victim.outputs] == ["abort"]
        got = token_ids(victim)[0]
        assert got == (want[0][:len(got)] if want else [])
        assert stage != "decoding" or len(got) >= 2
    for request_id, outs in outputs.items():
        assert token_ids(outs[-1]) == alone(golden[OTHERS[request_id][0]], OTHERS[request_id][1]), request_id
        assert all(c.finish_reason == "length" for c in outs[-1].outputs)
    if want is not None:
        assert token_ids(again[-1]) == want
    else:
        assert re.fullmatch(REGEX, again[-1].outputs[0].text)
    assert stats.num_preemptions or stage != "preempted"


async def collect(outputs) -> list:
    """Every output of an async stream."""
    return [out async for out in outputs]


async def until(ask, what: str):
    """Await ask() until it is truthy (DEADLINE_S at most)."""
    deadline = time.monotonic() + DEADLINE_S
    while not (value := await ask()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
    return value


async def idle_stats(engine):
    """The engine's stats once no request runs or waits; no block may then be in use."""
    stats = await until_stats(engine, lambda s: s.num_running == 0 and s.num_waiting == 0)
    assert stats.kv_num_used_blocks == 0
    assert stats.kv_num_free_blocks + stats.kv_num_cached_blocks == stats.kv_num_blocks
    return stats


# ---- prefix hits on blocks whose first owner is aborted ---------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("abort_at", range(6))
def test_prefix_hits_while_the_same_prefix_is_aborted_read_as_alone(stories_path, golden, alone, abort_at,
                                                                    async_scheduling):
    # One prompt of five and a half blocks four times over, chunked 5 tokens a step: the first is
    # aborted at step abort_at (before it ran, mid-prefill, or once its prompt is cached), the
    # second two steps later while the third and fourth share the blocks the two filled.
    engine = make_engine(stories_path, block_size=4, num_kv_blocks=16, max_num_batched_tokens=5,
                         async_scheduling=async_scheduling)
    prompt, arrivals = golden[:22], {0: "a", 1: "b", 3: "c", 5: "d"}
    done, step = {}, 0
    try:
        while step <= max(arrivals) or engine.has_unfinished_requests():
            if step in arrivals:
                engine.add_request(arrivals[step], prompt, GREEDY)
            if step == abort_at:
                engine.abort_request("a")
            if step == abort_at + 2:
                engine.abort_request("b")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            assert_pool_invariants(engine)
            step += 1
            assert step < 500, "the engine made no progress"
        want = alone(prompt, GREEDY)[0]
        for request_id in "ab":
            got = done[request_id].outputs[0]
            assert got.finish_reason == "abort" and list(got.token_ids) == want[:len(got.token_ids)]
        for request_id in "cd":
            assert token_ids(done[request_id]) == [want], request_id
        assert done["d"].num_cached_tokens >= 16 and done["c"].num_cached_tokens > 0
        assert_pool_free(engine)
    finally:
        engine.shutdown()


# ---- many clients leave at once, on a pool that preempts all the time ---------------------------------

@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_many_streams_left_at_once_on_a_preempting_pool_leave_the_rest_as_alone(stories_path, golden, alone,
                                                                                engine_core):
    # A pool of one full-length sequence (16 blocks of 2 tokens) under 16 requests of up to 2
    # sequences each: preemption all along. Half the callers leave together once each has seen an
    # output, half of those by cancelling their task, half by closing their stream.
    config = EngineConfig(model=str(stories_path), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=2,
                          num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=8)
    engine = start_async_engine(config, engine_core)
    requests = {f"r{i}": (golden[5 * i:5 * i + 6 + i % 5],
                          SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, n=1 + i % 2))
                for i in range(16)}
    leavers = {f"r{i}" for i in range(0, 16, 2)}

    async def follow(request_id, seen: asyncio.Event, leave: asyncio.Event):
        outputs = []
        stream = engine.generate(*requests[request_id], request_id)
        try:
            async for out in stream:
                outputs.append(out)
                seen.set()
                if leave.is_set():
                    await stream.aclose()       # a client gone between two outputs
                    break
        finally:
            seen.set()
        return outputs

    async def scenario():
        seen = {request_id: asyncio.Event() for request_id in requests}
        leave = {request_id: asyncio.Event() for request_id in requests}
        tasks = {request_id: asyncio.create_task(follow(request_id, seen[request_id], leave[request_id]))
                 for request_id in requests}
        for request_id in leavers:
            await seen[request_id].wait()
        for k, request_id in enumerate(sorted(leavers)):       # together, in one turn of the loop
            if k % 2:
                leave[request_id].set()
            else:
                tasks[request_id].cancel()
        results = {}
        for request_id, task in tasks.items():
            try:
                results[request_id] = await task
            except asyncio.CancelledError:
                results[request_id] = None
        stats = await idle_stats(engine)
        again = await collect(engine.generate(*requests["r0"], "again"))
        return results, stats, again

    try:
        results, stats, again = asyncio.run(scenario())
    finally:
        engine.shutdown()
    for request_id, (prompt, params) in requests.items():
        want, outputs = alone(prompt, params), results[request_id]
        if request_id not in leavers:
            assert token_ids(outputs[-1]) == want and outputs[-1].finished, request_id
        elif outputs:                   # as far as it read: the start of its output alone
            for got, ref in zip(token_ids(outputs[-1]), want):
                assert got == ref[:len(got)], request_id
    assert stats.num_preemptions >= len(requests) // 2
    assert token_ids(again[-1]) == alone(*requests["r0"])


# ---- shutdown of the async engines with requests at every stage, and a new engine after it ----------

def test_shutting_an_async_engine_down_ends_every_caller_at_every_stage_then_a_new_one_serves(staged, stories_path,
                                                                                             golden, alone):
    engine = staged

    async def scenario():
        streams = {}

        def start(request_id, prompt, params):
            streams[request_id] = asyncio.create_task(collect(engine.generate(prompt, params, request_id)))
        start("grammar", golden[40:50], constrained())               # its grammar held
        for request_id, (part, params) in OTHERS.items():
            start(request_id, golden[part], params)
        await engine.call_utility("run_until", "b", "decoding")
        await until(lambda: engine.call_utility("is_frozen"), "b to decode")
        start("queued", golden[60:72], GREEDY)                        # the three sequence slots are taken
        await until_stats(engine, lambda s: any(r.request_id == "queued" for r in s.requests))
        await engine.call_utility("run_until", "queued", "mid-prefill")   # stepping on while it shuts down
        stats = asyncio.create_task(engine.get_stats())
        start("late", golden[:5], GREEDY)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        ended = {}
        for request_id, task in list(streams.items()) + [("stats", stats)]:
            try:
                ended[request_id] = await asyncio.wait_for(task, DEADLINE_S)
            except EngineDeadError as exc:
                ended[request_id] = exc
        return ended

    try:
        ended = asyncio.run(scenario())
    finally:
        core = getattr(engine, "engine", None)          # the engine on a thread: its held compile goes
        if core is not None:
            core.open_grammar_compiles()
    for request_id in ("grammar", "a", "b", "queued"):
        assert isinstance(ended[request_id], EngineShutDownError), (request_id, ended[request_id])
    for request_id in ("stats", "late"):      # answered before the stop, or refused by it
        assert not isinstance(ended[request_id], BaseException) or isinstance(ended[request_id], EngineShutDownError)
    late = ended["late"]
    if not isinstance(late, BaseException):
        assert token_ids(late[-1]) == alone(golden[:5], GREEDY)
    with pytest.raises(EngineShutDownError):
        asyncio.run(collect(engine.generate(golden[:5], GREEDY, "after")))
    # A new engine of the same kind in this process serves as alone.
    mode = "thread" if core is not None else "process"
    again = start_async_engine(EngineConfig(model=str(stories_path), device="cpu",
                                            max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=10), mode)

    async def serve():
        outputs = await asyncio.gather(collect(again.generate(golden[:12], GREEDY, "x")),
                                       collect(again.generate(golden[40:50], constrained(), "y")))
        return outputs, await idle_stats(again)
    try:
        (greedy, held), _ = asyncio.run(serve())
    finally:
        again.shutdown()
    assert token_ids(greedy[-1]) == alone(golden[:12], GREEDY)
    assert re.fullmatch(REGEX, held[-1].outputs[0].text)


# ---- reset_prefix_cache(reset_running_requests=True), vLLM's: running requests preempted first ------

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_reset_running_requests_preempts_them_and_forgets_the_cache(stories_path, golden, alone, async_scheduling):
    engine = make_engine(stories_path, block_size=4, num_kv_blocks=16, max_num_batched_tokens=8,
                         async_scheduling=async_scheduling)
    requests = {"a": (golden[:17], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)),
                "b": (golden[40:50], constrained(12)), "c": (golden[60:80], GREEDY)}
    try:
        for request_id, (prompt, params) in requests.items():
            engine.add_request(request_id, prompt, params)
        done = {}
        while not (engine.scheduler.num_running >= 3 and any(s.num_output_tokens >= 2 for s in engine.scheduler.running)):
            done.update({out.request_id: out for out in engine.step() if out.finished})
        keys = dict(engine.block_manager.key_to_block)
        assert keys and engine.reset_prefix_cache() is False and engine.block_manager.key_to_block == keys
        running = list(engine.scheduler.running)
        assert engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
        bm = engine.block_manager
        assert bm.num_used_blocks == 0 and not bm.key_to_block and bm.num_cached_free_blocks == 0
        waiting = list(engine.scheduler.waiting)
        assert waiting[:len(running)] == running and all(s.num_preemptions for s in running)
        done.update(drain(engine))
        for request_id, (prompt, params) in requests.items():      # b's grammar goes on where it was
            assert token_ids(done[request_id]) == alone(prompt, params), request_id
        assert_pool_free(engine)
        with pytest.raises(ValueError, match="reset_running_requests must be true or false"):
            engine.reset_prefix_cache(reset_running_requests="yes")
    finally:
        engine.shutdown()


def test_the_async_engines_reset_prefix_cache_as_vllms(staged, golden, alone):
    # vLLM's EngineClient.reset_prefix_cache (what RL frameworks call after new weights) was missing
    # from both async engines: an AttributeError.
    engine = staged
    prompt, other = golden[:17], golden[60:72]

    async def scenario():
        await last(engine.generate(prompt, GREEDY, "warm"))
        held = asyncio.create_task(last(engine.generate(golden[40:50], constrained(), "grammar")))
        await until_stats(engine, lambda s: s.num_waiting == 1 and s.kv_num_cached_blocks > 0)
        assert await engine.reset_prefix_cache() is True          # a request waits, holding no blocks
        assert (await engine.get_stats()).kv_num_cached_blocks == 0
        await engine.call_utility("run_until", "running", "decoding")
        running = asyncio.create_task(last(engine.generate(other, SamplingParams(temperature=0, max_tokens=12,
                                                                                  ignore_eos=True), "running")))
        await until(lambda: engine.call_utility("is_frozen"), "the request to decode")
        assert await engine.reset_prefix_cache() is False        # it holds blocks
        assert await engine.reset_prefix_cache(reset_running_requests=True) is True
        stats = await engine.get_stats()
        assert (stats.kv_num_used_blocks, stats.kv_num_cached_blocks, stats.num_running) == (0, 0, 0)
        with pytest.raises(ValueError, match="reset_connector must be true or false"):
            await engine.reset_prefix_cache(reset_connector=1)
        await engine.call_utility("thaw")
        await engine.call_utility("open_grammar_compiles")
        outputs = await running, await held
        return outputs, await idle_stats(engine)

    (running, held), stats = asyncio.run(scenario())
    assert token_ids(running) == alone(other, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert re.fullmatch(REGEX, held.outputs[0].text)
    assert stats.num_preemptions >= 1


def test_llm_reset_running_requests_preempts_requests_added_by_hand(stories_path, golden, alone):
    with LLM(str(stories_path), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=4,
             num_gpu_blocks_override=16) as llm:
        engine = llm.llm_engine
        engine.add_request("by-hand", golden[:17], GREEDY)
        engine.step()
        assert llm.reset_prefix_cache() is False
        assert llm.reset_prefix_cache(reset_running_requests=True) is True
        assert token_ids(drain(engine)["by-hand"]) == alone(golden[:17], GREEDY)
        assert_pool_free(engine)


# ---- prompts at max_model_len, and max_tokens past it ------------------------------------------------

def test_prompts_at_and_past_max_model_len_are_refused_by_name_and_leave_the_engine_serving(staged, golden, alone):
    engine = staged

    async def scenario():
        for length in (MAX_MODEL_LEN, MAX_MODEL_LEN + 1):
            with pytest.raises(ValueError, match=f"prompt has {length} tokens, which leaves no room under "
                                                 f"max_model_len {MAX_MODEL_LEN}"):
                await collect(engine.generate(golden[:length], GREEDY, f"long-{length}"))
        # max_tokens past the context: cut where it ends, "length"
        long_ask = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        outputs = await asyncio.gather(collect(engine.generate(golden[:MAX_MODEL_LEN - 1], long_ask, "last-slot")),
                                       collect(engine.generate(golden[:20], long_ask, "past")))
        return [out[-1] for out in outputs], await idle_stats(engine)

    (last_slot, past), _ = asyncio.run(scenario())
    assert [len(c.token_ids) for c in last_slot.outputs] == [1] and last_slot.outputs[0].finish_reason == "length"
    assert token_ids(last_slot) == alone(golden[:MAX_MODEL_LEN - 1], SamplingParams(temperature=0, max_tokens=1))
    assert token_ids(past) == alone(golden[:20], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert past.outputs[0].finish_reason == "length"
