"""An aborted request's id taken at once by a request of fewer completions, while a step of the old
one is still in flight (async scheduling): the old sequences' results reach nobody, and the engine
goes on (stories260K, CPU)."""
import json

import pytest

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


def finals(engine):
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return done


def test_an_id_taken_by_fewer_completions_with_the_old_step_in_flight(stories_path, golden):
    # The in-flight step scored the old request's three prompts; reading it back looked each old
    # sequence up by its index among the new request's one sequence, and step() raised IndexError
    # for the second.
    old = dict(prompt_logprobs=0)
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", max_model_len=64, block_size=4,
                                    num_kv_blocks=40, async_scheduling=True), log=lambda msg: None)
    engine.add_request("a", golden[:10], SamplingParams(temperature=0, n=3, max_tokens=4, **old))
    assert engine.step() == [] and len(engine._in_flight) == 1
    engine.abort_request("a")
    new = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **old)
    engine.add_request("a", golden[:5], new)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    aborted, *rest = [out for out in outputs if out.finished]
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 3 and not any(c.token_ids for c in aborted.outputs)
    assert [len(out.outputs) for out in rest] == [1]
    alone = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", max_model_len=64), log=lambda msg: None)
    alone.add_request("a", golden[:5], new)
    want = finals(alone)["a"]
    assert rest[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert (rest[0].prompt_logprobs is None) == (want.prompt_logprobs is None)
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests
    engine.shutdown()
    alone.shutdown()
