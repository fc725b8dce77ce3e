"""The engine thread's work for constrained rows whose matchers live in a grammar process (stories260K,
CPU, async scheduling): a decode step writes the process one message (its advance, and the fill of the
next step's masks), the pipe is polled without building a selector, the rows of a clean answer are
read without asking their matchers, the update reads the rows whose answer is out last, the others in
batch order; the outputs stay those of the in-process matchers."""
import random
from types import SimpleNamespace

import numpy as np
import pytest

from minillm import SamplingParams, StructuredOutputsParams
from minillm import grammar_process as gp
from minillm.scheduler import _settled_first
from test_grammar_process import long_constrained, new_engine, run, tokens_until
from test_structured_engine import PROMPT


@pytest.fixture
def steady(stories_path):
    """An engine with three long constrained requests and a plain one, all decoding; (engine, its grammar process)."""
    engine = new_engine(stories_path, True)
    try:
        for i in range(3):
            engine.add_request(f"c{i}", PROMPT, long_constrained(i))
        counts: dict[str, int] = {}
        for request_id in ("c0", "c1", "c2"):
            tokens_until(engine, counts, request_id, 3)
        engine.add_request("plain", PROMPT, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        tokens_until(engine, counts, "plain", 3)       # added once the grammar is there: it would run ahead
        yield engine, engine.structured_outputs._process
    finally:
        engine.shutdown()


def test_a_decode_step_writes_the_grammar_process_one_message(steady, monkeypatch):
    engine, process = steady
    messages, post = [], process._post
    monkeypatch.setattr(process, "_post", lambda message: (messages.append(message), post(message)))

    def no_selector(*args):
        raise AssertionError("the pipe was polled through Connection.poll")
    monkeypatch.setattr(type(process._conn), "poll", no_selector)
    for _ in range(6):
        messages.clear()
        engine.step()
        assert [m[0] for m in messages] == [gp.BATCH], messages
        assert [command[0] for command in messages[0][1]] == [gp.ADVANCE, gp.FILL]
        assert len(messages[0][1][0][1]) == 3               # the three constrained rows' handles
    assert {r.request_id for r in engine.stats(cells=1).requests} == {"c0", "c1", "c2", "plain"}


def test_rows_of_a_clean_answer_are_read_without_asking_their_matchers(steady, monkeypatch):
    engine, process = steady
    asked = []
    for name in ("_sync", "is_complete", "is_terminated", "is_stopped"):
        original = getattr(gp.RemoteMatcher, name)
        monkeypatch.setattr(gp.RemoteMatcher, name,
                            lambda self, *a, _name=name, _f=original: (asked.append(_name), _f(self, *a))[1])
    answers = []
    advance = process.advance
    monkeypatch.setattr(process, "advance", lambda *a: answers.append(advance(*a)) or answers[-1])
    for _ in range(6):
        engine.step()
    assert asked == []
    assert len(answers) == 6 and all(answer.is_read and answer.clean for answer in answers[:-1])
    matcher = engine.requests["c0"].seqs[0].structured_output.matcher
    matcher.settle()
    assert matcher.num_accepted == matcher.num_fed and not matcher.is_stopped()


def test_outputs_with_grammars_ending_among_going_ones_are_the_in_process_ones(stories_path):
    """Answers turn from clean to not as a grammar ends in a step where others go on (its EOS, a
    choice complete, ignore_eos at a grammar's end), and the flags after each step's token still
    stop each sequence where the in-process matchers stop it."""
    def requests():
        reqs = {f"go-{i}": long_constrained(i) for i in range(2)}
        for i in range(4):
            reqs[f"choice-{i}"] = SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=
                                                 StructuredOutputsParams(choice=["a cat", "the big dog", "no"]))
            reqs[f"regex-{i}"] = SamplingParams(temperature=1.0, seed=10 + i, max_tokens=40, ignore_eos=i % 2 == 0,
                                                structured_outputs=StructuredOutputsParams(regex="[a-z]{2,6}\\."))
        reqs["plain"] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        return reqs
    outputs = {}
    for grammar_process in (True, False):
        engine = new_engine(stories_path, grammar_process)
        try:
            outputs[grammar_process] = {rid: (list(c.token_ids), c.finish_reason, c.stop_reason)
                                        for rid, c in run(engine, requests()).items()}
        finally:
            engine.shutdown()
    assert outputs[True] == outputs[False]
    assert {outputs[True][f"choice-{i}"][1] for i in range(4)} == {"stop"}


def test_the_update_reads_settled_rows_first_in_batch_order():
    """_settled_first against its definition, for random batches and random rows whose answer is out."""
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(0, 12)
        seqs = []
        for i in range(n):
            kind = rng.choice(["plain", "settled", "waiting"])
            request = None if kind == "plain" else SimpleNamespace(is_settled=kind == "settled")
            seqs.append(SimpleNamespace(name=i, structured_output=request))
        out = SimpleNamespace(sampling_seqs=seqs, structured_rows=[(b, s) for b, s in enumerate(seqs)
                                                                   if s.structured_output is not None])
        waiting = [s for s in seqs if s.structured_output is not None and not s.structured_output.is_settled]
        expected = [s for s in seqs if s not in waiting] + waiting
        assert [s.name for s in _settled_first(out)] == [s.name for s in expected]


def test_a_failed_command_in_a_batch_leaves_the_commands_after_it_answered(steady):
    """An advance the process cannot take (a matcher it does not hold) answers an error; the fill
    that went in the same message is still answered, and the process goes on."""
    engine, process = steady
    engine.step()
    stranger = gp.RemoteMatcher(process, 10_000, None)
    advanced = process.advance([stranger], [[5]])
    assert not advanced.done() and process._outbox       # held for the next command
    filled = process.fill(0, [], [])
    with pytest.raises(gp.GrammarProcessError, match="KeyError"):
        advanced.result()
    assert isinstance(filled.result(), float) and not process.failed
    assert stranger.is_error() and stranger.is_stopped()
    for _ in range(3):
        engine.step()
    assert not process.failed


def test_a_steady_constrained_step_makes_no_lock(steady, monkeypatch):
    """The grammar process's answers are completed and read on the engine thread alone: no Future (a
    condition and its lock, 6 us an answer) is made for them, nor any other lock, step after step."""
    import threading
    engine, process = steady
    made = []
    condition, lock = threading.Condition, threading.Lock
    monkeypatch.setattr(threading, "Condition", lambda *a: made.append("condition") or condition(*a))
    monkeypatch.setattr(threading, "Lock", lambda: made.append("lock") or lock())
    answers = []
    fill = process.fill
    monkeypatch.setattr(process, "fill", lambda *a: answers.append(fill(*a)) or answers[-1])
    for _ in range(6):
        engine.step()
    assert made == [] and len(answers) == 6
    with pytest.raises(gp.GrammarProcessError, match="KeyError"):
        process.advance([gp.RemoteMatcher(process, 10_000, None)], [[5]]).result()
    assert all(isinstance(answer.result(), float) for answer in answers)


class _CountedSlices(np.ndarray):
    """A device buffer stand-in that counts how often it is sliced."""

    count = 0

    def __getitem__(self, index):
        _CountedSlices.count += 1
        return super().__getitem__(index)


def test_the_kept_mask_buffer_is_sliced_once_for_a_steady_row_count_and_again_once_regrown():
    from minillm.ops import numpy as numpy_ops
    from minillm.sampler import Sampler
    from minillm.structured_output import GrammarBitmask
    sampler = Sampler(numpy_ops, [0])
    sampler.ops = SimpleNamespace(xp=SimpleNamespace(empty=lambda shape, dtype: np.empty(shape, dtype).view(_CountedSlices)),
                                  apply_token_bitmask=lambda logits, mask, rows: numpy_ops.apply_token_bitmask(
                                      logits, np.asarray(mask), np.asarray(rows)))
    sampler.device = SimpleNamespace(copy_to_device_async=lambda dst, src, event=True: dst.__setitem__(..., src))
    rng = np.random.default_rng(0)
    vocab, batch = 70, 8
    for step, num_rows in enumerate([3, 3, 3, 6, 6, 3, 3]):
        bitmask = rng.integers(-2**31, 2**31, (num_rows, 3), dtype=np.int64).astype(np.int32)   # [N, W]
        rows = rng.choice(batch, num_rows, replace=False).astype(np.int32)
        logits = np.zeros((batch, vocab), np.float32)
        before = _CountedSlices.count
        sampler.apply_grammar_bitmask(logits, GrammarBitmask(bitmask, rows))
        expected = np.zeros_like(logits)
        numpy_ops.apply_token_bitmask(expected, bitmask, rows)
        np.testing.assert_array_equal(logits, expected)
        first_of_its_kind = step in (0, 3, 5)           # a new row count, or the buffer regrown under it
        assert _CountedSlices.count - before == (2 if first_of_its_kind else 0), step
    assert np.shares_memory(sampler._bitmask_views[3, 3][0], sampler._bitmask)     # views of the regrown buffer
