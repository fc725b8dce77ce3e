"""The spec_decode counters of n-gram speculation count only drafts whose tokens reached a request.

A request aborted (or stopped by the API server) while its drafts are being verified gets none of
the step's tokens; vLLM's scheduler skips such a request before it counts its drafts, so the
counters keep agreeing with the tokens the requests received.
"""
import json

import pytest

from minillm import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def prompt(stories_path) -> list[int]:
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    return [1] + golden[1:30] + golden[1:8]          # its greedy continuation repeats the prompt


def run_until_drafts_in_flight(llm: LLM, prompt: list[int]) -> dict[int, list[int]]:
    """Add requests a and b and step until both have drafts on the device; their drafts by seq_id."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)
    running = engine.scheduler.running
    while not (len(running) == 2 and all(s.spec_token_ids for s in running)):
        assert engine.has_unfinished_requests()
        engine.step()
    return {s.request_id: list(s.spec_token_ids) for s in running}


@pytest.mark.parametrize("end", ["abort", "stop_sequence"])
def test_drafts_of_a_request_ended_while_they_are_verified_are_not_counted(stories_path, prompt, end):
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC, async_scheduling=True)
    engine = llm.engine
    in_flight = run_until_drafts_in_flight(llm, prompt)
    before = engine.stats().spec_decode
    assert before.num_drafts == 0 and in_flight["a"] and in_flight["b"]
    if end == "abort":
        engine.abort_request("a")
    else:
        engine.stop_sequence("a", 0, "stop")
    while engine.stats().spec_decode.num_drafts == 0:
        outputs = {o.request_id: o for o in engine.step()}
    after = engine.stats().spec_decode
    # b's draft alone was verified for a request: a got no token of that step
    b_tokens = len(outputs["b"].outputs[0].token_ids)
    assert after.num_drafts == 1
    assert after.num_draft_tokens == len(in_flight["b"])
    accepted = after.num_accepted_tokens
    assert sum(after.num_accepted_tokens_per_pos) == accepted
    # the first token came from the prompt's step, then one token per step plus b's accepted drafts
    assert accepted <= len(in_flight["b"]) and b_tokens >= accepted + 1


def test_a_request_row_never_counts_drafts_in_flight_as_output(stories_path, prompt):
    """With async scheduling a step verifying drafts is still in flight when stats() is read: the
    request's row counts its one sure token of that step, not its drafts (which may be rejected), so
    output_tokens never goes down from one snapshot to the next."""
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC, async_scheduling=True)
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    counts, saw_drafts = [], False
    while engine.has_unfinished_requests():
        engine.step()
        saw_drafts |= any(s.spec_token_ids for s in engine.scheduler.running)
        counts += [row.output_tokens for row in engine.stats().requests if row.request_id == "r"]
    assert saw_drafts
    assert counts == sorted(counts) and counts[-1] <= 40
