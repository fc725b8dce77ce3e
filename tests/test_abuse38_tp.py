"""stories260K over two processes beside one, with what users combine with tensor parallelism:
prompt log-probabilities, prefix hits, preemption in a small pool, chunked prefill, seeded n > 1,
structured outputs, penalties and stop strings give the same tokens and log-probabilities."""
import json

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.sampling_params import StructuredOutputsParams

# Chunks of 16 tokens, and a pool that preempts when four long prompts decode together.
ENGINE = dict(device="cpu", block_size=4, num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64)


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def engines(stories_path):
    """{1: one process, 2: two}, built once for the module."""
    with LLM(str(stories_path), **ENGINE) as one, LLM(str(stories_path), tensor_parallel_size=2, **ENGINE) as two:
        yield {1: one, 2: two}


def run_both(engines, prompts, params) -> list:
    """Each engine's outputs (tp 1, tp 2), its preemption count beside them."""
    out = []
    for tp in (1, 2):
        before = engines[tp].engine.scheduler.num_preemptions
        got = engines[tp].generate(prompts, params, use_tqdm=False)
        out.append((got, engines[tp].engine.scheduler.num_preemptions - before))
    return out


def assert_same_logprobs(ours: list, want: list) -> None:
    """Log-probability dicts, position by position: same ids and ranks, values within float error."""
    assert len(ours) == len(want)
    for x, y in zip(ours, want):
        if y is None:
            assert x is None
            continue
        assert x.keys() == y.keys()
        assert [x[t].rank for t in x] == [y[t].rank for t in x]
        np.testing.assert_allclose([x[t].logprob for t in x], [y[t].logprob for t in x], rtol=1e-4, atol=1e-4)


def assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [(c.text, c.finish_reason, c.stop_reason) for c in g.outputs] == \
               [(c.text, c.finish_reason, c.stop_reason) for c in w.outputs]
        assert g.num_cached_tokens == w.num_cached_tokens
        for a, b in zip(g.outputs, w.outputs):
            assert_same_logprobs(a.logprobs or [], b.logprobs or [])


def test_prompt_logprobs_over_two_ranks_are_one_processes(engines, golden):
    # They were refused ("not supported with tensor_parallel_size > 1"); vLLM gathers the LM head
    # for them as for the sampled rows. Prompts longer than a chunk, scored over several steps.
    prompts = [{"prompt_token_ids": golden[:40]}, {"prompt_token_ids": golden[50:57]}, "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3, logprobs=2)
    (two, _), (one, _) = run_both(engines, prompts, params)[::-1]
    assert_same(two, one)
    for g, w in zip(two, one):
        assert len(g.prompt_logprobs) == len(g.prompt_token_ids) and g.prompt_logprobs[0] is None
        assert_same_logprobs(g.prompt_logprobs, w.prompt_logprobs)
    # the group stays in step for the plain requests after them
    (after, _), (want, _) = run_both(engines, prompts[2:], SamplingParams(temperature=0, max_tokens=8))
    assert_same(after, want)


CASES = {
    "prefix_hits": (lambda g: [{"prompt_token_ids": g[:30]}, {"prompt_token_ids": g[:30] + g[60:64]}],
                    SamplingParams(temperature=0, max_tokens=8, logprobs=2)),
    "preempted": (lambda g: [{"prompt_token_ids": g[i:i + 22]} for i in (0, 25, 50, 75)],
                  SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)),
    "n3_seeded": (lambda g: ["Once upon a time", "The little dog"],
                  SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=10, logprobs=2)),
    "penalties": (lambda g: ["Once upon a time", "Lily and Tom went to the park"],
                  SamplingParams(temperature=0, max_tokens=20, presence_penalty=1.0, frequency_penalty=0.5,
                                 repetition_penalty=1.3)),
    "stop_strings": (lambda g: ["Once upon a time", "The little dog"],
                     SamplingParams(temperature=0, max_tokens=30, stop=[".", " park"],
                                    include_stop_str_in_output=True)),
    "structured": (lambda g: ["Once upon a time", "The little dog"],
                   SamplingParams(temperature=0, max_tokens=8,
                                  structured_outputs=StructuredOutputsParams(regex="[A-Z][a-z]+ [a-z]+"))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_features_combined_with_two_ranks_give_one_processes_outputs(engines, golden, case):
    prompts, params = CASES[case]
    (one, one_preempted), (two, two_preempted) = run_both(engines, prompts(golden), params)
    assert_same(two, one)
    assert two_preempted == one_preempted
    if case == "preempted":
        assert two_preempted > 0
    if case == "prefix_hits":
        assert two[1].num_cached_tokens > 0

