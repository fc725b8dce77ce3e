"""Differential fuzz of scheduling and KV memory on stories260K: requests sharing long prefixes arrive
in random order, some mid-run, some aborted, on engines combining a pool at its minimum with the host
KV tier, n-gram speculation, async scheduling, FP8 KV, prefix caching off and max_model_len hits.
Every finished greedy output equals the request's output alone on a roomy engine, and the pool ends
holding only the prefix cache."""
import json
import random

import pytest

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_MODEL_LEN = 64


def make_engine(path, **kw):
    return LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=MAX_MODEL_LEN, **kw),
                     log=lambda msg: None)


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def roomy(stories_path):
    """One reference engine per KV cache dtype, and a cache of each request's output alone."""
    engines, outputs = {}, {}

    def alone(prompt, params, kv_cache_dtype):
        key = (tuple(prompt), repr(params), kv_cache_dtype)
        if key not in outputs:
            if kv_cache_dtype not in engines:
                engines[kv_cache_dtype] = make_engine(stories_path, enable_prefix_caching=False,
                                                      num_kv_blocks=512, kv_cache_dtype=kv_cache_dtype)
            engine = engines[kv_cache_dtype]
            engine.add_request("alone", prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs[key] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        return outputs[key]
    return alone


def random_requests(rng, golden, count):
    """Greedy requests over a few prompt families that share long prefixes; some run to max_model_len."""
    bases = [golden[:rng.randint(20, 60)], golden[:rng.randint(20, 60)],
             [1] + [rng.randint(3, 511) for _ in range(rng.randint(10, 40))]]
    requests = []
    for i in range(count):
        base = rng.choice(bases)
        prompt = base[:rng.randint(1, len(base))] + [rng.randint(3, 511) for _ in range(rng.choice([0, 0, 3, 17]))]
        prompt = prompt[:MAX_MODEL_LEN - 1]
        room = MAX_MODEL_LEN - len(prompt)
        params = SamplingParams(temperature=0, max_tokens=rng.choice([None, 1, rng.randint(1, room), room + 5]),
                                n=rng.choice([1, 1, 2]), ignore_eos=rng.random() < 0.7,
                                repetition_penalty=rng.choice([1.0, 1.0, 1.0, 1.3]))
        requests.append((f"r{i}", prompt, params))
    return requests


CONFIGS = [
    dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=5, max_num_seqs=4, async_scheduling=True,
         kv_offload_gib=0.0001, speculative_config=SPEC),
    dict(block_size=2, num_kv_blocks=33, max_num_batched_tokens=7, async_scheduling=False,
         kv_offload_gib=0.00002, kv_cache_dtype="fp8"),
    dict(block_size=8, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=3, async_scheduling=True,
         enable_prefix_caching=False, speculative_config=SPEC),
    dict(block_size=1, num_kv_blocks=66, max_num_batched_tokens=3, async_scheduling=True,
         kv_offload_gib=0.00002, max_step_factor=2.0),
]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("config", CONFIGS, ids=["offload-spec-async", "offload-fp8", "nocache-spec-async",
                                                 "offload-bs1-factor"])
def test_shuffled_arrivals_and_aborts_give_each_greedy_output_as_alone(stories_path, golden, roomy, config, seed):
    rng = random.Random(seed)
    requests = random_requests(rng, golden, 12)
    kv_dtype = config.get("kv_cache_dtype", "auto")
    alone = {rid: roomy(prompt, params, kv_dtype) for rid, prompt, params in requests}
    engine = make_engine(stories_path, **config)
    rng.shuffle(requests)
    for rid, prompt, params in requests[:4]:
        engine.add_request(rid, prompt, params)
    pending, done, aborted = requests[4:], {}, set()
    for _ in range(5000):
        if pending and rng.random() < 0.4:
            rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        if engine.requests and rng.random() < 0.04:
            rid = rng.choice(sorted(engine.requests))
            engine.abort_request(rid)
            aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in done
            if out.finished:
                done[out.request_id] = out
        if not pending and not engine.has_unfinished_requests():
            break
    assert set(done) == {rid for rid, _, _ in requests}
    for rid, outputs in done.items():
        got = [(c.token_ids, c.finish_reason) for c in outputs.outputs]
        if rid not in aborted:
            assert got == alone[rid], rid
        else:
            assert all(ids == ref[:len(ids)] for (ids, _), (ref, _) in zip(got, alone[rid])), rid
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_num_used_blocks) == (0, 0, 0)
    assert stats.kv_num_cached_blocks == len(engine.block_manager.key_to_block)
    assert engine.scheduler.num_preemptions > 0
    assert stats.kv_offload_hits > 0 or "kv_offload_gib" not in config
