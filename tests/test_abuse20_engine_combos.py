"""Engine features in combination on stories260K: a feature that changes scheduling or memory (prefix
caching, preemption, chunked prefill, speculation, the host KV tier, async scheduling, tensor
parallelism, a step budget) leaves each request's output as the plain engine gives it."""
import json

import numpy as np
import pytest

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


def make_engine(path, **kw):
    return LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=64, num_kv_blocks=16, **kw),
                     log=lambda msg: None)


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
    fp8 = dict(kv_cache_dtype="fp8", calculate_kv_scales=True, tensor_parallel_size=budget.get("tensor_parallel_size", 1))
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
