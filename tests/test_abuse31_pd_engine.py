"""kv_transfer_params through the Python API on an engine that is both producer and consumer
(kv_both): params that set do_remote_decode and do_remote_prefill are a prefill request for a remote
decode, as the API server takes them, and never raise from the engine's steps."""
from __future__ import annotations

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine

from test_kv_transfer import PROMPTS, run, wait_until_free


def test_both_flags_on_a_kv_both_engine_are_a_prefill_for_a_remote_decode(stories_path):
    # check_request took do_remote_decode first and let the request in; the connector's scheduler
    # side took do_remote_prefill first and raised "has no remote_lease_id" from every step after
    # (the request stayed waiting: the engine could run nothing more).
    engine = LLMEngine(EngineConfig(str(stories_path), device="cpu", block_size=8,
                                    kv_transfer_config={"kv_role": "kv_both", "kv_lease_s": 60}))
    try:
        ids = engine.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
        both = {"do_remote_decode": True, "do_remote_prefill": True}
        out = run(engine, "both", ids, SamplingParams(temperature=0, max_tokens=1,
                                                      extra_args={"kv_transfer_params": both}))
        kv = out.kv_transfer_params
        assert kv["do_remote_prefill"] is True and kv["remote_num_tokens"] == len(ids)
        assert engine.stats(cells=1).kv_transfer_num_leases == 1
        after = run(engine, "after", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert after.finished and len(after.outputs[0].token_ids) == 4
        engine.kv_connector.leases.release(kv["remote_lease_id"])
        wait_until_free(engine)
    finally:
        engine.shutdown()
