"""The KV pool's accounting under abuse, on stories260K on the CPU.

Hypothesis draws a pool a few blocks above one full-length sequence (recompute preemption), the host
KV tier, the priority policy, async scheduling, and requests over prompt families that share
prefixes, with n > 1, cache salts, priorities, stop strings, max_tokens 1 and prompt_logprobs. They
arrive at random steps; some are aborted at a random step, or once waiting, preempted or running,
and some have one child of n ended alone (an API server's stop string: LLMEngine.stop_sequence).

After every step each block's reference count is the number of live sequences' tables that hold it,
free + cached-free + used blocks are the pool, a block's prefix key is the key of the tokens (and
salt) of every sequence that holds it at that position, the host tier holds only keys some
sequence's tokens hashed to and its maps agree. At the end every block is free, the host tier is
whole, no sequence is queued or kept, and each greedy request that was neither aborted nor cut
gives its output alone.
"""
from __future__ import annotations

import gc
import json
import os
import weakref
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_kv_offload import assert_host_consistent

from minillm import SamplingParams
from minillm.block_manager import cache_salt_root, prompt_block_keys
from minillm.block_tables import BlockTables
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sequence import SequenceStatus

MAX_LEN = 48
BYTES_PER_TOKEN = 2 * 5 * 4 * 8 * 4      # K and V, 5 layers, 4 KV heads of 8, float32
STOP_WORDS = [".", " the", ",", " was"]
EXAMPLES = int(os.environ.get("MINILLM_FUZZ_EXAMPLES", "80"))
CUT = "<cut>"                            # the stop string that ends one child of n alone
ABORTS = ["at_step", "waiting", "preempted", "running"]


def make_engine(path, host_blocks: int = 0, **kw) -> LLMEngine:
    """An engine on the CPU with a host tier of exactly host_blocks blocks (0: none)."""
    per_block = BYTES_PER_TOKEN * kw.get("block_size", 16)
    gib = (host_blocks + 0.5) * per_block / 2**30 if host_blocks else 0
    return LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=MAX_LEN, kv_offload_gib=gib, **kw),
                     log=lambda m: None)


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def alone(stories_path):
    """(completions as (token ids, finish reason, stop reason), prompt logprob ids) of a request run
    alone on a roomy engine without prefix caching, memoised."""
    engine = make_engine(stories_path, enable_prefix_caching=False)
    memo = {}

    def run(prompt: list[int], fields: dict):
        key = (tuple(prompt), repr(sorted(fields.items())))
        if key not in memo:
            engine.add_request("alone", prompt, SamplingParams(**fields), output_kind="final")
            done = None
            while engine.has_unfinished_requests():
                done = next((o for o in engine.step() if o.finished), done)
            memo[key] = ([(c.token_ids, c.finish_reason, c.stop_reason) for c in done.outputs],
                         None if done.prompt_logprobs is None else
                         [None if d is None else sorted(d) for d in done.prompt_logprobs])
        return memo[key]

    yield run
    engine.shutdown()


# ---- the invariants ---------------------------------------------------------------------------

def assert_accounts(engine: LLMEngine, seqs: list, roots: dict, keys_seen: set, finished_keys: set) -> None:
    """The pool, the prefix cache and the host tier agree with the live sequences (seqs: every
    sequence added so far; roots: seq_id -> the key root of its request's salt; keys_seen grows by
    the prefix keys of their tokens, finished_keys by the seq_ids of finished sequences whose keys
    are in it)."""
    bm, sched, bs = engine.block_manager, engine.scheduler, engine.block_manager.block_size
    queued = [*sched.running, *sched.waiting]
    assert len({id(s) for s in queued}) == len(queued), "a sequence is queued twice"
    live = [s for s in seqs if not s.is_finished]
    assert {id(s) for s in live} == {id(s) for s in queued}, "live and queued sequences differ"
    holders = Counter()
    for s in seqs:
        root = roots[s.seq_id]
        assert s.block_key_root == root, s.request_id
        if s.is_finished:
            assert not s.block_table and not s.block_hashes, f"finished {s.request_id} holds blocks"
            if s.seq_id not in finished_keys:       # its tokens no longer change
                finished_keys.add(s.seq_id)
                keys_seen.update(prompt_block_keys(s.token_ids, bs, root))
            continue
        keys = prompt_block_keys(s.token_ids, bs, root)
        keys_seen.update(keys)
        assert s.token_block_keys == keys[:len(s.token_block_keys)], f"{s.request_id}: keys of other tokens"
        if s.status is SequenceStatus.WAITING:
            assert s in sched.waiting and not s.block_table and s.num_computed_tokens == 0, s.request_id
            continue
        assert s.status is SequenceStatus.RUNNING and s in sched.running, s.request_id
        table, hashes = s.block_table, s.block_hashes
        assert s.num_computed_tokens <= s.num_tokens, s.request_id
        assert len(table) == bm.blocks_needed(s.num_computed_tokens), (s.request_id, len(table), s.num_computed_tokens)
        assert hashes == keys[:len(hashes)] and len(hashes) <= s.num_computed_tokens // bs, s.request_id
        for i, block in enumerate(table):
            holders[block] += 1
            key = bm.block_keys[block]
            if i < len(hashes):
                assert key in (None, hashes[i]), f"{s.request_id}: block {i} holds another prefix's key"
            else:
                assert key is None, f"{s.request_id}: block {i} is cached before it is computed"
    assert bm.ref_counts == [holders[b] for b in range(bm.num_blocks)]
    assert len(bm.free_queue) == len(set(bm.free_queue))
    assert set(bm.free_queue) == {b for b in range(bm.num_blocks) if not holders[b]}
    cached_free = sum(bm.block_keys[b] is not None for b in bm.free_queue)
    assert bm.num_cached_free_blocks == cached_free
    assert all(bm.block_keys[block] == key for key, block in bm.key_to_block.items())
    assert sum(key is not None for key in bm.block_keys) == len(bm.key_to_block)
    shared = [b for b, n in holders.items() if n > 1]
    assert all(bm.block_keys[b] is not None for b in shared), "a shared block holds no prefix key"
    assert 0 <= bm.prefix_cache_hits <= bm.prefix_cache_queries
    assert_block_tables_current(engine.runner.block_tables, sched.running)
    stats = engine.stats(summary=True)
    assert (stats.kv_num_used_blocks, stats.kv_num_cached_blocks, stats.kv_num_free_blocks) == \
        (bm.num_used_blocks, cached_free, bm.num_free_blocks - cached_free)
    assert stats.kv_num_used_blocks + stats.kv_num_cached_blocks + stats.kv_num_free_blocks == bm.num_blocks
    host = engine.kv_connector
    if host is not None:
        assert_host_consistent(host)
        assert set(host.key_to_block) <= keys_seen, "the host tier holds a key no sequence's tokens hash to"
        assert stats.kv_offload_num_used_blocks == len(host.lru)


def assert_block_tables_current(tables: BlockTables, running: list) -> None:
    """The runner's host rows: one row per entry, none also free, and the row of a sequence whose
    table the entry saw last (the same list, as long) is that table, zeros after it."""
    rows = [entry[0] for entry in tables._entries.values()]
    assert len(set(rows)) == len(rows) and not set(rows) & set(tables._free)
    for s in running:
        entry = tables._entries.get(s.seq_id)
        if entry is not None and entry[1] is s.block_table and entry[2] == len(s.block_table):
            row, n = tables.rows[entry[0]], len(s.block_table)
            assert row[:n].tolist() == s.block_table and not row[n:].any(), s.request_id


def assert_whole(engine: LLMEngine, seqs: list) -> None:
    """Nothing queued, in flight or held: every block free, the host tier's maps consistent."""
    bm, sched = engine.block_manager, engine.scheduler
    assert not engine.has_unfinished_requests() and not engine.requests
    assert not sched.waiting and not sched.running and not sched.masked_out
    assert all(s.is_finished and not s.block_table for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts) and bm.num_used_blocks == 0
    if engine.kv_connector is not None:
        assert_host_consistent(engine.kv_connector)
        # a key on both tiers holds the same K/V on both
        host_pool, kv_pool = engine.runner.kv_connector.host_pool, engine.runner.kv_pool
        for key, host in engine.kv_connector.key_to_block.items():
            if (block := bm.key_to_block.get(key)) is not None:
                np.testing.assert_allclose(np.asarray(host_pool[:, :, host]), np.asarray(kv_pool[:, :, block]),
                                           rtol=1e-5, atol=1e-5)
    assert engine.reset_prefix_cache()
    assert bm.num_cached_free_blocks == 0 and not bm.key_to_block
    if engine.kv_connector is not None:
        host = engine.kv_connector
        assert not host.lru and not host.key_to_block and len(host.free_blocks) == host.num_blocks


# ---- the scenarios ----------------------------------------------------------------------------

@st.composite
def engine_configs(draw, host_tier: bool = False) -> tuple[dict, int]:
    """(EngineConfig fields, host tier blocks): a pool at most 2 blocks above one full-length
    sequence; host_tier: a host tier of half a sequence's blocks or more."""
    bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    min_blocks = -(-MAX_LEN // bs)
    kw = dict(block_size=bs, num_kv_blocks=min_blocks + draw(st.integers(0, 2)),
              max_num_seqs=draw(st.integers(1, 6)), async_scheduling=draw(st.booleans()),
              scheduling_policy=draw(st.sampled_from(["fcfs", "priority", "priority"])))
    if draw(st.booleans()):
        kw["max_num_batched_tokens"] = draw(st.integers(1, 24))
    else:
        kw.update(enable_chunked_prefill=False, max_num_batched_tokens=draw(st.integers(MAX_LEN, 2 * MAX_LEN)))
    host_blocks = draw(st.sampled_from([min_blocks // 2, min_blocks, 2 * min_blocks] if host_tier else
                                       [0, 1, min_blocks // 2, min_blocks, 2 * min_blocks]))
    return kw, host_blocks


@st.composite
def request_lists(draw, golden: list[int], waves: bool = False) -> list[dict]:
    """Requests over prompt families sharing prefixes, each with its arrival step and how it ends
    early; waves: most take an earlier one's prompt and salt again, later (a device or host hit
    once other prompts have evicted its blocks)."""
    bases = [golden[:40], [1] + golden[60:70] * 3, golden[:28] + golden[1:12]]
    requests = []
    for i in range(draw(st.integers(1, 10))):
        base = draw(st.sampled_from(bases))
        cut = draw(st.one_of(st.sampled_from([8, 16, 17, 24, 32]), st.integers(1, len(base))))
        prompt = base[:cut] + draw(st.lists(st.integers(3, 511), max_size=2))
        salt, arrival = draw(st.sampled_from([None, None, "a", "b"])), draw(st.integers(0, 40))
        if requests and draw(st.integers(0, 3 if waves else 1)):       # an earlier prompt again, later
            earlier = draw(st.sampled_from(requests))
            prompt, salt, arrival = earlier["prompt"], earlier["salt"], earlier["arrival"] + draw(st.integers(5, 40))
        max_tokens = draw(st.sampled_from([1, 1, 3, 12, None, None]))
        n = draw(st.sampled_from([1, 1, 2, 3]))
        fields = dict(n=n, max_tokens=max_tokens, ignore_eos=draw(st.sampled_from([False, True, True])),
                      stop=draw(st.sampled_from([[], [], [STOP_WORDS[i % 4]], STOP_WORDS[:2]])),
                      prompt_logprobs=draw(st.sampled_from([None, None, None, 1])))
        if draw(st.integers(0, 3)):
            fields["temperature"] = 0.0
        else:
            fields.update(temperature=1.0, seed=draw(st.integers(0, 99)))
        end = draw(st.sampled_from([None, None, None, *ABORTS, "cut_child"]))
        rid = f"r{i}"
        if requests and not draw(st.integers(0, 5)):
            rid = draw(st.sampled_from(requests))["rid"]      # taken again once the earlier one is done
        requests.append(dict(rid=rid, prompt=prompt, fields=fields, salt=salt,
                             priority=draw(st.integers(-1, 1)), arrival=arrival,
                             end=None if end == "cut_child" and n == 1 else end,
                             end_step=draw(st.integers(0, 12)), cut_index=draw(st.integers(0, n - 1))))
    return requests


def abort_state(seqs) -> str:
    """Where a request's live sequences are: 'preempted', 'waiting' or 'running'."""
    live = [s for s in seqs if not s.is_finished]
    if any(s.status is SequenceStatus.WAITING and s.num_preemptions for s in live):
        return "preempted"
    return "waiting" if all(s.status is SequenceStatus.WAITING for s in live) else "running"


class Run:
    """Adds, aborts and cuts a scenario's requests at their steps (a request whose id an earlier one
    holds waits until that one is finished); keeps what step() reports."""

    def __init__(self, engine: LLMEngine, requests: list[dict]):
        self.engine, self.requests = engine, requests
        self.by_priority = engine.config.scheduling_policy == "priority"
        self.seqs: list = []
        self.roots: dict[int, bytes] = {}        # seq_id -> its key chain's root
        self.added: dict[int, object] = {}       # request index -> its Request
        self.done: dict[int, object] = {}        # request index -> its final RequestOutput
        self.ended: dict[int, str] = {}          # request index -> how it was ended early

    @property
    def is_done(self) -> bool:
        return len(self.done) == len(self.requests) and not self.engine.has_unfinished_requests()

    def act(self, step: int) -> None:
        engine = self.engine
        for k, r in enumerate(self.requests):
            held = engine.requests.get(r["rid"])
            if k not in self.added and step >= r["arrival"] and (held is None or held.is_finished):
                engine.add_request(r["rid"], r["prompt"], SamplingParams(**r["fields"]), cache_salt=r["salt"],
                                   priority=r["priority"] if self.by_priority else 0)
                req = self.added[k] = engine.requests[r["rid"]]
                for s in req.seqs:
                    self.roots[s.seq_id] = cache_salt_root(r["salt"])
                    self.seqs.append(s)
            req, end = self.added.get(k), r["end"]
            if req is None or end is None or k in self.ended or req.is_finished:
                continue
            if step < r["arrival"] + r["end_step"] and end != "preempted":   # a preemption is caught when it comes
                continue
            if end == "cut_child":
                if not req.seqs[r["cut_index"]].is_finished:
                    engine.stop_sequence(r["rid"], r["cut_index"], CUT)
                    self.ended[k] = end
            elif end == "at_step" or end == abort_state(req.seqs):
                engine.abort_request(r["rid"])
                self.ended[k] = end

    def read(self, outputs) -> None:
        for out in outputs:
            # the oldest unreported request of that id (an aborted one reports before its successor)
            k = next(k for k, r in enumerate(self.requests)
                     if r["rid"] == out.request_id and k in self.added and k not in self.done)
            if out.finished:
                self.done[k] = out


def run_scenario(stories_path, config: dict, host_blocks: int, requests: list[dict], resets: list[int],
                 alone) -> None:
    engine = make_engine(stories_path, host_blocks, **config)
    try:
        run, keys_seen, finished_keys, step = Run(engine, requests), set(), set(), 0
        while not run.is_done:
            run.act(step)
            if step in resets:      # refused (nothing forgotten) while a block is in use
                in_use = engine.block_manager.num_used_blocks
                assert engine.reset_prefix_cache() == (not in_use), (step, in_use)
            run.read(engine.step())
            assert_accounts(engine, run.seqs, run.roots, keys_seen, finished_keys)
            step += 1
            assert step < 3000, "the engine made no progress"
        assert_whole(engine, run.seqs)
        check_outputs(run, alone)
        assert_sequences_let_go(engine, run)
        event(f"preempted: {bool(engine.scheduler.num_preemptions)}")
        event(f"host hits: {bool(engine.kv_connector and engine.kv_connector.hit_tokens)}")
        for kind in run.ended.values():
            event(f"ended early: {kind}")
    finally:
        engine.shutdown()


def assert_sequences_let_go(engine: LLMEngine, run: Run) -> None:
    """Once every request is done the engine keeps at most one step's batch of their sequences."""
    refs = [weakref.ref(s) for s in run.seqs]
    run.seqs, run.added = [], {}
    gc.collect()
    kept = [ref() for ref in refs if ref() is not None]
    assert len(kept) <= engine.config.max_num_seqs, sorted((s.request_id, s.index) for s in kept)


def check_outputs(run: Run, alone) -> None:
    """Each request's outputs: n completions; a greedy request neither aborted nor cut gives its
    output alone; an aborted or cut completion's tokens are a prefix of it. (A seeded one may not:
    a row's logits move by about 1e-5 with the rows beside it, and a uniform that close to a step
    of the distribution picks the next token.)"""
    for k, r in enumerate(run.requests):
        out, fields, ended = run.done[k], r["fields"], run.ended.get(k)
        assert len(out.outputs) == fields["n"]
        assert all(c.finish_reason in ("stop", "length", "abort") for c in out.outputs), out
        if fields["temperature"] != 0:
            continue
        want, want_prompt_lps = alone(r["prompt"], fields)
        for c, (ids, reason, stop) in zip(out.outputs, want):
            cut = ended == "cut_child" and c.index == r["cut_index"] and c.stop_reason == CUT
            if c.finish_reason == "abort" or cut:
                assert ended is not None and list(c.token_ids) == ids[:len(c.token_ids)], (k, c.index)
            else:
                assert (list(c.token_ids), c.finish_reason, c.stop_reason) == (ids, reason, stop), (k, c.index)
        if fields["prompt_logprobs"] is not None and ended is None:
            assert [None if d is None else sorted(d) for d in out.prompt_logprobs] == want_prompt_lps, k


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])
@given(data=st.data())
def test_random_aborts_preemptions_and_host_tier_keep_the_pool_accounted(stories_path, golden, alone, data):
    config, host_blocks = data.draw(engine_configs(), label="config")
    requests = data.draw(request_lists(golden), label="requests")
    resets = data.draw(st.lists(st.integers(0, 60), max_size=3), label="reset_prefix_cache steps")
    run_scenario(stories_path, config, host_blocks, requests, resets, alone)


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                             HealthCheck.data_too_large])
@given(data=st.data())
def test_waves_of_repeated_prompts_through_the_host_tier_keep_the_pool_accounted(stories_path, golden, alone, data):
    config, host_blocks = data.draw(engine_configs(host_tier=True), label="config")
    requests = data.draw(request_lists(golden, waves=True), label="requests")
    run_scenario(stories_path, config, host_blocks, requests, [], alone)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("rule", [dict(repetition_penalty=1.2), dict(bad_words=["Tim was"])],
                         ids=["penalty", "bad-words"])
def test_finished_requests_whose_sampling_reads_their_outputs_are_let_go(stories_path, golden, rule,
                                                                          async_scheduling):
    # A penalty or a bad word of several tokens makes a sequence's sampling read its earlier tokens;
    # the scheduler kept every such sequence it was ever given (pruned only when a step in flight
    # was asked about, never under sync scheduling): a server's memory grew with each request.
    engine = make_engine(stories_path, block_size=4, max_num_seqs=4, async_scheduling=async_scheduling)
    refs = []
    for i in range(40):
        engine.add_request(f"r{i}", golden[:8 + i % 20], SamplingParams(temperature=0, max_tokens=4, **rule))
        refs += [weakref.ref(s) for s in engine.requests[f"r{i}"].seqs]
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()
    kept = [ref() for ref in refs if ref() is not None]
    assert len(kept) <= 4, f"{len(kept)} sequences of 40 finished requests are kept"
    engine.shutdown()
