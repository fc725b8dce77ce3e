"""The engine core loop under abuse on stories260K (CPU, tiny pools, small blocks, small token budgets).

After every step the pool's bookkeeping is checked against the sequences that hold it: a block's
ref count is the number of live sequences whose table holds it (a cached-free block is held by the
prefix cache alone, with no reference, and sits in the free queue); free + used = total; a block
in two tables is a full block shared by prefix (same place, same key in both); a finished or
aborted sequence holds no block. Greedy outputs under preemption and chunking equal each request's
output alone on a roomy engine. Every workload is drawn from a seeded generator."""
import json
import random

import pytest

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine

MAX_MODEL_LEN = 32


def make_engine(path, **kw):
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw), log=lambda msg: None)


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def alone(stories_path):
    """alone(prompt, params, max_model_len) -> [(token ids, finish reason)] of each completion, the
    request run by itself on a roomy engine without prefix caching (cached across the module)."""
    engines, outputs = {}, {}

    def run(prompt, params, max_model_len=MAX_MODEL_LEN):
        key = (tuple(prompt), repr(params), max_model_len)
        if key not in outputs:
            if max_model_len not in engines:
                engines[max_model_len] = make_engine(stories_path, max_model_len=max_model_len,
                                                     enable_prefix_caching=False, num_kv_blocks=256)
            engine = engines[max_model_len]
            engine.add_request("alone", prompt, params)
            outputs[key] = completions(drain(engine)["alone"])
        return outputs[key]
    return run


def completions(out):
    return [(list(c.token_ids), c.finish_reason) for c in out.outputs]


def drain(engine, check=True, limit=5000):
    """Step until nothing is left, checking the pool after each step; {request id: final output}."""
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} reported after it finished"
            if out.finished:
                done[out.request_id] = out
        if check:
            assert_pool_invariants(engine)
    assert not engine.has_unfinished_requests(), "the engine did not drain"
    return done


def assert_pool_invariants(engine, seen=()):
    """The block pool agrees with the sequences holding it (seen: sequences that must hold nothing
    once finished, retired from the engine or not)."""
    bm, sched = engine.block_manager, engine.scheduler
    live = [*sched.running, *sched.waiting]
    holders = [0] * bm.num_blocks
    places: dict[int, list] = {}
    for seq in live:
        assert not seq.is_finished, f"finished {seq.request_id}#{seq.index} is still queued"
        assert len(set(seq.block_table)) == len(seq.block_table), f"a block twice in one table: {seq.block_table}"
        assert len(seq.block_hashes) <= len(seq.block_table)
        for i, block in enumerate(seq.block_table):
            holders[block] += 1
            places.setdefault(block, []).append((seq, i))
    for seq in sched.waiting:
        assert not seq.block_table, f"waiting {seq.request_id}#{seq.index} holds blocks"
    for seq in sched.running:
        assert seq.num_computed_tokens <= len(seq.block_table) * bm.block_size
    for block, where in places.items():
        if len(where) > 1:       # only a full block of the same prefix is shared
            assert len({i for _, i in where}) == 1, f"block {block} at different places: {where}"
            keys = {seq.block_hashes[i] if i < len(seq.block_hashes) else None for seq, i in where}
            assert len(keys) == 1 and None not in keys, f"block {block} shared without one prefix key"
    assert holders == bm.ref_counts, [(b, h, r) for b, (h, r) in enumerate(zip(holders, bm.ref_counts)) if h != r]
    assert list(bm.free_queue) == [b for b in bm.free_queue if holders[b] == 0]
    assert set(bm.free_queue) == {b for b in range(bm.num_blocks) if holders[b] == 0}
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    cached_free = [b for b in bm.free_queue if bm.block_keys[b] is not None]
    assert bm.num_cached_free_blocks == len(cached_free)
    assert sorted(bm.snapshot().cached_free_block_ids.tolist()) == sorted(cached_free)
    assert all(bm.block_keys[block] == key for key, block in bm.key_to_block.items())
    assert sum(key is not None for key in bm.block_keys) == len(bm.key_to_block)
    assert len(sched.running) <= sched.max_num_seqs
    for req in engine.requests.values():
        for seq in req.seqs:
            assert not seq.is_finished or not seq.block_table, f"finished {seq.request_id} holds blocks"
    for seq in seen:
        assert not seq.is_finished or not seq.block_table, f"finished {seq.request_id} holds blocks"
    stats = engine.stats()
    assert (stats.kv_num_used_blocks, stats.kv_num_cached_blocks) == (bm.num_used_blocks, len(cached_free))
    assert stats.kv_num_used_blocks + stats.kv_num_free_blocks + stats.kv_num_cached_blocks == bm.num_blocks
    assert (stats.num_running, stats.num_waiting) == (len(sched.running), len(sched.waiting))
    assert 0 <= stats.kv_token_utilization <= 1


def random_request(rng, golden, max_model_len, block_size):
    """A prompt from a few families sharing prefixes (some a whole number of blocks, some one short
    of max_model_len) and greedy params, some with n > 1."""
    kind = rng.random()
    if kind < 0.2:
        length = max_model_len - 1
    elif kind < 0.45:
        length = block_size * rng.randint(1, (max_model_len - 1) // block_size)
    else:
        length = rng.randint(1, max_model_len - 1)
    base = rng.choice([golden, golden[5:], [1] + [(97 * i) % 480 + 3 for i in range(max_model_len)]])
    room = max_model_len - length
    params = SamplingParams(temperature=0, max_tokens=rng.choice([None, 1, rng.randint(1, room)]),
                            n=rng.choice([1, 1, 2, 3]), ignore_eos=rng.random() < 0.7)
    return base[:length], params


CONFIGS = {
    "pool-of-one": dict(block_size=4, num_kv_blocks=8, max_num_batched_tokens=5, max_num_seqs=4),
    "bs1-async": dict(block_size=1, num_kv_blocks=40, max_num_batched_tokens=3, async_scheduling=True),
    "bs2-seqs8": dict(block_size=2, num_kv_blocks=17, max_num_batched_tokens=64, max_num_seqs=8),
    "bs8-nocache-async": dict(block_size=8, num_kv_blocks=5, max_num_batched_tokens=9, max_num_seqs=3,
                              enable_prefix_caching=False, async_scheduling=True),
    "bs4-one-seq": dict(block_size=4, num_kv_blocks=9, max_num_batched_tokens=2, max_num_seqs=1),
    "spec-async": dict(block_size=2, num_kv_blocks=16, max_num_batched_tokens=6, async_scheduling=True,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                           "prompt_lookup_min": 1}),
    "host-tier-step-factor": dict(block_size=4, num_kv_blocks=10, max_num_batched_tokens=8, kv_offload_gib=0.00005,
                                  max_step_factor=2.0),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", CONFIGS)
def test_random_arrivals_and_aborts_keep_the_pool_consistent_and_outputs_as_alone(stories_path, golden, alone,
                                                                                  config, seed):
    rng = random.Random(seed)
    cfg = CONFIGS[config]
    requests = [(f"r{i}", *random_request(rng, golden, MAX_MODEL_LEN, cfg["block_size"])) for i in range(10)]
    engine = make_engine(stories_path, **cfg)
    pending, done, aborted, seen = list(requests), {}, set(), []
    for num_steps in range(5000):
        while pending and (num_steps == 0 and len(pending) > 6 or rng.random() < 0.4):
            rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
            seen += engine.requests[rid].seqs
        if engine.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(engine.requests))
            engine.abort_request(rid)
            aborted.add(rid)
        if rng.random() < 0.05:
            in_use = engine.block_manager.num_used_blocks > 0
            keys = dict(engine.block_manager.key_to_block)
            assert engine.reset_prefix_cache() is not in_use
            assert engine.block_manager.key_to_block == (keys if in_use else {})
        for out in engine.step():
            assert out.request_id not in done
            if out.finished:
                done[out.request_id] = out
        assert_pool_invariants(engine, seen)
        if not pending and not engine.has_unfinished_requests():
            break
    assert set(done) == {rid for rid, _, _ in requests}
    assert engine.block_manager.num_used_blocks == 0
    for rid, prompt, params in requests:
        got, want = completions(done[rid]), alone(prompt, params)
        if rid in aborted:
            assert all(ids == ref[:len(ids)] for (ids, _), (ref, _) in zip(got, want)), rid
        else:
            assert got == want, rid


def in_stage(engine, stage):
    """Request ids with a sequence at `stage` now."""
    sched = engine.scheduler
    found = []
    for rid, req in engine.requests.items():
        for seq in req.seqs:
            if stage == "waiting" and seq in sched.waiting and not seq.num_preemptions:
                found.append(rid)
            elif stage == "mid-prefill" and seq in sched.running and seq.num_computed_tokens < seq.num_prompt_tokens:
                found.append(rid)
            elif stage == "preempted" and seq in sched.waiting and seq.num_preemptions:
                found.append(rid)
            elif stage == "decoding" and seq in sched.running and seq.num_output_tokens:
                found.append(rid)
            elif stage == "sibling-finished" and seq.is_finished and not req.is_finished:
                found.append(rid)
    return sorted(set(found))


STAGES = ["waiting", "mid-prefill", "preempted", "decoding", "sibling-finished"]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stage", STAGES)
def test_an_abort_at_each_stage_frees_its_blocks_and_leaves_the_others_as_alone(stories_path, golden, alone,
                                                                                stage, async_scheduling):
    engine = make_engine(stories_path, block_size=2, num_kv_blocks=20, max_num_batched_tokens=6, max_num_seqs=4,
                         async_scheduling=async_scheduling)
    requests = {f"r{i}": (golden[:[27, 9, 14, 20, 6, 11][i]] + [3 + i],
                          SamplingParams(temperature=0, n=[1, 2, 1, 3, 1, 2][i], ignore_eos=i != 4,
                                         max_tokens=[None, 4, None, None, None, 2][i]))
               for i in range(6)}
    seen = []
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
        seen += engine.requests[rid].seqs
    done, victim = {}, None
    for _ in range(2000):
        candidates = in_stage(engine, stage)
        if candidates:
            victim = candidates[0]
            before = [seq.status for seq in engine.requests[victim].seqs]
            engine.abort_request(victim)
            assert_pool_invariants(engine, seen)
            assert all(not seq.block_table and seq.is_finished for seq in engine.requests[victim].seqs)
            break
        for out in engine.step():
            done[out.request_id] = out
        assert_pool_invariants(engine, seen)
    assert victim is not None, f"no request reached {stage}"
    done.update(drain(engine))
    assert engine.block_manager.num_used_blocks == 0
    for rid, (prompt, params) in requests.items():
        got, want = completions(done[rid]), alone(prompt, params)
        if rid != victim:
            assert got == want, rid
            continue
        assert stage != "sibling-finished" or any(status.is_finished for status in before)
        for (ids, reason), (ref, ref_reason), status in zip(got, want, before):
            if status.is_finished:           # a completion done before the abort keeps its output
                assert (ids, reason) == (ref, ref_reason)
            else:
                assert ids == ref[:len(ids)] and reason == "abort"


def test_an_abort_right_after_finishing_changes_nothing(stories_path, golden, alone):
    engine = make_engine(stories_path, block_size=4, num_kv_blocks=8, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=3, n=2, ignore_eos=True)
    engine.add_request("a", golden[:10], params)
    outs = []
    while not outs or not outs[-1].finished:
        outs += [o for o in engine.step() if o.request_id == "a"]
    engine.abort_request("a")
    engine.abort_request(["a", "a"])
    assert_pool_invariants(engine)
    assert engine.step() == [] and completions(outs[-1]) == alone(golden[:10], params)
    # Kept cached: the prompt's two full blocks and a third of 2 prompt and 2 output tokens, once for
    # both greedy siblings (their third blocks hold the same tokens).
    assert engine.block_manager.num_cached_free_blocks == 3


def test_a_prompt_of_max_model_len_is_refused_and_one_token_shorter_fills_the_whole_pool(stories_path, golden,
                                                                                          alone):
    # A pool of exactly max_model_len tokens: a prompt one short of it takes every block, and its
    # n = 3 siblings take turns on it (each needs its own last block).
    engine = make_engine(stories_path, block_size=4, num_kv_blocks=MAX_MODEL_LEN // 4, max_num_batched_tokens=7)
    with pytest.raises(ValueError, match=f"prompt has {MAX_MODEL_LEN} tokens, which leaves no room"):
        engine.add_request("full", golden[:MAX_MODEL_LEN], SamplingParams(max_tokens=1))
    assert not engine.requests and not engine.scheduler.has_unfinished()
    prompt, params = golden[:MAX_MODEL_LEN - 1], SamplingParams(temperature=0, n=3, ignore_eos=True)
    engine.add_request("fills", prompt, params)
    engine.add_request("small", golden[:3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    used_at_launch, launch = [], engine.runner.launch

    def counting_launch(out, *args):
        used_at_launch.append(engine.block_manager.num_used_blocks)
        return launch(out, *args)
    engine.runner.launch = counting_launch
    done = drain(engine)
    assert max(used_at_launch) == engine.block_manager.num_blocks
    assert completions(done["fills"]) == alone(prompt, params) and len(done["fills"].outputs[0].token_ids) == 1
    assert completions(done["small"]) == alone(golden[:3], SamplingParams(temperature=0, max_tokens=20,
                                                                          ignore_eos=True))


@pytest.mark.parametrize("block_size", [1, 2, 8])
def test_prompts_of_whole_blocks_hit_all_but_their_last_block(stories_path, golden, alone, block_size):
    # At least one prompt token is computed: a prompt of k full blocks, cached whole, hits k - 1.
    engine = make_engine(stories_path, block_size=block_size, num_kv_blocks=64 // block_size,
                         max_num_batched_tokens=5)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for k in (1, 2, 3):
        prompt = golden[:k * block_size]
        engine.add_request(f"first{k}", prompt, params)
        first = drain(engine)[f"first{k}"]
        engine.add_request(f"again{k}", prompt, params)
        again = drain(engine)[f"again{k}"]
        assert completions(first) == completions(again) == alone(prompt, params)
        assert again.num_cached_tokens == (k - 1) * block_size


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_preemption_storm_gives_each_greedy_output_as_alone(stories_path, golden, alone, async_scheduling):
    # Fifteen sequences growing to max_model_len on a pool of one sequence's worth: the latest
    # admitted is preempted again and again, recomputed from its prompt and its tokens so far.
    engine = make_engine(stories_path, block_size=2, num_kv_blocks=MAX_MODEL_LEN // 2, max_num_batched_tokens=4,
                         max_num_seqs=6, async_scheduling=async_scheduling)
    requests = {f"r{i}": (golden[i:i + 4 + i], SamplingParams(temperature=0, n=1 + i % 2, ignore_eos=True))
                for i in range(10)}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = drain(engine)
    assert engine.scheduler.num_preemptions >= 20
    assert {rid: completions(out) for rid, out in done.items()} == \
           {rid: alone(prompt, params) for rid, (prompt, params) in requests.items()}


def test_reset_prefix_cache_is_refused_while_requests_run_and_forgets_everything_after(stories_path, golden):
    engine = make_engine(stories_path, block_size=4, num_kv_blocks=16, max_num_batched_tokens=6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", golden[:17], params)
    drain(engine)
    engine.add_request("b", golden[:17], params)
    engine.step()
    keys = dict(engine.block_manager.key_to_block)
    assert engine.reset_prefix_cache() is False
    assert engine.block_manager.key_to_block == keys and engine.block_manager.num_cached_free_blocks
    assert drain(engine)["b"].num_cached_tokens == 16
    assert engine.reset_prefix_cache() is True
    assert not engine.block_manager.key_to_block and engine.block_manager.num_cached_free_blocks == 0
    assert_pool_invariants(engine)
    engine.add_request("c", golden[:17], params)
    assert drain(engine)["c"].num_cached_tokens == 0


def test_priority_under_fcfs_is_refused_by_name_and_queues_nothing(stories_path):
    # Under first come, first served (vLLM's default policy) a priority is refused, not silently
    # ignored; a policy that does not exist is refused by name.
    engine = make_engine(stories_path)
    with pytest.raises(ValueError, match="priority must be 0 under scheduling_policy 'fcfs', got 1"):
        engine.add_request("p", [1, 403], SamplingParams(max_tokens=2), priority=1)
    assert not engine.requests and not engine.scheduler.has_unfinished()
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"):
        LLM(str(stories_path), device="cpu", scheduling_policy="lifo")


def test_seeded_sampling_and_log_probabilities_under_preemption_are_as_alone(stories_path, golden, alone):
    # A preempted sequence keeps its generator and its tokens: recomputing its K/V changes none of
    # its samples, and its prompt log-probabilities (computed again) are reported once.
    engine = make_engine(stories_path, block_size=2, num_kv_blocks=MAX_MODEL_LEN // 2, max_num_batched_tokens=5)
    requests = {f"s{i}": (golden[i:2 * i + 5], SamplingParams(temperature=0.9, top_k=8, seed=i, n=1 + i % 2,
                                                             logprobs=1, prompt_logprobs=i % 2, ignore_eos=True))
                for i in range(6)}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = drain(engine)
    assert engine.scheduler.num_preemptions > 0
    for rid, (prompt, params) in requests.items():
        assert completions(done[rid]) == alone(prompt, params), rid
        out = done[rid]
        assert all(len(c.logprobs) == len(c.token_ids) for c in out.outputs)
        assert (out.prompt_logprobs is None) == (params.prompt_logprobs is None)
        assert out.prompt_logprobs is None or len(out.prompt_logprobs) == len(prompt)
