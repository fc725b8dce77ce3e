"""Structured outputs in the step (CPU): the matchers' cached flags, tokens taken ahead of the
scheduler, masks filled on the mask thread, the order of a constrained step's host work with
async scheduling on and off (a constrained step's sampling is deferred to the start of the next
step), a failed fill, the sampler's kept mask buffers, and the simulated device of the host-time
benchmark."""
import json
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

import minillm.ops.numpy as npops
from minillm import SamplingParams, StructuredOutputsParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, StepError
from minillm.sampler import Sampler
from minillm.sequence import Sequence, SequenceStatus
from minillm.structured_output import (GrammarBitmask, StructuredOutputRequest,
                                       bitmask_words)
from test_structured_engine import CHECKS, PROMPT
from test_structured_output import ARITHMETIC_BOUNDED, CHOICES, DATE, SCHEMA, VOCAB, allowed, char_ids, compile_
from test_structured_output import manager  # noqa: F401  (a fixture)

EOS = 2
GRAMMARS = [dict(json=SCHEMA), dict(regex=DATE), dict(choice=CHOICES), dict(grammar=ARITHMETIC_BOUNDED)]


class Untouchable:
    """Stands in for an llguidance matcher that another thread is filling: any use is an error."""

    def __getattr__(self, name):
        raise AssertionError(f"the llguidance matcher was asked {name} while another thread fills it")


def flags(matcher):
    """What the engine thread asks a matcher (from its cached flags)."""
    return matcher.is_stopped(), matcher.is_error(), matcher.error, matcher.is_terminated()


def live_flags(matcher):
    m = matcher._matcher
    error = m.get_error().split("\n", 1)[0]           # the message without the parser state after it
    return matcher.is_terminated() or m.is_stopped(), m.is_error(), error, matcher.is_terminated()


@pytest.mark.parametrize("kwargs", GRAMMARS, ids=["json", "regex", "choice", "lark"])
def test_matcher_flags_are_cached_and_a_fill_leaves_them(manager, kwargs):
    """After every accepted (or refused) token the cached flags are the matcher's own; a fill
    does not change them; asking them never touches the llguidance matcher."""
    rng = np.random.default_rng(7)
    grammar = compile_(manager, **kwargs)
    for _ in range(8):
        matcher = grammar.new_matcher()
        for _ in range(60):
            ids = sorted(allowed(matcher))
            assert flags(matcher) == live_flags(matcher)
            assert matcher.can_terminate() == (matcher.is_terminated() or (matcher._matcher.is_accepting()
                                                                           and not matcher._matcher.is_error()))
            raw, matcher._matcher = matcher._matcher, Untouchable()
            cached = flags(matcher)
            matcher._matcher = raw
            assert cached == live_flags(matcher)
            refused = rng.random() < 0.05                              # now and then a token the grammar refuses
            token = int(rng.integers(VOCAB)) if refused else int(rng.choice(ids))
            if not matcher.accept_token(token) or matcher.is_terminated():
                assert flags(matcher) == live_flags(matcher)
                break


def request_for(grammar) -> StructuredOutputRequest:
    future = Future()
    future.set_result(grammar)
    request = StructuredOutputRequest(future)
    assert request.is_ready
    return request


def test_tokens_taken_ahead_are_the_schedulers_results(tok, manager):
    request = request_for(compile_(manager, regex=DATE))
    ids = char_ids(tok, "2024-")
    request.advance(ids[:1])
    assert request.num_advanced == 1 and request.matcher.num_accepted == 1
    request.matcher._matcher, raw = Untouchable(), request.matcher._matcher
    assert request.accept_token(ids[0]) and request.num_advanced == 0     # the recorded result
    assert not request.is_complete
    request.matcher._matcher = raw
    assert request.accept_token(ids[1]) and request.matcher.num_accepted == 2   # nothing ahead: accepted now
    request.advance([ids[2], char_ids(tok, "x")[0], ids[3]])                    # stops at the refused "x"
    assert request.num_advanced == 2 and request.matcher.is_error()
    assert request.accept_token(ids[2]) and not request.accept_token(char_ids(tok, "x")[0])
    assert "not allowed" in request.rejection(char_ids(tok, "x")[0])
    other = request_for(compile_(manager, regex=DATE))
    other.advance(ids[:1])
    with pytest.raises(RuntimeError, match="ahead"):
        other.accept_token(ids[1])


def test_batched_advance_gives_each_matcher_its_own_results(tok, manager):
    """The manager's advance feeds a step's tokens to many matchers in one llguidance call; each
    request records what its matcher answers alone, token by token: accepted, refused (then in
    error), an EOS after a complete output (which llguidance does not record), a token after an
    EOS, and a verification step's several tokens in order (stopping at a refusal)."""
    date, choice = compile_(manager, regex=DATE), compile_(manager, choice=CHOICES)
    word = char_ids(tok, CHOICES[0])
    cases = [(date, [], char_ids(tok, "2")), (date, [], char_ids(tok, "x")), (choice, word, [EOS]),
             (choice, word + [EOS], char_ids(tok, "a")), (date, char_ids(tok, "20"), char_ids(tok, "2")),
             (date, [], char_ids(tok, "1")), (date, [], char_ids(tok, "9x4"))]
    requests, twins = [], []
    for grammar, before, _ in cases:
        request, twin = request_for(grammar), request_for(grammar)
        for t in before:
            request.accept_token(t)
            twin.accept_token(t)
        requests.append(request)
        twins.append(twin)
    seqs = [constrained_seq(request, placeholders=2) for request in requests]
    for i, seq in enumerate(seqs):
        seq.seq_id = i
    manager.advance(list(enumerate(seqs)), {i: step for i, (_, _, step) in enumerate(cases)})
    for request, twin, (_, _, step) in zip(requests, twins, cases):
        expected = []
        for t in step:
            expected.append(twin.accept_token(t))
            if not expected[-1]:
                break
        assert request.num_advanced == len(expected)
        assert [request.accept_token(t) for t in step[:len(expected)]] == expected
        assert flags(request.matcher) == flags(twin.matcher)
        assert request.matcher.num_accepted == twin.matcher.num_accepted
    assert [r.matcher.is_error() for r in requests] == [False, True, False, False, False, False, True]
    assert requests[2].matcher.is_terminated() and not requests[3].accept_token(char_ids(tok, "a")[0])


def constrained_seq(request, prompt=(1, 5, 6), outputs=(), placeholders=0) -> Sequence:
    seq = Sequence("r", 0, list(prompt), SamplingParams(), 0.0, np.random.default_rng(0), 64)
    seq.token_ids += list(outputs)
    seq.num_output_placeholders = placeholders
    seq.structured_output = request
    seq.status = SequenceStatus.RUNNING
    return seq


def test_start_fill_fills_the_rows_that_go_on_on_the_mask_thread(tok, manager):
    """Rows: constrained sequences that go on; a finished one, one whose grammar is complete and
    an unconstrained one are left out; a token taken ahead counts; the fill equals each matcher's
    own row; two fills in a row use two buffers, the third the first again."""
    date, choice = compile_(manager, regex=DATE), compile_(manager, choice=CHOICES)
    ahead = request_for(date)
    ahead.advance(char_ids(tok, "19"))
    complete = request_for(choice)
    for t in char_ids(tok, CHOICES[0]):
        complete.accept_token(t)
    assert complete.is_complete
    finished = constrained_seq(request_for(date))
    finished.status = SequenceStatus.FINISHED_ABORTED
    plain = constrained_seq(None)
    seqs = [plain, constrained_seq(request_for(date)), finished, constrained_seq(ahead, placeholders=2),
            constrained_seq(complete, outputs=char_ids(tok, CHOICES[0])), constrained_seq(request_for(choice))]
    rows = list(enumerate(seqs))
    pending = manager.start_fill(rows)
    mask = pending.result()
    assert mask.rows.tolist() == [1, 3, 5] and pending.fill_time_s > 0
    for i, b in enumerate(mask.rows):
        single = np.zeros((1, bitmask_words(VOCAB)), np.int32)
        seqs[b].structured_output.matcher.fill_bitmask(single, 0)
        assert np.array_equal(mask.bitmask[i], single[0])
    second = manager.start_fill(rows).result()
    third = manager.start_fill(rows).result()
    assert not np.shares_memory(mask.bitmask, second.bitmask) and np.shares_memory(mask.bitmask, third.bitmask)
    assert mask.rows.tolist() == [1, 3, 5]        # its own array: the third fill reused the buffer
    assert manager.start_fill([(0, plain), (1, finished)]) is None
    behind = constrained_seq(request_for(date), outputs=char_ids(tok, "1"))   # its token never reached the matcher
    with pytest.raises(RuntimeError, match="not at its latest token"):
        manager.start_fill([(0, behind)])


def test_a_fill_error_is_raised_where_the_masks_are_taken(tok, manager, monkeypatch):
    def broken(pairs, out):
        raise ValueError("the fill broke")
    monkeypatch.setattr(manager, "_fill_rows", broken)
    pending = manager.start_fill([(0, constrained_seq(request_for(compile_(manager, regex=DATE))))])
    with pytest.raises(ValueError, match="the fill broke"):
        pending.result()


class DeviceLikeOps:
    """The NumPy ops behind an array module that is not NumPy's: the sampler takes its device
    path (uploads into a kept buffer) over host arrays."""

    xp = SimpleNamespace(empty=np.empty)

    def __getattr__(self, name):
        return getattr(npops, name)


def masked_token_by_token(logits, words, rows):
    """The mask rule written out: words[i] masks logits row rows[i]."""
    out = logits.copy()
    for i, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(words[i, t // 32]) >> (t % 32)) & 1:
                out[r, t] = -np.inf
    return out


@pytest.mark.parametrize("device_path", [False, True])
def test_sampler_masks_exactly_its_rows(device_path):
    """The CPU backend masks in place from the host masks; a device path uploads the masks into a
    buffer kept from step to step that grows with the number of masks, the kernel reading mask i
    for row rows[i] (also for masks moved to other rows). Each step masks exactly its rows."""
    sampler = Sampler(DeviceLikeOps() if device_path else npops, [EOS])
    rng = np.random.default_rng(3)
    for batch, rows in ((6, [0, 4]), (3, [2]), (9, [8, 1, 5])):
        for moved in (False, True):
            logits = rng.standard_normal((batch, 100)).astype(np.float32)
            words = rng.integers(-2**31, 2**31, (len(rows), bitmask_words(100)), dtype=np.int64).astype(np.int32)
            expect = masked_token_by_token(logits, words, rows)
            mask = GrammarBitmask(words, np.asarray(rows[::-1] if moved else rows, np.int32))
            sampler.apply_grammar_bitmask(logits, mask.at_rows(rows) if moved else mask)
            assert np.array_equal(logits, expect)
    if device_path:
        assert sampler._bitmask.shape[0] >= 3              # a row a mask
    else:
        assert sampler._bitmask is None


# ----------------------------------------------------------------------------- the engine's order

def spy_engine(stories_path, async_scheduling: bool):
    """An engine with a mixed batch added and its step's host work logged in order."""
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", async_scheduling=async_scheduling,
                                    enable_prefix_caching=False))
    for i, kind in enumerate(["json", "date", None, None, "choice", None]):
        structured = StructuredOutputsParams(**CHECKS[kind][0]) if kind else None
        engine.add_request(f"r{i}", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=kind is None,
                                                           structured_outputs=structured))
    for kind in ["json", "date", "choice"]:     # compiled before the first step, whatever a compile takes
        engine.structured_outputs.grammar_init(StructuredOutputsParams(**CHECKS[kind][0])).result(timeout=120)
    log = []

    def spy(obj, name, label):
        real = getattr(obj, name)

        def logged(*args, **kwargs):
            log.append(label)
            return real(*args, **kwargs)
        setattr(obj, name, logged)
    spy(engine.runner, "compute_logits", "forward")
    spy(engine.runner.sampler, "sample_no_sync", "sample")
    spy(engine.scheduler, "update_from_output", "update")
    spy(engine.structured_outputs, "start_fill", "fill")
    return engine, log


def test_async_a_constrained_step_samples_at_the_start_of_the_next_one(stories_path):
    """With a token in flight a constrained step is launched without its sampling; its masks are
    filled once the step before is read back, before the scheduler takes that step, and its
    sampling is queued right before the next forward pass."""
    engine, log = spy_engine(stories_path, async_scheduling=True)
    num_deferred = 0
    while engine.has_unfinished_requests():
        engine.step()
        if engine._in_flight and engine._in_flight[-1][1].sampled_by is not None:
            num_deferred += 1
            assert engine._in_flight[-1][0].structured_rows
    engine.shutdown()
    assert num_deferred > 10
    text = " ".join(log)
    assert text.count("fill update") >= num_deferred          # the fill starts before the scheduler's update
    assert text.count("sample forward") >= num_deferred - 1   # the deferred sampling goes right before the forward
    steady = text.split("fill update", 1)[1].rsplit("fill", 1)[0]
    assert "forward sample" not in steady                      # no constrained step sampled at once meanwhile


def test_sync_the_fill_starts_before_the_forward_and_nothing_is_deferred(stories_path):
    engine, log = spy_engine(stories_path, async_scheduling=False)
    while engine.has_unfinished_requests():
        engine.step()
        assert not engine._in_flight
    engine.shutdown()
    steps = " ".join(log).split("update")
    constrained = [s for s in steps if "fill" in s]
    assert len(constrained) > 10 and all(s.split() == ["fill", "forward", "sample"] for s in constrained)


def test_async_a_failed_mask_fill_aborts_its_step_and_the_engine_goes_on(stories_path):
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", async_scheduling=True), log=lambda m: None)
    engine.add_request("c", PROMPT, SamplingParams(temperature=0, max_tokens=30,
                                                   structured_outputs=StructuredOutputsParams(regex=DATE)))
    # The grammar compiled before the first step, whatever a compile takes (a first one starts the
    # grammar check process), so that both rows are in the fourth fill.
    engine.structured_outputs.grammar_init(StructuredOutputsParams(regex=DATE)).result(timeout=120)
    engine.add_request("u", PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    so_manager, calls = engine.structured_outputs, []
    real = so_manager._fill_rows

    def fill_rows(pairs, out):
        calls.append(len(pairs))
        if len(calls) == 4:
            raise ValueError("the fill broke")
        real(pairs, out)
    so_manager._fill_rows = fill_rows
    with pytest.raises(StepError) as failure:
        for _ in range(100):
            engine.step()
    assert failure.value.request_ids == ["c", "u"] and "the fill broke" in str(failure.value)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert {r: o.outputs[0].finish_reason for r, o in outs.items()} == {"c": "abort", "u": "abort"}
    engine.add_request("again", PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                       structured_outputs=StructuredOutputsParams(regex=DATE)))
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    again = outs["again"].outputs[0]
    assert again.finish_reason == "stop" and CHECKS["date"][1](again.text)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.shutdown()


# ----------------------------------------------------------------------------- the benchmark's device

def test_simulated_device_picks_allowed_tokens_and_keeps_time():
    from minillm.benchmarks.simulated_device import SimulatedDevice
    sim = SimulatedDevice(forward_s=2e-3, sample_s=1e-3, token_low=10, token_high=20)
    rng = np.random.default_rng(0)
    words = np.zeros((5, 40), np.int32)
    words[0, 7] = -2**31                                         # one allowed token: 7 * 32 + 31
    words[1] = rng.integers(-2**31, 2**31, 40, dtype=np.int64).astype(np.int32)
    words[2, [3, 30]] = [0b1000, 0b10]
    words[3] = -1
    words[4, 39] = 1
    picked = sim.pick_allowed(words, np.arange(5))
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    assert all(bits[r, t] for r, t in enumerate(picked)) and picked[0] == 7 * 32 + 31 and picked[4] == 39 * 32
    from minillm.benchmarks.simulated_device import SimulatedBuffer, SimulatedLogits, SimulatedSamplerOps
    ops = SimulatedSamplerOps(sim, npops)
    buffer = ops.xp.empty((8, 40), np.int32)
    assert isinstance(buffer, SimulatedBuffer) and buffer[:5].nbytes == words.nbytes
    buffer[:5].upload(words)                                    # the masks in one copy
    logits = SimulatedLogits(6, 40 * 32)
    ops.apply_token_bitmask(logits, buffer[:5], np.array([5, 0, 3, 1, 2], np.int32))
    assert logits.masked[5] == 7 * 32 + 31 and logits.masked[2] == 39 * 32
    assert all(bits[i, logits.masked[r]] for i, r in enumerate([5, 0, 3, 1, 2]))
    end = sim.queue(2e-3)
    assert sim.queue(1e-3) == pytest.approx(end + 1e-3) and sim.busy_s == pytest.approx(3e-3)
    with pytest.raises(RuntimeError, match="allows no token"):
        sim.pick_allowed(np.zeros((3, 4), np.int32), np.array([1]))


def test_structured_step_benchmark_runs_on_the_simulated_device(tmp_path):
    """The host-time harness end to end at a small size: both runs, every part reported."""
    from minillm.benchmarks import structured_step
    out = tmp_path / "sim.json"
    structured_step.main(["--device", "sim", "--batch", "8", "--constrained", "2", "--prompt-len", "8",
                          "--warmup", "2", "--steps", "6", "--repeats", "1", "--json", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [r["constrained"] for r in runs] == [0, 2]
    for r in runs:
        assert set(r["parts_ms"]) == set(structured_step.PART_NAMES) and r["batch_mean"] == 8
        assert sum(r["parts_ms"].values()) == pytest.approx(r["step_ms_mean"], rel=1e-6)
    assert runs[1]["fill_steps"] == 6 and runs[1]["parts_ms"]["advance"] > 0


def test_structured_step_benchmark_alternates_which_run_of_a_pair_goes_first(tmp_path, capsys):
    """Every other repeat runs its constrained batch first; each pair still compares constrained with unconstrained."""
    from minillm.benchmarks import structured_step
    out = tmp_path / "sim.json"
    structured_step.main(["--device", "sim", "--batch", "4", "--constrained", "1", "--prompt-len", "8",
                          "--warmup", "1", "--steps", "2", "--repeats", "2", "--json", str(out)])
    figures = json.loads(out.read_text())
    runs = figures["runs"]
    assert [r["constrained"] for r in runs] == [0, 1, 1, 0]
    plain, held = runs[3]["step_ms_median"], runs[2]["step_ms_median"]
    assert figures["pair_overheads"][1] == pytest.approx(held / plain - 1)
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("each repeat's pair"))
    first, second = line.split("first): ")[1].split(", ")
    assert not first.endswith("*") and second.endswith("*")


def test_async_abort_while_a_steps_sampling_is_deferred(stories_path):
    """A constrained request aborted while its step's sampling waits: its token is dropped, the
    other requests give their alone output."""
    from minillm import LLM
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(stories_path), device="cpu") as llm:
        alone = llm.generate([PROMPT], plain)[0].outputs[0].token_ids
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", async_scheduling=True))
    engine.add_request("c", PROMPT, SamplingParams(temperature=0, max_tokens=60,
                                                   structured_outputs=StructuredOutputsParams(**CHECKS["json"][0])))
    engine.add_request("u", PROMPT, plain)
    outs = {}
    for _ in range(200):
        outs.update({o.request_id: o for o in engine.step()})
        if engine._deferred_out is not None and len(outs.get("c").outputs[0].token_ids if "c" in outs else []) >= 3:
            break
    assert engine._deferred_out is not None
    engine.abort_request("c")
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs["c"].outputs[0].finish_reason == "abort"
    assert outs["u"].outputs[0].token_ids == alone
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.shutdown()
