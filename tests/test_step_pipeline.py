"""The step seam on the CPU: the scheduler driven through update_from_output by a fake runner
that lags one step behind the launch, as the GPU does (tokens come back a step later)."""
from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.block_manager import BlockManager
from minillm.sampling_params import SamplingParams
from minillm.scheduler import Scheduler
from minillm.sequence import Sequence, SequenceStatus
from minillm.step import SchedulerOutput, StepOutput

EOS = 0


def token_at(seq: Sequence, position: int) -> int:
    """The fake model's token for seq at a position: a function of the prompt and the position."""
    return 3 + (sum(seq.prompt_token_ids[:3]) * 7 + position * 5) % 40


class FakeInFlight:
    def __init__(self, out: SchedulerOutput, eos_at: dict[int, int]):
        self.sampled = {}
        for b in out.sampling_rows:
            seq = out.seqs[b]
            position = out.num_computed_tokens[b] + out.num_new_tokens[b]   # index of the sampled token
            self.sampled[seq.seq_id] = EOS if eos_at.get(seq.seq_id) == position else token_at(seq, position)

    def wait(self) -> StepOutput:
        return StepOutput(dict(self.sampled))


class Pipeline:
    """The engine's loop around a scheduler: schedule, launch, complete the step before."""

    def __init__(self, sched: Scheduler, lag: int, eos_at: dict[int, int] | None = None):
        self.sched, self.lag, self.eos_at = sched, lag, eos_at or {}
        self.in_flight: deque[tuple[SchedulerOutput, FakeInFlight]] = deque()
        self.num_preempted_in_flight = 0      # preempted while their token was on its way

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check_launch(out)
        self.num_preempted_in_flight += sum(1 for p in out.preempted if p.num_output_placeholders)
        if not out.is_empty:
            self.in_flight.append((out, FakeInFlight(out, self.eos_at)))
        depth = self.lag if not out.is_empty else 0
        while len(self.in_flight) > depth:
            self.sched.update_from_output(*self.in_flight.popleft())
        return out

    def check_launch(self, out: SchedulerOutput) -> None:
        """What a runner relies on: blocks for every scheduled token, at most one unknown input."""
        bs = self.sched.block_manager.block_size
        for seq, start, n in zip(out.seqs, out.num_computed_tokens, out.num_new_tokens):
            assert not seq.is_finished
            assert len(seq.block_table) * bs >= start + n
            assert start + n - len(seq.token_ids) <= 1       # only the in-flight token is unknown

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not (self.sched.has_unfinished() or self.in_flight):
                return
            self.step()
        raise AssertionError("did not finish")


def create_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256):
    return Scheduler(BlockManager(num_blocks, block_size, True), max_num_seqs, budget, max_model_len, [EOS])


def create_seq(rid, prompt_len, max_tokens=6, base=1, **params):
    prompt = [base + (i % 50) for i in range(prompt_len)]
    p = SamplingParams(max_tokens=max_tokens, **params)
    return Sequence(rid, 0, prompt, p, 0.0, np.random.default_rng(0), max_tokens)


def expected_outputs(seq: Sequence) -> list[int]:
    p0 = seq.num_prompt_tokens
    return [token_at(seq, p0 + i) for i in range(seq.max_tokens)]


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)
    assert not sched.has_unfinished()


def test_lagging_runner_gives_the_same_tokens_as_a_synchronous_one():
    results = []
    for lag in (0, 1):
        sched = create_scheduler()
        seqs = [create_seq(f"r{i}", 3 + 5 * i, base=1 + 9 * i) for i in range(5)]
        for s in seqs:
            sched.add(s)
        Pipeline(sched, lag).run()
        assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)
        assert all(s.output_token_ids == expected_outputs(s) for s in seqs)
        assert all(s.num_output_placeholders == 0 for s in seqs)
        assert_all_free(sched)
        results.append([s.output_token_ids for s in seqs])
    assert results[0] == results[1]


def test_abort_while_its_token_is_in_flight_drops_the_token():
    sched = create_scheduler()
    a, b = create_seq("a", 5), create_seq("b", 6, base=20)
    sched.add(a)
    sched.add(b)
    pipe = Pipeline(sched, lag=1)
    pipe.step()                                    # prompts launched, tokens in flight
    assert a.num_output_placeholders == 1 and a.token_ids == a.prompt_token_ids
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert a.num_output_placeholders == 0 and a.block_table == []
    pipe.run()
    assert a.output_token_ids == [] and a.status is SequenceStatus.FINISHED_ABORTED
    assert b.output_token_ids == expected_outputs(b)
    assert_all_free(sched)


def test_stop_string_while_the_next_token_is_in_flight():
    sched = create_scheduler()
    a = create_seq("a", 5, max_tokens=10)
    sched.add(a)
    pipe = Pipeline(sched, lag=1)
    pipe.step()
    pipe.step()                                    # token 1 read back, token 2 in flight
    assert len(a.output_token_ids) == 1 and a.num_output_placeholders == 1
    sched.stop(a, "the end")                       # the output processor saw a stop string
    assert a.status is SequenceStatus.FINISHED_STOPPED and a.stop_reason == "the end"
    pipe.run()
    assert a.output_token_ids == expected_outputs(a)[:1]       # the in-flight token is dropped
    assert_all_free(sched)


def test_stop_string_on_the_last_token_overrides_length():
    sched = create_scheduler()
    a = create_seq("a", 5, max_tokens=2)
    sched.add(a)
    Pipeline(sched, lag=1).run()
    assert a.status is SequenceStatus.FINISHED_LENGTH
    sched.stop(a, "x")
    assert a.status is SequenceStatus.FINISHED_STOPPED and a.stop_reason == "x"
    assert_all_free(sched)


def test_preemption_while_a_token_is_in_flight():
    sched = create_scheduler(num_blocks=7, block_size=4, budget=64)
    a, b = create_seq("a", 8, max_tokens=8), create_seq("b", 8, max_tokens=8, base=30)
    sched.add(a)
    sched.add(b)
    pipe = Pipeline(sched, lag=1)
    pipe.run()
    assert sched.num_preemptions > 0 and pipe.num_preempted_in_flight > 0
    assert a.output_token_ids == expected_outputs(a) and b.output_token_ids == expected_outputs(b)
    assert_all_free(sched)


def test_two_sequences_finish_in_the_same_step():
    sched = create_scheduler()
    a, b = create_seq("a", 5, max_tokens=8), create_seq("b", 5, max_tokens=8, base=40)
    c = create_seq("c", 4, max_tokens=3, base=9)
    for s in (a, b, c):
        sched.add(s)
    # a and b sample EOS at the same position; c ends by length in that very step.
    eos_at = {a.seq_id: 7, b.seq_id: 7}
    pipe = Pipeline(sched, lag=1, eos_at=eos_at)
    pipe.run()
    assert a.status is b.status is SequenceStatus.FINISHED_STOPPED
    assert a.stop_reason is None and a.output_token_ids[-1] == EOS and len(a.output_token_ids) == 3
    assert len(b.output_token_ids) == 3
    assert c.status is SequenceStatus.FINISHED_LENGTH and len(c.output_token_ids) == 3
    assert_all_free(sched)


def test_min_tokens_holds_back_eos_and_stop_token_ids_stop():
    sched = create_scheduler()
    a = create_seq("a", 5, max_tokens=8, min_tokens=4)
    b = create_seq("b", 5, max_tokens=8, base=11, stop_token_ids=[EOS])
    sched.add(a)
    sched.add(b)
    Pipeline(sched, lag=1, eos_at={a.seq_id: 6, b.seq_id: 6}).run()
    assert a.status is SequenceStatus.FINISHED_LENGTH     # EOS at output 2 < min_tokens is ignored
    assert b.status is SequenceStatus.FINISHED_STOPPED and b.stop_reason == EOS
    assert_all_free(sched)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "abort", "stop"]), st.integers(0, 30)),
                min_size=1, max_size=60))
def test_random_scripts_with_a_lagging_runner_leak_nothing(script):
    sched = create_scheduler(num_blocks=10, block_size=4, max_num_seqs=4, budget=12)
    pipe = Pipeline(sched, lag=1)
    seqs: list[Sequence] = []
    for op, arg in script:
        if op == "add":
            seqs.append(create_seq(f"r{len(seqs)}", 1 + arg % 9, max_tokens=1 + arg % 5, base=1 + arg))
            sched.add(seqs[-1])
        elif op == "step":
            pipe.step()
        elif seqs:
            seq = seqs[arg % len(seqs)]
            if op == "abort":
                sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
            elif not seq.is_finished or seq.status is SequenceStatus.FINISHED_LENGTH:
                sched.stop(seq, "s")
        held = sum(len(s.block_table) for s in seqs if not s.is_finished)
        assert sched.block_manager.num_used_blocks <= held
        assert all(s.num_output_placeholders == 0 for s in seqs if s.is_finished)
    pipe.run()
    for s in seqs:
        assert s.is_finished and s.num_output_placeholders == 0
        known = s.output_token_ids
        assert known == expected_outputs(s)[:len(known)]
    assert_all_free(sched)
