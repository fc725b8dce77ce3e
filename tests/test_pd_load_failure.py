"""A decode engine whose step fails before the K/V it claimed from a prefill engine landed: the blocks
the load was to fill were registered in the prefix cache at admission and must not serve a later prompt."""
from __future__ import annotations

import pytest
from test_kv_transfer import PROMPTS, claim, engines, prefill, run, wait_until_free

from minillm import SamplingParams
from minillm.engine import StepError


def test_a_step_that_fails_before_its_remote_load_leaves_no_prefix_of_unloaded_blocks(stories_path):
    producer, consumer, plain = engines(stories_path)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        ids = plain.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
        reference = run(plain, "ref", ids, greedy).outputs[0].token_ids
        worker = consumer.runner.kv_connector
        load = worker.start_load_kv

        def fails(meta):
            if meta is not None and meta.loads:
                raise MemoryError("no room for the copies")
            return load(meta)
        worker.start_load_kv = fails
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                extra_args={"kv_transfer_params": claim(prefill(producer, "p", ids), ids)})
        with pytest.raises(StepError) as failure:
            run(consumer, "d", ids, params)
        assert failure.value.request_ids == ["d"]
        worker.start_load_kv = load
        bm = consumer.block_manager
        assert bm.num_used_blocks == 0 and not bm.key_to_block      # nothing of the unloaded prompt is cached
        again = run(consumer, "again", ids, greedy)                  # computed here, not read from the pool
        assert again.outputs[0].token_ids == reference
        wait_until_free(producer)
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()
