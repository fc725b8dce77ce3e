"""The engine thread's per-row work each step: a mixed batch gives each request its outputs alone.

Greedy, seeded, penalised, stop-string, JSON-schema, n = 2 and logprobs requests, and requests under
every stop rule (stop token ids, one in the step max_tokens ends, under min_tokens, max_model_len,
ignore_eos, a choice whose grammar completes) run together
(stories260K, CPU) and each one alone on the same engine: tokens, text, finish and stop reasons and
logprob ranks are equal, with async scheduling and the matchers in a grammar process, with n-gram
speculation (its verifier draws from the same generators as the sampling), and through an engine
core's token outputs. A seeded sequence's sampling draws its generator's stream in order.
"""
import json
import time

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.device import make_device
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
