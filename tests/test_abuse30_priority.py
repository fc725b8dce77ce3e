"""Priority scheduling (vLLM's scheduling_policy="priority") on stories260K: CPU, tiny pools.

Orders are read from the engine's own state after each step (the running queue, each sequence's
preemption count), never from timing. Every greedy output equals the request's output run alone;
the pool's bookkeeping is checked after every step."""
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from test_abuse30_engine import assert_pool_invariants

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine

MAX_MODEL_LEN = 32


def make_engine(path, **kw):
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    kw.setdefault("scheduling_policy", "priority")
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw), log=lambda msg: None)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def alone(stories_path):
    """alone(prompt, params) -> [token ids of each completion], the request run by itself on a roomy
    first come, first served engine (cached across the module)."""
    engine = make_engine(stories_path, scheduling_policy="fcfs", enable_prefix_caching=False, num_kv_blocks=256)
    outputs = {}

    def run(prompt, params):
        key = (tuple(prompt), repr(params))
        if key not in outputs:
            engine.add_request("alone", prompt, params)
            outputs[key] = Run(engine).drain().done["alone"]
        return outputs[key]
    return run


def token_ids(out):
    return [list(c.token_ids) for c in out.outputs]


class Run:
    """Steps an engine, recording from its state the order sequences were first scheduled and the
    order they were preempted in, as (request id, index)."""

    def __init__(self, engine):
        self.engine = engine
        self.order: list[tuple[str, int]] = []
        self.preempted: list[tuple[str, int]] = []
        self.done: dict = {}
        self._preemptions: dict[tuple[str, int], int] = {}

    def step(self) -> None:
        engine = self.engine
        live = [seq for req in engine.requests.values() for seq in req.seqs]
        for out in engine.step():
            assert out.request_id not in self.done
            if out.finished:
                self.done[out.request_id] = out
        for seq in engine.scheduler.running:
            if (seq.request_id, seq.index) not in self.order:
                self.order.append((seq.request_id, seq.index))
        for seq in live:
            key = (seq.request_id, seq.index)
            if seq.num_preemptions > self._preemptions.get(key, 0):
                self.preempted += [key] * (seq.num_preemptions - self._preemptions.get(key, 0))
                self._preemptions[key] = seq.num_preemptions
        assert_pool_invariants(self.engine)

    def drain(self, limit: int = 3000) -> "Run":
        for _ in range(limit):
            if not self.engine.has_unfinished_requests():
                return self
            self.step()
        raise AssertionError("the engine did not drain")


def add_all(engine, requests):
    """requests: (request id, prompt, params, priority) each, queued in that order."""
    for rid, prompt, params, priority in requests:
        engine.add_request(rid, prompt, params, priority=priority)


def assert_as_alone(run, requests, alone):
    for rid, prompt, params, _ in requests:
        assert token_ids(run.done[rid]) == token_ids(alone(prompt, params)), rid


def test_a_later_request_of_higher_priority_is_scheduled_first(stories_path, golden, alone):
    engine = make_engine(stories_path, max_num_seqs=1, num_kv_blocks=64, block_size=4)
    requests = [("low", golden[0:5], greedy(3), 5), ("high", golden[1:6], greedy(3), -1),
                ("mid", golden[2:7], greedy(3), 2), ("high2", golden[3:8], greedy(3, n=2), -1),
                ("zero", golden[4:9], greedy(3), 0)]
    add_all(engine, requests)
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["high", "high2", "high2", "zero", "mid", "low"]
    run = Run(engine).drain()
    assert run.order == [("high", 0), ("high2", 0), ("high2", 1), ("zero", 0), ("mid", 0), ("low", 0)]
    assert not run.preempted
    assert_as_alone(run, requests, alone)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_equal_priorities_keep_arrival_order(stories_path, golden, alone, policy):
    # Under fcfs every priority is 0; under the priority policy ties go by arrival time, which a
    # caller may give (one in the past counts as given), then by the order they were queued.
    engine = make_engine(stories_path, max_num_seqs=1, num_kv_blocks=64, block_size=4, scheduling_policy=policy)
    requests = [(f"r{i}", golden[i:i + 4], greedy(2, n=1 + i % 2), 0 if policy == "fcfs" else 7) for i in range(5)]
    add_all(engine, requests)
    now = time.time()
    engine.add_request("late", golden[9:13], greedy(2), arrival_time=now - 10, priority=requests[0][3])
    engine.add_request("early", golden[8:12], greedy(2), arrival_time=now - 20, priority=requests[0][3])
    run = Run(engine).drain()
    queued = [(rid, i) for rid, _, params, _ in requests for i in range(params.n)]
    if policy == "fcfs":
        assert run.order == queued + [("late", 0), ("early", 0)]
    else:
        assert run.order == [("early", 0), ("late", 0)] + queued
    assert_as_alone(run, requests, alone)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_pool_running_dry_preempts_the_lowest_priority_not_the_latest(stories_path, golden, alone,
                                                                           async_scheduling):
    requests = [("p2", golden[0:4], greedy(20), 2), ("p0", golden[10:14], greedy(20), 0),
                ("p1", golden[20:24], greedy(20), 1)]
    first_victim = {}
    for policy in ("fcfs", "priority"):
        engine = make_engine(stories_path, scheduling_policy=policy, block_size=2, num_kv_blocks=16, max_num_seqs=3,
                             enable_prefix_caching=False, async_scheduling=async_scheduling)
        add_all(engine, [(rid, prompt, params, priority if policy == "priority" else 0)
                         for rid, prompt, params, priority in requests])
        run = Run(engine).drain()
        assert run.preempted, "the pool never ran dry"
        first_victim[policy] = run.preempted[0][0]
        if policy == "priority":
            assert ("p0", 0) not in run.preempted    # the highest priority always had room
        assert_as_alone(run, requests, alone)
    # fcfs preempts the latest admitted; the priority policy the largest (priority, arrival).
    assert first_victim == {"fcfs": "p1", "priority": "p2"}


def test_a_waiting_request_of_higher_priority_preempts_at_max_num_seqs(stories_path, golden, alone):
    engine = make_engine(stories_path, max_num_seqs=2, num_kv_blocks=64, block_size=4)
    requests = [("lo5", golden[0:5], greedy(12), 5), ("lo4", golden[5:10], greedy(12), 4)]
    add_all(engine, requests)
    run = Run(engine)
    run.step()
    run.step()
    assert {s.request_id for s in engine.scheduler.running} == {"lo5", "lo4"}
    hi = ("hi", golden[10:15], greedy(6), 0)
    add_all(engine, [hi])
    run.step()
    # Admitted at once; the running request of the largest priority value went back to wait.
    assert [s.request_id for s in engine.scheduler.running] == ["lo4", "hi"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["lo5"]
    assert run.preempted == [("lo5", 0)]
    run.drain()
    assert run.preempted == [("lo5", 0)]
    assert_as_alone(run, requests + [hi], alone)


def test_a_waiting_request_of_higher_priority_preempts_when_the_pool_is_full(stories_path, golden, alone):
    engine = make_engine(stories_path, block_size=2, num_kv_blocks=16, enable_prefix_caching=False)
    requests = [("lo3", golden[0:8], greedy(10), 3), ("lo4", golden[8:16], greedy(10), 4)]
    add_all(engine, requests)
    run = Run(engine)
    run.step()
    run.step()
    assert engine.block_manager.num_free_blocks < 7     # too few for the 14-token prompt below
    hi = ("hi", golden[16:30], greedy(4), 1)
    add_all(engine, [hi])
    run.step()
    assert [s.request_id for s in engine.scheduler.running] == ["lo3", "hi"]
    assert run.preempted == [("lo4", 0)]
    run.drain()
    assert ("hi", 0) not in run.preempted and ("lo3", 0) not in run.preempted
    assert_as_alone(run, requests + [hi], alone)


@pytest.mark.parametrize("later", [1, 2])
def test_a_waiting_request_of_equal_or_lower_priority_preempts_nothing(stories_path, golden, later):
    # Equal priorities never displace each other (the one preempted would be back first next step).
    engine = make_engine(stories_path, max_num_seqs=1, num_kv_blocks=64, block_size=4)
    add_all(engine, [("first", golden[0:5], greedy(8), 1)])
    run = Run(engine)
    run.step()
    add_all(engine, [("later", golden[5:10], greedy(4), later)])
    for _ in range(3):
        run.step()
        assert [s.request_id for s in engine.scheduler.running] == ["first"]
    run.drain()
    assert run.order == [("first", 0), ("later", 0)] and not run.preempted


def test_aborting_a_waiting_request_leaves_the_priority_order(stories_path, golden, alone):
    engine = make_engine(stories_path, max_num_seqs=1, num_kv_blocks=64, block_size=4)
    requests = [(f"r{p}", golden[p:p + 5], greedy(3), p) for p in (3, 1, 4, 0, 2)]
    add_all(engine, requests)
    run = Run(engine)
    run.step()
    engine.abort_request("r1")
    engine.abort_request("r3")
    run.drain()
    assert run.order == [("r0", 0), ("r2", 0), ("r4", 0)]
    assert run.done["r1"].outputs[0].finish_reason == "abort" and run.done["r3"].outputs[0].finish_reason == "abort"
    assert_as_alone(run, [r for r in requests if r[0] in ("r0", "r2", "r4")], alone)


def test_mixed_priorities_under_a_tiny_pool_finish_as_alone(stories_path, golden, alone):
    # Chunked prompts, preemption in both directions and prefix sharing at once.
    engine = make_engine(stories_path, block_size=2, num_kv_blocks=20, max_num_seqs=4, max_num_batched_tokens=6)
    rng = np.random.default_rng(30)
    requests = []
    for i in range(12):
        start = int(rng.integers(0, 40))
        requests.append((f"q{i}", golden[start:start + int(rng.integers(3, 12))], greedy(int(rng.integers(2, 14))),
                         int(rng.integers(-2, 3))))
    run = Run(engine)
    for i, request in enumerate(requests):
        add_all(engine, [request])
        if i % 3 == 2:
            run.step()
    run.drain()
    assert run.preempted
    assert_as_alone(run, requests, alone)


# ---- the offline API ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=MAX_MODEL_LEN, scheduling_policy="priority",
             max_num_seqs=1, num_kv_blocks=64, block_size=4) as model:
        yield model


def test_generate_takes_one_priority_a_prompt_and_serves_the_lowest_first(llm, golden, alone):
    engine = llm.llm_engine
    order = []
    real_step = engine.step

    def step():
        outputs = real_step()
        order.extend(s.prompt_token_ids[:3] for s in engine.scheduler.running if s.prompt_token_ids[:3] not in order)
        return outputs

    engine.step = step
    try:
        prompts = [golden[i:i + 5] for i in range(4)]
        outs = llm.generate(prompts, greedy(3), priority=[3, np.int64(-1), 2, 0])
    finally:
        del engine.step
    assert [out.prompt_token_ids for out in outs] == prompts           # outputs in prompt order
    assert order == [prompts[i][:3] for i in (1, 3, 2, 0)]              # served by priority
    assert [token_ids(out) for out in outs] == [token_ids(alone(p, greedy(3))) for p in prompts]


@pytest.mark.parametrize("priority, needle", [
    (["high", 0], r"priority must be a list of integers, one a prompt, got \['high', 0\]"),
    ([True, 0], r"priority must be a list of integers, one a prompt, got \[True, 0\]"),
    ([1.0, 0], r"priority must be a list of integers, one a prompt, got \[1.0, 0\]"),
    ([0], "priority has 1 entries for 2 prompts"),
    ([0, 0, 0], "priority has 3 entries for 2 prompts"),
    (1, "priority must be a list of integers, one a prompt, got 1"),
    ("01", "priority must be a list of integers, one a prompt, got '01'"),
    ([2 ** 63, 0], r"priority must be an integer in \[-2\*\*63, 2\*\*63 - 1\], got 9223372036854775808"),
])
def test_generate_and_chat_name_a_bad_priority_and_queue_nothing(llm, golden, priority, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate([golden[:4], golden[4:8]], greedy(2), priority=priority)
    assert not llm.llm_engine.has_unfinished_requests()
    conversations = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "ho"}]]
    with pytest.raises(ValueError, match=needle):
        llm.chat(conversations, greedy(2), priority=priority,
                 chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_takes_one_priority_a_conversation(llm):
    conversations = [[{"role": "user", "content": "Once upon"}], [{"role": "user", "content": "a time"}]]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    by_priority = llm.chat(conversations, greedy(3), chat_template=template, priority=[1, 0])
    plain = llm.chat(conversations, greedy(3), chat_template=template)
    assert [token_ids(o) for o in by_priority] == [token_ids(o) for o in plain]


@pytest.mark.parametrize("priority, needle", [
    (True, "priority must be an integer, got True"),
    ("1", "priority must be an integer, got '1'"),
    (None, "priority must be an integer, got None"),
    (1.5, "priority must be an integer, got 1.5"),
    (-2 ** 63 - 1, r"priority must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"),
])
def test_add_request_names_a_bad_priority_and_queues_nothing(llm, priority, needle):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=needle):
        engine.add_request("bad", [1, 403], greedy(2), priority=priority)
    assert not engine.has_unfinished_requests() and "bad" not in engine.requests


def test_an_unknown_policy_is_named_by_the_config_and_the_cli(stories_path):
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"):
        EngineConfig(model=str(stories_path), scheduling_policy="lifo")
    result = subprocess.run([sys.executable, "-m", "minillm.cli", "generate", str(stories_path), "--prompt", "hi",
                             "--scheduling-policy", "lifo"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--scheduling-policy" in result.stderr, result.stderr
