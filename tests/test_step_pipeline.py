"""The step seam on the CPU: the scheduler driven through update_from_output by a fake runner
that lags one step behind the launch, as the GPU does (tokens come back a step later). The fake
runner verifies draft tokens greedily, so speculation must give the same tokens as plain decoding."""
from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.block_manager import BlockManager
from minillm.sampling_params import SamplingParams
from minillm.scheduler import Scheduler
from minillm.sequence import Sequence, SequenceStatus
from minillm.spec_decode import SpeculativeConfig
from minillm.step import SchedulerOutput, StepOutput

EOS = 0


def token_at(seq: Sequence, position: int) -> int:
    """The fake model's token for seq at a position: a function of the prompt and the position
    (periodic, so n-gram drafts find it, with a twist every 13 positions that they get wrong)."""
    return 3 + (sum(seq.prompt_token_ids[:3]) * 7 + position * 5) % 40 + (position % 13 == 0)


class FakeInFlight:
    """The fake model's tokens for a launched step; a sequence with drafts keeps those that match
    and then gets the model's token (the greedy rule)."""

    def __init__(self, out: SchedulerOutput, eos_at: dict[int, int], model=token_at):
        self.sampled: dict[int, list[int]] = {}
        self.accepted: dict[int, int] = {}
        for b in out.sampling_rows:
            seq = out.seqs[b]
            drafts = out.scheduled_spec_decode_tokens.get(seq.seq_id, [])
            first = out.num_computed_tokens[b] + out.num_new_tokens[b] - len(drafts)   # its first new token
            tokens = []
            for j in range(len(drafts) + 1):
                position = first + j
                tokens.append(EOS if eos_at.get(seq.seq_id) == position else model(seq, position))
                if j == len(drafts) or drafts[j] != tokens[-1]:
                    break
            self.sampled[seq.seq_id] = tokens
            if drafts:
                self.accepted[seq.seq_id] = len(tokens) - 1

    def wait(self) -> StepOutput:
        return StepOutput(dict(self.sampled), num_accepted_tokens=dict(self.accepted))


class Pipeline:
    """The engine's loop around a scheduler: read back first if the scheduler needs it, schedule,
    launch, complete the step before."""

    def __init__(self, sched: Scheduler, lag: int, eos_at: dict[int, int] | None = None, on_token=None,
                 model=token_at):
        self.sched, self.lag, self.eos_at, self.on_token, self.model = sched, lag, eos_at or {}, on_token, model
        self.in_flight: deque[tuple[SchedulerOutput, FakeInFlight]] = deque()
        self.num_preempted_in_flight = 0      # preempted while their token was on its way
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_read_back_first = 0          # steps read back before the next could be scheduled

    def step(self) -> SchedulerOutput:
        if self.in_flight and self.sched.needs_output_tokens():
            self.num_read_back_first += 1
            self.complete()
        out = self.sched.schedule()
        self.check_launch(out)
        self.num_preempted_in_flight += sum(1 for p in out.preempted if p.num_output_placeholders)
        if not out.is_empty:
            self.in_flight.append((out, FakeInFlight(out, self.eos_at, self.model)))
        depth = self.lag if not out.is_empty else 0
        while len(self.in_flight) > depth:
            self.complete()
        return out

    def complete(self) -> None:
        out, in_flight = self.in_flight.popleft()
        step = in_flight.wait()
        self.num_draft_tokens += sum(len(d) for d in out.scheduled_spec_decode_tokens.values())
        self.num_accepted_tokens += sum(step.num_accepted_tokens.values())
        self.sched.update_from_output(out, step, self.on_token)

    def check_launch(self, out: SchedulerOutput) -> None:
        """What a runner relies on: blocks for every scheduled token, at most one unknown input,
        drafts only after every known token."""
        bs = self.sched.block_manager.block_size
        for seq, start, n in zip(out.seqs, out.num_computed_tokens, out.num_new_tokens):
            assert not seq.is_finished
            assert len(seq.block_table) * bs >= start + n
            drafts = out.scheduled_spec_decode_tokens.get(seq.seq_id, [])
            assert start + n - len(drafts) - len(seq.token_ids) <= 1   # only the in-flight token is unknown
            if drafts:
                assert start + n - len(drafts) == len(seq.token_ids) and seq.spec_token_ids == drafts
                assert seq.num_output_tokens <= seq.max_tokens         # the drafts' tokens fit max_tokens

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not (self.sched.has_unfinished() or self.in_flight):
                return
            self.step()
        raise AssertionError("did not finish")


def create_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, spec_k=None,
                     max_step_ms=None, step_cost=None):
    spec = SpeculativeConfig(num_speculative_tokens=spec_k, prompt_lookup_min=2, prompt_lookup_max=3) \
        if spec_k else None
    return Scheduler(BlockManager(num_blocks, block_size, True), max_num_seqs, budget, max_model_len, [EOS],
                     speculative_config=spec, step_cost=step_cost, max_step_ms=max_step_ms)


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


# ---- speculative decoding: drafts verified by the fake runner ---------------------------------

def spec_seqs(num, max_tokens=40, **params):
    return [create_seq(f"r{i}", 3 + 4 * i, max_tokens=max_tokens, base=1 + 7 * i, **params) for i in range(num)]


def run_spec(seqs, lag, spec_k, **kw):
    sched = create_scheduler(spec_k=spec_k, **kw)
    for s in seqs:
        sched.add(s)
    pipe = Pipeline(sched, lag)
    pipe.run()
    return sched, pipe


def test_speculation_gives_the_plain_tokens_with_a_lagging_runner():
    for lag in (0, 1):
        seqs = spec_seqs(5)
        sched, pipe = run_spec(seqs, lag, spec_k=3, num_blocks=128)
        assert all(s.output_token_ids == expected_outputs(s) for s in seqs)
        assert all(s.status is SequenceStatus.FINISHED_LENGTH and not s.spec_token_ids for s in seqs)
        # drafts were accepted and rejected: the periodic tokens are found, the twists are not
        assert 0 < pipe.num_accepted_tokens < pipe.num_draft_tokens
        assert_all_free(sched)


def test_speculation_under_preemption():
    for lag in (0, 1):
        seqs = spec_seqs(4, max_tokens=30)
        sched, pipe = run_spec(seqs, lag, spec_k=4, num_blocks=22, budget=64)
        assert sched.num_preemptions > 0 and pipe.num_accepted_tokens > 0
        assert all(s.output_token_ids == expected_outputs(s) for s in seqs)
        assert_all_free(sched)


def test_a_step_with_drafts_is_read_back_before_the_next_is_scheduled():
    sched = create_scheduler(spec_k=3)
    a = spec_seqs(1)[0]
    sched.add(a)
    pipe = Pipeline(sched, lag=1)
    while not pipe.num_draft_tokens and not a.is_finished:
        out = pipe.step()
        if out.scheduled_spec_decode_tokens:
            # the sequence's length is unknown: the next step must wait for this one
            assert sched.needs_output_tokens()
            assert a.num_output_placeholders == len(a.spec_token_ids) + 1
            assert sched.schedule().is_empty             # scheduled without waiting: it sits out
            pipe.complete()
            assert not a.spec_token_ids and a.num_output_placeholders == 0
            assert a.num_computed_tokens == a.num_tokens - 1
            break
    else:
        raise AssertionError("no drafts were proposed")
    pipe.run()
    assert a.output_token_ids == expected_outputs(a)
    assert_all_free(sched)


def counting_then_looping(seq: Sequence, position: int) -> int:
    """A fake model whose tokens never repeat for 24 positions, then loop over five."""
    return 100 + position if position < seq.num_prompt_tokens + 24 else 200 + position % 5


def test_steps_stay_in_flight_while_proposals_find_nothing():
    sched = create_scheduler(spec_k=3, num_blocks=128)
    seqs = spec_seqs(3, max_tokens=60)
    for s in seqs:
        sched.add(s)
    pipe = Pipeline(sched, lag=1, model=counting_then_looping)
    while not any(s.num_output_tokens > 24 for s in seqs):
        pipe.step()
    # nothing to propose: a read-back first only at the rounds that try again (1, 2, 4, 8 steps apart)
    assert pipe.num_draft_tokens == 0 and pipe.num_read_back_first <= 8
    pipe.run()
    # the loop is found within a few rounds, and its drafts are accepted
    assert pipe.num_accepted_tokens > 30
    assert all(s.output_token_ids == [counting_then_looping(s, s.num_prompt_tokens + i) for i in range(60)]
               for s in seqs)
    assert_all_free(sched)


def test_drafts_fit_max_tokens_and_the_token_budget():
    sched = create_scheduler(spec_k=6, budget=10, max_num_seqs=4)
    seqs = spec_seqs(3, max_tokens=23)
    for s in seqs:
        sched.add(s)
    pipe = Pipeline(sched, lag=0)
    while sched.has_unfinished():
        out = pipe.step()
        assert out.num_tokens <= 10
        for s in out.seqs:
            assert len(out.scheduled_spec_decode_tokens.get(s.seq_id, [])) <= 6
    assert pipe.num_draft_tokens > 0
    assert all(s.output_token_ids == expected_outputs(s) for s in seqs)
    assert_all_free(sched)


def _decoding_with_a_match(sched: Scheduler, prompt=(5, 6, 7, 8, 5, 6, 7), first=8, **params) -> Sequence:
    """A sequence whose prompt repeats, prefilled, with its first token read back (by default
    5 6 7 8 5 6 7 8: [6, 7, 8] recurs and [5, 6, 7] is proposed)."""
    seq = Sequence("a", 0, list(prompt), SamplingParams(max_tokens=20, **params), 0.0, np.random.default_rng(0), 20)
    sched.add(seq)
    out = sched.schedule()
    sched.update_from_output(out, StepOutput({seq.seq_id: [first]}))
    return seq


def test_drafts_are_dropped_when_the_pool_is_short_never_preempting():
    sched = create_scheduler(num_blocks=2, block_size=4, spec_k=3)
    seq = _decoding_with_a_match(sched)
    out = sched.schedule()                     # positions 7..10 need a third block: none is free
    assert out.seqs == [seq] and out.num_new_tokens == [1] and not out.scheduled_spec_decode_tokens
    assert not out.preempted and sched.num_preemptions == 0
    # with room left in its own last block, the drafts that fit it are kept
    sched = create_scheduler(num_blocks=3, block_size=4, spec_k=3)
    seq = _decoding_with_a_match(sched, prompt=[5, 6, 7, 8, 5], first=6)   # [5, 6] recurs: [7, 8, 5]
    filler = Sequence("b", 0, [9] * 4, SamplingParams(max_tokens=4), 0.0, np.random.default_rng(0), 4)
    assert sched.block_manager.allocate(filler, [], 4) and sched.block_manager.num_free_blocks == 0
    out = sched.schedule()                     # position 5 and two drafts fill its second block
    assert out.scheduled_spec_decode_tokens == {seq.seq_id: [7, 8]} and out.num_new_tokens == [3]
    assert not out.preempted
    roomy = create_scheduler(num_blocks=3, block_size=4, spec_k=3)
    seq = _decoding_with_a_match(roomy)
    out = roomy.schedule()
    assert out.scheduled_spec_decode_tokens == {seq.seq_id: [5, 6, 7]} and out.num_new_tokens == [4]
    assert out.num_decode_tokens == 4 and out.num_prefill_tokens == 0
    assert seq.num_output_placeholders == 4 and seq.num_computed_tokens == 11


def test_rejected_drafts_move_num_computed_back_and_the_blocks_stay_counted():
    sched = create_scheduler(num_blocks=8, block_size=4, spec_k=3)
    seq = _decoding_with_a_match(sched)
    out = sched.schedule()                     # drafts [5, 6, 7] at positions 8..10
    sched.update_from_output(out, StepOutput({seq.seq_id: [5, 9]}, num_accepted_tokens={seq.seq_id: 1}))
    assert seq.output_token_ids == [8, 5, 9] and seq.num_computed_tokens == 9 == seq.num_tokens - 1
    assert len(seq.block_table) == 3 and sched.block_manager.num_used_blocks == 3
    # only blocks of computed, known tokens are hashed: [5 6 7 8] and [5 6 7 8]; not [5 9 ...]
    assert len(seq.block_hashes) == 2
    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_a_stop_inside_a_verified_step_cuts_its_tokens_there():
    for how in ("stop token", "stop string"):
        sched = create_scheduler(num_blocks=8, block_size=4, spec_k=3)
        seq = _decoding_with_a_match(sched, **({"stop_token_ids": [6]} if how == "stop token" else {}))
        out = sched.schedule()
        assert out.scheduled_spec_decode_tokens == {seq.seq_id: [5, 6, 7]}
        seen = []

        def on_token(s, i):
            seen.append(i)
            return "x" if how == "stop string" and i == 1 else None
        every_draft_accepted = StepOutput({seq.seq_id: [5, 6, 7, 8]}, num_accepted_tokens={seq.seq_id: 3})
        appended = sched.update_from_output(out, every_draft_accepted, on_token)
        assert seq.output_token_ids == [8, 5, 6] and [t for _, t in appended] == [5, 6] and seen == [0, 1]
        assert seq.status is SequenceStatus.FINISHED_STOPPED
        assert seq.stop_reason == (6 if how == "stop token" else "x")
        assert_all_free(sched)


def test_tokens_after_a_stop_in_the_same_step_are_dropped():
    for stop_at in (9, 14, 22):
        plain, spec = spec_seqs(1)[0], spec_seqs(1)[0]
        for seq, k in ((plain, None), (spec, 4)):
            sched = create_scheduler(spec_k=k)
            sched.add(seq)
            # the output processor finds a stop string when the stop_at-th output arrives
            pipe = Pipeline(sched, lag=1, on_token=lambda s, i: "stop" if len(s.output_token_ids) == stop_at else None)
            pipe.run()
            assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "stop"
            assert_all_free(sched)
        assert spec.output_token_ids == plain.output_token_ids == expected_outputs(plain)[:stop_at]


def test_a_stop_token_among_accepted_drafts_ends_the_sequence_there():
    a = spec_seqs(1)[0]
    stop = expected_outputs(a)[17]             # recurs: drafts propose it before it is sampled
    results = []
    for k in (None, 4):
        seq = spec_seqs(1, stop_token_ids=[stop])[0]
        sched, pipe = run_spec([seq], 1, spec_k=k)
        results.append((seq.output_token_ids, seq.status, seq.stop_reason))
        assert_all_free(sched)
    assert results[0] == results[1]
    assert results[1][0][-1] == stop and results[1][1] is SequenceStatus.FINISHED_STOPPED


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "abort", "stop"]), st.integers(0, 30)),
                min_size=1, max_size=60), st.sampled_from([0, 1]))
def test_random_scripts_with_speculation_leak_nothing(script, lag):
    sched = create_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, budget=12, spec_k=3)
    pipe = Pipeline(sched, lag=lag)
    seqs: list[Sequence] = []
    for op, arg in script:
        if op == "add":
            seqs.append(create_seq(f"r{len(seqs)}", 1 + arg % 9, max_tokens=1 + arg % 17, base=1 + arg))
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
        assert all(s.num_output_placeholders == 0 and not s.spec_token_ids for s in seqs if s.is_finished)
    pipe.run()
    for s in seqs:
        assert s.is_finished and s.num_output_placeholders == 0
        known = s.output_token_ids
        assert known == expected_outputs(s)[:len(known)]
    assert_all_free(sched)


# ---- a step-time budget: chunk sizes change, tokens do not ----------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(0, 30)), min_size=1, max_size=60),
       st.sampled_from([0, 1]), st.sampled_from([None, 3]), st.floats(0.5, 4.0))
def test_random_scripts_under_a_step_budget_give_the_plain_tokens(script, lag, spec_k, max_step_ms):
    from minillm.step_cost import StepCostModel
    cost = StepCostModel([1e-3, 2e-4, 1e-4, 1e-6, 1e-6])    # 1 ms a step, 0.1 ms a token, ...
    sched = create_scheduler(num_blocks=16, block_size=4, max_num_seqs=4, budget=24, spec_k=spec_k,
                             max_step_ms=max_step_ms, step_cost=cost)
    pipe = Pipeline(sched, lag=lag)
    seqs: list[Sequence] = []
    for op, arg in script:
        if op == "add":
            seqs.append(create_seq(f"r{len(seqs)}", 1 + arg % 23, max_tokens=1 + arg % 17, base=1 + arg))
            sched.add(seqs[-1])
        elif op == "step":
            pipe.step()
        elif seqs:
            sched.finish(seqs[arg % len(seqs)], SequenceStatus.FINISHED_ABORTED)
    pipe.run(max_steps=2000)
    for s in seqs:
        assert s.is_finished and s.num_output_placeholders == 0
        known = s.output_token_ids
        assert known == expected_outputs(s)[:len(known)]
        if s.status is SequenceStatus.FINISHED_LENGTH:
            assert len(known) == s.max_tokens
    assert_all_free(sched)


def test_drafts_are_held_to_the_step_budget():
    from minillm.step_cost import StepCostModel, step_features
    cost = StepCostModel([1e-3, 0.0, 1e-4, 0.0, 0.0])      # a step of n tokens: 1 + 0.1 n ms
    most_drafts = {}
    for max_step_ms in (None, 1.45):                         # 1.45 ms: 4 tokens, 2 of them drafts
        sched = create_scheduler(spec_k=4, num_blocks=128, budget=64, max_step_ms=max_step_ms,
                                 step_cost=cost if max_step_ms else None)
        seqs = spec_seqs(2, max_tokens=60)
        for s in seqs:
            sched.add(s)
        pipe = Pipeline(sched, lag=0)
        drafts = []
        for k in range(30):
            if k == 12:
                sched.add(create_seq("long", 40, base=90))
            out = pipe.step()
            drafts.append(sum(len(d) for d in out.scheduled_spec_decode_tokens.values()))
            if max_step_ms and k >= 2:
                # within the budget, or only the floor's block of prompt tokens over it
                assert cost.estimate(step_features(out)) <= 1.45e-3 * (1 + 1e-9) or out.num_prefill_tokens <= 4
        pipe.run()
        assert all(s.output_token_ids == expected_outputs(s) for s in seqs)
        assert_all_free(sched)
        most_drafts[max_step_ms] = max(drafts)
    assert most_drafts[None] > 2 and most_drafts[1.45] == 2
