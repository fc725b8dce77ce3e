"""The engine thread's per-row host work: what the scheduler and the core read each step stays what it was."""
import numpy as np

from minillm.block_manager import BlockManager
from minillm.engine_core.core import TokenOutputs
from minillm.sampling_params import SamplingParams
from minillm.scheduler import Scheduler, StepOutput
from minillm.sequence import Sequence, SequenceStatus

EOS = 0


def create_scheduler(max_num_seqs=8, num_blocks=64):
    return Scheduler(BlockManager(num_blocks, 4, True), max_num_seqs, 64, 256, [EOS])


def create_seq(rid, params, index=0, prompt_len=5):
    prompt = [1 + (i % 50) for i in range(prompt_len)]
    return Sequence(rid, index, prompt, params, 0.0, np.random.default_rng(0), params.max_tokens)


def launch_and_read(sched, token=7):
    """Schedule a step, then read it back: (the step, the tokens in flight until then)."""
    out = sched.schedule()
    in_flight = {s.request_id: s.num_output_placeholders for s in out.seqs}
    sched.update_from_output(out, StepOutput({s.seq_id: [token] for s in out.sampling_seqs}))
    return out, in_flight


def test_a_penalised_sequence_with_a_token_in_flight_needs_its_tokens_read_back():
    sched = create_scheduler()
    plain = [create_seq(f"p{i}", SamplingParams(max_tokens=16, ignore_eos=True)) for i in range(4)]
    penalised = create_seq("r", SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3))
    for seq in plain[:2] + [penalised] + plain[2:]:
        sched.add(seq)
    assert not sched.needs_output_tokens()          # nothing launched: every token is known
    out = sched.schedule()
    assert penalised in out.seqs and penalised.num_output_placeholders == 1
    assert sched.needs_output_tokens()
    sched.update_from_output(out, StepOutput({s.seq_id: [7] for s in out.sampling_seqs}))
    assert not sched.needs_output_tokens()
    sched.schedule()
    assert sched.needs_output_tokens()
    sched.finish(penalised, SequenceStatus.FINISHED_ABORTED)
    assert not sched.needs_output_tokens()          # its placeholder was dropped with it
    assert sched.num_running == 4 and not sched._output_readers   # and the finished reader is let go


def test_only_running_readers_count_a_preempted_one_with_a_token_in_flight_does_not():
    # Two sequences over a pool too small for both to grow: the second is preempted while its
    # token is in flight, and a waiting sequence's placeholder does not hold the next step back.
    sched = create_scheduler(num_blocks=5)
    a = create_seq("a", SamplingParams(max_tokens=16, ignore_eos=True), prompt_len=8)
    b = create_seq("b", SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=0.5), prompt_len=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a, b] and b.num_output_placeholders == 1
    assert sched.needs_output_tokens()
    sched._preempt(sched.running.pop())               # as schedule() preempts the last when the pool is short
    assert b.status is SequenceStatus.WAITING and b.num_output_placeholders == 1
    assert not sched.needs_output_tokens()


def test_bad_words_of_several_tokens_need_the_tokens_read_back():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return {"ab": [3, 4], " ab": [5, 3, 4]}[text]

    params = SamplingParams(max_tokens=16, ignore_eos=True, bad_words=["ab"])
    params.update_from_tokenizer(Tok(), vocab_size=64)
    assert params.needs_output_tokens
    sched = create_scheduler()
    seq = create_seq("w", params)
    sched.add(seq)
    sched.schedule()
    assert sched.needs_output_tokens()


def test_a_stop_token_and_eos_end_a_sequence_as_before():
    sched = create_scheduler()
    stop = create_seq("s", SamplingParams(max_tokens=16, stop_token_ids=[9]))
    eos = create_seq("e", SamplingParams(max_tokens=16))
    length = create_seq("l", SamplingParams(max_tokens=2, ignore_eos=True))
    for seq in (stop, eos, length):
        sched.add(seq)
    out = sched.schedule()
    tokens = {stop.seq_id: [9], eos.seq_id: [EOS], length.seq_id: [7]}
    appended = sched.update_from_output(out, StepOutput(tokens))
    assert sorted((s.request_id, t) for s, t in appended) == [("e", EOS), ("l", 7), ("s", 9)]
    assert (stop.status, stop.stop_reason) == (SequenceStatus.FINISHED_STOPPED, 9)
    assert (eos.status, eos.stop_reason) == (SequenceStatus.FINISHED_STOPPED, None)
    assert length.status is SequenceStatus.RUNNING
    launch_and_read(sched)
    assert length.status is SequenceStatus.FINISHED_LENGTH and length.output_token_ids == [7, 7]


def test_a_stop_string_from_on_token_ends_the_sequence_after_its_token():
    sched = create_scheduler()
    seq = create_seq("t", SamplingParams(max_tokens=16, ignore_eos=True))
    sched.add(seq)
    out = sched.schedule()
    seen = []

    def on_token(s, i):
        seen.append((s.request_id, i, s.token_ids[-1]))
        return "stop here"

    sched.update_from_output(out, StepOutput({seq.seq_id: [11]}), on_token)
    assert seen == [("t", 0, 11)]
    assert (seq.status, seq.stop_reason) == (SequenceStatus.FINISHED_STOPPED, "stop here")


class _Metrics:
    num_cached_tokens, first_scheduled_time, first_token_time, last_token_time = 3, 1.0, 2.0, 3.0


class _Request:
    def __init__(self, seqs, states):
        self.request_id, self.seqs, self.states = "q", seqs, states
        self.metrics, self.prompt_logprobs = _Metrics(), None


def test_the_cores_report_of_one_sequence_and_of_several():
    outputs = TokenOutputs(None)
    one = create_seq("q", SamplingParams(max_tokens=16))
    one.num_cached_tokens = 4
    req = _Request([one], [outputs.new_state(one, True)])
    one.token_ids.append(21)
    first = outputs.request_output(req, False)
    assert [(s.index, s.new_token_ids, s.num_cached_tokens) for s in first.seqs] == [(0, [21], None)]
    one.token_ids += [22, 23]
    assert outputs.request_output(req, False).seqs[0].new_token_ids == [22, 23]

    params = SamplingParams(max_tokens=16, n=2)
    pair = [create_seq("q", params, index=i) for i in range(2)]
    pair[0].num_cached_tokens, pair[1].num_cached_tokens = 4, 8
    req = _Request(pair, [outputs.new_state(s, True) for s in pair])
    pair[1].token_ids.append(30)
    report = outputs.request_output(req, False)
    # n > 1: each sequence's first report with news carries its own prefix-cache count, once
    assert [(s.index, s.new_token_ids, s.num_cached_tokens) for s in report.seqs] == [(0, [], None), (1, [30], 8)]
    pair[0].token_ids.append(31)
    pair[1].token_ids.append(32)
    report = outputs.request_output(req, False)
    assert [(s.index, s.new_token_ids, s.num_cached_tokens) for s in report.seqs] == [(0, [31], 4), (1, [32], None)]
