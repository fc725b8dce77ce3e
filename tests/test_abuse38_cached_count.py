"""A request of n > 1 completions whose prompt is one token past a block boundary: its siblings, admitted
in the same step as the first child, are served all but the last prompt token from the blocks the first
child fills, so each schedules one token, and one-token rows go first in a step. The request's first
output (which vLLM's streams read) took the count of the first row scheduled: a sibling's, not the first
child's 0. It depended on the prompt's length, so a server test with a random prompt failed now and then."""
from __future__ import annotations

import json

import pytest
from test_abuse36_parallel_leftovers import BLOCK, CoreDriver, EngineDriver

from minillm import SamplingParams
from minillm.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.mark.parametrize("driver", [EngineDriver, CoreDriver], ids=["engine", "engine_core"])
@pytest.mark.parametrize("length", [2 * BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 5])
def test_the_first_output_counts_the_first_childs_cached_tokens(stories_path, golden, driver, length):
    run = driver(stories_path)
    params = SamplingParams(temperature=0, n=3, max_tokens=2, ignore_eos=True,
                            output_kind=RequestOutputKind.CUMULATIVE)
    run.add(golden[:length], params)
    outputs = []
    while not outputs:
        outputs += run.step()
    seqs = run.engine.requests["parent"].seqs
    assert seqs[0].num_cached_tokens == 0 and seqs[1].num_cached_tokens == (length - 1) // BLOCK * BLOCK
    assert outputs[0].metrics.num_cached_tokens == 0
