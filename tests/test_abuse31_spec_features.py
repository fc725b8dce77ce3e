"""N-gram speculation beside constrained requests and requests that run their prompt in the same steps.

A constrained request (choice, regex, JSON schema) gets drafts held to its grammar, and shares steps
whose logits rows are laid out by the other drafting requests; a request asking for prompt
log-probabilities has its prompt chunks computed in steps that verify other requests' drafts.
Greedy outputs, their log-probabilities and the prompt log-probabilities are those of the engine
without speculation.
"""
import json

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.sampling_params import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}


@pytest.fixture(scope="module")
def requests(stories_path) -> list[tuple[str, list[int], SamplingParams]]:
    """Drafting requests (repetitive prompts), constrained ones and a long prompt with prompt_logprobs."""
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    repeat = [1] + golden[1:30] + golden[1:8]
    loop = [1] + golden[60:70] * 3
    greedy = dict(temperature=0, ignore_eos=True)
    return [
        ("draft", repeat, SamplingParams(max_tokens=40, logprobs=2, **greedy)),
        ("prompt", [1] + golden[50:120], SamplingParams(max_tokens=12, prompt_logprobs=2, logprobs=1, **greedy)),
        ("choice", loop, SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
            choice=["Tom went home", "Lily was happy"]), **greedy)),
        ("loop", loop, SamplingParams(max_tokens=30, logprobs=1, **greedy)),
        ("regex", repeat, SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(
            regex="( [a-z]+){1,6}\\."), **greedy)),
        ("json", repeat, SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA),
                                        **greedy)),
    ]


def run(llm: LLM, requests, every: int) -> dict:
    """Add a request every `every` steps (all at once for 0) and step until all are done."""
    engine, done, pending, step = llm.engine, {}, list(requests), 0
    while pending or engine.has_unfinished_requests():
        while pending and step >= every * (len(requests) - len(pending)):
            engine.add_request(*pending.pop(0))
        done.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    return done


def logprob_rows(entries) -> list:
    return [None if d is None else {t: (float(v), v.rank) for t, v in d.items()} for d in entries]


def assert_rows_close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.keys() == w.keys() and [g[t][1] for t in g] == [w[t][1] for t in g]
            np.testing.assert_allclose([g[t][0] for t in g], [w[t][0] for t in g], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("every,budget", [(0, None), (3, 32), (5, 16)])
def test_constrained_and_prompt_logprob_requests_beside_drafts(stories_path, requests, every, budget,
                                                               async_scheduling):
    kw = dict(device="cpu", async_scheduling=async_scheduling)
    if budget:
        kw["max_num_batched_tokens"] = budget          # the long prompt is chunked over verify steps
    want = run(LLM(str(stories_path), **kw), requests, every)
    llm = LLM(str(stories_path), speculative_config=SPEC, **kw)
    got = run(llm, requests, every)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    for rid, prompt, _ in requests:
        g, w = got[rid].outputs[0], want[rid].outputs[0]
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), rid
        if w.logprobs is not None:
            assert len(g.logprobs) == len(g.token_ids)
            assert_rows_close(logprob_rows(g.logprobs), logprob_rows(w.logprobs))
    plp = got["prompt"].prompt_logprobs
    assert len(plp) == len(requests[1][1]) and plp[0] is None
    assert_rows_close(logprob_rows(plp), logprob_rows(want["prompt"].prompt_logprobs))
    assert got["choice"].outputs[0].text in ("Tom went home", "Lily was happy")
    assert got["json"].outputs[0].text.startswith('{')
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
