"""KV cache churn on stories260K the way a busy server drives it, where the seeded stress of
test_abuse37 does not go: the host tier's saves in a step that fails before they land, one prompt
sent 50 times at once (exact block multiples and one token past) on a pool just above one request,
and the K/V each tier holds after churn (salted prompts, aborts mid-prefill and mid-decode,
preemption, prompt_logprobs beside cache hits) against what a fresh engine computes for each
prefix. Outputs equal the request's output alone; the pool and the host tier end whole."""
import json

import numpy as np
import pytest
from test_kv_offload import assert_host_consistent

from minillm import SamplingParams
from minillm.block_manager import cache_salt_root, prompt_block_keys
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, StepError

BS = 4
MAX_LEN = 48
BYTES_PER_BLOCK = 2 * 5 * 4 * 8 * BS * 4     # K and V, 5 layers, 4 KV heads of 8, float32


def make(stories_path, host_blocks=0, **kw):
    """An engine on the CPU with blocks of 4 tokens and a host tier of host_blocks blocks (0: none)."""
    return LLMEngine(EngineConfig(str(stories_path), device="cpu", block_size=BS, max_model_len=MAX_LEN,
                                  kv_offload_gib=host_blocks * BYTES_PER_BLOCK / 2**30, **kw), log=lambda msg: None)


def finish(engine, requests=(), on_step=None, has_more=lambda: False):
    """Add requests {id: (prompt, params, salt)}, step (calling on_step(engine) first) until nothing is
    unfinished and has_more() is false; {id: final output}."""
    for rid, (prompt, params, salt) in dict(requests).items():
        engine.add_request(rid, prompt, params, cache_salt=salt)
    done = {}
    while engine.has_unfinished_requests() or has_more():
        if on_step is not None:
            on_step(engine)
        for out in engine.step():
            assert out.request_id not in done
            if out.finished:
                done[out.request_id] = out
    return done


def summary(out):
    """Each completion's (token ids, finish reason), and the prompt logprobs' token ids."""
    prompt = None if out.prompt_logprobs is None else [None if d is None else sorted(d) for d in out.prompt_logprobs]
    return [(c.token_ids, c.finish_reason) for c in out.outputs], prompt


def assert_whole(engine):
    """Every device block free, the host tier's maps consistent."""
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    if engine.kv_connector is not None:
        assert_host_consistent(engine.kv_connector)


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def fresh(stories_path):
    """A roomy engine: alone(prompt, params, salt) -> summary of the request run alone (memoised), and
    kv(tokens, salt) -> the K/V it computes for the last full block of tokens."""
    engine = make(stories_path, num_kv_blocks=64)
    memo = {}

    def alone(prompt, params, salt=None):
        key = (tuple(prompt), repr(params), salt)
        if key not in memo:
            engine.reset_prefix_cache()
            memo[key] = summary(finish(engine, {"alone": (prompt, params, salt)})["alone"])
        return memo[key]

    def kv(tokens, salt):
        engine.reset_prefix_cache()
        finish(engine, {"kv": (tokens + [5], SamplingParams(temperature=0, max_tokens=1), salt)})
        key = prompt_block_keys(tokens, BS, cache_salt_root(salt))[-1]
        return np.asarray(engine.runner.kv_pool[:, :, engine.block_manager.key_to_block[key]]).copy()

    alone.kv = kv
    yield alone
    engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_that_fails_before_its_saves_land_leaves_no_host_key_of_unwritten_blocks(stories_path, golden,
                                                                                        fresh, async_scheduling):
    # B's prompt evicts A's blocks from the device; the step that was to save them to the host tier
    # failed before its copies. The host tier kept A's keys on blocks nobody wrote, and the next A
    # loaded them: 16 cached tokens of garbage, another greedy output.
    engine = make(stories_path, host_blocks=64, num_kv_blocks=13, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a, b = golden[:30], golden[60:100]
    finish(engine, {"a1": (a, params, None)})
    worker = engine.runner.kv_connector
    real, failed = worker.start_load_kv, []

    def fails(meta):
        if meta is not None and meta.saves.num_blocks and not failed:
            failed.append(meta.saves.num_blocks)
            raise MemoryError("no room for the copies")
        return real(meta)
    worker.start_load_kv = fails
    with pytest.raises(StepError) as failure:
        finish(engine, {"b": (b, params, None)})
    assert failure.value.request_ids == ["b"] and failed
    worker.start_load_kv = real
    finish(engine)
    assert_whole(engine)
    assert summary(finish(engine, {"a2": (a, params, None)})["a2"]) == fresh(a, params)
    hits = engine.kv_connector.hit_tokens
    finish(engine, {"b2": (b, params, None)})      # the saves land this time: A is served from the host tier
    assert summary(finish(engine, {"a3": (a, params, None)})["a3"]) == fresh(a, params)
    assert engine.kv_connector.hit_tokens > hits
    assert_whole(engine)
    engine.shutdown()


@pytest.mark.parametrize("length", [3 * BS, 3 * BS + 1], ids=["block-multiple", "one-past"])
def test_one_prompt_fifty_times_at_once_on_a_pool_just_above_one_request(stories_path, golden, fresh, length):
    prompt = golden[:length]
    engine = make(stories_path, host_blocks=8, num_kv_blocks=MAX_LEN // BS + 1, max_num_batched_tokens=7,
                  max_num_seqs=16)
    kinds = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=MAX_LEN - length, ignore_eos=True, logprobs=1)]
    requests = {f"r{i}": (prompt, kinds[i % 3], None) for i in range(50)}
    done = finish(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for rid, (ids, params, salt) in requests.items():
        assert summary(done[rid]) == fresh(ids, params, salt), rid
    assert_whole(engine)
    engine.shutdown()


def test_churned_kv_in_both_tiers_holds_what_a_fresh_engine_computes(stories_path, golden, fresh):
    engine = make(stories_path, host_blocks=10, num_kv_blocks=14, max_num_batched_tokens=5, async_scheduling=True)
    registered = {}                               # prefix key -> (tokens, salt) of every block registered
    real = engine.block_manager.cache_full_blocks
    salts = {}

    def cache_full_blocks(seq, *args):
        real(seq, *args)
        for k, key in enumerate(seq.block_hashes):
            registered[key] = (seq.token_ids[:(k + 1) * BS], salts[seq.request_id])
    engine.block_manager.cache_full_blocks = cache_full_blocks
    shared = golden[:20]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    requests = {}
    for i in range(12):
        prompt = shared + golden[30 + 3 * i:30 + 3 * i + i % 5] if i % 3 else golden[40 + 2 * i:40 + 2 * i + 8 + i]
        params = SamplingParams(temperature=0, max_tokens=6 + i % 7, ignore_eos=True, n=1 + i % 2,
                                prompt_logprobs=1 if i % 4 == 1 else None)
        requests[f"r{i}"] = (prompt, params, [None, "alice", "bob"][i % 3])
    requests["mid-prefill"] = (golden[:36], greedy, "alice")
    requests["mid-decode"] = (shared + golden[90:95], greedy, None)
    salts.update({rid: salt for rid, (_, _, salt) in requests.items()})
    pending, aborted = list(requests), set()

    def churn(engine):
        if pending:
            rid = pending.pop(0)
            engine.add_request(rid, *requests[rid][:2], cache_salt=requests[rid][2])
        for rid, prefill in (("mid-prefill", True), ("mid-decode", False)):
            seqs = engine.requests[rid].seqs if rid in engine.requests and rid not in aborted else []
            if any(s.num_computed_tokens and (s.num_computed_tokens < s.num_prompt_tokens) == prefill and
                   len(s.token_ids) < s.num_prompt_tokens + 3 for s in seqs):
                engine.abort_request(rid)
                aborted.add(rid)

    done = finish(engine, on_step=churn, has_more=lambda: bool(pending))
    assert aborted == {"mid-prefill", "mid-decode"}
    assert engine.scheduler.num_preemptions > 0 and engine.kv_connector.hit_tokens > 0
    for rid, (prompt, params, salt) in requests.items():
        outputs, prompt_logprobs = summary(done[rid])
        want, want_prompt_logprobs = fresh(prompt, params, salt)
        if rid in aborted:
            assert all(c[1] == "abort" and c[0] == w[0][:len(c[0])] for c, w in zip(outputs, want)), rid
        else:
            assert (outputs, prompt_logprobs) == (want, want_prompt_logprobs), rid
    assert_whole(engine)
    host = engine.kv_connector
    held = [(key, np.asarray(engine.runner.kv_connector.host_pool[:, :, h])) for h, key in enumerate(host.block_keys)
            if key is not None]
    held += [(key, np.asarray(engine.runner.kv_pool[:, :, b])) for key, b in engine.block_manager.key_to_block.items()]
    assert len(held) > 10 and {salt for key, _ in held for salt in [registered[key][1]]} == {None, "alice", "bob"}
    for key, data in held:
        np.testing.assert_allclose(data, fresh.kv(*registered[key]), atol=1e-5)
    engine.shutdown()
