"""The engine thread's per-row work each step: a mixed batch gives each request its outputs alone.

Greedy, seeded, penalised, stop-string, JSON-schema, n = 2 and logprobs requests, and requests under
every stop rule (stop token ids, one in the step max_tokens ends, under min_tokens, max_model_len,
ignore_eos, a choice whose grammar completes) run together
(stories260K, CPU) and each one alone on the same engine: tokens, text, finish and stop reasons and
logprob ranks are equal, with async scheduling and the matchers in a grammar process, with n-gram
speculation (its verifier draws from the same generators as the sampling), and through an engine
core's token outputs. A seeded sequence's sampling draws its generator's stream in order. A request's
first_scheduled_time and num_cached_tokens are those of the first step that runs one of its sequences
(its lowest-index sequence there), with admissions spread over steps, siblings admitted apart, cached
prompts and priority preemptions.
"""
import json
import time

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.device import make_device
from minillm.engine import LLMEngine
from minillm.engine_core.core import EngineCore
from minillm.ops import get_ops
from minillm.sampling_metadata import SamplingInputBuffer
from minillm.sampling_params import StructuredOutputsParams
from minillm.sequence import Sequence

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


def mixed_batch(golden: list[int]) -> list[tuple[list[int], dict]]:
    """(prompt, SamplingParams' fields) of a batch mixing every kind of per-row work the update and outputs do."""
    p = [1] + golden[1:12]
    q = [1] + golden[20:30] * 2          # repeats: n-gram drafts for it
    return [
        (p, dict(temperature=0, max_tokens=20)),
        (q, dict(temperature=0.9, seed=11, max_tokens=24)),
        (p, dict(temperature=1.0, seed=5, max_tokens=18, presence_penalty=0.6, frequency_penalty=0.3,
                 repetition_penalty=1.2)),
        (q, dict(temperature=0, max_tokens=40, stop=[" the", "."], include_stop_str_in_output=True)),
        (p, dict(temperature=0.8, seed=3, max_tokens=40, stop=[" was"])),
        (p, dict(temperature=0.7, seed=21, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA))),
        (q, dict(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA))),
        (p, dict(temperature=1.0, seed=9, n=2, max_tokens=16)),
        (q, dict(temperature=0, max_tokens=12, logprobs=3)),
        (p, dict(temperature=0.6, seed=4, max_tokens=14, logprobs=2, min_tokens=6)),
        (q, dict(temperature=1.0, max_tokens=10)),                  # unseeded: its count only
        # every stop rule (p's greedy continuation is golden[12:])
        (p, dict(temperature=0, max_tokens=30, stop_token_ids=[golden[15]])),
        (p, dict(temperature=0, max_tokens=4, stop_token_ids=[golden[15]])),     # stop token and max_tokens at once
        (p, dict(temperature=0, max_tokens=20, min_tokens=4, stop_token_ids=[golden[16]])),  # its 5th token
        (q, dict(temperature=0, max_tokens=None)),                                # to max_model_len
        (p, dict(temperature=1.0, seed=8, max_tokens=30, ignore_eos=True)),
        (q, dict(temperature=0.9, seed=13, max_tokens=30, min_tokens=10, stop_token_ids=[golden[22]])),
        (p, dict(temperature=0.8, seed=6, max_tokens=30, structured_outputs=StructuredOutputsParams(
            choice=["once upon a time", "the end"]))),                           # a grammar that completes
    ]


def outcome(c, seeded: bool) -> tuple:
    ranks = None if c.logprobs is None else [[(t, v.rank) for t, v in d.items()] for d in c.logprobs]
    if not seeded:
        return len(c.token_ids), c.finish_reason
    return tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason, ranks


def is_reproducible(fields: dict) -> bool:
    """Greedy or seeded: the same tokens wherever it runs."""
    return fields["temperature"] == 0 or "seed" in fields


def outcomes(outputs, batch) -> list:
    return [[outcome(c, is_reproducible(fields)) for c in out.outputs] for out, (_, fields) in zip(outputs, batch)]


@pytest.mark.parametrize("engine_args", [
    {},
    {"async_scheduling": True, "grammar_process": True},
    {"async_scheduling": True, "speculative_config": SPEC},
], ids=["sync", "async-grammar-process", "async-ngram"])
def test_a_mixed_batch_gives_each_request_its_output_alone(stories_path, golden, engine_args):
    batch = mixed_batch(golden)
    with LLM(str(stories_path), device="cpu", max_model_len=128, **engine_args) as llm:
        together = llm.generate([{"prompt_token_ids": p} for p, _ in batch],
                                [SamplingParams(**fields) for _, fields in batch], use_tqdm=False)
        alone = [llm.generate([{"prompt_token_ids": p}], SamplingParams(**fields), use_tqdm=False)[0]
                 for p, fields in batch]
    assert outcomes(together, batch) == outcomes(alone, batch)
    assert any(c.stop_reason in (" the", ".", " was") for out in together for c in out.outputs)
    assert all(together[k].outputs[0].text.startswith('{"name":') for k in (5, 6))   # held to the schema
    ends = [(c.finish_reason, c.stop_reason) for c in (out.outputs[0] for out in together[11:])]
    assert ends[0] == ("stop", golden[15]) and ends[1] == ("stop", golden[15]) and ends[2] == ("stop", golden[16])
    assert ends[3] == ("length", None) and len(together[14].outputs[0].token_ids) == 128 - len(batch[14][0])
    assert together[17].outputs[0].text in ("once upon a time", "the end") and ends[6] == ("stop", None)


def run_core(core: EngineCore, batch) -> dict[str, list]:
    """Per request, per sequence: its token ids, logprob rows' token ids, grammar_terminated and
    finish reason, from a core's step messages."""
    from minillm.engine_core.messages import AddRequest
    for i, (prompt, fields) in enumerate(batch):
        assert core.add_request(AddRequest(f"r{i}", prompt, fields, time.time())) is None
    got: dict[str, dict[int, list]] = {}
    for _ in range(2000):
        if not core.engine.has_unfinished_requests():
            break
        for message in core.step().outputs:
            for seq in message.seqs:
                tokens, rows, ends = got.setdefault(message.request_id, {}).setdefault(seq.index, ([], [], []))
                tokens.extend(seq.new_token_ids)
                rows.extend(sorted(row) for row in seq.new_logprobs or ())
                if seq.finish_reason is not None:
                    ends.append((seq.finish_reason, seq.stop_reason, seq.grammar_terminated))
    return {rid: [seqs[k] for k in sorted(seqs)] for rid, seqs in got.items()}


def test_a_core_reports_the_mixed_batch_as_each_request_alone(stories_path, golden):
    batch = [(p, fields) for p, fields in mixed_batch(golden) if is_reproducible(fields) and "stop" not in fields]
    config = EngineConfig(model=str(stories_path), device="cpu", max_model_len=128, async_scheduling=True,
                          grammar_process=True)
    core = EngineCore(config)
    try:
        together = run_core(core, batch)
        alone = {}
        for i, request in enumerate(batch):
            alone.update({f"r{i}": run_core(core, [request])["r0"]})
    finally:
        core.engine.shutdown()
    assert together == alone


def test_a_seeded_row_draws_its_generator_in_order_step_after_step():
    # Three steps of three rows (greedy, seeded, seeded), with a draw of the verifier's between steps:
    # the sampling's uniforms are the generators' next values in order.
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.5, seed=2)]
    seqs = [Sequence(f"r{i}", 0, [1, 2], p, 0.0, p.seed, 8) for i, p in enumerate(params)]
    ops = get_ops("numpy")
    inputs = SamplingInputBuffer(ops, make_device("numpy"), 4, [0])
    want = {1: np.random.default_rng(1), 2: np.random.default_rng(2)}
    for step in range(3):
        meta = inputs.prepare(seqs, 32)
        uniforms = np.asarray(meta.uniforms)
        assert uniforms[0] == 0.0
        assert uniforms[1] == want[1].random() and uniforms[2] == want[2].random()
        drawn = seqs[1].rng.random(step + 1)            # as the verifier draws
        assert drawn.tolist() == want[1].random(step + 1).tolist()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_is_first_scheduled_with_the_first_step_that_runs_it(stories_path, golden, policy):
    # Three rows at most and a small token budget: admissions spread over steps, an n = 3 request's
    # siblings are admitted steps apart, repeated prompts are cached, and under "priority" later
    # urgent requests preempt running ones (which come back later). Each step's SchedulerOutput is
    # recorded as the scheduler returns it, with the wall clock around the call.
    config = EngineConfig(model=str(stories_path), device="cpu", max_model_len=128, max_num_seqs=3,
                          max_num_batched_tokens=40, scheduling_policy=policy)
    engine = LLMEngine(config)
    steps = []               # (clock after the step before's schedule, clock before this one's, its seqs)
    schedule = engine.scheduler.schedule

    def recorded():
        before = time.time()
        out = schedule()
        steps.append((steps[-1][3] if steps else 0.0, before, [(s, s.num_cached_tokens) for s in out.seqs],
                      time.time()))
        return out

    engine.scheduler.schedule = recorded
    prompts = [[1] + golden[1:30], [1] + golden[5:20], [1] + golden[1:30], [1] + golden[40:52]]
    requests = [("a", prompts[0], dict(n=3, max_tokens=6), 5), ("b", prompts[1], dict(max_tokens=12), 5),
                ("c", prompts[2], dict(max_tokens=5), 5), ("d", prompts[3], dict(n=2, max_tokens=4), 0)]
    try:
        for rid, prompt, fields, priority in requests[:2]:
            engine.add_request(rid, prompt, SamplingParams(temperature=0, **fields),
                               priority=priority if policy == "priority" else 0)
        held = {}
        for k in range(500):
            if k == 2:           # later arrivals: one repeats a's prompt, one outranks the running ones
                for rid, prompt, fields, priority in requests[2:]:
                    engine.add_request(rid, prompt, SamplingParams(temperature=0, **fields),
                                       priority=priority if policy == "priority" else 0)
            held.update({rid: engine.requests[rid] for rid, *_ in requests if rid in engine.requests})
            engine.step()
            if k > 2 and not engine.has_unfinished_requests():
                break
    finally:
        engine.shutdown()
    assert len(held) == 4 and all(req.is_finished for req in held.values())
    if policy == "priority":
        assert engine.scheduler.num_preemptions > 0
    assert any(cached for *_, rows, _ in steps for _, cached in rows)        # a prompt came from the cache
    for rid, req in held.items():
        k = next(k for k, (_, _, rows, _) in enumerate(steps) if any(s.request_id == rid for s, _ in rows))
        after_before, before, rows, _ = steps[k]
        first, cached = min(((s, c) for s, c in rows if s.request_id == rid), key=lambda sc: sc[0].index)
        assert after_before <= req.metrics.first_scheduled_time <= before, rid
        assert req.metrics.num_cached_tokens == cached, rid
    first_steps = {i: next(k for k, (_, _, rows, _) in enumerate(steps) if any(s.request_id == "a" and s.index == i
                                                                        for s, _ in rows)) for i in range(3)}
    assert len(set(first_steps.values())) > 1                                # a's siblings were admitted apart
    assert held["a"].metrics.num_cached_tokens == 0 and held["c"].metrics.num_cached_tokens > 0
