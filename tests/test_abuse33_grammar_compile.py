"""A grammar compiles off the step loop, cached by its text: the engine core does not compile-check a
constraint an API server checked (the check of a large GBNF grammar held the core's loop for a
quarter of a second a request); a bad grammar that reaches the core still ends its request with the
compile's error."""
from __future__ import annotations

import time

import msgspec
import pytest

import minillm.structured_output as so
from minillm.config import EngineConfig
from minillm.engine_core import messages as m
from minillm.engine_core.core import EngineCore, sampling_fields
from minillm.server.async_llm import _wire_constraint
from minillm.structured_output import StructuredOutputsParams

# A GBNF chain of 4,000 rules: its check (the conversion to Lark and llguidance's parse) took 0.25 s.
CHAIN = "root ::= r0\n" + "".join(f'r{i} ::= "a{i}" r{i + 1} | "b"\n' for i in range(4000)) + 'r4000 ::= "z"\n'


@pytest.fixture
def checks(monkeypatch):
    """The constraints llguidance compile-checks, in order."""
    seen, real = [], so._check_grammar

    def counted(key):
        seen.append(key)
        return real(key)

    monkeypatch.setattr(so, "_check_grammar", counted)
    return seen


def across_the_wire(params: StructuredOutputsParams) -> dict:
    """The constraint as the engine core receives it from an API server."""
    return msgspec.msgpack.decode(m.encoder().encode(_wire_constraint(params)))


def test_the_core_does_not_check_a_grammar_again_on_its_step_loop(checks):
    params = StructuredOutputsParams(grammar=CHAIN)            # the API server's check
    assert len(checks) == 1
    rebuilt = sampling_fields({"structured_outputs": across_the_wire(params)})["structured_outputs"]
    assert len(checks) == 1
    assert rebuilt.key == params.key


def test_the_core_still_checks_a_constraints_fields(checks):
    with pytest.raises(so.StructuredOutputsError, match="exactly one"):
        sampling_fields({"structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}})
    with pytest.raises(so.StructuredOutputsError, match="^grammar: must not be empty"):
        sampling_fields({"structured_outputs": {"grammar": " "}})
    assert checks == []


@pytest.fixture(scope="module")
def core(stories_path):
    core = EngineCore(EngineConfig(model=str(stories_path), device="cpu"), log=lambda _: None)
    yield core
    core.engine.shutdown()


def test_a_bad_grammar_that_reaches_the_core_ends_its_request_with_the_compile_error(core):
    before = dict(core.engine.stats().num_requests_finished)
    wire = {"grammar": "start: missing_rule"}
    fields = {"max_tokens": 4, "structured_outputs": wire}
    assert core.add_request(m.AddRequest("bad-grammar", [1, 2, 3], fields, time.time())) is None
    seq = core.engine.requests["bad-grammar"].seqs[0]
    for _ in range(2000):
        if seq.is_finished:
            break
        core.step()
    assert seq.is_finished
    after = core.engine.stats().num_requests_finished
    assert after.get("error", 0) == before.get("error", 0) + 1
    with pytest.raises(so.StructuredOutputsError) as info:
        StructuredOutputsParams(grammar="start: missing_rule")
    assert seq.stop_reason == f"structured_outputs.{info.value}"
