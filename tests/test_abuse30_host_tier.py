"""The host KV tier (--kv-offload-gib) under abuse on stories260K with tiny pools: blocks offloaded
and loaded back hold the KV a plain engine computes for them, and greedy outputs match an engine
without the tier; a full tier drops its least recently used blocks; a request aborted while its
blocks load; the prefix cache reset while blocks sit in the tier; requests racing to load one
shared prefix; the tier under preemption; and the tier's figures against the copies made."""
from __future__ import annotations

import json

import numpy as np
import pytest

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sequence import Sequence

from test_kv_offload import assert_host_consistent

BS = 4
BYTES_PER_BLOCK = 2 * 5 * 4 * 8 * BS * 4     # K and V, 5 layers, 4 KV heads of 8, float32
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


def make(stories_path, host_blocks: int = 0, num_kv_blocks: int = 12, max_model_len: int = 48,
         **kw) -> LLMEngine:
    """An engine on the CPU with blocks of 4 tokens and a host tier of host_blocks blocks (0: none)."""
    return LLMEngine(EngineConfig(str(stories_path), device="cpu", block_size=BS, num_kv_blocks=num_kv_blocks,
                                  max_model_len=max_model_len, kv_offload_gib=host_blocks * BYTES_PER_BLOCK / 2**30,
                                  **kw))


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    """Add the requests and step until all are done: each one's output token ids."""
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs


def prompt_keys(engine: LLMEngine, ids: list[int]) -> list[bytes]:
    """The prefix-cache keys of a prompt's full blocks."""
    seq = Sequence("keys", 0, ids, SamplingParams(), 0.0, None, 1)
    return engine.block_manager.keys_of(seq, len(ids) // BS)


def in_host(engine: LLMEngine, ids: list[int]) -> list[bool]:
    """For each full block of a prompt, whether the host tier holds it."""
    return [key in engine.kv_connector.key_to_block for key in prompt_keys(engine, ids)]


class Copies:
    """Counts the blocks the host tier's worker copies each way (its figures are checked against them)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.saved = self.loaded = 0
        worker = engine.runner.kv_connector
        real = worker._copy

        def copy(saves, loads):
            self.saved += saves.num_blocks
            self.loaded += loads.num_blocks
            return real(saves, loads)

        worker._copy = copy


def assert_no_leak(engine: LLMEngine) -> None:
    """Every device block free, the host tier's maps consistent."""
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert_host_consistent(engine.kv_connector)


def block_kv(engine: LLMEngine, key: bytes) -> np.ndarray:
    """The K/V a device block holds for a prefix-cache key: [layers, 2, block_size, kv_heads, head_dim]."""
    block = engine.block_manager.key_to_block[key]
    return np.asarray(engine.runner.kv_pool[:, :, block]).copy()


def prompts_of(golden: list[int], count: int, length: int, stride: int = 9) -> dict[str, list[int]]:
    """count distinct prompts of `length` tokens, each starting at BOS."""
    return {f"p{i}": [1] + golden[1 + stride * i: length + stride * i] for i in range(count)}


# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_loaded_back_hold_the_kv_computed_for_them(stories_path, golden, async_scheduling):
    plain = make(stories_path, async_scheduling=async_scheduling)
    tiered = make(stories_path, host_blocks=32, async_scheduling=async_scheduling)
    first = [1] + golden[1:21]                    # 21 tokens: 5 full blocks
    others = prompts_of(golden[30:], 3, 21)
    for engine in (plain, tiered):
        run(engine, {"first": first})
        run(engine, others)                       # pushes the first prompt out of the device pool
        assert engine.block_manager.find_cached_blocks(Sequence("x", 0, first, GREEDY, 0.0, None, 1)) == []
    assert all(in_host(tiered, first))
    before = tiered.stats(cells=1).kv_offload_hits
    again_tiered = run(tiered, {"again": first})
    again_plain = run(plain, {"again": first})
    assert again_tiered == again_plain
    assert tiered.stats(cells=1).kv_offload_hits - before == 20          # every block but the last token's
    for key in prompt_keys(tiered, first):        # loaded blocks hold what the plain engine computed
        np.testing.assert_array_equal(block_kv(tiered, key), block_kv(plain, key))
    assert_no_leak(tiered)


def test_a_full_host_tier_drops_its_least_recently_used_blocks(stories_path, golden):
    # A device pool of one request (4 blocks): each request evicts the last one's 3 hashed blocks to
    # the host tier, which holds 6: two requests' worth.
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    engine = make(stories_path, host_blocks=6, num_kv_blocks=4, max_model_len=16)
    plain = make(stories_path, num_kv_blocks=4, max_model_len=16)
    a, b, c, d = prompts_of(golden, 4, 9).values()
    run(engine, {"a": a})
    run(engine, {"b": b})
    assert in_host(engine, a) == [True, True] and not any(in_host(engine, b))
    run(engine, {"a-again": a})                   # A, saved before B, is used again: loaded from the tier
    assert engine.kv_connector.hit_tokens == 8 and all(in_host(engine, b))
    run(engine, {"c": c})
    run(engine, {"d": d})                         # C's blocks take the least recently used ones: B's
    assert in_host(engine, a) == [True, True] and in_host(engine, c) == [True, True]
    assert not any(in_host(engine, b))
    assert len(engine.kv_connector.lru) == 6
    hits = engine.kv_connector.hit_tokens
    assert run(engine, {"b-again": b}, params) == run(plain, {"b-again": b}, params)
    assert engine.kv_connector.hit_tokens == hits      # B was dropped: computed again
    assert_no_leak(engine)


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "with-a-request-sharing-its-blocks"])
def test_a_request_aborted_while_its_blocks_load(stories_path, golden, shared):
    tiered = make(stories_path, host_blocks=32, async_scheduling=True)
    plain = make(stories_path)
    first = [1] + golden[1:21]
    for engine in (tiered, plain):
        run(engine, {"first": first})
        run(engine, prompts_of(golden[30:], 3, 21))
    copies = Copies(tiered)
    tiered.add_request("victim", first + [5, 6], GREEDY)
    if shared:
        tiered.add_request("sibling", first + [7, 8], GREEDY)
    tiered.step()                                 # launched with its loads, not read back
    assert tiered._in_flight and copies.loaded == 5
    tiered.abort_request("victim")
    outputs = {}
    while tiered.has_unfinished_requests():
        for out in tiered.step():
            if out.finished:
                outputs[out.request_id] = (out.outputs[0].finish_reason, out.outputs[0].token_ids)
    assert outputs["victim"][0] == "abort"
    if shared:                                    # the sibling read the loaded blocks it shares
        assert outputs["sibling"] == ("length", run(plain, {"sibling": first + [7, 8]})["sibling"])
    assert_no_leak(tiered)
    assert run(tiered, {"again": first + [5, 6]}) == run(plain, {"again": first + [5, 6]})
    for key in prompt_keys(tiered, first):
        np.testing.assert_array_equal(block_kv(tiered, key), block_kv(plain, key))
    assert_no_leak(tiered)


def test_reset_prefix_cache_forgets_the_host_tier_too(stories_path, golden):
    tiered = make(stories_path, host_blocks=32)
    plain = make(stories_path)
    first = [1] + golden[1:21]
    run(tiered, {"first": first})
    run(tiered, prompts_of(golden[30:], 3, 21))
    assert all(in_host(tiered, first))
    tiered.add_request("busy", first, GREEDY)     # a request holding blocks: nothing is forgotten
    tiered.step()
    used = tiered.stats(cells=1).kv_offload_num_used_blocks
    assert tiered.block_manager.num_used_blocks and tiered.reset_prefix_cache() is False
    assert tiered.stats(cells=1).kv_offload_num_used_blocks == used and all(in_host(tiered, first))
    tiered.abort_request("busy")
    while tiered.has_unfinished_requests():
        tiered.step()
    assert tiered.reset_prefix_cache() is True
    stats = tiered.stats(cells=1)
    assert stats.kv_offload_num_used_blocks == 0 and not any(in_host(tiered, first))
    assert_no_leak(tiered)
    hits = stats.kv_offload_hits
    assert run(tiered, {"again": first}) == run(plain, {"again": first})
    assert tiered.stats(cells=1).kv_offload_hits == hits    # computed afresh, nothing loaded
    run(tiered, prompts_of(golden[30:], 3, 21))   # the tier fills again after a reset
    assert all(in_host(tiered, first))
    hits = tiered.stats(cells=1).kv_offload_hits
    assert run(tiered, {"third": first}) == run(plain, {"third": first})
    assert tiered.stats(cells=1).kv_offload_hits == hits + 20
    assert_no_leak(tiered)


@pytest.mark.parametrize("budget", [256, 8], ids=["one-step", "chunked"])
def test_requests_sharing_a_prefix_load_it_once(stories_path, golden, budget):
    tiered = make(stories_path, host_blocks=32, num_kv_blocks=24, max_num_batched_tokens=budget,
                  async_scheduling=True)
    plain = make(stories_path, num_kv_blocks=24)
    prefix = [1] + golden[1:21]
    run(tiered, {"prefix": prefix})
    run(tiered, prompts_of(golden[30:], 5, 21))   # the prefix leaves the device for the tier
    assert all(in_host(tiered, prefix)) and not tiered.block_manager.find_cached_blocks(
        Sequence("x", 0, prefix, GREEDY, 0.0, None, 1))
    copies, hits = Copies(tiered), tiered.kv_connector.hit_tokens
    racers = {f"r{i}": prefix + golden[100 + 3 * i: 103 + 3 * i] for i in range(4)}
    outputs = run(tiered, racers)
    assert outputs == {rid: run(plain, {rid: ids})[rid] for rid, ids in racers.items()}
    assert copies.loaded == 5 and tiered.kv_connector.hit_tokens - hits == 20
    assert_no_leak(tiered)


def test_the_tier_under_preemption(stories_path, golden):
    # 10 blocks of 4 tokens for four requests of 13 + 16 tokens: they preempt one another, and a
    # victim's evicted blocks come back from the tier when it resumes.
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tiered = make(stories_path, host_blocks=64, num_kv_blocks=10, max_model_len=40)
    plain = make(stories_path, num_kv_blocks=40, max_model_len=40)
    prompts = prompts_of(golden, 4, 13, stride=17)
    outputs = run(tiered, prompts, params)
    stats = tiered.stats(cells=1)
    assert stats.num_preemptions > 0 and stats.kv_offload_hits > 0
    assert outputs == {rid: run(plain, {rid: ids}, params)[rid] for rid, ids in prompts.items()}
    assert_no_leak(tiered)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_tiers_figures_match_the_copies_made(stories_path, golden, async_scheduling):
    tiered = make(stories_path, host_blocks=8, num_kv_blocks=12, async_scheduling=async_scheduling)
    copies = Copies(tiered)
    prompts = prompts_of(golden, 6, 17)
    for rid in ["p0", "p1", "p2", "p0", "p3", "p1", "p4", "p0", "p5", "p2"]:
        run(tiered, {rid: prompts[rid]})
    stats, host = tiered.stats(cells=1), tiered.kv_connector
    assert copies.saved > 8 and copies.loaded > 0                 # the tier filled and served
    assert stats.kv_offload_num_blocks == 8 and stats.kv_offload_num_used_blocks == len(host.lru) == 8
    assert stats.kv_offload_hits == copies.loaded * BS
    assert stats.kv_offload_bytes_to_host == copies.saved * BYTES_PER_BLOCK
    assert stats.kv_offload_bytes_to_device == copies.loaded * BYTES_PER_BLOCK
    assert tiered.runner.kv_connector.copy_stats()["bytes_to_device"] == copies.loaded * BYTES_PER_BLOCK
    assert_no_leak(tiered)


def test_a_salted_prompt_never_loads_another_salts_blocks(stories_path, golden):
    tiered = make(stories_path, host_blocks=64)
    first = [1] + golden[1:21]
    tiered.add_request("alice", first, GREEDY, cache_salt="alice")
    while tiered.has_unfinished_requests():
        tiered.step()
    run(tiered, prompts_of(golden[30:], 3, 21))
    assert len(tiered.kv_connector.lru) >= 5 and not any(in_host(tiered, first))   # alice's keys are salted
    for salt, loaded in (("bob", 0), (None, 0), ("alice", 20)):
        hits = tiered.kv_connector.hit_tokens
        tiered.add_request(f"again-{salt}", first, GREEDY, cache_salt=salt)
        while tiered.has_unfinished_requests():
            tiered.step()
        assert tiered.kv_connector.hit_tokens - hits == loaded, salt
        run(tiered, prompts_of(golden[30:], 3, 21))
    assert_no_leak(tiered)
