"""Feature mixes drawn from seeded generators on stories260K (CPU): each request's greedy (or
seeded) output is its output alone, whatever runs beside it and whatever the engine does to it.

A draw mixes prefix caching, tiny pools (preemption by recompute), the host KV tier, chunked
prefill under tiny token budgets, max_num_seqs 1 to 16, async scheduling, n-gram speculation (1 to
5 drafts), the priority policy, a step-time factor, the grammar process and the FP8 cache (held to FP8 alone) with
per-request n > 1, seeds, stop strings and tokens, min_tokens, max_tokens 1, logprobs and
prompt_logprobs, structured outputs, bad_words, allowed_token_ids, logit_bias, penalties, the three
output kinds, prompts up to max_model_len - 1 and prompts of one repeated token. After every step
the pool agrees with its holders; once all is done nothing is left: no block held, the prefix cache
and the host tier's maps consistent, no queue or step or match left behind. The same draws also go
through an engine core and the API server's output side, and through aborts whose ids are taken
again at once.
"""
import dataclasses
import json
import random
import time
from collections import deque

import pytest
from test_abuse30_engine import assert_pool_invariants

from minillm import SamplingParams, StructuredOutputsParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.engine_core import messages as m
from minillm.engine_core.core import SAMPLING_FIELDS, EngineCore
from minillm.engine_core.output_processor import OutputProcessor
from minillm.sampling_params import RequestOutputKind

MAX_MODEL_LEN = 48
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"]}
CONSTRAINTS = [dict(choice=["yes", "no way", "Tom"]), dict(regex="( [a-z]+){1,4}\\."),
               dict(regex="(Tom|Lily) (ran|was) [a-z]{2,8}"), dict(json=SCHEMA)]
FP8_TOLERANCE = 0.05   # FP8 rounds the K/V of a prompt computed in chunks apart from the same prompt in one piece
TOLERANCE = 2e-3


def make_engine(path, **kw):
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw), log=lambda msg: None)


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def alone(stories_path):
    """alone(prompt, params, fp8) -> summary of the request run by itself (cumulative output) on a
    roomy engine without prefix caching, with the FP8 cache or without (cached across the module)."""
    engines, outputs = {}, {}

    def run(prompt, params, fp8):
        key = (tuple(prompt), repr(params), fp8)
        if key not in outputs:
            if fp8 not in engines:
                engines[fp8] = make_engine(stories_path, enable_prefix_caching=False, num_kv_blocks=256,
                                           kv_cache_dtype="fp8" if fp8 else "auto")
            engine = engines[fp8]
            engine.add_request("alone", prompt, dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE))
            outputs[key] = summary(drain(engine)["alone"])
        return outputs[key]
    yield run
    for engine in engines.values():
        engine.shutdown()


def drain(engine):
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return done


def logprob_rows(entries, ranked: bool):
    """Log-probability dicts as sorted (token, value[, rank]) rows; a rank past 5 is left out (a
    near tie down the list may swap under float noise)."""
    if entries is None:
        return None
    return [None if d is None else sorted((t, float(v), v.rank if v.rank <= 5 else None) if ranked
                                          else (t, float(v)) for t, v in d.items()) for d in entries]


def summary(out):
    """What must not depend on the engine or the batch: each completion's ids, text, reasons,
    cumulative logprob and logprobs, and the prompt logprobs."""
    return ([(list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
              None if c.cumulative_logprob is None else float(c.cumulative_logprob), logprob_rows(c.logprobs, True))
             for c in out.outputs], logprob_rows(out.prompt_logprobs, False))


class Deltas:
    """A DELTA request's reports added up into the summary its cumulative output would give."""

    def __init__(self):
        self.completions: dict[int, list] = {}
        self.prompt_logprobs = None

    def add(self, out):
        for c in out.outputs:
            acc = self.completions.setdefault(c.index, [[], "", None, None, None, []])
            acc[0] += c.token_ids
            acc[1] += c.text
            acc[5] += c.logprobs or []
            if c.cumulative_logprob is not None:
                acc[4] = float(c.cumulative_logprob)
            if c.finish_reason is not None:
                assert acc[2] is None, f"{out.request_id}#{c.index}: a second finish report"
                acc[2], acc[3] = c.finish_reason, c.stop_reason
        if out.prompt_logprobs is not None:
            assert self.prompt_logprobs is None, f"{out.request_id}: prompt logprobs reported twice"
            self.prompt_logprobs = out.prompt_logprobs

    def summary(self, params):
        return ([(ids, text, reason, stop, cum, logprob_rows(lps, True) if params.logprobs is not None else None)
                 for _, (ids, text, reason, stop, cum, lps) in sorted(self.completions.items())],
                logprob_rows(self.prompt_logprobs, False))


def close(a, b, tol) -> bool:
    """Equal structures, floats within tol."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= tol
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return a == b


def random_config(rng):
    bs = rng.choice([1, 2, 4, 8])
    cfg = dict(block_size=bs, num_kv_blocks=max(MAX_MODEL_LEN // bs + 1, rng.randint(MAX_MODEL_LEN // bs,
                                                                                      4 * MAX_MODEL_LEN // bs)),
               max_num_batched_tokens=rng.choice([1, 2, 3, 5, 8, 64]), max_num_seqs=rng.choice([1, 2, 3, 16]),
               async_scheduling=rng.random() < 0.5, enable_prefix_caching=rng.random() < 0.7)
    if rng.random() < 0.4:
        cfg["speculative_config"] = {"method": "ngram", "num_speculative_tokens": rng.randint(1, 5),
                                     "prompt_lookup_max": rng.randint(1, 4), "prompt_lookup_min": 1}
    if rng.random() < 0.25 and cfg["enable_prefix_caching"]:
        cfg["kv_offload_gib"] = 0.0001
    if rng.random() < 0.2:
        cfg["kv_cache_dtype"] = "fp8"
    if rng.random() < 0.25:
        cfg["scheduling_policy"] = "priority"
    if rng.random() < 0.15:
        cfg["max_step_factor"] = rng.choice([1.0, 2.0, 4.0])
    if rng.random() < 0.25:                  # the matchers in a process of their own, as on the GPU
        cfg["grammar_process"] = True
    return cfg


def random_prompt(rng, golden):
    kind = rng.random()
    if kind < 0.15:                          # one token again and again: the n-gram drafter's worst case
        return [1] + [rng.choice([403, 261, 5])] * rng.randint(1, MAX_MODEL_LEN - 2)
    if kind < 0.25:
        return golden[:MAX_MODEL_LEN - 1]
    base = rng.choice([golden, golden[7:], [1] + golden[1:12] * 5])
    return base[:rng.randint(1, MAX_MODEL_LEN - 1)]


def random_params(rng, room):
    r = rng.random
    kw = dict(temperature=0, ignore_eos=r() < 0.6, max_tokens=rng.choice([None, 1, rng.randint(1, max(1, room))]))
    if r() < 0.3:
        kw["n"] = rng.randint(2, 3)
    if r() < 0.2:
        kw.update(temperature=0.8, seed=rng.randint(0, 99), top_k=rng.choice([-1, 5]))
    if r() < 0.25:
        kw["min_tokens"] = min(rng.randint(0, 6), kw["max_tokens"] or 6)
    if r() < 0.25:
        kw["stop"] = rng.sample([" the", ".", " was", "a", "ed", " he"], 2)
    if r() < 0.15:
        kw["stop_token_ids"] = [rng.randint(3, 500)]
    elif r() < 0.3:
        kw["stop_token_ids"] = rng.sample([410, 263, 426, 261, 403, 265, 286], 2)
    if r() < 0.25:
        kw["logprobs"] = rng.randint(0, 3)
    if r() < 0.2:
        kw["prompt_logprobs"] = rng.randint(0, 2)
    if r() < 0.15:
        kw["bad_words"] = rng.sample(["the", " was", " happy", " little girl", " he said", "Lily", "ed"], 2)
    if r() < 0.1:
        kw.update(presence_penalty=0.7, frequency_penalty=0.5)
    if r() < 0.2:
        kw["output_kind"] = rng.choice([RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
    if r() < 0.1:
        kw["allowed_token_ids"] = rng.sample(range(3, 500), 20)
    if r() < 0.15:
        kw["logit_bias"] = {rng.randint(3, 500): rng.choice([-100, 5.0, 100])}
    if r() < 0.1:
        kw["repetition_penalty"] = 1.3
    if r() < 0.1:
        kw["include_stop_str_in_output"] = True
    if r() < 0.15 and "allowed_token_ids" not in kw:
        kw["structured_outputs"] = StructuredOutputsParams(**rng.choice(CONSTRAINTS))
    return SamplingParams(**kw)


def random_requests(rng, golden, num):
    requests = []
    for i in range(num):
        prompt = random_prompt(rng, golden)
        requests.append((f"r{i}", prompt, random_params(rng, MAX_MODEL_LEN - len(prompt))))
    return requests


def assert_idle(engine):
    """Nothing is left behind once every request is done."""
    assert not engine.requests and not engine._changed and not engine._in_flight
    sched, bm = engine.scheduler, engine.block_manager
    assert not sched.running and not len(sched.waiting) and not sched.masked_out
    assert bm.num_used_blocks == 0 and not any(bm.ref_counts)
    assert all(bm.block_keys[block] == key for key, block in bm.key_to_block.items())
    assert sum(key is not None for key in bm.block_keys) == len(bm.key_to_block) == bm.num_cached_free_blocks
    tier = engine.kv_connector
    if tier is not None:
        assert not tier._matched and not tier._loads and not tier._pinned
        assert all(tier.block_keys[host] == key for key, host in tier.key_to_block.items())
        assert set(tier.lru) == {host for host, key in enumerate(tier.block_keys) if key is not None}
        assert not set(tier.lru) & set(tier.free_blocks) and len(tier.lru) + len(tier.free_blocks) == tier.num_blocks
    if engine.structured_outputs is not None:
        assert not engine.structured_outputs.num_compiling
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.kv_num_used_blocks == 0


def assert_as_alone(requests, got, aborted, alone, fp8):
    """Each request's summary is its summary alone; an aborted one's ids are a prefix of it."""
    for rid, prompt, params in requests:
        want = alone(prompt, params, fp8)
        if rid in aborted:
            for (ids, *_), (ref, *_) in zip(got[rid][0], want[0]):
                assert ids == ref[:len(ids)], rid
        else:
            assert close(got[rid], want, FP8_TOLERANCE if fp8 else TOLERANCE), (rid, got[rid], want)


@pytest.mark.parametrize("seed", range(12))
def test_random_feature_mixes_give_each_request_its_output_alone(stories_path, golden, alone, seed):
    rng = random.Random(seed)
    cfg = random_config(rng)
    requests = random_requests(rng, golden, rng.randint(3, 12))
    kinds = {rid: params.output_kind for rid, _, params in requests}
    engine = make_engine(stories_path, **cfg)
    pending, done, deltas, aborted, seen = list(requests), {}, {}, set(), []
    for num_steps in range(5000):
        while pending and (num_steps == 0 or rng.random() < 0.3):
            rid, prompt, params = pending.pop(0)
            priority = {"priority": rng.randint(-2, 2)} if cfg.get("scheduling_policy") == "priority" else {}
            engine.add_request(rid, prompt, params, **priority)
            seen += engine.requests[rid].seqs
        if engine.requests and rng.random() < 0.02:
            rid = rng.choice(sorted(engine.requests))
            engine.abort_request(rid)
            aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} reported after it finished"
            if kinds[out.request_id] is RequestOutputKind.DELTA:
                deltas.setdefault(out.request_id, Deltas()).add(out)
            elif kinds[out.request_id] is RequestOutputKind.FINAL_ONLY:
                assert out.finished
            if out.finished:
                done[out.request_id] = out
        assert_pool_invariants(engine, seen)
        if not pending and not engine.has_unfinished_requests():
            break
    assert_idle(engine)
    got = {rid: deltas[rid].summary(params) if kinds[rid] is RequestOutputKind.DELTA else summary(done[rid])
           for rid, _, params in requests}
    assert_as_alone(requests, got, aborted, alone, cfg.get("kv_cache_dtype") == "fp8")
    engine.shutdown()


@pytest.mark.parametrize("seed", range(6))
def test_through_an_engine_core_and_the_api_servers_output_side(stories_path, golden, alone, seed):
    # Stop strings are found on the API server's side and reach the core 0, 1 or 3 steps later.
    rng = random.Random(1000 + seed)
    cfg = random_config(rng)
    requests = random_requests(rng, golden, rng.randint(3, 9))
    kinds = {rid: params.output_kind for rid, _, params in requests}
    delay = rng.choice([0, 1, 3])
    core = EngineCore(EngineConfig(model=str(stories_path), device="cpu", max_model_len=MAX_MODEL_LEN, **cfg),
                      log=lambda _: None)
    engine, processor = core.engine, OutputProcessor(core.engine.tokenizer)
    pending, done, deltas, aborted, in_transit = list(requests), {}, {}, set(), deque()
    for num_steps in range(5000):
        while pending and (num_steps == 0 or rng.random() < 0.3):
            rid, prompt, params = pending.pop(0)
            priority = {"priority": rng.randint(-2, 2)} if cfg.get("scheduling_policy") == "priority" else {}
            processor.add(rid, None, prompt, params, time.time(), handle=rid)
            fields = {name: getattr(params, name) for name in SAMPLING_FIELDS}
            assert core.add_request(m.AddRequest(rid, prompt, fields, time.time(), **priority)) is None
        if engine.requests and rng.random() < 0.02:
            rid = rng.choice(sorted(engine.requests))
            if (final := processor.abort(rid, time.time())) is not None:
                done[rid] = final[1]
                if kinds[rid] is RequestOutputKind.DELTA:
                    deltas.setdefault(rid, Deltas()).add(final[1])
            engine.abort_request(rid)
            aborted.add(rid)
        busy = engine.has_unfinished_requests()
        if busy:
            step = processor.process(core.step(), time.time())
            in_transit.append(step.stops)
            for handle, out in step.outputs:
                assert handle == out.request_id and out.request_id not in done
                if kinds[out.request_id] is RequestOutputKind.DELTA:
                    deltas.setdefault(out.request_id, Deltas()).add(out)
                if out.finished:
                    done[out.request_id] = out
        if in_transit and (len(in_transit) > delay or not busy):
            for rid, index, stop in in_transit.popleft():
                engine.stop_sequence(rid, index, stop)
        if not pending and not busy and not in_transit:
            break
    assert_idle(engine)
    assert not processor.requests
    got = {rid: deltas[rid].summary(params) if kinds[rid] is RequestOutputKind.DELTA else summary(done[rid])
           for rid, _, params in requests}
    assert_as_alone(requests, got, aborted, alone, cfg.get("kv_cache_dtype") == "fp8")
    engine.shutdown()


@pytest.mark.parametrize("seed", range(5))
def test_the_host_tier_serves_evicted_prefixes_as_alone(stories_path, golden, alone, seed):
    # A device pool of one sequence's worth and a small host tier: prompts of four families come
    # back after their blocks left the device, and are loaded from host memory.
    rng = random.Random(2000 + seed)
    bs = rng.choice([1, 2, 4, 8])
    cfg = dict(block_size=bs, num_kv_blocks=MAX_MODEL_LEN // bs + rng.randint(1, 3),
               kv_offload_gib=rng.choice([0.00002, 0.0001, 0.0005]), max_num_batched_tokens=rng.choice([3, 8, 64]),
               max_num_seqs=rng.choice([1, 2, 4]), async_scheduling=rng.random() < 0.5,
               kv_cache_dtype=rng.choice(["auto", "auto", "fp8"]))
    if rng.random() < 0.3:
        cfg["speculative_config"] = {"method": "ngram", "num_speculative_tokens": rng.randint(1, 4),
                                     "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    families = [golden, golden[3:], [1] + golden[40:90], [1] + [403, 261, 5] * 20]
    requests = []
    for i in range(rng.randint(6, 10)):
        length = rng.randint(bs, MAX_MODEL_LEN - 2)
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, MAX_MODEL_LEN - length), n=rng.choice([1, 1, 2]),
                                ignore_eos=True, logprobs=rng.choice([None, 1]),
                                prompt_logprobs=1 if rng.random() < 0.1 else None)
        requests.append((f"r{i}", rng.choice(families)[:length], params))
    engine = make_engine(stories_path, **cfg)
    pending, done, seen = list(requests), {}, []
    for num_steps in range(5000):
        while pending and (num_steps == 0 or rng.random() < 0.25 or not engine.has_unfinished_requests()):
            rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
            seen += engine.requests[rid].seqs
        done.update({out.request_id: out for out in engine.step() if out.finished})
        assert_pool_invariants(engine, seen)
        if not pending and not engine.has_unfinished_requests():
            break
    assert_idle(engine)
    assert engine.kv_connector.hit_tokens > 0
    assert_as_alone(requests, {rid: summary(out) for rid, out in done.items()}, set(), alone,
                    cfg["kv_cache_dtype"] == "fp8")
    engine.shutdown()


@pytest.mark.parametrize("seed", range(4))
def test_an_aborted_id_taken_again_at_once_leaves_both_requests_as_alone(stories_path, golden, alone, seed):
    # Four ids, each aborted and added again (with another prompt and params) while its steps may
    # still be in flight: the reports of the old request come first, and none reaches the new one.
    rng = random.Random(3000 + seed)
    cfg = random_config(rng)
    engine = make_engine(stories_path, **cfg)
    ids, requests, generation, seen = ["a", "b", "c", "d"], {}, {}, []

    def add(rid):
        prompt = random_prompt(rng, golden)
        params = random_params(rng, MAX_MODEL_LEN - len(prompt))
        params.output_kind = RequestOutputKind.CUMULATIVE
        generation[rid] = generation.get(rid, -1) + 1
        requests[(rid, generation[rid])] = (prompt, params)
        priority = {"priority": rng.randint(-2, 2)} if cfg.get("scheduling_policy") == "priority" else {}
        engine.add_request(rid, prompt, params, **priority)
        seen.extend(engine.requests[rid].seqs)

    for rid in ids:
        add(rid)
    reported = dict.fromkeys(ids, 0)     # the generation each id's next report belongs to
    done, aborted, num_readds = {}, set(), 0
    for _ in range(5000):
        if num_readds < 6 and rng.random() < 0.1:
            rid = rng.choice(ids)
            if rid in engine.requests and not engine.requests[rid].is_finished:
                engine.abort_request(rid)
                aborted.add((rid, generation[rid]))
            add(rid)
            num_readds += 1
        for out in engine.step():
            key = (out.request_id, reported[out.request_id])
            assert key not in done
            if out.finished:
                done[key] = out
                reported[out.request_id] += 1
        assert_pool_invariants(engine, seen)
        if not engine.has_unfinished_requests():
            if num_readds >= 6:
                break
            add(rng.choice(ids))
            num_readds += 1
    assert_idle(engine)
    assert set(done) == set(requests)
    fp8 = cfg.get("kv_cache_dtype") == "fp8"
    for key, (prompt, params) in requests.items():
        got, want = summary(done[key]), alone(prompt, params, fp8)
        if key in aborted:
            assert all(ids == ref[:len(ids)] for (ids, *_), (ref, *_) in zip(got[0], want[0])), key
        else:
            assert close(got, want, FP8_TOLERANCE if fp8 else TOLERANCE), (key, got, want)
    engine.shutdown()
