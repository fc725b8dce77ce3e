"""Scheduler: token budget, chunked prefill, mixed batches, preemption; property tests."""
from collections import Counter

import numpy as np
import pytest
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


def test_siblings_admitted_in_one_step_share_the_prompt_blocks_it_fills():
    # n = 4 completions of a 30-token prompt (7 full blocks): the first admission's blocks are
    # shared at once, so the others compute only the last 2 prompt tokens and the pool holds the
    # prompt once.
    sched = create_scheduler(num_blocks=20, block_size=4, budget=64)
    seqs = [Sequence("n", i, [1 + (t % 50) for t in range(30)], SamplingParams(n=4, max_tokens=4, ignore_eos=True),
                     0.0, np.random.default_rng(i), 4) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    out = run_step(sched)
    assert out.num_new_tokens == [30, 2, 2, 2] and out.preempted == []
    shared = seqs[0].block_table[:7]
    assert all(s.block_table[:7] == shared for s in seqs)
    assert all(sched.block_manager.ref_counts[b] == 4 for b in shared)
    assert sched.block_manager.num_used_blocks == 7 + 4
    assert [s.num_cached_tokens for s in seqs] == [0, 28, 28, 28]
    while sched.has_unfinished():
        run_step(sched)
    assert sched.block_manager.num_used_blocks == 0


def test_aborts_anywhere_in_a_long_waiting_queue_keep_its_order_and_take_no_scan():
    import time
    sched = create_scheduler()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    seqs = [Sequence(str(i), 0, [1, 2, 3], params, 0.0, None, 4) for i in range(20000)]
    for seq in seqs:
        sched.add(seq)
    sched.finish(seqs[1], SequenceStatus.FINISHED_ABORTED)
    assert [s.request_id for s in sched.waiting][:3] == ["0", "2", "3"] and len(sched.waiting) == 19999
    started = time.perf_counter()
    for seq in reversed(seqs):                     # clients gone, the newest first: each abort scanned the queue
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert time.perf_counter() - started < 2.0     # about 0.02 s; a scan per abort took 8 s
    assert not sched.has_unfinished() and all(s.status is SequenceStatus.FINISHED_ABORTED for s in seqs)


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
    # The snapshot's cached-free blocks (kept as they change) are the free blocks holding a key.
    cached = [b for b in bm.free_queue if bm.block_keys[b] is not None]
    assert sorted(bm.snapshot().cached_free_block_ids.tolist()) == sorted(cached)
    assert bm.num_cached_free_blocks == len(cached)
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


# ---- the step-time budget: prompt chunks sized by a cost model while decodes run ------------------

from minillm.step_cost import StepCostModel, is_decode_row, step_features  # noqa: E402

# 1 ms a step and 0.1 ms a token; attention and KV reads free: a step of n tokens takes 1 + 0.1 n ms.
PER_TOKEN = StepCostModel([1e-3, 0.0, 1e-4, 0.0, 0.0])


def create_budget_scheduler(max_step_ms, cost=PER_TOKEN, max_step_factor=None, max_mixed_tokens=None, **kw):
    sched = create_scheduler(**kw)
    return Scheduler(sched.block_manager, sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len,
                     [EOS], step_cost=cost, max_step_ms=max_step_ms, max_step_factor=max_step_factor,
                     max_mixed_tokens=max_mixed_tokens)


def start_decoding(sched, num, prompt_len=3):
    """num short requests, run until every one of them decodes."""
    seqs = [create_seq(f"d{i}", prompt_len, max_tokens=200, base=1 + i) for i in range(num)]
    for s in seqs:
        sched.add(s)
    while any(s.num_output_tokens == 0 for s in seqs):
        run_step(sched)
    return seqs


def test_step_budget_caps_prompt_chunks_while_decodes_run():
    sched = create_budget_scheduler(max_step_ms=3.0, budget=64, num_blocks=128)
    start_decoding(sched, 2)
    long = create_seq("long", 100, base=80)
    sched.add(long)
    out = run_step(sched)
    # 2 decode tokens + q prompt tokens within 3 ms: 1 + 0.1 (2 + q) <= 3, so q = 18 (the token budget gave 62).
    assert out.num_new_tokens == [1, 1, 18] and out.step_limit_s == pytest.approx(3e-3)
    assert out.estimated_step_s == pytest.approx(1e-3 + 1e-4 * 20)
    assert out.estimated_step_s == PER_TOKEN.estimate(step_features(out))
    out = run_step(sched)
    assert out.num_new_tokens == [1, 1, 18] and long.num_computed_tokens == 36


def test_step_budget_leaves_a_step_without_decodes_to_the_token_budget():
    sched = create_budget_scheduler(max_step_ms=3.0, budget=64, num_blocks=128)
    long = create_seq("long", 100, base=80)
    sched.add(long)
    assert run_step(sched).num_new_tokens == [64]           # nothing decodes: 64 tokens, 7.4 ms estimated
    plain = create_scheduler(budget=64, num_blocks=128)
    plain.add(create_seq("long", 100, base=80))
    assert run_step(plain).num_new_tokens == [64]


def test_step_budget_with_a_large_limit_schedules_as_the_token_budget_does():
    capped = create_budget_scheduler(max_step_ms=1e6, budget=16, num_blocks=128)
    plain = create_scheduler(budget=16, num_blocks=128)
    for sched in (capped, plain):
        for i in range(4):
            sched.add(create_seq(str(i), 5 + 9 * i, max_tokens=6, base=1 + 10 * i))
    while capped.has_unfinished() or plain.has_unfinished():
        a, b = run_step(capped), run_step(plain)
        assert [s.request_id for s in a.seqs] == [s.request_id for s in b.seqs]
        assert a.num_new_tokens == b.num_new_tokens


def test_a_long_prompt_still_finishes_when_the_decodes_alone_exceed_the_budget():
    # Two decodes cost 1.2 ms against a 0.5 ms budget: nothing fits, the oldest prefill gets one
    # KV block (4 tokens) a step, a later one waits.
    sched = create_budget_scheduler(max_step_ms=0.5, budget=64, num_blocks=128, max_model_len=512)
    decoders = start_decoding(sched, 2)
    long, later = create_seq("long", 30, max_tokens=2, base=80), create_seq("later", 10, max_tokens=2, base=90)
    sched.add(long)
    sched.add(later)
    chunks = []
    while long.num_output_tokens == 0:
        out = run_step(sched)
        assert out.seqs[:2] == decoders and out.num_new_tokens[:2] == [1, 1]   # decodes never wait
        chunks.append(out.num_new_tokens[2:])
    assert chunks == [[4]] * 7 + [[2]]                        # 30 tokens: 7 blocks and the rest
    assert later.num_computed_tokens == 0
    while later.num_output_tokens == 0:
        run_step(sched)
    assert long.num_output_tokens >= 1 and later.num_output_tokens == 1


def test_step_budget_sizes_each_prefill_with_what_the_earlier_ones_left():
    sched = create_budget_scheduler(max_step_ms=4.0, budget=100, num_blocks=128, max_num_seqs=8)
    start_decoding(sched, 2)
    a, b = create_seq("a", 12, base=60), create_seq("b", 50, base=70)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    # 3 ms of room = 30 tokens: 2 decodes, all 12 of a, 16 of b.
    assert out.num_new_tokens == [1, 1, 12, 16]
    assert out.estimated_step_s == pytest.approx(4e-3)


def test_a_relative_budget_follows_the_batch_of_decodes():
    # 1.5x the step of the batch's decode rows, the waiting prompt counted as the row it becomes:
    # 2 decodes + 1 (1.3 ms) allow 1.95 ms, 7 tokens beside the 2 decodes; 10 + 1 (2.1 ms) allow
    # 3.15 ms, 11 tokens. Nothing decoding: the token budget alone.
    for num_decodes, chunk in ((2, 7), (10, 11)):
        sched = create_budget_scheduler(None, max_step_factor=1.5, budget=64, num_blocks=256, max_num_seqs=16)
        start_decoding(sched, num_decodes)
        sched.add(create_seq("long", 100, base=80))
        out = run_step(sched)
        assert out.num_new_tokens == [1] * num_decodes + [chunk]
        limit = 1.5 * (1e-3 + 1e-4 * (num_decodes + 1))
        assert out.estimated_step_s == pytest.approx(1e-3 + 1e-4 * (num_decodes + chunk))
        assert out.estimated_step_s <= limit < out.estimated_step_s + 1e-4
        assert out.step_limit_s == pytest.approx(limit)          # what the monitor draws the step against
    sched = create_budget_scheduler(None, max_step_factor=1.5, budget=64, num_blocks=128)
    sched.add(create_seq("long", 100, base=80))
    out = run_step(sched)
    assert out.num_new_tokens == [64] and out.step_limit_s is None   # the token budget alone sized it
    assert sched.snapshot(4).max_step_factor == 1.5 and sched.snapshot(4).max_step_ms is None


def test_a_relative_budget_counts_the_prompts_that_wait_to_join_the_batch():
    # A mixed step's fixed cost (1 ms) is more than 1.5x the step of 2 decodes alone leaves (0.6
    # ms): sized by those two, the queue of prompts would get the one-block floor a step. Counted
    # as the decode rows they become (up to max_num_seqs), they widen the limit to 1.5x the step
    # of the whole batch.
    cost = StepCostModel([1e-3, 1e-3, 1e-4, 0.0, 0.0])
    sched = create_budget_scheduler(None, cost=cost, max_step_factor=1.5, budget=512, num_blocks=512,
                                    max_num_seqs=16)
    start_decoding(sched, 2)
    for i in range(20):
        sched.add(create_seq(f"p{i}", 40, base=100 + 40 * i))
    out = run_step(sched)
    # The batch: 2 decoding + 14 more of the waiting ones (max_num_seqs 16): 2.6 ms, so 3.9 ms a
    # step; 2 ms of base and mixed leave 1.9 ms = 19 tokens with the 2 decodes, 17 of them prompt.
    assert out.estimated_step_s == pytest.approx(1.5 * (1e-3 + 1e-4 * 16))
    assert out.num_new_tokens == [1, 1, 17]
    # With room for one more sequence only, the batch is 3 rows (1.3 ms, so 1.95 ms a step): below
    # the mixed step's 2.3 ms with one token, so the prompt gets the floor, one KV block.
    small = create_budget_scheduler(None, cost=cost, max_step_factor=1.5, budget=512, num_blocks=512,
                                    max_num_seqs=3)
    start_decoding(small, 2)
    for i in range(20):
        small.add(create_seq(f"p{i}", 40, base=100 + 40 * i))
    assert run_step(small).num_new_tokens == [1, 1, small.block_manager.block_size]


def test_under_a_step_budget_a_step_with_decodes_stays_within_the_largest_mixed_graph():
    # 100 ms of budget would take the whole 64-token chunk; the largest whole mixed graph is 24
    # tokens, 2 of them the decodes.
    sched = create_budget_scheduler(100.0, budget=64, num_blocks=128, max_mixed_tokens=24)
    start_decoding(sched, 2)
    sched.add(create_seq("long", 100, base=80))
    assert run_step(sched).num_new_tokens == [1, 1, 22]
    # With nothing decoding the token budget alone applies; with the decodes filling the graph the
    # oldest prompt still gets its one-block floor.
    alone = create_budget_scheduler(100.0, budget=64, num_blocks=128, max_mixed_tokens=24)
    alone.add(create_seq("long", 100, base=80))
    assert run_step(alone).num_new_tokens == [64]
    full = create_budget_scheduler(100.0, budget=64, num_blocks=128, max_mixed_tokens=2)
    start_decoding(full, 2)
    full.add(create_seq("long", 100, base=80))
    assert run_step(full).num_new_tokens == [1, 1, full.block_manager.block_size]


def test_with_both_budgets_the_tighter_one_sizes_the_chunk():
    # 2 decodes and the waiting prompt: 1.3 ms; 3x that is 3.9 ms, against 2.0 ms absolute: 8
    # tokens; at 1.5x (1.95 ms): 7.
    for max_step_ms, factor, chunk in ((2.0, 3.0, 8), (2.0, 1.5, 7)):
        sched = create_budget_scheduler(max_step_ms, max_step_factor=factor, budget=64, num_blocks=128)
        start_decoding(sched, 2)
        sched.add(create_seq("long", 100, base=80))
        assert run_step(sched).num_new_tokens == [1, 1, chunk]


def test_step_budget_needs_a_cost_model():
    with pytest.raises(ValueError, match="cost model"):
        Scheduler(BlockManager(8, 4), 4, 16, 64, [EOS], max_step_ms=5.0)
    with pytest.raises(ValueError, match="cost model"):
        Scheduler(BlockManager(8, 4), 4, 16, 64, [EOS], max_step_factor=1.5)


def test_measured_step_times_reach_the_cost_model_and_the_snapshot():
    model = StepCostModel([1e-3, 0.0, 1e-4, 0.0, 0.0], refit_every=4)
    sched = create_budget_scheduler(max_step_ms=3.0, cost=model, budget=64, num_blocks=128)
    for _ in range(4):
        sched.add(create_seq(str(_), 6, base=1 + _))
        out = run_step(sched)
        sched.record_step_time(out, 2 * out.estimated_step_s)   # the device runs at half the estimate
    snap = sched.snapshot(8)
    assert snap.max_step_ms == 3.0 and snap.step_cost.num_refits == 1
    assert snap.step_cost.last_measured_s == pytest.approx(2 * snap.step_cost.last_estimated_s)
    assert model.estimate(step_features(out)) == pytest.approx(2 * out.estimated_step_s)
    assert create_scheduler().snapshot(8).step_cost is None


def check_step_budget(sched, out):
    """While decodes run, a step stays within the step budget, or holds no more prompt tokens than
    the floor (one KV block for the oldest prefill)."""
    decoding = [is_decode_row(n, start, s.num_prompt_tokens) or s.seq_id in out.scheduled_spec_decode_tokens
                for s, start, n in zip(out.seqs, out.num_computed_tokens, out.num_new_tokens)]
    if not any(decoding):
        return
    prefill = sum(n for n, d in zip(out.num_new_tokens, decoding) if not d)
    estimate = sched.step_cost.estimate(step_features(out))
    assert estimate <= sched.max_step_ms / 1e3 * (1 + 1e-9) or prefill <= sched.block_manager.block_size


def test_a_resumed_sequence_cached_to_its_last_token_counts_as_a_decode_under_the_step_budget():
    # Two preempted sequences come back: "b" finds all but its last token in the prefix cache and
    # decodes at once; "c" recomputes. Sized as a step with nothing decoding, "c" took its whole
    # recompute beside b's decode, past the one-block floor a step with decodes may hold.
    sched = create_budget_scheduler(max_step_ms=1e-3, cost=StepCostModel([1e-3, 5e-4, 0.0, 1e-6, 1e-6]),
                                    num_blocks=13, block_size=4, max_num_seqs=3, budget=6, max_model_len=52)
    for i, (plen, max_tokens, family) in enumerate([(29, 9, 0), (6, 1, 1), (10, 4, 2), (3, 3, 0)]):
        sched.add(create_seq(str(i), plen, max_tokens, base=1 + family))
    while sched.has_unfinished():
        out = run_step(sched)
        check_invariants(sched, out)
        check_step_budget(sched, out)


@settings(max_examples=100, deadline=None)
@given(ops, st.integers(6, 40), st.integers(1, 6), st.integers(4, 48), st.booleans(),
       st.floats(0.0, 8.0), st.floats(0.0, 1e-3))
def test_random_workloads_under_a_step_budget_finish_and_never_leak(script, num_blocks, max_seqs, budget, prefix,
                                                                    max_step_ms, per_token):
    cost = StepCostModel([1e-3, 5e-4, per_token, 1e-6, 1e-6])
    sched = create_budget_scheduler(max_step_ms=max_step_ms or 1e-3, cost=cost, num_blocks=num_blocks,
                                    block_size=4, max_num_seqs=max_seqs, budget=budget,
                                    max_model_len=num_blocks * 4, prefix=prefix)
    seqs = []
    for op in script:
        if op[0] == "add":
            _, plen, max_tokens, prefix_family = op
            if plen + max_tokens > num_blocks * 4:
                continue
            seqs.append(create_seq(str(len(seqs)), plen, max_tokens, base=1 + prefix_family))
            sched.add(seqs[-1])
        elif op[0] == "abort" and seqs:
            sched.finish(seqs[op[1] % len(seqs)], SequenceStatus.FINISHED_ABORTED)
        else:
            out = run_step(sched)
            check_invariants(sched, out)
            check_step_budget(sched, out)
    for _ in range(5000):                     # the floor of one block a step: everything finishes
        if not sched.has_unfinished():
            break
        out = run_step(sched)
        check_invariants(sched, out)
        check_step_budget(sched, out)
        assert not out.is_empty or not sched.running
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    for seq in seqs:
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == seq.max_tokens
