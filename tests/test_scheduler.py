"""Scheduler: token budget, chunked prefill, mixed batches, preemption; property tests."""
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.block_manager import BlockManager
from minillm.sampling_params import SamplingParams
from minillm.scheduler import Scheduler, StepOutput
from minillm.sequence import Sequence, SequenceStatus

EOS = 0


def create_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256,
                     prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, [EOS])


def create_seq(rid, prompt_len, max_tokens=4, base=1):
    prompt = [base + (i % 50) for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(rid, 0, prompt, params, 0.0, np.random.default_rng(0), max_tokens)


def run_step(sched, token=7):
    """One step with a runner that emits `token` for every sequence at its end."""
    out = sched.schedule()
    sched.update_from_output(out, StepOutput({s.seq_id: [token] for s in out.sampling_seqs}))
    return out


def test_long_prompt_is_chunked_under_the_budget():
    sched = create_scheduler(budget=16)
    seq = create_seq("a", 40)
    sched.add(seq)
    counts = [run_step(sched).num_new_tokens for _ in range(3)]
    assert counts == [[16], [16], [8]]
    assert seq.num_output_tokens == 1               # sampled only when the prompt was done


def test_decode_and_prefill_share_a_step():
    sched = create_scheduler(budget=16)
    a = create_seq("a", 5)
    sched.add(a)
    run_step(sched)
    b = create_seq("b", 30, base=60)
    sched.add(b)
    out = run_step(sched)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 15]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 15


def test_max_num_seqs_caps_the_running_set():
    sched = create_scheduler(max_num_seqs=2, budget=100)
    for i in range(4):
        sched.add(create_seq(str(i), 3))
    out = run_step(sched)
    assert len(out.seqs) == 2 and len(sched.waiting) == 2


def test_pool_exhaustion_preempts_the_latest_admitted_and_recomputes():
    sched = create_scheduler(num_blocks=4, block_size=4, budget=64, max_model_len=16)
    a, b = create_seq("a", 7, max_tokens=8), create_seq("b", 7, max_tokens=8, base=70)
    sched.add(a)
    sched.add(b)
    preempted = []
    while sched.has_unfinished():
        out = run_step(sched)
        preempted += out.preempted
    assert sched.num_preemptions >= 1 and preempted[0] is b
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert sched.block_manager.num_free_blocks == 4


def test_length_and_eos_stops():
    sched = create_scheduler()
    seq = create_seq("a", 3, max_tokens=2)
    sched.add(seq)
    run_step(sched)
    run_step(sched)
    assert seq.status is SequenceStatus.FINISHED_LENGTH
    eos_seq = Sequence("e", 0, [5, 6], SamplingParams(max_tokens=5), 0.0, np.random.default_rng(0), 5)
    sched.add(eos_seq)
    run_step(sched, token=EOS)
    assert eos_seq.status is SequenceStatus.FINISHED_STOPPED


def test_min_tokens_defers_eos():
    sched = create_scheduler()
    seq = Sequence("m", 0, [5, 6], SamplingParams(max_tokens=5, min_tokens=2), 0.0, np.random.default_rng(0), 5)
    sched.add(seq)
    run_step(sched, token=EOS)
    assert not seq.is_finished
    run_step(sched, token=EOS)
    assert seq.status is SequenceStatus.FINISHED_STOPPED


def check_invariants(sched, out):
    bm = sched.block_manager
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(out.seqs) <= sched.max_num_seqs and len(sched.running) <= sched.max_num_seqs
    holders = Counter(b for s in sched.running for b in s.block_table)
    for block in range(bm.num_blocks):
        assert bm.ref_counts[block] == holders.get(block, 0)
        if holders.get(block, 0) > 1:                 # shared only as a cached prefix block
            assert bm.block_keys[block] is not None
        assert (block in bm.free_queue) == (holders.get(block, 0) == 0)
    for s in sched.waiting:
        assert s.block_table == [] and s.num_computed_tokens == 0
    for s in sched.running:
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 30)),
), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(6, 40), st.integers(1, 6), st.integers(4, 48), st.booleans())
def test_random_workloads_never_leak_or_double_book(script, num_blocks, max_seqs, budget, prefix):
    sched = create_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=max_seqs, budget=budget,
                             max_model_len=num_blocks * 4, prefix=prefix)
    seqs = []
    for op in script:
        if op[0] == "add":
            _, plen, max_tokens, prefix_family = op
            if plen + max_tokens > num_blocks * 4:
                continue
            seq = create_seq(str(len(seqs)), plen, max_tokens, base=1 + prefix_family)
            seqs.append(seq)
            sched.add(seq)
        elif op[0] == "abort" and seqs:
            seq = seqs[op[1] % len(seqs)]
            sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        else:
            check_invariants(sched, run_step(sched))
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        check_invariants(sched, run_step(sched))
    assert not sched.has_unfinished()
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    for seq in seqs:
        assert seq.is_finished
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == seq.max_tokens
