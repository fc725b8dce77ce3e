"""Engine features in combination on stories260K: a feature that changes scheduling or memory (prefix
caching, preemption, chunked prefill, speculation, the host KV tier, async scheduling, tensor
parallelism, a step budget) leaves each request's output as the plain engine gives it."""
import json

import numpy as np
import pytest

from minillm import SamplingParams, StructuredOutputsParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


def make_engine(path, **kw):
    kw = {"max_model_len": 64, "num_kv_blocks": 16, **kw}
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw), log=lambda msg: None)


def run(engine, requests):
    """Add (request_id, prompt, params) in order and step until every one is done; the final outputs."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("budget", [dict(max_step_factor=2.0), dict(max_step_ms=5.0, tensor_parallel_size=2)],
                         ids=["factor", "ms-tp2"])
def test_a_step_budget_leaves_the_fp8_scales_to_the_first_real_prefill(stories_path, golden, budget):
    # The step cost calibration's dummy steps ran first and set calculate_kv_scales' scales from
    # their token-0 keys and values: a step budget changed every FP8 output.
    fp8 = dict(kv_cache_dtype="fp8", calculate_kv_scales=True,
               tensor_parallel_size=budget.get("tensor_parallel_size", 1))
    request = [("a", golden[:40], SamplingParams(temperature=0, max_tokens=12, logprobs=1))]
    plain = make_engine(stories_path, **fp8)
    budgeted = make_engine(stories_path, **{**fp8, **budget})
    try:
        np.testing.assert_array_equal(budgeted.runner.model.kv_scales, 1.0)
        want, got = run(plain, request)["a"].outputs[0], run(budgeted, request)["a"].outputs[0]
        np.testing.assert_array_equal(budgeted.runner.model.kv_scales, plain.runner.model.kv_scales)
        assert got.token_ids == want.token_ids
        assert [dict(d) for d in got.logprobs] == [dict(d) for d in want.logprobs]
    finally:
        plain.shutdown()
        budgeted.shutdown()


def test_tensor_parallel_fp8_scales_are_the_layers_over_every_rank(stories_path, golden):
    # Each rank set calculate_kv_scales' scales from its own KV heads: other scales than on one
    # device, and another greedy output.
    fp8 = dict(kv_cache_dtype="fp8", calculate_kv_scales=True)
    request = [("a", golden[:40], SamplingParams(temperature=0, max_tokens=12))]
    one, split = make_engine(stories_path, **fp8), make_engine(stories_path, tensor_parallel_size=2, **fp8)
    try:
        want, got = run(one, request)["a"].outputs[0], run(split, request)["a"].outputs[0]
        np.testing.assert_allclose(split.runner.model.kv_scales, one.runner.model.kv_scales, rtol=1e-6)
        assert got.token_ids == want.token_ids
    finally:
        one.shutdown()
        split.shutdown()


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
COMBOS = {
    "tiny-pool-chunked-async": dict(block_size=4, num_kv_blocks=34, max_num_batched_tokens=5, async_scheduling=True),
    "offload-spec-async": dict(block_size=4, num_kv_blocks=36, kv_offload_gib=0.0005, speculative_config=SPEC,
                               async_scheduling=True, max_num_batched_tokens=9),
    "nocache-spec-seqs2": dict(block_size=8, num_kv_blocks=18, enable_prefix_caching=False, speculative_config=SPEC,
                               max_num_seqs=2),
    "step-factor-spec": dict(block_size=8, num_kv_blocks=16, max_step_factor=3.0, speculative_config=SPEC,
                             max_num_batched_tokens=6),
}


def varied_requests(golden):
    """Prompts of several lengths sharing prefixes, each with other per-request options; the two
    greedy runs to max_model_len outgrow every small pool and take n-gram drafts from the story's
    own repeats."""
    repeat = [1] + [403, 407, 261, 378] * 6
    greedy = dict(temperature=0, max_tokens=8)
    return [
        ("plain", golden[:17], SamplingParams(**greedy)),
        ("logprobs", golden[:20], SamplingParams(**greedy, logprobs=3, prompt_logprobs=2)),
        ("one", golden[:3], SamplingParams(temperature=0, max_tokens=1, logprobs=0)),
        ("stops", golden[:40], SamplingParams(**greedy, stop=[" the", "."], stop_token_ids=[286], min_tokens=2)),
        ("penalties", repeat, SamplingParams(**greedy, repetition_penalty=1.3, presence_penalty=0.5,
                                             frequency_penalty=0.4)),
        ("seeded", repeat, SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=3, max_tokens=8, logprobs=2)),
        ("choice", golden[:33], SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no way"]))),
        ("banned", golden[:40] + [300, 301], SamplingParams(**greedy, bad_words=["the"], logit_bias={300: 5.0})),
        ("to-the-end", golden[:40], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, n=2)),
    ]


def summary(out):
    """What must not depend on the engine's configuration: each completion's ids, text, reasons
    and logprobs, and the prompt logprobs (log-probabilities as {token: float} dicts)."""
    as_dicts = lambda entries: None if entries is None else [   # noqa: E731
        None if d is None else {t: float(v) for t, v in d.items()} for d in entries]
    return ([(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs],
            [as_dicts(c.logprobs) for c in out.outputs], as_dicts(out.prompt_logprobs))


def assert_same_logprobs(got, want):
    """Entries with the same tokens and log-probabilities within float noise."""
    assert (got is None) == (want is None) and len(got or ()) == len(want or ())
    for g, w in zip(got or (), want or ()):
        assert (g is None) == (w is None) and set(g or ()) == set(w or ())
        for token in w or ():
            assert g[token] == pytest.approx(w[token], abs=1e-4)


@pytest.fixture(scope="module")
def plain_outputs(stories_path, golden):
    engine = make_engine(stories_path, max_model_len=128, num_kv_blocks=64)
    try:
        return {rid: summary(out) for rid, out in run(engine, varied_requests(golden)).items()}
    finally:
        engine.shutdown()


@pytest.mark.parametrize("combo", COMBOS)
def test_combined_features_give_each_varied_request_the_plain_engines_output(stories_path, golden, plain_outputs,
                                                                             combo):
    engine = make_engine(stories_path, **{"max_model_len": 128, "num_kv_blocks": 64, **COMBOS[combo]})
    try:
        got = {rid: summary(out) for rid, out in run(engine, varied_requests(golden)).items()}
        completions = lambda outputs: {rid: ids for rid, (ids, _, _) in outputs.items()}   # noqa: E731
        assert completions(got) == completions(plain_outputs)
        for rid, (_, logprobs, prompt_logprobs) in got.items():
            _, want, want_prompt = plain_outputs[rid]
            for g, w in zip(logprobs, want):
                assert_same_logprobs(g, w)
            assert_same_logprobs(prompt_logprobs, want_prompt)
        assert engine.scheduler.num_preemptions > 0          # each pool is too small for both "to-the-end" runs
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_num_used_blocks) == (0, 0, 0)
    finally:
        engine.shutdown()
