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


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("extra", [dict(async_scheduling=False), dict(async_scheduling=True, speculative_config=SPEC)],
                         ids=["sync", "async-spec"])
def test_what_a_client_sends_at_the_bounds_leaves_the_loop_and_the_pool_sound(stories_path, golden, extra):
    # Many small requests beside: a prompt of exactly max_model_len (refused where it enters, naming
    # the prompt), min_tokens over max_tokens (refused, naming min_tokens), a duplicate id while the
    # first runs (refused, as vLLM's "already running"), one that runs to max_model_len exactly,
    # EOS as a stop token under ignore_eos, and aborts: twice, of unknown ids, during a grammar's compile.
    from minillm import StructuredOutputsParams
    engine = make_engine(stories_path, max_model_len=32, num_kv_blocks=9, block_size=4, max_num_batched_tokens=8,
                         **extra)
    greedy = dict(temperature=0)
    try:
        with pytest.raises(ValueError, match="prompt has 32 tokens"):
            engine.add_request("full", golden[:32], SamplingParams(**greedy, max_tokens=1))
        with pytest.raises(ValueError, match="min_tokens"):
            engine.add_request("min", golden[:3], SamplingParams(**greedy, max_tokens=2, min_tokens=3))
        for i in range(6):
            engine.add_request(f"tiny{i}", golden[:1 + i], SamplingParams(**greedy, max_tokens=2 + i, n=1 + i % 2))
        engine.add_request("to-the-end", golden[:20], SamplingParams(**greedy, max_tokens=12, logprobs=1))
        engine.add_request("eos-stop", golden[:6], SamplingParams(**greedy, max_tokens=8, ignore_eos=True,
                                                                   stop_token_ids=[2], logit_bias={2: 30.0}))
        engine.add_request("compiling", golden[:5], SamplingParams(**greedy, n=2, structured_outputs=(
            StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))))
        engine.abort_request("compiling")
        engine.abort_request(["compiling", "unknown"])
        first = {out.request_id: out for out in engine.step() if out.finished}
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("to-the-end", golden[:3], SamplingParams(max_tokens=1))
        done = {**first, **run(engine, [])}
        assert engine.get_num_unfinished_requests() == 0
        engine.abort_request("to-the-end")
        assert engine.step() == []
        assert [c.finish_reason for c in done["compiling"].outputs] == ["abort", "abort"]
        end = done["to-the-end"].outputs[0]
        assert (len(end.token_ids), end.finish_reason, len(end.logprobs)) == (12, "length", 12)
        eos = done["eos-stop"].outputs[0]
        assert (eos.token_ids, eos.finish_reason, eos.stop_reason, eos.text) == ([2], "stop", 2, "")
        alone = make_engine(stories_path, max_model_len=32)
        try:
            for rid in ["to-the-end"] + [f"tiny{i}" for i in range(6)]:
                prompt = golden[:20] if rid == "to-the-end" else golden[:1 + int(rid[-1])]
                n, max_tokens = (1, 12) if rid == "to-the-end" else (1 + int(rid[-1]) % 2, 2 + int(rid[-1]))
                want = run(alone, [(rid, prompt, SamplingParams(**greedy, max_tokens=max_tokens, n=n))])[rid]
                assert [c.token_ids for c in done[rid].outputs] == [c.token_ids for c in want.outputs], rid
        finally:
            alone.shutdown()
        assert engine.scheduler.num_preemptions > 0       # the pool holds 36 tokens
        assert_pool_empty(engine)
    finally:
        engine.shutdown()
