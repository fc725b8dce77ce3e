"""A seeded stress of LLMEngine's core on stories260K the way a busy server drives it.

Many requests (shared long prefixes, n > 1, random max_tokens) arrive at random steps on tiny KV
pools that force preemption and recompute, under prefix caching on and off, the host KV tier,
n-gram speculation, small token budgets, a step-time budget, the priority policy and async
scheduling; requests are aborted while waiting,
while preempted (their token still in flight under async scheduling) and in the step whose token
would finish them. After every step the pool agrees with the sequences holding it; each request is
reported finished exactly once with a valid finish reason; greedy outputs equal the request's output
alone (an aborted one's are a prefix of it); the pool is wholly free at the end.
"""
import random
from collections import Counter

import pytest
from test_fuzz18_engine import MAX_MODEL_LEN, golden, make_engine  # noqa: F401 - golden is a fixture

from minillm import SamplingParams
from minillm.sequence import SequenceStatus

FINISH_REASONS = {"stop", "length", "abort"}


@pytest.fixture(scope="module")
def alone(stories_path):
    """(token ids, finish reason) of a greedy request run alone on a roomy pool, memoised."""
    engine = make_engine(stories_path, enable_prefix_caching=False)
    memo = {}

    def run(prompt, params):
        key = (tuple(prompt), params.max_tokens, params.ignore_eos)
        if key not in memo:
            engine.add_request("alone", prompt, SamplingParams(temperature=0, max_tokens=params.max_tokens,
                                                               ignore_eos=params.ignore_eos))
            out = None
            while engine.has_unfinished_requests():
                out = next((o for o in engine.step() if o.finished), out)
            memo[key] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        return memo[key]

    yield run
    engine.shutdown()


def assert_invariants(engine):
    """The pool agrees with the live sequences: ref counts, the free queue, the prefix cache's maps."""
    bm, sched = engine.block_manager, engine.scheduler
    holders = [0] * bm.num_blocks
    for seq in [*sched.running, *sched.waiting]:
        assert not seq.is_finished, f"finished {seq.request_id} is still queued"
        for block in seq.block_table:
            holders[block] += 1
    assert all(not seq.block_table for seq in sched.waiting), "a waiting sequence holds blocks"
    assert min(bm.ref_counts) >= 0 and holders == bm.ref_counts
    assert len(bm.free_queue) == len(set(bm.free_queue))
    assert set(bm.free_queue) == {b for b in range(bm.num_blocks) if holders[b] == 0}
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert bm.num_cached_free_blocks == sum(bm.block_keys[b] is not None for b in bm.free_queue)
    assert all(bm.block_keys[block] == key for key, block in bm.key_to_block.items())
    assert sum(key is not None for key in bm.block_keys) == len(bm.key_to_block)
    stats = engine.stats(summary=True)
    assert stats.kv_num_used_blocks == bm.num_used_blocks
    assert (stats.num_running, stats.num_waiting) == (sched.num_running, sched.num_waiting)


def assert_idle(engine):
    """Every block is free (cached-free or plain) and nothing is queued or in flight."""
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_used_blocks == 0 and not any(bm.ref_counts) and bm.num_free_blocks == bm.num_blocks


def drive(engine, on_step=None, has_more=lambda: False):
    """Step to the end (until nothing is unfinished and has_more() is false), calling on_step(engine)
    before each step and checking the invariants after it; {request_id: final RequestOutput}."""
    done = {}
    while engine.has_unfinished_requests() or has_more():
        if on_step is not None:
            on_step(engine)
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} reported after it finished"
            if out.finished:
                assert all(c.finish_reason in FINISH_REASONS for c in out.outputs), out
                done[out.request_id] = out
        assert_invariants(engine)
    assert_idle(engine)
    return done


def assert_as_alone(alone, prompt, params, out):
    """Each greedy completion is the request's output alone; an aborted one's is a prefix of it."""
    want, reason = alone(prompt, params)
    for c in out.outputs:
        if c.finish_reason == "abort":
            assert c.token_ids == want[:len(c.token_ids)], (out.request_id, c.token_ids, want)
        else:
            assert (c.token_ids, c.finish_reason) == (want, reason), (out.request_id, c.token_ids, want)


CONFIGS = [   # tiny pools (a full-length sequence needs 16 of 4-token blocks, or 8 of 8) and small budgets
    dict(block_size=4, num_kv_blocks=17, max_num_batched_tokens=7, max_num_seqs=8),
    dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=True),
    dict(block_size=4, num_kv_blocks=18, max_num_batched_tokens=5, max_num_seqs=8, enable_prefix_caching=False,
         speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                             "prompt_lookup_min": 1}),
    dict(block_size=8, num_kv_blocks=9, max_num_batched_tokens=16, max_num_seqs=8, kv_offload_gib=0.0001,
         async_scheduling=True),
    dict(block_size=2, num_kv_blocks=40, max_num_batched_tokens=3, max_num_seqs=8, async_scheduling=True,
         speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                             "prompt_lookup_min": 1}, kv_offload_gib=0.0001),
    dict(block_size=4, num_kv_blocks=17, max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=False,
         async_scheduling=True, enable_prefix_caching=False),
    dict(block_size=4, num_kv_blocks=18, max_num_batched_tokens=8, max_num_seqs=3, scheduling_policy="priority",
         async_scheduling=True, kv_offload_gib=0.0001),
    dict(block_size=4, num_kv_blocks=18, max_num_batched_tokens=32, max_num_seqs=8, max_step_factor=2.0,
         speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                             "prompt_lookup_min": 1}),
]


def random_prompt(rng, golden):
    """A prompt of 1 to 50 tokens: a long shared prefix (prefix-cache hits), a repeated token
    (the n-gram drafter's best case) or a slice of a story."""
    kind = rng.random()
    if kind < 0.35:
        return golden[:32] + golden[40:40 + rng.randint(0, 12)]
    if kind < 0.5:
        return [1] + [rng.choice([403, 261])] * rng.randint(1, 30)
    start = rng.randint(0, 60)
    return [1] + golden[start:start + rng.randint(0, 45)]


def random_requests(rng, golden, num):
    requests = {}
    for i in range(num):
        prompt = random_prompt(rng, golden)
        greedy = rng.random() < 0.75
        params = SamplingParams(n=rng.choice([1, 1, 2, 3]), temperature=0 if greedy else 1.0,
                                seed=None if greedy else rng.randint(0, 9), ignore_eos=rng.random() < 0.5,
                                max_tokens=rng.randint(1, min(24, MAX_MODEL_LEN - len(prompt))))
        requests[f"r{i}"] = (prompt, params)
    return requests


class Chaos:
    """Adds requests at random steps and aborts some: waiting, preempted, or with the token that
    would finish them in flight; counts which kinds it hit."""

    def __init__(self, rng, requests, by_priority=False):
        self.rng, self.pending, self.requests = rng, list(requests), requests
        self.by_priority = by_priority
        self.hits = Counter()

    def __call__(self, engine):
        rng = self.rng
        while self.pending and rng.random() < 0.35:
            rid = self.pending.pop(0)
            engine.add_request(rid, *self.requests[rid], priority=rng.randint(-1, 1) if self.by_priority else 0)
        live = {rid: req for rid, req in engine.requests.items() if not req.is_finished}
        if live and rng.random() < 0.06:
            kinds = {rid: abort_kind(req.seqs) for rid, req in live.items()}
            preferred = [rid for rid, kind in kinds.items() if kind != "running"]
            rid = rng.choice(sorted(preferred or live))
            self.hits[kinds[rid]] += 1
            engine.abort_request(rid)


def abort_kind(seqs):
    """What an abort of a request with these sequences catches."""
    if any(s.status is SequenceStatus.WAITING and s.num_preemptions for s in seqs):
        return "preempted"
    if any(s.is_at_length_limit and s.num_output_placeholders for s in seqs if not s.is_finished):
        return "last_token_in_flight"
    if all(s.status is SequenceStatus.WAITING for s in seqs if not s.is_finished):
        return "waiting"
    return "running"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()
                                                                     if k != "speculative_config"))
def test_a_busy_engine_keeps_its_pool_and_gives_each_greedy_request_its_output_alone(stories_path, golden,
                                                                                     alone, config):
    rng = random.Random(sorted(config.items()).__repr__())
    requests = random_requests(rng, golden, 14)
    engine = make_engine(stories_path, **config)
    chaos = Chaos(rng, requests, config.get("scheduling_policy") == "priority")
    done = drive(engine, chaos, lambda: bool(chaos.pending))
    assert set(done) == set(requests)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"
    reasons = Counter(c.finish_reason for out in done.values() for c in out.outputs)
    assert +Counter(engine.stats().num_requests_finished) == reasons
    for rid, (prompt, params) in requests.items():
        assert len(done[rid].outputs) == params.n
        if params.temperature == 0:
            assert_as_alone(alone, prompt, params, done[rid])
    engine.shutdown()



class AbortWhen:
    """Aborts each target request at the first step its sequences are in the state it names."""

    def __init__(self, targets):
        self.targets = dict(targets)      # request_id -> abort_kind() that triggers its abort
        self.hit = set()

    def __call__(self, engine):
        for rid, kind in list(self.targets.items()):
            req = engine.requests.get(rid)
            if req is not None and not req.is_finished and abort_kind(req.seqs) == kind:
                engine.abort_request(rid)
                self.hit.add(rid)
                del self.targets[rid]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborts_while_waiting_preempted_and_with_the_last_token_in_flight(stories_path, golden, alone,
                                                                          async_scheduling):
    # Three 30-token prompts sharing 28 tokens, each to 60 tokens (15 blocks of 4) on 17 blocks:
    # the later ones are preempted; "w" waits behind them; "last" is aborted with its last token
    # on the device (async scheduling) or once it is running.
    shared = golden[:28]
    requests = {f"p{i}": (shared + golden[40 + i:42 + i], SamplingParams(temperature=0, max_tokens=30,
                                                                       ignore_eos=True)) for i in range(3)}
    requests["w"] = (shared + golden[50:53], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    requests["last"] = (golden[:6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2))
    engine = make_engine(stories_path, block_size=4, num_kv_blocks=17, max_num_batched_tokens=16,
                         async_scheduling=async_scheduling)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    aborts = AbortWhen({"p2": "preempted", "w": "waiting",
                        "last": "last_token_in_flight" if async_scheduling else "running"})
    done = drive(engine, aborts)
    assert aborts.hit == {"p2", "w", "last"}, aborts.targets
    assert engine.scheduler.num_preemptions > 0
    assert {rid for rid, out in done.items() if any(c.finish_reason == "abort" for c in out.outputs)} == aborts.hit
    assert not done["w"].outputs[0].token_ids
    for rid, (prompt, params) in requests.items():
        assert_as_alone(alone, prompt, params, done[rid])
    engine.shutdown()
