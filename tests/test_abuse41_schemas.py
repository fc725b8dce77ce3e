"""JSON schemas as vLLM's default backend ("auto") takes them (stories260K, CPU): keywords xgrammar takes and
llguidance does not implement (dependentRequired, dependentSchemas, propertyNames as a pattern, minProperties
over optional properties) are enforced; schemas that backend hands to its guidance fallback
(has_xgrammar_unsupported_json_features: multipleOf, uniqueItems, a pattern beside a length bound, ...) are
read as guidance reads them, objects open; and outputs of recursive, enum, const, pattern and anyOf schemas
validate at temperature 1.0."""
from __future__ import annotations

import json

import jsonschema
import pytest
import test_abuse30_structured

from minillm import SamplingParams
from minillm.structured_output import (StructuredOutputsError, StructuredOutputsParams,
                                       has_xgrammar_unsupported_json_features, is_read_by_guidance)

accepts = test_abuse30_structured.accepts
manager = test_abuse30_structured.manager                  # a fixture

NUMBER_SEEDS = 24


def two_ints(**more) -> dict:
    """An object schema of two optional integer properties a and b, and more keywords."""
    return {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, **more}


def sampled(llm, schema: dict, max_tokens: int = 64) -> list:
    """The outputs that finished under the schema over NUMBER_SEEDS seeds at temperature 1.0, each checked
    against it; every output finishes by stop or length."""
    constraint = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=constraint)
              for seed in range(NUMBER_SEEDS)]
    outs = [out.outputs[0] for out in llm.generate(["Once upon a time"] * NUMBER_SEEDS, params, use_tqdm=False)]
    assert {out.finish_reason for out in outs} <= {"stop", "length"}, [out.stop_reason for out in outs]
    values = [json.loads(out.text) for out in outs if out.finish_reason == "stop"]
    assert values, [out.text for out in outs]
    for value in values:
        jsonschema.validate(value, schema)
    return values


# ---- keywords vLLM's default backend takes, enforced here --------------------------------------------------

DEPENDENT = {
    "dependentRequired": two_ints(dependentRequired={"a": ["b"]}),
    "dependentSchemas": two_ints(dependentSchemas={"a": {"required": ["b"], "properties": {"b": {"minimum": 5}}}}),
}


@pytest.mark.parametrize("name", DEPENDENT)
def test_dependent_keywords_are_taken_and_enforced(manager, name):
    params = StructuredOutputsParams(json=DEPENDENT[name])
    assert accepts(manager, params, "{}") and accepts(manager, params, '{"b":7}')
    assert accepts(manager, params, '{"a":1,"b":7}')
    assert not accepts(manager, params, '{"a":1}')
    assert not accepts(manager, params, '{"a":1,"b":7,"c":1}')          # closed, as xgrammar reads it
    if name == "dependentSchemas":
        assert not accepts(manager, params, '{"a":1,"b":2}') and accepts(manager, params, '{"b":2}')


def test_outputs_under_dependent_keywords_validate(llm):
    for schema in DEPENDENT.values():
        sampled(llm, schema)


def test_property_names_as_a_pattern_are_taken_and_enforced(manager, llm):
    schema = {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,3}$"},
              "additionalProperties": {"type": "integer"}, "maxProperties": 2}
    params = StructuredOutputsParams(json=schema)
    assert accepts(manager, params, '{"ab":1,"c":2}') and accepts(manager, params, "{}")
    assert not accepts(manager, params, '{"abcd":1}') and not accepts(manager, params, '{"A":1}')
    assert not accepts(manager, params, '{"ab":"x"}')
    sampled(llm, schema)


def test_min_properties_over_optional_listed_properties_is_taken_and_enforced(manager, llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                               "c": {"type": "boolean"}}, "minProperties": 2}
    params = StructuredOutputsParams(json=schema)
    assert accepts(manager, params, '{"a":1,"c":true}') and accepts(manager, params, '{"a":1,"b":2,"c":false}')
    assert not accepts(manager, params, '{"a":1}') and not accepts(manager, params, '{"a":1,"d":2}')
    values = sampled(llm, schema)
    assert all(len(value) >= 2 for value in values)


def test_min_properties_that_repeated_keys_could_meet_is_still_refused_where_objects_are_open():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 3}
    with pytest.raises(StructuredOutputsError, match="minProperties") as caught:
        StructuredOutputsParams(json=schema, disable_additional_properties=False)
    assert caught.value.field == "json"


def test_min_properties_past_the_choices_written_is_refused_naming_the_schema():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(12)}, "minProperties": 6}
    with pytest.raises(StructuredOutputsError, match="min/maxProperties") as caught:
        StructuredOutputsParams(json=schema)
    assert caught.value.field == "json"


# ---- schemas vLLM's default backend hands to guidance --------------------------------------------------------

@pytest.mark.parametrize("schema,expected", [
    ({"type": "integer", "multipleOf": 3}, True),
    ({"type": ["number", "null"], "multipleOf": 0.5}, True),
    ({"type": "array", "uniqueItems": True}, True),
    ({"type": "array", "contains": {"const": 1}}, True),
    ({"type": "string", "format": "password"}, True),
    ({"type": "string", "format": "uri-reference"}, False),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, True),
    ({"type": "string", "pattern": "^a+$"}, False),
    ({"type": "object", "properties": {"a": {}}, "propertyNames": {"enum": ["a"]}}, True),
    ({"type": "object", "patternProperties": {"^a": {}, "^b": {}}}, True),
    ({"type": "object", "patternProperties": {"^a": {}}}, False),
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}, True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, False),
    ({"multipleOf": 3}, False),                          # no type: vLLM's check does not look at it
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else str(v))
def test_the_check_of_what_xgrammar_is_not_given_is_vllms(schema, expected):
    assert has_xgrammar_unsupported_json_features(schema) is expected


def test_a_schema_read_by_guidance_keeps_its_objects_open(manager):
    stepped = two_ints()
    stepped["properties"]["a"]["multipleOf"] = 3
    assert is_read_by_guidance(stepped)
    assert accepts(manager, StructuredOutputsParams(json=stepped), '{"a":3,"zz":"x"}')
    assert not accepts(manager, StructuredOutputsParams(json=stepped), '{"a":4}')
    assert not accepts(manager, StructuredOutputsParams(json=two_ints()), '{"a":3,"zz":"x"}')
    assert not accepts(manager, StructuredOutputsParams(json=stepped, disable_additional_properties=True),
                       '{"a":3,"zz":"x"}')


def test_pattern_properties_go_to_outlines_in_vllm_and_stay_closed_here(manager):
    schema = two_ints(patternProperties={"^x_": {"type": "integer"}})
    schema["properties"]["a"]["multipleOf"] = 3
    assert has_xgrammar_unsupported_json_features(schema) and not is_read_by_guidance(schema)
    params = StructuredOutputsParams(json=schema)
    assert accepts(manager, params, '{"a":3,"x_1":2}') and not accepts(manager, params, '{"a":3,"y":2}')


def test_unique_items_is_refused_as_vllms_guidance_fallback_refuses_it():
    with pytest.raises(StructuredOutputsError, match="uniqueItems") as caught:
        StructuredOutputsParams(json={"type": "array", "maxItems": 3, "uniqueItems": True})
    assert caught.value.field == "json"


# ---- recursion, enum, const, pattern, anyOf -----------------------------------------------------------------

TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
    "required": ["v"]}}, "$ref": "#/$defs/node"}
TAKEN = {
    "tree": TREE,
    "enum of mixed types": {"enum": [1, "a", None, True, {"k": [1, 2]}, [1, "b"], 2.5]},
    "const object": {"const": {"a": 1, "b": [True, None], "c": "x"}},
    "long pattern": {"type": "string", "pattern": "^(?:" + "|".join(f"w{i:03d}" for i in range(400)) + ")$"},
    "anyOf of objects": {"anyOf": [two_ints(required=["a"]), {"type": "object", "properties": {
        "s": {"type": "string", "maxLength": 5}}, "required": ["s"]}]},
}


@pytest.mark.parametrize("name", TAKEN)
def test_outputs_of_schemas_vllm_gives_xgrammar_validate(llm, name):
    assert not has_xgrammar_unsupported_json_features(TAKEN[name])
    sampled(llm, TAKEN[name], max_tokens=96)


def test_anyof_objects_are_each_closed(manager):
    params = StructuredOutputsParams(json=TAKEN["anyOf of objects"])
    assert accepts(manager, params, '{"a":1,"b":2}') and accepts(manager, params, '{"s":"x"}')
    assert not accepts(manager, params, '{"a":1,"s":"x"}')
