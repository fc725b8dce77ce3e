"""The prefix-cache counters under preemption, as vLLM counts them: prefix_cache_queries and
prefix_cache_hits are the prompt tokens of new sequences looked up and found; a preempted sequence
that is admitted again (its generated tokens now part of what it looks up, its own freed blocks
often still cached) is not a new query."""
from __future__ import annotations

import random

from minillm import LLM, SamplingParams


def test_a_resumed_sequence_is_not_counted_as_a_prefix_cache_query_or_hit(stories_path):
    rng = random.Random(32)
    # Prompts that share no block (each starts with its own token after BOS): a new sequence finds nothing.
    prompts = [[1, 10 + k] + [rng.randrange(3, 512) for _ in range(20)] for k in range(6)]
    llm = LLM(str(stories_path), device="cpu", block_size=4, num_kv_blocks=40, max_num_seqs=6)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0, "the pool should be too small for all six at once"
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits == 0
