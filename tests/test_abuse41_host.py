"""The engine thread's per-step host work: the runner's inputs and the rows of the tokens still on the device,
and what a core reports of each request every step.

With async scheduling a decode row's input token is the one the step before sampled, still on the device:
the runner patches it in from that step's sampled ids. The rows of that patch, the step's input ids,
positions, slots and block tables are checked against a per-row reading of the step (stories260K, CPU)
through batches that keep their order, lose finished sequences, admit new ones and mix prefill chunks in.
A core's step messages say a request finished exactly once, in its last message, when all its sequences
have ended, and a sequence's finish from the message of its last token on (n = 1 and n = 3 requests that
end by length, by a stop token, and by abort).
"""
import time

import numpy as np
import pytest

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.engine_core.core import EngineCore
from minillm.engine_core.messages import AddRequest


def per_row_inputs(out, block_size: int):
    """Input ids, positions, slots and (token row, seq_id) of the inputs on the device, one row at a time."""
    ids, positions, slots, holes, row = [], [], [], [], 0
    spec = out.scheduled_spec_decode_tokens
    for seq, start, n in zip(out.seqs, out.num_computed_tokens, out.num_new_tokens):
        known = seq.token_ids[start:start + n] + (spec.get(seq.seq_id, []) if spec else [])
        for i in range(n):
            p = start + i
            ids.append(known[i] if i < len(known) else 0)
            if i >= len(known):
                holes.append((row, seq.seq_id))
            positions.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
            row += 1
    return ids, positions, slots, holes


def record_steps(engine: LLMEngine):
    """Check every step's inputs and placeholder patch against per_row_inputs; returns the counts of
    decode steps whose rows kept the sampling step's order and of those that did not."""
    runner = engine.runner
    prepare, patch_of, launch = runner.prepare_inputs, runner._placeholder_patch, runner.launch
    counts = {"same order": 0, "other rows": 0, "no holes": 0}
    last = {"sampled": None, "holes": None}

    def checked_prepare(out):
        ids, positions, meta, holes = prepare(out)
        want_ids, want_pos, want_slots, want_holes = per_row_inputs(out, runner.block_size)
        assert ids.tolist() == want_ids and positions.tolist() == want_pos
        assert np.asarray(meta.slot_mapping).tolist() == want_slots
        assert ids.dtype == np.int32 and np.asarray(meta.slot_mapping).dtype == np.int32
        tables = np.asarray(meta.block_tables)
        for b, seq in enumerate(out.seqs):
            assert tables[b, :len(seq.block_table)].tolist() == seq.block_table
        rows, hole_ids = holes
        assert list(zip(rows.tolist(), hole_ids)) == want_holes and rows.dtype == np.int32
        last["holes"] = want_holes
        return ids, positions, meta, holes

    def checked_patch(holes):
        patch = patch_of(holes)
        want = last["holes"]
        if not want:
            assert patch is None
            counts["no holes"] += 1
            return patch
        dst, src, _ = patch
        sampled = last["sampled"]
        assert dst.tolist() == [row for row, _ in want] and dst.dtype == np.int32 and src.dtype == np.int32
        assert src.tolist() == [sampled.index(sid) for _, sid in want]
        counts["same order" if [sid for _, sid in want] == sampled else "other rows"] += 1
        return patch

    def recorded_launch(out, *args, **kwargs):
        step = launch(out, *args, **kwargs)
        if out.sampling_rows:
            last["sampled"] = [s.seq_id for s in out.sampling_seqs]
        return step

    runner.prepare_inputs, runner._placeholder_patch, runner.launch = checked_prepare, checked_patch, recorded_launch
    return counts


@pytest.mark.parametrize("chunk", [512, 24], ids=["whole-prompts", "prefill-chunks"])
def test_each_steps_inputs_and_placeholder_rows_are_the_per_row_reading(stories_path, chunk):
    config = EngineConfig(model=str(stories_path), device="cpu", max_model_len=128, max_num_seqs=6,
                          max_num_batched_tokens=chunk, async_scheduling=True)
    engine = LLMEngine(config)
    try:
        counts = record_steps(engine)
        rng = np.random.default_rng(0)
        outputs = {}
        for wave in range(3):               # later requests join a running batch; earlier ones finish first
            for i in range(4):
                prompt = [1] + rng.integers(2, 500, 5 + 7 * i).tolist()
                engine.add_request(f"w{wave}-{i}", prompt, SamplingParams(
                    temperature=0.8, seed=wave * 10 + i, max_tokens=6 + 5 * i, ignore_eos=True))
            for _ in range(8):
                for out in engine.step():
                    outputs[out.request_id] = out
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
    finally:
        engine.shutdown()
    assert len(outputs) == 12 and all(o.finished for o in outputs.values())
    assert counts["same order"] > 5 and counts["other rows"] > 0


def test_an_input_no_step_sampled_is_an_error(stories_path):
    config = EngineConfig(model=str(stories_path), device="cpu", max_model_len=64, async_scheduling=True)
    engine = LLMEngine(config)
    try:
        runner = engine.runner
        with pytest.raises(RuntimeError, match="no step sampled it"):
            runner._placeholder_patch((np.array([0], np.int32), [7]))
        runner._last_sampled = (np.array([5, 6], np.int32), [3, 4], None)
        with pytest.raises(RuntimeError, match=r"sequences \[7\] were not sampled"):
            runner._placeholder_patch((np.array([0, 1], np.int32), [4, 7]))
        dst, src, _ = runner._placeholder_patch((np.array([0, 1], np.int32), [4, 3]))
        assert dst.tolist() == [0, 1] and src.tolist() == [1, 0]
        runner._last_sampled = (np.array([5, 6, 8, 9], np.int32), [3, 4], np.array([0, 3], np.int32))
        assert runner._placeholder_patch((np.array([2], np.int32), [4]))[1].tolist() == [3]
        assert runner._placeholder_patch((np.array([2, 5], np.int32), [3, 4]))[1].tolist() == [0, 3]
        assert runner._placeholder_patch((np.zeros(0, np.int32), [])) is None
    finally:
        engine.shutdown()


def run_core(core: EngineCore, requests: dict, abort_at: int | None = None, aborted=()) -> list:
    """Every step message of requests (request id -> fields) to the end (aborted ones at step abort_at)."""
    for k, (rid, fields) in enumerate(requests.items()):
        assert core.add_request(AddRequest(rid, [1] + [30 + k] * 6, fields, time.time())) is None
    messages = []
    for step in range(500):
        if step == abort_at:
            core.engine.abort_request(list(aborted))
        messages.extend(core.step().outputs)
        if not core.engine.has_unfinished_requests():
            return messages
    raise AssertionError("the requests did not finish")


def test_a_core_reports_each_finish_once_in_the_last_message(stories_path):
    core = EngineCore(EngineConfig(model=str(stories_path), device="cpu", max_model_len=128, async_scheduling=True))
    siblings = dict(temperature=1.0, seed=4, n=3, max_tokens=12, ignore_eos=True)
    try:
        # A stop token the seeded siblings reach at different steps (their tokens do not depend on it).
        tokens = [[], [], []]
        for msg in run_core(core, {"probe": siblings}):
            for seq in msg.seqs:
                tokens[seq.index].extend(seq.new_token_ids)
        first = lambda t: [ids.index(t) if t in ids else len(ids) for ids in tokens]   # noqa: E731
        stop = next(t for t in tokens[0] if len(set(first(t))) > 1)
        requests = {  # request id -> the fields
            "len": dict(temperature=0, max_tokens=5, ignore_eos=True),
            "n3": {**siblings, "stop_token_ids": [stop]},
            "n3-short": dict(temperature=1.0, seed=5, n=3, max_tokens=3, ignore_eos=True),
            "aborted": dict(temperature=0, max_tokens=60, ignore_eos=True),
            "n2-aborted": dict(temperature=0.8, seed=6, n=2, max_tokens=60, ignore_eos=True),
            "stop": dict(temperature=0, max_tokens=40, stop_token_ids=list(range(2, 512))),
        }
        messages = run_core(core, requests, abort_at=6, aborted=["aborted", "n2-aborted"])
    finally:
        core.engine.shutdown()
    for rid, fields in requests.items():
        n = fields.get("n", 1)
        mine = [msg for msg in messages if msg.request_id == rid]
        assert [msg.finished for msg in mine] == [False] * (len(mine) - 1) + [True]
        ends, finished_in = {}, set()
        for number, msg in enumerate(mine):
            for seq in msg.seqs:
                if seq.index in ends:       # a sibling's later messages repeat its finish, with no tokens
                    assert seq.finish_reason == ends[seq.index] and not seq.new_token_ids
                elif seq.finish_reason is not None:
                    ends[seq.index] = seq.finish_reason
                    finished_in.add(number)
            assert msg.finished == (len(ends) == n and number == len(mine) - 1)
        want = {"len": {"length"}, "n3": {"stop", "length"}, "n3-short": {"length"}, "aborted": {"abort"},
                "n2-aborted": {"abort"}, "stop": {"stop"}}[rid]
        assert sorted(ends) == list(range(n)) and set(ends.values()) <= want
        if rid == "n3":                      # its sequences ended in different steps
            assert len(finished_in) > 1 and "stop" in ends.values()
