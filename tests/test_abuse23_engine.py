"""The engine core under combinations of features on stories260K: each request's output is what it
gets alone, the block pool ends empty, and what a client sends never breaks the loop."""
import json

import pytest
from test_abuse20_engine_combos import make_engine, run

from minillm import SamplingParams


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


def assert_pool_empty(engine):
    """Every block free, none referenced (the block manager's own counters)."""
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    assert not any(bm.ref_counts)


def test_reset_prefix_cache_forgets_the_host_tier_too(stories_path, golden):
    # reset_prefix_cache cleared the device's cached blocks only: the host tier served the same
    # prompt's blocks again (28 of its 30 tokens), as vLLM's CPU offload tier did (vllm#57727).
    engine = make_engine(stories_path, max_model_len=48, num_kv_blocks=12, block_size=4, kv_offload_gib=0.001)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    try:
        want = run(engine, [("a", golden[:30], greedy)])["a"].outputs[0].token_ids
        run(engine, [("evicts-a", golden[100:144], greedy)])     # the whole pool: a's blocks go to the host
        again = run(engine, [("again", golden[:30], greedy)])["again"]
        assert again.metrics.num_cached_tokens == 28               # the host tier serves them, as it should
        run(engine, [("evicts-again", golden[100:144], greedy)])
        assert engine.reset_prefix_cache()
        hits = engine.kv_connector.snapshot().hit_tokens
        cold = run(engine, [("cold", golden[:30], greedy)])["cold"]
        assert cold.metrics.num_cached_tokens == 0
        assert engine.kv_connector.snapshot().hit_tokens == hits
        assert cold.outputs[0].token_ids == want
        # The tier fills and serves again after the reset.
        run(engine, [("evicts-cold", golden[100:144], greedy)])
        assert run(engine, [("warm", golden[:30], greedy)])["warm"].metrics.num_cached_tokens == 28
        assert_pool_empty(engine)
    finally:
        engine.shutdown()
