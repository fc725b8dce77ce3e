"""The host KV tier when a step fails before its loads land (stories260K, CPU): the device blocks the
loads were to fill had their prefix keys from the admission, and must not serve a later prompt."""
import json

import pytest

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, StepError


def finals(engine):
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return done


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_that_fails_before_its_host_loads_leaves_no_prefix_of_unloaded_blocks(stories_path,
                                                                                     async_scheduling):
    # A's prompt goes to the host tier (B's evicts it from the device); A again hits it there, and the
    # step that was to load it failed in the copies (a device allocation, say). The blocks kept the
    # keys they got at admission: the next A read 28 cached tokens of K/V nobody wrote.
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    config = dict(model=str(stories_path), device="cpu", max_model_len=48)
    engine = LLMEngine(EngineConfig(**config, block_size=4, num_kv_blocks=13, kv_offload_gib=0.0005,
                                    async_scheduling=async_scheduling), log=lambda msg: None)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt, other = golden[:30], golden[60:100]
    engine.add_request("a1", prompt, params)
    first = finals(engine)["a1"].outputs[0].token_ids
    engine.add_request("b", other, params)
    finals(engine)
    worker = engine.runner.kv_connector
    load = worker.start_load_kv
    failed_loads = []

    def fails(meta):
        if meta is not None and meta.loads.num_blocks:
            failed_loads.append(meta.loads.num_blocks)
            raise MemoryError("no room for the copies")
        return load(meta)
    worker.start_load_kv = fails
    engine.add_request("a2", prompt, params)
    with pytest.raises(StepError) as failure:
        finals(engine)
    assert failure.value.request_ids == ["a2"] and failed_loads
    worker.start_load_kv = load
    finals(engine)
    engine.add_request("a3", prompt, params)
    again = finals(engine)["a3"]
    alone = LLMEngine(EngineConfig(**config), log=lambda msg: None)
    alone.add_request("a", prompt, params)
    assert first == again.outputs[0].token_ids == finals(alone)["a"].outputs[0].token_ids
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and all(bm.block_keys[b] == k for k, b in bm.key_to_block.items())
    engine.shutdown()
    alone.shutdown()
