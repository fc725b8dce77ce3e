"""vLLM offline scripts against minillm's LLM and LLMEngine: what vLLM's outputs offline do, minillm's do."""
import pytest

from minillm import SamplingParams
from minillm.sampling_params import RequestOutputKind

PROMPT = "Once upon a time"


def _summary(out):
    """What a finished output says of each completion."""
    return [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob,
             None if c.logprobs is None else [dict(entry) for entry in c.logprobs]) for c in out.outputs]


def _merged(engine, params, aggregate: bool):
    """One request's step outputs through the engine, merged with RequestOutput.add; and how many came."""
    engine.add_request("merged", PROMPT, params)
    merged, num_outputs = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_outputs += 1
            if merged is None:
                merged = out
            else:
                merged.add(out, aggregate=aggregate)
    return merged, num_outputs


@pytest.mark.parametrize("kind, aggregate", [(RequestOutputKind.DELTA, True), (RequestOutputKind.CUMULATIVE, False)])
def test_request_output_add_merges_a_stream_into_the_final_output(llm, kind, aggregate):
    """vLLM's RequestOutput.add (a DELTA stream added up, a CUMULATIVE one replaced): an AttributeError here."""
    params = dict(n=2, seed=3, max_tokens=12, stop=["park"], logprobs=2, prompt_logprobs=1)
    [final] = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)
    merged, num_outputs = _merged(llm.llm_engine, SamplingParams(**params, output_kind=kind), aggregate)
    assert num_outputs > 2 and merged.finished
    assert _summary(merged) == _summary(final)
    assert [dict(e or {}) for e in merged.prompt_logprobs] == [dict(e or {}) for e in final.prompt_logprobs]
