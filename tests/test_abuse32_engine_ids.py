"""An aborted request's id taken at once by a request of fewer completions, while a step of the old
one is still in flight (async scheduling): the old sequences' results reach nobody, a failure of
that step is a StepError, and the engine goes on (stories260K, CPU)."""
import json

import pytest

from minillm import SamplingParams, StructuredOutputsParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, StepError


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


def test_a_deferred_sampling_that_fails_after_its_id_was_taken_is_a_step_error(stories_path, golden):
    # A constrained request's step was launched with its sampling deferred; the request was aborted
    # and its id taken by a request of one completion; the deferred sampling then failed. Naming the
    # failed step's requests looked the old sequences up among the new one's and raised IndexError
    # instead of StepError (which the engine core survives; any other exception ends it).
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", max_model_len=64, block_size=4,
                                    num_kv_blocks=40, async_scheduling=True), log=lambda msg: None)
    engine.add_request("a", golden[:10], SamplingParams(temperature=0, n=3, max_tokens=8, structured_outputs=
                                                        StructuredOutputsParams(regex="( [a-z]+){1,6}\\.")))
    # compiled before the steps are counted, whatever a compile takes
    engine.structured_outputs.grammar_init(StructuredOutputsParams(regex="( [a-z]+){1,6}\\.")).result(timeout=120)
    for _ in range(10):
        engine.step()
        if engine._deferred_out is not None:
            break
    assert engine._deferred_out is not None
    engine.abort_request("a")
    new = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", golden[:5], new)
    sample = engine.runner.sampler.sample_no_sync

    def fails(*args, **kwargs):
        raise MemoryError("no room for the sampler")
    engine.runner.sampler.sample_no_sync = fails
    with pytest.raises(StepError) as failure:
        engine.step()
    assert failure.value.request_ids == []          # the old request was aborted already
    engine.runner.sampler.sample_no_sync = sample
    done = [out for out in drain_all(engine) if out.finished]
    assert [[c.finish_reason for c in out.outputs] for out in done] == [["abort"] * 3, ["length"]]
    alone = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", max_model_len=64), log=lambda msg: None)
    alone.add_request("a", golden[:5], new)
    assert done[1].outputs[0].token_ids == finals(alone)["a"].outputs[0].token_ids
    assert engine.block_manager.num_used_blocks == 0
    engine.shutdown()
    alone.shutdown()


def drain_all(engine):
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs
