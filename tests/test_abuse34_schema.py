"""Structured outputs with real-world JSON schemas through the Python API (stories260K, CPU): multipleOf
as llguidance reads it, intersected steps, schemas of pydantic models and tools, each output checked with
jsonschema; and the API server's check of a constraint, cached."""
from __future__ import annotations

import datetime
import decimal
import json
import uuid
from typing import Literal, Optional, Union

import jsonschema
import llguidance
import pytest
from pydantic import BaseModel, Field
from test_abuse30_structured import accepts, manager  # noqa: F401,F811 (a module fixture)

from minillm import SamplingParams
from minillm import structured_output
from minillm.structured_output import StructuredOutputsError, StructuredOutputsParams

SEEDS = 16
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


def finished_outputs(llm, schema: dict, seeds: int = SEEDS, max_tokens: int = 96) -> list[str]:
    """The texts of the outputs, at temperature 1, that the schema's grammar finished (at least one)."""
    constraint = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=constraint)
              for seed in range(seeds)]
    done = [out.outputs[0] for out in llm.generate(["Once upon a time"] * seeds, params, use_tqdm=False)]
    assert {out.finish_reason for out in done} <= {"stop", "length"}, [out.stop_reason for out in done]
    texts = [out.text for out in done if out.finish_reason == "stop"]
    assert texts
    return texts


def exactly(text: str):
    """JSON read with its numbers as Decimals: jsonschema then checks multipleOf in decimal, as JSON
    Schema defines it (with floats 0.7 is not a multiple of 0.1)."""
    return json.loads(text, parse_float=decimal.Decimal)


@pytest.mark.parametrize("step", [0.07, 0.53, 0.011, 1.11, 0.0007])
def test_a_multiple_of_that_llguidance_reads_as_other_digits_is_a_value_error_saying_so(step):
    # llguidance finds a step's digits by multiplying its float by 10 until it is whole: 0.07 came to
    # 7000000000000001e-17 and was refused as "too many digits: 7000000000000001", a number the
    # client never wrote.
    with pytest.raises(StructuredOutputsError, match=rf"^json: multipleOf {step!r} is not supported: .*"
                                                     r"cannot be matched exactly") as err:
        StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "number", "multipleOf": step}}})
    assert err.value.field == "json"


def test_the_multiple_of_steps_refused_are_those_llguidance_misreads():
    for places in range(1, 5):
        for digits in range(1, 400, 3):
            step = float(f"{digits}e-{places}")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "number", "multipleOf": step}))
            misread = "too many digits" in llguidance.LLMatcher.validate_grammar(grammar)
            try:
                StructuredOutputsParams(json={"type": "number", "multipleOf": step})
                refused = False
            except StructuredOutputsError as e:
                refused = "cannot be matched exactly" in str(e)
            assert refused == misread, step


@pytest.mark.parametrize("schema", [
    {"allOf": [{"type": "integer", "multipleOf": 8192}, {"multipleOf": 9999}]},       # 81,911,808 states
    {"allOf": [{"type": "number", "multipleOf": 9973}, {"multipleOf": 1e-9}]},        # lcm wrapped: only 0
    {"$defs": {"A": {"type": "integer", "multipleOf": 997}}, "type": "object",
     "properties": {"a": {"$ref": "#/$defs/A", "multipleOf": 991}}},
    {"allOf": [{"properties": {"a": {"multipleOf": 256}}}, {"properties": {"a": {"multipleOf": 257}}}]},
])
def test_intersected_multiple_of_that_combine_past_what_llguidance_holds_are_a_value_error(schema):
    # llguidance takes the least common multiple of intersected steps in 32-bit integers: 8192 with
    # 9999 made an automaton of 82 million states and the engine process aborted for memory at the
    # request's first mask; 9973 with 1e-9 wrapped and took only 0.
    with pytest.raises(StructuredOutputsError, match=r"^json: multipleOf .* intersected .* cannot be matched"):
        StructuredOutputsParams(json=schema)


def test_steps_that_are_not_intersected_or_combine_small_are_taken(manager):
    apart = {"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 8192},
                                              "b": {"allOf": [{"multipleOf": 9999}]}}}
    assert accepts(manager, StructuredOutputsParams(json=apart), '{"a":16384,"b":19998}')
    together = {"allOf": [{"type": "number", "multipleOf": 0.05}, {"multipleOf": 0.3}]}
    params = StructuredOutputsParams(json=together)
    assert [accepts(manager, params, text) for text in ("0.6", "0.3", "0.15", "0.1")] == [True, True, False, False]


@pytest.mark.parametrize("schema", [
    {"type": "number", "multipleOf": 0.01},
    {"type": "number", "multipleOf": 0.1, "minimum": 0, "maximum": 100},
    {"type": "number", "multipleOf": 1e-3, "exclusiveMinimum": -5, "maximum": 5},
    {"type": "number", "multipleOf": 0.05, "minimum": 0.5, "maximum": 90},
    {"type": "array", "items": {"type": "number", "multipleOf": 0.25, "minimum": -1, "maximum": 1}, "maxItems": 3},
])
def test_outputs_under_a_float_multiple_of_are_exact_decimal_multiples(llm, schema):
    for text in finished_outputs(llm, schema):
        jsonschema.validate(exactly(text), exactly(json.dumps(schema)))


class Address(BaseModel):
    street: str = Field(max_length=16)
    zip: str = Field(pattern=r"^\d{5}$")


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=10)
    age: int = Field(ge=0, le=130)
    nickname: Optional[str] = Field(default=None, max_length=6)
    address: Address


class Node(BaseModel):
    value: int = Field(ge=-9, le=9)
    children: list[Node] = Field(max_length=2)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    barks: bool


class Pet(BaseModel):
    pet: Union[Cat, Dog] = Field(discriminator="kind")


class Stamp(BaseModel):
    when: datetime.datetime
    day: datetime.date
    at: datetime.time
    id: uuid.UUID


@pytest.mark.parametrize("model", [Person, Node, Pet, Stamp])
def test_outputs_of_pydantic_models_validate(llm, model):
    schema = model.model_json_schema()
    for text in finished_outputs(llm, schema, max_tokens=160):
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
        model.model_validate_json(text)


TOOL = {"type": "object", "properties": {
    "unit": {"type": ["string", "null"], "enum": ["c", "f", None]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "tags": {"type": "array", "prefixItems": [{"type": "boolean"}, {"const": {"a": [1, None]}}], "items": False,
             "minItems": 2}},
    "required": ["unit", "days", "tags", "zone"], "additionalProperties": {"type": "string", "maxLength": 3},
    "maxProperties": 4}


@pytest.mark.parametrize("schema", [
    TOOL,
    {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"type": "object", "properties": {"b": {"type": "string", "maxLength": 4}}, "required": ["b"]}]},
    {"type": "object", "patternProperties": {"^x_": {"type": "integer"}, "^y": {"type": "boolean"}},
     "additionalProperties": False, "maxProperties": 2},
    {"enum": [1, "one", None, True, 1.5, [1, 2], {"a": 1}]},
    {"type": ["string", "integer", "null"], "maxLength": 3, "maximum": 99, "minimum": -99},
    {"type": "string", "nullable": True, "minLength": 2, "maxLength": 3, "pattern": "^[é漢😀a]+$"},
    {"type": "string", "format": "ipv6"},
    {"type": "string", "format": "time"},
    {"$ref": "#/$defs/A", "$defs": {"A": {"type": "object", "properties": {"x": {"$ref": "#/$defs/B"}},
                                          "required": ["x"]}, "B": {"type": "integer", "minimum": 3, "maximum": 9}}},
])
def test_outputs_of_tool_and_hand_written_schemas_validate(llm, schema):
    for text in finished_outputs(llm, schema):
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


@pytest.fixture
def counted_checks(monkeypatch):
    """The keys llguidance's check runs for (the cache of checked constraints starts empty)."""
    checked = []
    check = structured_output._check_grammar

    def counting(key):
        checked.append(key)
        return check(key)

    monkeypatch.setattr(structured_output, "_check_grammar", counting)
    monkeypatch.setattr(structured_output, "_checked", type(structured_output._checked)())
    return checked


def test_a_constraint_given_again_is_not_checked_again(counted_checks):
    # An API server checks each request's constraint: a large schema sent in many requests was
    # serialised and validated by llguidance each time.
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(50)}}
    for _ in range(5):
        StructuredOutputsParams(json=json.loads(json.dumps(schema)))
    StructuredOutputsParams(json=schema, disable_additional_properties=False)    # another constraint (open)
    StructuredOutputsParams(regex="[0-9]+")
    assert len(counted_checks) == 3
    for _ in range(3):                 # a refusal is kept too, and still refused each time
        with pytest.raises(StructuredOutputsError, match="^json: invalid JSON schema"):
            StructuredOutputsParams(json={"type": "string", "pattern": "("})
    assert len(counted_checks) == 4


def test_the_cache_of_checked_constraints_keeps_the_latest(counted_checks, monkeypatch):
    monkeypatch.setattr(structured_output, "_MAX_CHECKED", 2)
    for regex in ["a", "b", "a", "c", "b", "a"]:     # b evicted by c; then a, least recently used
        StructuredOutputsParams(regex=regex)
    assert [key[1] for key in counted_checks] == ["a", "b", "c", "b", "a"]
