"""Structured outputs abused as vLLM users do, through the Python API (stories260K, CPU): numbers
in JSON schemas (const and enum floats, bounds, multipleOf), each output checked with jsonschema."""
from __future__ import annotations

import json

import jsonschema
import pytest
from test_abuse30_structured import accepts, manager  # noqa: F401,F811 (a module fixture)

from minillm import SamplingParams
from minillm.structured_output import StructuredOutputsError, StructuredOutputsParams

SEEDS = 4


def outputs(llm, schema: dict, seeds: int = SEEDS, max_tokens: int = 48) -> list[str]:
    """The texts of `seeds` outputs at temperature 1 under the schema, each finished by its grammar."""
    constraint = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=constraint)
              for seed in range(seeds)]
    done = llm.generate(["Once upon a time"] * seeds, params, use_tqdm=False)
    assert [out.outputs[0].finish_reason for out in done] == ["stop"] * seeds
    return [out.outputs[0].text for out in done]


def assert_valid(llm, schema: dict, **kwargs) -> None:
    for text in outputs(llm, schema, **kwargs):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", [
    {"const": 2.0 ** 60},                                   # written 1152921504606847000
    {"enum": [-1.2345678901234568e18, "x"]},                # -1234567890123456800
    {"type": "number", "const": 9.199999999999998e18},      # 9199999999999998000
    {"type": "array", "items": {"const": {"id": -7.777777777777777e17}}, "minItems": 1, "maxItems": 1},
])
def test_a_const_or_enum_float_past_2_53_is_matched_as_its_exact_integer(llm, schema):
    # llguidance writes a float const by its shortest digits with no dot or exponent: 2.0**60 as
    # 1152921504606847000, which JSON readers such as Python's take as that integer, not 2**60; every
    # output failed the schema's own const.
    assert_valid(llm, schema)


@pytest.mark.parametrize("schema", [
    {"const": 6.5159297272276296e19},                       # written 65159297272276296000
    {"enum": [1.0, 1e300]},                                 # written 1000...000 (301 digits)
    {"type": "object", "properties": {"x": {"const": [2.0 ** 64 + 2 ** 12]}}},
])
def test_a_const_or_enum_float_past_2_63_written_as_another_integer_is_a_value_error_naming_json(schema):
    with pytest.raises(StructuredOutputsError, match=r"^json: .*float") as err:
        StructuredOutputsParams(json=schema)
    assert err.value.field == "json"


@pytest.mark.parametrize("value", [1e22, 1e20, 1e16, 0.1234567890123, 3.141592653589793, 1e-30, -0.0, 1e-7])
def test_a_const_float_written_as_itself_is_taken(llm, value):
    # 1e22 and 2**64 are integers whose shortest digits are exact; the others are written positionally
    # (1e-7 as 0.0000001), which reads back as the same float.
    assert_valid(llm, {"const": value}, seeds=2, max_tokens=64)
    assert_valid(llm, {"enum": [value, 2.5]}, seeds=2, max_tokens=64)


@pytest.mark.parametrize("schema,edge,inside", [
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.5}, "0", "0.25"),   # confloat(gt=0, lt=0.5)
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 0.1}, "0", "0.1"),
    ({"type": ["number", "null"], "exclusiveMinimum": 5, "maximum": 5.5}, "5", "5.5"),
    ({"type": "number", "exclusiveMaximum": 0, "minimum": -0.25}, "-0", "-0.25"),
    ({"type": "number", "exclusiveMaximum": -3, "exclusiveMinimum": -3.5}, "-3", "-3.01"),
])
def test_an_exclusive_integer_bound_next_to_the_other_is_kept(manager, schema, edge, inside):
    # llguidance took the integer bound itself when the other bound lay within the unit interval
    # beside it: {"exclusiveMinimum": 0, "exclusiveMaximum": 0.5} let "0" through.
    params = StructuredOutputsParams(json=schema)
    assert not accepts(manager, params, edge)
    assert accepts(manager, params, inside)


@pytest.mark.parametrize("schema,edge", [
    ({"type": "number", "exclusiveMinimum": 5, "exclusiveMaximum": 6}, "5.0000000000000000001"),
    ({"type": "number", "exclusiveMaximum": 1}, "0.99999999999999999"),
    ({"type": "number", "exclusiveMinimum": 0.1}, "0.10000000000000000001"),
])
def test_an_exclusive_bound_takes_no_number_that_reads_back_as_the_bound(manager, schema, edge):
    # Above 5 as written, 5.0000000000000000001 is read as the float 5.0, which the bound excludes.
    assert json.loads(edge) in (5.0, 1.0, 0.1)
    assert not accepts(manager, StructuredOutputsParams(json=schema), edge)



@pytest.mark.parametrize("schema,outside,inside", [
    ({"type": "number", "maximum": 0.9999999999999999}, "1", "0.5"),
    ({"type": "number", "maximum": 99.99999999999999}, "100", "99.5"),
    ({"type": "number", "minimum": 0.9688114292759761}, "0.968811429275976", "0.97"),
    ({"type": "number", "maximum": -977.8175310091901}, "-977.81753100919", "-978"),
    ({"type": "number", "minimum": -3.9999999999999996, "maximum": 0}, "-4", "-3"),
])
def test_a_bound_of_sixteen_digits_or_more_is_kept(manager, schema, outside, inside):
    # llguidance writes a bound's digits out and rounds past the 15th: maximum 0.9999999999999999 let 1 through.
    params = StructuredOutputsParams(json=schema)
    assert not accepts(manager, params, outside)
    assert accepts(manager, params, inside)


HOST = {"type": "string", "format": "hostname"}
EMAIL = {"type": "string", "format": "email"}


@pytest.mark.parametrize("schema,text,ok", [
    (HOST, ".".join(["a" * 63] * 4), False),                 # 255 characters: past RFC 1123's 253
    (HOST, ".".join(["a" * 63] * 3 + ["a" * 61]), True),     # 253
    (EMAIL, "a" * 65 + "@example.com", False),               # a local part past RFC 5321's 64
    (EMAIL, "a" * 64 + "@example.com", True),
    (EMAIL, "a@" + "b" * 64 + ".com", False),                # a domain label past 63
    (EMAIL, "a@" + ".".join(["b" * 63] * 4), False),         # 256 characters: past 254
    (EMAIL, "first.last@[192.168.0.1]", True),
])
def test_hostnames_and_emails_keep_to_the_rfc_lengths(manager, schema, text, ok):
    # llguidance's hostname took any number of labels (stories260K wrote hostnames of 288 and 303
    # characters), and its email any length of local part and of domain label.
    assert accepts(manager, StructuredOutputsParams(json=schema), json.dumps(text)) is ok
