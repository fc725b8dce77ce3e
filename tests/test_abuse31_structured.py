"""Structured outputs abused as vLLM users do, through the Python API (stories260K, CPU): large
integers in JSON schemas, which llguidance reads as 64-bit floats."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_abuse30_structured import accepts, manager  # noqa: F401 (a module fixture)

from minillm.structured_output import StructuredOutputsError, StructuredOutputsParams

VOCAB = 512
INT64_MIN = -2 ** 63




# Each of these took the process down with a segmentation fault where the constraint was built (an
# API server's request thread, or LLM.generate's caller): llguidance's integer range at -2**63.
NEAR_INT64_MIN = [
    {"const": INT64_MIN + 1},
    {"const": INT64_MIN},
    {"enum": [1, INT64_MIN + 1]},
    {"const": {"id": [INT64_MIN + 1]}},
    {"type": "integer", "const": -1e19},
    {"type": "integer", "enum": [3, -1e300]},
    {"type": "integer", "minimum": INT64_MIN + 1, "maximum": INT64_MIN + 1},
]
_BUILD_EACH = """
import json, sys
from minillm.server.errors import APIError
from minillm.server.structured import checked_params
for schema in json.loads(sys.argv[1]):
    try:
        checked_params(lambda field: "response_format.json_schema.schema", json=schema)
    except APIError as e:
        print(json.dumps([e.status, e.param, e.message]), flush=True)
    else:
        print(json.dumps(None), flush=True)
"""


def test_integers_at_the_64_bit_minimum_are_a_400_naming_the_schema_not_a_crash():
    # In a process of its own: without the check the first schema kills the process that builds it.
    run = subprocess.run([sys.executable, "-c", _BUILD_EACH, json.dumps(NEAR_INT64_MIN)],
                         capture_output=True, text=True, timeout=120)
    answers = [json.loads(line) for line in run.stdout.splitlines()]
    assert run.returncode == 0 and len(answers) == len(NEAR_INT64_MIN), (run.returncode, run.stderr[-2000:])
    for schema, answer in zip(NEAR_INT64_MIN, answers):
        assert answer is not None and answer[:2] == [400, "response_format.json_schema.schema"], (schema, answer)
        assert "64-bit" in answer[2], answer


@pytest.mark.parametrize("schema", [
    {"const": 2 ** 53 + 1},                      # matched as 9007199254740992
    {"enum": ["a", 123456789012345678901234567890]},   # as 123456789012345680000000000000
    {"const": 2 ** 63},                          # as 9223372036854776000
    {"type": "array", "items": {"enum": [[10 ** 17 + 1]]}},
])
def test_an_integer_const_or_enum_a_float_does_not_hold_is_a_value_error_naming_json(schema):
    # These compiled, and the output, finished with "stop", held another integer than the schema's.
    with pytest.raises(StructuredOutputsError, match=r"^json: .*64-bit float") as err:
        StructuredOutputsParams(json=schema)
    assert err.value.field == "json"


@pytest.mark.parametrize("value", [2 ** 53, -2 ** 53, 2 ** 60, 10 ** 17, 2 ** 63 - 1, INT64_MIN + 1024, 10 ** 30])
def test_an_integer_const_a_float_holds_is_taken_and_matched_exactly(manager, value):
    params = StructuredOutputsParams(json={"const": value})
    assert accepts(manager, params, str(value))
    assert not accepts(manager, params, str(value + 1))


@pytest.mark.parametrize("schema", [
    {"type": "integer", "maximum": 999999999999999999},                   # let 10**18 through
    {"type": "integer", "minimum": 2 ** 53 + 1, "maximum": 2 ** 53 + 8},  # 2**53
    {"type": "integer", "exclusiveMaximum": 2 ** 60, "minimum": 0},       # 2**60
    {"type": "integer", "exclusiveMinimum": 2 ** 53, "maximum": 2 ** 54},  # 2**53
    {"type": ["integer", "null"], "exclusiveMinimum": -2 ** 60, "maximum": 0},   # -2**60
])
def test_an_integer_bound_a_float_does_not_hold_exactly_is_a_value_error_naming_json(schema):
    # llguidance rounded the bound to a float (and took an exclusive bound's neighbour there as a
    # float too), and let the integer in the comment, outside the bounds, through.
    with pytest.raises(StructuredOutputsError, match=r"^json: .*64-bit float") as err:
        StructuredOutputsParams(json=schema)
    assert err.value.field == "json"


@pytest.mark.parametrize("schema,inside,outside", [
    ({"type": "integer", "maximum": 2 ** 60, "minimum": 0}, 2 ** 60, 2 ** 60 + 1),
    ({"type": "integer", "maximum": 2 ** 63 - 1, "minimum": 0}, 2 ** 63 - 1, 2 ** 63),
    ({"type": "integer", "exclusiveMaximum": 2 ** 53, "minimum": 0}, 2 ** 53 - 1, 2 ** 53),
    ({"type": "integer", "minimum": -2 ** 60, "maximum": 0}, -2 ** 60, -2 ** 60 - 1),
])
def test_an_integer_bound_a_float_holds_is_taken_and_kept(manager, schema, inside, outside):
    params = StructuredOutputsParams(json=schema)
    assert accepts(manager, params, str(inside))
    assert not accepts(manager, params, str(outside))


def test_a_structural_tag_alone_is_refused_by_its_name():
    # vLLM counts structural_tag among the constraints, so a request may give it alone; the error was
    # "exactly one of json, regex, choice, grammar, json_object must be set, got none", naming the
    # whole object and telling the client it had set nothing.
    with pytest.raises(StructuredOutputsError, match=r"^structural_tag: .*not supported") as err:
        StructuredOutputsParams(structural_tag='{"type": "structural_tag", "structures": [], "triggers": []}')
    assert err.value.field == "structural_tag"


@pytest.mark.parametrize("step", [2 ** 31, 1000003, 99991, 0.99991, 123456789e-20, -2 ** 31, -3, 0])
def test_a_multiple_of_with_many_significant_digits_is_a_value_error_naming_json(step):
    # llguidance matches multipleOf with an automaton of one state per multiple of its significant
    # digits: 99991 took 0.6 s and held 50 MB per compiled grammar, 1000003 5 s, and 2**31 asked for
    # gigabytes and aborted the engine process in its compile thread (the entry check passed it); a
    # negative one, which JSON Schema refuses, was read as its opposite.
    for kind in ("integer", "number"):
        with pytest.raises(StructuredOutputsError, match=r"^json: .*multipleOf") as err:
            StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": kind, "multipleOf": step}}})
        assert err.value.field == "json"


@pytest.mark.parametrize("step,inside,outside", [(86400, "172800", "86401"), (0.01, "1.25", "1.255"),
                                                 (1024, "3072", "3073"), (2.5e-7, "0.00000075", "0.0000007"),
                                                 (9999, "19998", "19999")])
def test_a_multiple_of_with_few_significant_digits_is_taken_and_kept(manager, step, inside, outside):
    params = StructuredOutputsParams(json={"type": "number", "multipleOf": step})
    assert accepts(manager, params, inside)
    assert not accepts(manager, params, outside)
