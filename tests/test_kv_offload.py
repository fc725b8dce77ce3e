"""The host-memory tier of the prefix cache (--kv-offload-gib) behind the KV connector API.

End to end on stories260K: a multi-turn chat whose conversations do not fit the device pool gives
the same greedy text with the tier as without, and each turn's history comes from cache. Property
tests drive the scheduler, block manager and both sides of the connector through random scripts,
with the copy stream simulated so that copies and compute interleave as a GPU may run them.
"""
from __future__ import annotations

import json
import random
from collections import Counter, deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.block_manager import BlockManager
from minillm.config import EngineConfig, available_host_bytes
from minillm.device import CpuDevice, CudaDevice, block_runs
from minillm.kv_connector.host_tier import HostTierScheduler, HostTierWorker
from minillm.sampling_params import SamplingParams as Params
from minillm.scheduler import Scheduler
from minillm.sequence import Sequence, SequenceStatus
from minillm.step import SchedulerOutput, StepOutput

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BLOCK = 4


# ---------------------------------------------------------------------------------------------
# End to end: a multi-turn chat on stories260K
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


def chat_engine(path, **kw) -> LLM:
    """A device pool of 48 blocks x 4 tokens: two of the eight conversations at their longest."""
    return LLM(str(path), device="cpu", num_kv_blocks=48, block_size=BLOCK, max_model_len=128, **kw)


def run_chat(llm: LLM, golden: list[int], num_convs: int = 8, num_turns: int = 4):
    """Each turn of each conversation in turn: prompt = history + a few user tokens; history =
    prompt + reply. Returns (replies, per turn: [(history tokens, cached tokens)], per turn: the
    prefix-cache hits (device + host) counted in the stats over that turn)."""
    convs = [[1] + golden[1 + 9 * c: 1 + 9 * c + 24] for c in range(num_convs)]   # 25 tokens
    history = [[] for _ in range(num_convs)]
    replies, cached, stats_hits = [], [], []
    for turn in range(num_turns):
        before = llm.engine.stats(cells=1)
        rows = []
        for c in range(num_convs):
            prompt = history[c] + (convs[c] if turn == 0 else golden[60 + 3 * c + turn: 66 + 3 * c + turn])
            out = llm.generate([prompt], GREEDY)[0]
            rows.append((len(history[c]), out.metrics.num_cached_tokens))
            replies.append(out.outputs[0].token_ids)
            history[c] = prompt + out.outputs[0].token_ids
        after = llm.engine.stats(cells=1)
        cached.append(rows)
        stats_hits.append(after.prefix_cache_hits + after.kv_offload_hits
                          - before.prefix_cache_hits - before.kv_offload_hits)
    return replies, cached, stats_hits


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multi_turn_chat_same_text_and_history_from_cache(stories_path, golden, async_scheduling):
    plain = chat_engine(stories_path, async_scheduling=async_scheduling)
    tiered = chat_engine(stories_path, async_scheduling=async_scheduling, kv_offload_gib=0.002)
    replies, cached, _ = run_chat(plain, golden)
    replies_tier, cached_tier, hits_tier = run_chat(tiered, golden)
    assert replies_tier == replies
    for turn in range(1, 4):
        history = sum(h for h, _ in cached[turn])
        # Without the tier the conversations do not fit: most of their history was evicted.
        assert sum(c for _, c in cached[turn]) < 0.5 * history
        # With it each turn's history comes from cache, device or host, at 90% or more.
        assert hits_tier[turn] >= 0.9 * history
        for h, c in cached_tier[turn]:
            assert c >= 0.9 * h
    s = tiered.engine.stats(cells=4096)                  # one host block a cell
    assert s.kv_offload_hits > 0.5 * sum(h for t in cached_tier for h, _ in t)
    assert 0 < s.kv_offload_num_used_blocks <= s.kv_offload_num_blocks
    per_block = tiered.engine.runner.kv_pool.nbytes // 48
    assert s.kv_offload_bytes_to_device == s.kv_offload_hits // BLOCK * per_block
    assert s.kv_offload_bytes_to_host == s.kv_offload_num_used_blocks * per_block   # never evicted from host
    assert s.kv_offload_block_map.count(-2) == s.kv_offload_num_used_blocks
    moved = tiered.engine.runner.kv_connector.copy_stats()
    assert moved["bytes_to_host"] == s.kv_offload_bytes_to_host
    assert moved["bytes_to_device"] == s.kv_offload_bytes_to_device
    assert tiered.engine.block_manager.num_free_blocks == 48


def test_abort_during_a_copy_back_leaks_nothing(stories_path, golden):
    """A turn whose history is loaded from the host is aborted while its step is in flight."""
    llm = chat_engine(stories_path, async_scheduling=True, kv_offload_gib=0.002)
    engine = llm.engine
    first = [1] + golden[1:25]
    reply = llm.generate([first], GREEDY)[0].outputs[0].token_ids
    for c in range(1, 7):                                 # push the conversation out of the device
        llm.generate([[1] + golden[1 + 9 * c: 25 + 9 * c]], GREEDY)
    prompt = first + reply + golden[70:76]
    assert engine.block_manager.find_cached_blocks(Sequence("x", 0, prompt, Params(), 0.0, None, 1)) == []
    engine.add_request("victim", prompt, GREEDY)
    engine.step()                                         # launched with its loads, not read back
    assert engine.kv_connector.hit_tokens >= 0.9 * len(first + reply) and engine._in_flight
    engine.abort_request("victim")
    while engine.has_unfinished_requests():
        engine.step()
    bm, host = engine.block_manager, engine.kv_connector
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert_host_consistent(host)
    # The blocks it loaded hold the right KV: the same turn again gives the text of a plain engine.
    again = llm.generate([prompt], GREEDY)[0]
    expected = chat_engine(stories_path).generate([prompt], GREEDY)[0]
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
    assert again.metrics.num_cached_tokens >= 0.9 * len(first + reply)


# ---------------------------------------------------------------------------------------------
# Bad configuration
# ---------------------------------------------------------------------------------------------

def test_more_than_the_machine_has_is_a_start_up_error(stories_path):
    available = available_host_bytes()
    assert available is not None
    too_much = 2 * available / 2**30
    with pytest.raises(ValueError, match=r"kv_offload_gib .* exceeds the machine's available memory"):
        EngineConfig(model=str(stories_path), kv_offload_gib=too_much)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kv_offload_gib must be a finite number >= 0"):
            EngineConfig(model=str(stories_path), kv_offload_gib=bad)
    with pytest.raises(ValueError, match="kv_offload_gib needs enable_prefix_caching"):
        EngineConfig(model=str(stories_path), kv_offload_gib=0.01, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_gib 1e-09 holds no KV block"):
        LLM(str(stories_path), device="cpu", num_kv_blocks=16, max_model_len=64, kv_offload_gib=1e-9)


def test_cli_reports_the_start_up_error_in_one_line(stories_path):
    from tests.test_cli import minillm
    result = minillm("generate", str(stories_path), "--device", "cpu", "-p", "Once",
                     "--kv-offload-gib", str(2 * available_host_bytes() / 2**30))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("minillm generate: error: Invalid value for '--kv-offload-gib'")
    assert "available memory" in result.stderr and "Traceback" not in result.stderr


def test_off_builds_no_connector(stories_path):
    llm = LLM(str(stories_path), device="cpu", num_kv_blocks=16, max_model_len=64)
    assert llm.engine.kv_connector is None and llm.engine.runner.kv_connector is None
    assert llm.engine.block_manager.freed is None and llm.engine.block_manager.evicted is None
    s = llm.engine.stats()
    assert s.kv_offload_num_blocks == 0 and s.kv_offload_block_map == []


# ---------------------------------------------------------------------------------------------
# Property tests: scheduler + block manager + both connector sides, copies on a simulated stream
# ---------------------------------------------------------------------------------------------

class SimEvent:
    def __init__(self):
        self.done = False


class SimStream:
    def __init__(self):
        self.ops: deque = deque()


class SimDevice(CpuDevice):
    """CUDA stream semantics on the host: each stream runs its queued operations in order, a
    wait holds its stream until the event is recorded, and which stream runs next is up to the
    policy: "random", "compute" (copies run as late as they can) or "copy" (as early as they
    can). The host sees work done only through events."""

    def __init__(self, rng: random.Random, policy: str = "random"):
        self.rng, self.policy = rng, policy
        self.compute_stream = SimStream()
        self.streams = [self.compute_stream]

    def empty_host_like(self, pool, num_blocks):
        return np.full(pool.shape[:2] + (num_blocks,) + pool.shape[3:], np.nan, dtype=pool.dtype)

    def copy_stream(self):
        self.streams.append(SimStream())
        return self.streams[-1]

    def record_event(self, stream=None):
        event = SimEvent()
        (stream or self.compute_stream).ops.append(("record", event))
        return event

    def wait_event(self, event, stream=None):
        (stream or self.compute_stream).ops.append(("wait", event))

    def elapsed_seconds(self, start, end):
        return 0.0

    def copy_blocks(self, dst, dst_ids, src, src_ids, stream=None):
        d, s = np.array(dst_ids), np.array(src_ids)
        stream.ops.append(("run", lambda: dst.__setitem__((slice(None), slice(None), d), src[:, :, s])))

    def enqueue(self, fn):
        """A kernel on the compute stream."""
        self.compute_stream.ops.append(("run", fn))

    def _runnable(self) -> list[SimStream]:
        return [s for s in self.streams if s.ops and (s.ops[0][0] != "wait" or s.ops[0][1].done)]

    def run_one(self) -> bool:
        ready = self._runnable()
        if not ready:
            return False
        first = {"compute": self.compute_stream, "copy": self.streams[-1]}.get(self.policy)
        stream = first if first in ready else self.rng.choice(ready)
        kind, arg = stream.ops.popleft()
        if kind == "record":
            arg.done = True
        elif kind == "run":
            arg()
        return True

    def run_some(self) -> None:
        for _ in range(self.rng.randrange(4)):
            self.run_one()

    def run_until(self, event) -> None:
        while not event.done:
            assert self.run_one(), "deadlock: no stream can run"

    def synchronize(self) -> None:
        while self.run_one():
            pass
        assert not any(s.ops for s in self.streams), "deadlock: a wait never satisfied"


def token_at(seq: Sequence, position: int) -> int:
    """The fake model's token for seq at a position (a function of the prompt and the position)."""
    return 3 + (sum(seq.prompt_token_ids[:3]) * 7 + position * 5) % 40


def kv_stamps(tokens: list[int]) -> np.ndarray:
    """The fake KV of each position: a function of the whole prefix up to it, as an exact float."""
    out, v = np.empty(len(tokens)), 0
    for i, t in enumerate(tokens):
        v = (v * 1000003 + t + 1) % (1 << 40)
        out[i] = v
    return out


class FakeRunner:
    """Writes each scheduled token's fake K (its stamp) and V (minus it) into the pool on the
    simulated compute stream, and checks there that every position a step reads holds its stamp."""

    def __init__(self, device: SimDevice, worker: HostTierWorker, kv_pool: np.ndarray):
        self.device, self.worker, self.kv_pool = device, worker, kv_pool
        self.num_reads_checked = 0

    def launch(self, out: SchedulerOutput):
        assert_copies_well_formed(out.kv_connector_metadata)
        self.worker.start_load_kv(out.kv_connector_metadata)
        jobs = []
        for seq, start, n in zip(out.seqs, out.num_computed_tokens, out.num_new_tokens):
            tokens = seq.token_ids + [token_at(seq, p) for p in range(len(seq.token_ids), start + n)]
            table = np.asarray(seq.block_table)
            pos = np.arange(start + n)
            jobs.append((table[pos // BLOCK], pos % BLOCK, start, kv_stamps(tokens[:start + n])))
        self.device.enqueue(lambda: self._kernel(jobs))
        done = self.device.record_event()
        sampled = {out.seqs[b].seq_id: token_at(out.seqs[b], out.num_computed_tokens[b] + out.num_new_tokens[b])
                   for b in out.sampling_rows}
        return SimInFlight(self.device, done, sampled)

    def _kernel(self, jobs) -> None:
        # As the model does in each layer: every row's new K/V is appended, then every row attends
        # (a row may read blocks another row of the step fills: a prefix shared at admission).
        pool = self.kv_pool
        for blocks, slots, start, stamps in jobs:
            pool[0, 0, blocks[start:], slots[start:], 0, 0] = stamps[start:]
            pool[0, 1, blocks[start:], slots[start:], 0, 0] = -stamps[start:]
        for blocks, slots, start, stamps in jobs:
            read = pool[0, 0, blocks[:start], slots[:start], 0, 0]
            assert np.array_equal(read, stamps[:start]), "a step read KV that is not its prefix's"
            assert np.array_equal(pool[0, 1, blocks[:start], slots[:start], 0, 0], -stamps[:start])
            self.num_reads_checked += start


def assert_copies_well_formed(meta) -> None:
    """No block is the target of two copies of a step, and no host block is both read and written."""
    for ids in (meta.saves.device_blocks, meta.saves.host_blocks, meta.loads.device_blocks, meta.loads.host_blocks):
        assert len(set(ids.tolist())) == len(ids)
    assert not set(meta.saves.host_blocks.tolist()) & set(meta.loads.host_blocks.tolist())


class SimInFlight:
    def __init__(self, device, done, sampled):
        self.device, self.done, self.sampled = device, done, sampled

    def wait(self) -> StepOutput:
        self.device.run_until(self.done)
        return StepOutput({seq_id: [token] for seq_id, token in self.sampled.items()})


def make_system(num_blocks: int, num_host_blocks: int, rng: random.Random, budget: int = 16, max_seqs: int = 4,
                policy: str = "random"):
    bm = BlockManager(num_blocks, BLOCK, True)
    host = HostTierScheduler(bm, num_host_blocks, bytes_per_block=1)
    sched = Scheduler(bm, max_seqs, budget, num_blocks * BLOCK, [0], kv_connector=host)
    device = SimDevice(rng, policy)
    kv_pool = np.full((1, 2, num_blocks, BLOCK, 1, 1), np.nan)
    worker = HostTierWorker(num_host_blocks)
    worker.register_kv_cache(kv_pool, device)
    return sched, host, FakeRunner(device, worker, kv_pool)


def make_seq(rid: str, family: int, length: int, max_tokens: int) -> Sequence:
    """Prompts of one family share their beginning (the same turn history of one conversation)."""
    prompt = [1 + (family * 13 + i * (family + 1)) % 50 for i in range(length)]
    return Sequence(rid, 0, prompt, Params(max_tokens=max_tokens, ignore_eos=True), 0.0,
                    np.random.default_rng(0), max_tokens)


def assert_host_consistent(host: HostTierScheduler) -> None:
    """Every host block is either free or holds one key, both maps and the LRU agree."""
    held = [b for b in range(host.num_blocks) if host.block_keys[b] is not None]
    assert set(host.lru) == set(held) and len(host.lru) == len(held)
    assert {host.key_to_block[host.block_keys[b]] for b in held} == set(held)
    assert len(host.key_to_block) == len(held)
    free = list(host.free_blocks)
    assert len(free) == len(set(free)) and not set(free) & set(held)
    assert len(free) + len(held) == host.num_blocks
    assert not host._pinned and not host._loads and not host._matched


def assert_device_consistent(sched: Scheduler) -> None:
    """Ref counts are the running sequences' holdings; the free queue is every unheld block once."""
    bm = sched.block_manager
    holders = Counter(b for s in sched.running for b in s.block_table)
    for block in range(bm.num_blocks):
        assert bm.ref_counts[block] == holders.get(block, 0)
        assert (block in bm.free_queue) == (holders.get(block, 0) == 0)
    assert all(bm.key_to_block[bm.block_keys[b]] == b for b in range(bm.num_blocks) if bm.block_keys[b] is not None)
    assert bm.num_cached_free_blocks == sum(1 for b in bm.free_queue if bm.block_keys[b] is not None)
    for s in sched.waiting:
        assert s.block_table == [] and s.num_computed_tokens == 0


class Pipeline:
    """The engine loop around the scheduler with one step in flight (lag 1) or none (lag 0)."""

    def __init__(self, sched: Scheduler, runner: FakeRunner, lag: int):
        self.sched, self.runner, self.lag = sched, runner, lag
        self.in_flight: deque = deque()

    def step(self) -> None:
        out = self.sched.schedule()
        if not out.is_empty:
            self.in_flight.append((out, self.runner.launch(out)))
        depth = self.lag if not out.is_empty else 0
        while len(self.in_flight) > depth:
            out, step = self.in_flight.popleft()
            self.sched.update_from_output(out, step.wait())


SCRIPT = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(2, 30), st.integers(1, 6)),
    st.tuples(st.just("step")), st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("evict"), st.integers(4, 24)),
), min_size=1, max_size=50)


@settings(max_examples=150, deadline=None)
@given(SCRIPT, st.integers(10, 24), st.integers(1, 24), st.sampled_from([0, 1]),
       st.sampled_from(["random", "compute", "copy"]), st.randoms(use_true_random=False))
def test_random_scripts_lose_no_block_and_read_only_their_own_kv(script, num_blocks, num_host_blocks, lag, policy,
                                                                  rng):
    sched, host, runner = make_system(num_blocks, num_host_blocks, rng, policy=policy)
    pipe = Pipeline(sched, runner, lag)
    seqs: list[Sequence] = []
    for op in script:
        if op[0] in ("add", "evict"):
            # "evict": a one-off prompt of fresh tokens that pushes cached blocks out of the device.
            family, length, max_tokens = op[1:] if op[0] == "add" else (10 + len(seqs), op[1], 2)
            if length + max_tokens <= num_blocks * BLOCK:
                seqs.append(make_seq(f"r{len(seqs)}", family, length, max_tokens))
                sched.add(seqs[-1])
        elif op[0] == "abort" and seqs:
            sched.finish(seqs[op[1] % len(seqs)], SequenceStatus.FINISHED_ABORTED)
        else:
            pipe.step()
            assert_device_consistent(sched)
            assert_host_consistent(host)
        runner.device.run_some()
    for _ in range(2000):
        if not (sched.has_unfinished() or pipe.in_flight):
            break
        pipe.step()
        assert_device_consistent(sched)
        assert_host_consistent(host)
    runner.device.synchronize()
    assert not sched.has_unfinished()
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert_host_consistent(host)
    assert_host_blocks_hold_their_kv(host, runner.worker, seqs)
    for s in seqs:
        if s.status is SequenceStatus.FINISHED_LENGTH:
            assert s.output_token_ids == [token_at(s, s.num_prompt_tokens + i) for i in range(s.max_tokens)]


def assert_host_blocks_hold_their_kv(host: HostTierScheduler, worker: HostTierWorker, seqs: list[Sequence]) -> None:
    """Each host block holds the fake KV of the prefix its key stands for (from any sequence with it)."""
    bm, expected = host.block_manager, {}
    for s in seqs:
        stamps, parent = kv_stamps(s.token_ids), None
        for i in range(len(s.token_ids) // BLOCK):
            parent = bm.block_key(parent, s.token_ids[i * BLOCK:(i + 1) * BLOCK])
            expected[parent] = stamps[i * BLOCK:(i + 1) * BLOCK]
    for h in host.lru:
        assert np.array_equal(worker.host_pool[0, 0, h, :, 0, 0], expected[host.block_keys[h]])
        assert np.array_equal(worker.host_pool[0, 1, h, :, 0, 0], -expected[host.block_keys[h]])


def test_loads_of_an_aborted_sequence_land_before_anything_reuses_its_blocks():
    """The copy stream lags far behind: a sequence loads its history from the host, is aborted
    while the load is still queued, and its blocks go to another sequence at once."""
    sched, host, runner = make_system(num_blocks=12, num_host_blocks=16, rng=random.Random(0), budget=64,
                                      policy="compute")
    pipe = Pipeline(sched, runner, lag=1)
    a = make_seq("a", 0, 29, 2)
    sched.add(a)
    while not a.is_finished or pipe.in_flight:
        pipe.step()
    filler = make_seq("filler", 7, 40, 2)               # evicts a's blocks to the host
    sched.add(filler)
    while sched.has_unfinished() or pipe.in_flight:
        pipe.step()
    assert len(host.lru) >= 5                           # all but a's first block went to the host
    b = make_seq("b", 0, 33, 2)                         # a's prompt and more: its history is on the host
    sched.add(b)
    pipe.step()                                         # launched: loads queued, nothing ran yet
    assert host.hit_tokens >= 20 and b.num_computed_tokens == 33
    assert runner.device.streams[1].ops                 # the copies wait on the copy stream
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    c = make_seq("c", 3, 40, 3)                         # takes b's blocks while its loads wait
    sched.add(c)
    while sched.has_unfinished() or pipe.in_flight:
        pipe.step()
    runner.device.synchronize()
    assert c.output_token_ids == [token_at(c, 40 + i) for i in range(3)]
    assert_device_consistent(sched)
    assert_host_consistent(host)
    assert sched.block_manager.num_free_blocks == 12
    d = make_seq("d", 0, 33, 2)                          # reads b's prefix back: the right KV
    sched.add(d)
    before = runner.num_reads_checked
    while sched.has_unfinished() or pipe.in_flight:
        pipe.step()
    runner.device.synchronize()
    assert runner.num_reads_checked - before >= 28
    assert_host_blocks_hold_their_kv(host, runner.worker, [a, filler, b, c, d])


def history_on_host(policy: str, num_host_blocks: int = 16):
    """A system with a's 29-token prompt computed, then pushed to the host by a filler."""
    sched, host, runner = make_system(num_blocks=12, num_host_blocks=num_host_blocks, rng=random.Random(0),
                                      budget=64, policy=policy)
    pipe = Pipeline(sched, runner, lag=1)
    a, filler = make_seq("a", 0, 29, 2), make_seq("filler", 7, 40, 2)
    for seq in (a, filler):
        sched.add(seq)
        while sched.has_unfinished() or pipe.in_flight:
            pipe.step()
    assert len(host.lru) >= 5
    return sched, host, runner, pipe, [a, filler]


def test_a_load_into_a_block_the_step_in_flight_still_writes_waits_for_that_step():
    """x is aborted while its step, which writes x's last block, is in flight; b's loads take that
    block at once. Copies run as early as they can: the load must still wait for x's step."""
    sched, host, runner, pipe, seqs = history_on_host(policy="copy")
    x = make_seq("x", 5, 9, 8)
    sched.add(x)
    for _ in range(3):
        pipe.step()
    assert pipe.in_flight and pipe.in_flight[0][0].seqs == [x]
    partial = x.block_table[-1]
    sched.finish(x, SequenceStatus.FINISHED_ABORTED)       # freed while its step may still write it
    b = make_seq("b", 0, 33, 2)
    sched.add(b)
    pipe.step()
    meta = pipe.in_flight[-1][0].kv_connector_metadata
    assert partial in meta.loads.device_blocks.tolist()
    assert meta.loads.last_steps[meta.loads.device_blocks.tolist().index(partial)] == meta.step - 1
    while sched.has_unfinished() or pipe.in_flight:
        pipe.step()
    runner.device.synchronize()
    assert b.output_token_ids == [token_at(b, 33 + i) for i in range(2)]
    assert_host_blocks_hold_their_kv(host, runner.worker, seqs + [x, b])


def test_saves_never_overwrite_the_host_blocks_a_step_loads_from():
    """The host tier is full of b's history when b's allocation evicts the filler's blocks: their
    saves are dropped rather than written over the blocks b loads."""
    sched, host, runner, pipe, seqs = history_on_host(policy="random", num_host_blocks=7)
    b = make_seq("b", 0, 33, 2)
    sched.add(b)
    pipe.step()
    meta = pipe.in_flight[-1][0].kv_connector_metadata
    assert meta.loads.num_blocks >= 6 and meta.saves.num_blocks <= 7 - meta.loads.num_blocks
    assert not set(meta.saves.host_blocks.tolist()) & set(meta.loads.host_blocks.tolist())
    while sched.has_unfinished() or pipe.in_flight:
        pipe.step()
    runner.device.synchronize()
    assert runner.num_reads_checked >= 33 and b.output_token_ids == [token_at(b, 33 + i) for i in range(2)]
    assert_host_blocks_hold_their_kv(host, runner.worker, seqs + [b])


# ---------------------------------------------------------------------------------------------
# Pieces: block runs, stats in /metrics and the monitor
# ---------------------------------------------------------------------------------------------

def test_block_runs_cover_every_pair_in_consecutive_runs():
    src, dst = np.array([7, 3, 4, 5, 9, 10]), np.array([0, 11, 12, 2, 4, 5])
    runs = block_runs(src, dst)
    assert runs == [(3, 11, 2), (5, 2, 1), (7, 0, 1), (9, 4, 2)]
    pairs = {(s + i, d + i) for s, d, n in runs for i in range(n)}
    assert pairs == set(zip(src.tolist(), dst.tolist()))
    assert block_runs(np.array([], np.int64), np.array([], np.int64)) == []


def test_cpu_copy_blocks_moves_whole_blocks_across_layers():
    device = CpuDevice()
    pool = np.arange(2 * 2 * 5 * 3, dtype=np.float32).reshape(2, 2, 5, 3)
    host = device.empty_host_like(pool, 4)
    device.copy_blocks(host, np.array([2, 0]), pool, np.array([1, 4]), device.copy_stream())
    assert np.array_equal(host[:, :, 2], pool[:, :, 1]) and np.array_equal(host[:, :, 0], pool[:, :, 4])


def test_cuda_copy_blocks_pointers_pitches_and_runs():
    """CudaDevice.copy_blocks with cudaMemcpy2DAsync played row by row by memmove over host memory:
    its offsets, pitches, widths and directions move exactly the asked blocks."""
    import ctypes
    import types

    calls = []

    def memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
        calls.append((width, height, kind))
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    rt = types.SimpleNamespace(memcpy2DAsync=memcpy2d, memcpyHostToDevice=1, memcpyDeviceToHost=2,
                               deviceGetAttribute=lambda attribute, device: 2**31 - 1, getDevice=lambda: 0)
    device = CudaDevice.__new__(CudaDevice)
    device.cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt))

    class OnDevice:                      # what copy_blocks reads of a CuPy array
        def __init__(self, a):
            self.a, self.shape, self.dtype = a, a.shape, a.dtype
            self.data = types.SimpleNamespace(ptr=a.ctypes.data)

    rng = np.random.default_rng(0)
    pool = OnDevice(rng.standard_normal((3, 2, 7, 4, 2, 5)).astype(np.float32))   # [L, 2, blocks, bs, H, D]
    host = np.zeros((3, 2, 6, 4, 2, 5), np.float32)
    stream = types.SimpleNamespace(ptr=0)
    device.copy_blocks(host, np.array([0, 1, 2, 5]), pool, np.array([3, 4, 5, 0]), stream)
    assert np.array_equal(host[:, :, [0, 1, 2, 5]], pool.a[:, :, [3, 4, 5, 0]])
    assert not host[:, :, [3, 4]].any()
    assert calls == [(160, 6, 2), (3 * 160, 6, 2)]   # two runs of 6 rows (layer, K|V) of 160-byte blocks
    back = OnDevice(np.zeros_like(pool.a))
    device.copy_blocks(back, np.array([6, 1]), host, np.array([0, 5]), stream)
    assert np.array_equal(back.a[:, :, [6, 1]], pool.a[:, :, [3, 0]]) and calls[-1][2] == 1
    assert not back.a[:, :, [0, 2, 3, 4, 5]].any()


@pytest.fixture(scope="module")
def tier_stats(stories_path, golden):
    """Stats after a short chat, on a host tier of 48 blocks (5120 bytes each) that it mostly fills."""
    llm = chat_engine(stories_path, kv_offload_gib=48 * 5120 / 2**30)
    run_chat(llm, golden, num_convs=4, num_turns=2)
    return llm.engine.stats(cells=16)


def test_metrics_export_the_host_tier(tier_stats):
    from minillm.server.metrics import ServerMetrics
    metrics = ServerMetrics("stories", 128)
    metrics.update(tier_stats)
    text = metrics.render().decode()
    s = tier_stats
    assert f'minillm:kv_offload_blocks_total{{model_name="stories"}} {float(s.kv_offload_num_blocks)}' in text
    assert f'minillm:kv_offload_blocks_used{{model_name="stories"}} {float(s.kv_offload_num_used_blocks)}' in text
    assert f'minillm:kv_offload_hits_total{{model_name="stories"}} {float(s.kv_offload_hits)}' in text
    assert (f'minillm:kv_offload_bytes_total{{direction="to_device",model_name="stories"}} '
            f'{float(s.kv_offload_bytes_to_device)}') in text
    assert s.kv_offload_hits > 0 and s.kv_offload_bytes_to_host > 0


def test_metrics_leave_the_host_tier_out_when_off(stories_path):
    from minillm.server.metrics import ServerMetrics
    metrics = ServerMetrics("stories", 128)
    metrics.update(LLM(str(stories_path), device="cpu", num_kv_blocks=16, max_model_len=64).engine.stats())
    assert "kv_offload" not in metrics.render().decode()


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_block_grid_shows_the_host_tier_as_a_second_strip(tier_stats):
    from textual.app import App

    from minillm.tui.block_grid import HOST_LABEL, BlockGrid
    from minillm.tui.history import StatsHistory
    from minillm.tui.render import COLOR_CACHED

    class GridApp(App):
        def compose(self):
            yield BlockGrid(id="grid")

    async with GridApp().run_test(size=(60, 20)) as pilot:
        grid = pilot.app.query_one(BlockGrid)
        grid.show(tier_stats, StatsHistory())
        await pilot.pause()
        text = grid.render()
        lines = text.plain.split("\n")
        strip = next(line for line in lines if line.startswith(HOST_LABEL))
        assert len(strip.split()) - 1 == len(tier_stats.kv_offload_block_map)   # 16 cells fit in one row
        start = text.plain.index(strip)
        cached = sum(1 for sp in text.spans if start <= sp.start < start + len(strip) and str(sp.style) == COLOR_CACHED)
        assert cached == tier_stats.kv_offload_block_map.count(-2) > 0
        s = tier_stats
        assert f"host {s.kv_offload_num_used_blocks}/{s.kv_offload_num_blocks}" in grid.border_subtitle
