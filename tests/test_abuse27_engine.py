"""The engine's optional features used together through LLM and LLMEngine on stories260K, with
inputs earlier rounds did not try: each request's output is what it gets alone, the pool ends
empty, and what the caller does between calls has the effect vLLM gives it."""
import json

import pytest
from test_abuse20_engine_combos import make_engine, run

from minillm import LLM, SamplingParams


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.mark.parametrize("offload", [0, 0.001], ids=["device", "host-tier"])
def test_reset_prefix_cache_right_after_generate_with_async_scheduling_forgets_the_prompts(stories_path, golden,
                                                                                          offload):
    # With async scheduling (the GPU's default) the step launched after a request's stop token is
    # still in flight when generate() returns; reset_prefix_cache() took it for unfinished work and
    # returned False ("0 requests unfinished, 0 KV blocks in use"), so the next run hit the cache.
    with LLM(str(stories_path), device="cpu", max_model_len=64, block_size=4, num_gpu_blocks_override=32,
             async_scheduling=True, kv_offload_gib=offload) as llm:
        stops = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[golden[24]])
        first = llm.generate({"prompt_token_ids": golden[:20]}, stops)[0]
        assert first.outputs[0].finish_reason == "stop" and first.outputs[0].token_ids[-1] == golden[24]
        assert llm.reset_prefix_cache() is True
        again = llm.generate({"prompt_token_ids": golden[:20]}, stops)[0]
        assert again.num_cached_tokens == 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        bm = llm.llm_engine.block_manager
        assert bm.num_used_blocks == 0 and not any(bm.ref_counts)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_reset_prefix_cache_after_aborting_every_request_forgets_the_prompts(stories_path, golden, async_scheduling):
    # An aborted request stays in the engine until the next step() reports it: reset_prefix_cache
    # returned False between the abort and that step, logging "1 requests unfinished, 0 KV blocks
    # in use" while get_num_unfinished_requests() said 0.
    engine = make_engine(stories_path, block_size=4, num_kv_blocks=32, kv_offload_gib=0.001,
                         async_scheduling=async_scheduling)
    greedy = SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=1)
    try:
        engine.add_request("a", golden[:20], greedy)
        engine.add_request("b", golden[:20], SamplingParams(temperature=0, max_tokens=30, n=2))
        for _ in range(3):
            engine.step()
        engine.abort_request(["a", "b"])
        assert engine.get_num_unfinished_requests() == 0
        assert engine.reset_prefix_cache() is True
        reported = {out.request_id: out for out in engine.step()}
        assert sorted(reported) == ["a", "b"] and all(out.finished for out in reported.values())
        assert [c.finish_reason for c in reported["b"].outputs] == ["abort", "abort"]
        assert len(reported["a"].prompt_logprobs) == 20
        assert not engine.has_unfinished_requests() and engine.step() == []
        cold = run(engine, [("cold", golden[:20], SamplingParams(temperature=0, max_tokens=4))])["cold"]
        assert cold.metrics.num_cached_tokens == 0
        assert engine.kv_connector.snapshot().hit_tokens == 0
        bm = engine.block_manager
        assert bm.num_used_blocks == 0 and not any(bm.ref_counts)
    finally:
        engine.shutdown()
