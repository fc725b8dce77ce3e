"""The engine's optional features used together through LLM and LLMEngine on stories260K, with
inputs earlier rounds did not try: each request's output is what it gets alone, the pool ends
empty, and what the caller does between calls has the effect vLLM gives it."""
import json

import pytest

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
