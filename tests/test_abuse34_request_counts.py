"""request_success (and /v1/stats num_requests_finished) with the engine core in its own process: the API
server's OutputProcessor counts each sequence once, under one reason, whatever the order in which the
core's finish, a stop string found on the API server, a client's abort, a failed step and n > 1
children's ends arrive; a request the core refused is not counted even when its caller left first."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from minillm.engine_core import messages as m
from minillm.engine_core.output_processor import OutputProcessor
from minillm.sampling_params import RequestOutputKind, SamplingParams
from minillm.server.async_llm import with_own_finish_counts
from minillm.stats import EngineStats
from minillm.tokenizer import Tokenizer

RID = "r"


@pytest.fixture(scope="module")
def tok(stories_path):
    return Tokenizer.from_pretrained(stories_path)


@pytest.fixture
def words(tok):
    """Token ids of a few words, the stop string's own last."""
    return tok.encode(" the cat sat", add_special_tokens=False)


class Frontend:
    """An OutputProcessor driven as AsyncLLM drives it, tallying what reaches the core and the caller."""

    def __init__(self, tok: Tokenizer) -> None:
        self.proc = OutputProcessor(tok)
        self.step_no = 0
        self.reported = Counter()       # what FinishedCounts carried to the core
        self.finals = []                # the final outputs the caller was handed
        self.ends = {}                  # completion index -> the finish reason the caller was handed
        self.stops = []

    def add(self, n: int = 1, **params) -> None:
        self.proc.add(RID, None, [1, 2], SamplingParams(n=n, **params), 0.0, "stream")

    def step(self, *seqs: m.SeqOutput, finished: bool = False) -> None:
        """One StepOutputs for the request, processed as AsyncLLM._on_step does."""
        self.step_no += 1
        out = m.RequestStepOutput(RID, list(seqs), finished, 0, None, None, None)
        done = self.proc.process(m.StepOutputs(self.step_no, 0.0, [out]), 0.0)
        self.stops += done.stops
        self._collect(done.outputs)
        self.reported.update(self.proc.take_unreported())

    def fail(self) -> None:
        """A step that failed for the request (the core aborted it and retires it next step)."""
        self.step_no += 1
        failure = m.FailedRequests([RID], "RuntimeError", "boom")
        done = self.proc.process(m.StepOutputs(self.step_no, 0.0, [], [failure]), 0.0)
        self.proc.abandon(RID)
        self.reported.update(self.proc.take_unreported())
        assert not done.outputs

    def abort(self) -> None:
        """The caller left (AsyncLLM._abort)."""
        ended = self.proc.abort(RID, 0.0)
        if ended is not None:
            self._collect([ended])

    def _collect(self, outputs) -> None:
        for _, output in outputs:
            if output.finished:
                self.finals.append(output)
            for completion in output.outputs:
                if completion.finish_reason is not None:
                    assert self.ends.setdefault(completion.index, completion.finish_reason) \
                        == completion.finish_reason, "a completion the caller saw end changed its reason"

    def counts(self) -> Counter:
        """The whole count a snapshot shows: the core's sum of reports with this server's own in place."""
        stats = EngineStats.__new__(EngineStats)
        for one in dataclasses.fields(EngineStats):
            object.__setattr__(stats, one.name, None)
        object.__setattr__(stats, "num_requests_finished", dict(self.reported))
        own = with_own_finish_counts(stats, dict(self.reported), self.proc.finished)
        return Counter(own.num_requests_finished)

    def assert_counted(self, **expected: int) -> None:
        assert RID not in self.proc.requests or not self.proc.requests[RID].is_followed
        assert self.counts() == Counter(expected)
        assert len(self.finals) <= 1, "the caller was handed two final outputs"
        if self.finals:     # the caller saw every completion end, with the reasons counted
            assert Counter(self.ends.values()) == Counter(expected)


def seq(index: int, tokens: list[int], reason: str | None = None, stop_reason=None) -> m.SeqOutput:
    return m.SeqOutput(index, tokens, None, reason, stop_reason)


def test_natural_finish_then_a_late_abort(tok, words):
    f = Frontend(tok)
    f.add(max_tokens=2)
    f.step(seq(0, words[:1]))
    f.step(seq(0, words[1:2], "length"), finished=True)
    f.abort()           # the client's hang-up reaches the server after the last output
    f.assert_counted(length=1)


def test_abort_before_the_core_reports_the_natural_finish_of_the_same_step(tok, words):
    f = Frontend(tok)
    f.add(max_tokens=2)
    f.step(seq(0, words[:1]))
    f.abort()           # the core finished it by length in the step this abort crossed
    f.step(seq(0, words[1:2], "length"), finished=True)
    f.assert_counted(abort=1)


def test_abort_then_the_cores_abort_report(tok, words):
    f = Frontend(tok)
    f.add(max_tokens=8)
    f.step(seq(0, words[:1]))
    f.abort()
    f.step(seq(0, [], "abort"), finished=True)
    f.step(seq(0, [], "abort"), finished=True)     # a stray second report of the retired id
    f.assert_counted(abort=1)
    assert RID not in f.proc.requests


def test_stop_string_found_here_as_the_core_ends_it_by_length(tok, words):
    f = Frontend(tok)
    f.add(max_tokens=len(words), stop=[tok.decode(words)[-3:]])
    f.step(seq(0, words[:-1]))
    f.step(seq(0, words[-1:], "length"), finished=True)
    assert f.stops == []    # the core has ended it: no stop goes down
    f.assert_counted(stop=1)


def test_stop_string_found_here_then_the_core_ends_it_by_length_later(tok, words):
    f = Frontend(tok)
    f.add(max_tokens=len(words) + 2, stop=[tok.decode(words)[-3:]])
    f.step(seq(0, words))
    assert [s[:2] for s in f.stops] == [(RID, 0)]
    f.step(seq(0, words[:2], "length"), finished=True)    # tokens sampled before the stop reached the core
    f.assert_counted(stop=1)


def test_stop_string_found_here_then_the_client_leaves_before_the_core_retires_it(tok, words):
    f = Frontend(tok)
    f.add(max_tokens=len(words) + 2, stop=[tok.decode(words)[-3:]])
    f.step(seq(0, words))
    f.abort()
    f.step(seq(0, [], "stop", tok.decode(words)[-3:]), finished=True)
    f.assert_counted(stop=1)


def test_n_children_ending_apart_with_an_abort_between(tok, words):
    f = Frontend(tok)
    f.add(n=3, max_tokens=4, stop=[tok.decode(words)[-3:]])
    f.step(seq(0, words[:1], "length"), seq(1, words), seq(2, words[:1]))   # 0: length; 1: stop string here
    f.abort()           # 2 still runs
    f.step(seq(2, words[1:2], "length"), seq(1, [], "stop"), finished=True)
    f.assert_counted(length=1, stop=1, abort=1)


def test_n_children_all_ending_in_the_abort_step(tok, words):
    f = Frontend(tok)
    f.add(n=2, max_tokens=1)
    f.abort()
    f.step(seq(0, words[:1], "length"), seq(1, words[:1], "length"), finished=True)
    f.assert_counted(abort=2)


def test_n_children_finished_before_the_abort(tok, words):
    f = Frontend(tok)
    f.add(n=2, max_tokens=1)
    f.step(seq(0, words[:1], "length"), seq(1, words[:1], "length"), finished=True)
    f.abort()
    f.assert_counted(length=2)


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_other_output_kinds_abort_and_finish(tok, words, kind):
    f = Frontend(tok)
    f.add(n=2, max_tokens=2, output_kind=kind)
    f.step(seq(0, words[:1]), seq(1, words[:1]))
    f.step(seq(0, words[1:2], "length"), seq(1, words[1:2]))
    f.abort()
    f.step(seq(1, [], "abort"), finished=True)
    f.assert_counted(length=1, abort=1)


def test_a_failed_step_counts_its_request_once_when_the_core_retires_it(tok, words):
    f = Frontend(tok)
    f.add(n=2, max_tokens=4)
    f.step(seq(0, words[:1]), seq(1, words[:1]))
    f.fail()
    f.abort()           # the caller, handed the error, leaves
    f.step(seq(0, [], "abort"), seq(1, [], "abort"), finished=True)
    f.assert_counted(abort=2)
    assert f.finals == []


def test_an_abort_while_the_add_is_in_flight_of_a_request_the_core_accepts(tok, words):
    f = Frontend(tok)
    f.add(n=2, max_tokens=4)
    f.abort()
    f.proc.accepted(RID)
    f.reported.update(f.proc.take_unreported())
    assert f.counts() == Counter(abort=2)       # counted once the core has it, before its last report
    f.step(seq(0, [], "abort"), seq(1, [], "abort"), finished=True)
    f.assert_counted(abort=2)


def test_an_abort_while_the_add_is_in_flight_of_a_request_the_core_refuses(tok, words):
    # The caller left while its add was on its way; the core then refused the add (a check only the
    # engine makes). The request never ran: it was counted as 1 "abort" all the same.
    f = Frontend(tok)
    f.add(max_tokens=4)
    f.abort()
    f.proc.remove(RID)
    f.reported.update(f.proc.take_unreported())
    assert f.counts() == Counter()
    assert RID not in f.proc.requests
