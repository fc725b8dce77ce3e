"""JSON schemas under vLLM's default backend (xgrammar's strict mode): an array schema that gives no items,
and object and array schemas whose type is a list of types; the guidance backend's open reading of both."""
from __future__ import annotations

import json

import pytest

from minillm import StructuredOutputsParams
from minillm.structured_output import StructuredOutputManager, _with_closed_objects
from minillm.structured_outputs_config import StructuredOutputsConfig

ANY_ARRAY = '[1,"x",{"a":[]},null]'


@pytest.fixture(scope="module")
def manager(tok):
    mgr = StructuredOutputManager.from_tokenizer(tok, 512, max_num_seqs=4)
    yield mgr
    mgr.shutdown()


def accepts(manager, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the constraint takes text as a whole output."""
    matcher = manager.grammar_init(params).result().new_matcher()
    return matcher.accept_tokens(manager.ll_tokenizer.tokenize_str(text)) and matcher.can_terminate()


def guidance(schema: dict) -> StructuredOutputsParams:
    """The constraint as an engine on vLLM's guidance backend (its default options) runs it."""
    return StructuredOutputsConfig(backend="guidance").applied(StructuredOutputsParams(json=schema), None)


# ---- arrays that give no items ------------------------------------------------------------------------------

@pytest.mark.parametrize("schema", [{"type": "array"}, {"type": "array", "title": "Tags", "description": "any"},
                                    {"type": ["array", "null"]}, {"type": "array", "items": True}],
                         ids=["bare", "annotated", "type-list", "said-open"])
def test_a_bare_array_schema_takes_any_array(manager, schema):
    params = StructuredOutputsParams(json=schema)
    assert accepts(manager, params, ANY_ARRAY) and accepts(manager, params, "[]")
    nested = StructuredOutputsParams(json={"type": "object", "properties": {"tags": schema}, "required": ["tags"]})
    assert accepts(manager, nested, '{"tags":[1,2]}')


@pytest.mark.parametrize("schema", [{"type": "array", "maxItems": 3}, {"type": "array", "minItems": 0},
                                    {"type": ["array", "null"], "maxItems": 3},
                                    {"type": "array", "maxItems": 3, "title": "Tags"}],
                         ids=["maxItems", "minItems-0", "type-list", "annotated"])
def test_an_array_schema_that_says_more_than_its_type_and_gives_no_items_takes_only_the_empty_array(manager, schema):
    # xgrammar's strict mode reads an array with no items (or unevaluatedItems) as taking none, unless it
    # is the bare {"type": "array"} (annotations aside), its basic any-array rule.
    params = StructuredOutputsParams(json=schema)
    assert accepts(manager, params, "[]") and not accepts(manager, params, "[1]")
    assert accepts(manager, StructuredOutputsParams(json=schema, disable_additional_properties=False), "[1,2]")
    nested = StructuredOutputsParams(json={"type": "object", "properties": {"tags": schema}, "required": ["tags"]})
    assert accepts(manager, nested, '{"tags":[]}') and not accepts(manager, nested, '{"tags":["a"]}')


def test_unique_items_with_no_items_is_refused_as_vllm_refuses_it():
    # vLLM's default backend gives an array with uniqueItems to its guidance fallback, which refuses it.
    with pytest.raises(ValueError, match="uniqueItems"):
        StructuredOutputsParams(json={"type": "array", "uniqueItems": True})
    with pytest.raises(ValueError, match="uniqueItems"):
        guidance({"type": "array", "uniqueItems": True}).key


@pytest.mark.parametrize("schema,text", [
    ({"type": "array", "minItems": 1}, "[1]"),
    ({"allOf": [{"type": "array", "maxItems": 3}, {"items": {"type": "integer"}}]}, "[1,2]"),
    ({"type": "array", "items": {"type": "integer"}, "anyOf": [{"type": "array", "maxItems": 2}]}, "[1,2]"),
    ({"type": "array", "maxItems": 3, "additionalItems": {"type": "integer"}}, "[1]"),
], ids=["minItems", "allOf", "beside-anyOf", "additionalItems"])
def test_an_array_schema_with_no_items_that_closed_could_not_be_met_or_says_its_items_stays_open(manager, schema,
                                                                                                  text):
    assert accepts(manager, StructuredOutputsParams(json=schema), text)


# ---- a list of types --------------------------------------------------------------------------------------

def test_a_list_of_types_reads_the_bare_object_as_any_object(manager):
    # xgrammar reads {"type": ["object", "null"]} as {"type": "object"} or {"type": "null"}: any object.
    params = StructuredOutputsParams(json={"type": ["object", "null"], "description": "meta"})
    assert accepts(manager, params, '{"x":1}') and accepts(manager, params, "null")


@pytest.mark.parametrize("schema", [{"type": ["object", "null"], "maxProperties": 3},
                                    {"type": ["null", "object"], "required": []}],
                         ids=["maxProperties", "required-none"])
def test_a_list_of_types_closes_an_object_that_says_more_than_its_type(manager, schema):
    params = StructuredOutputsParams(json=schema)
    assert accepts(manager, params, "{}") and accepts(manager, params, "null")
    assert not accepts(manager, params, '{"x":1}')
    assert accepts(manager, StructuredOutputsParams(json=schema, disable_additional_properties=False), '{"x":1}')


def test_a_list_of_types_closes_the_object_and_the_array_each(manager):
    params = StructuredOutputsParams(json={"type": ["object", "array", "string"], "maxLength": 4})
    assert accepts(manager, params, "{}") and accepts(manager, params, "[]") and accepts(manager, params, '"abcd"')
    assert not accepts(manager, params, '{"x":1}') and not accepts(manager, params, "[1]")
    listed = StructuredOutputsParams(json={"type": ["object", "null"], "properties": {"a": {"type": "integer"}}})
    assert accepts(manager, listed, '{"a":1}') and not accepts(manager, listed, '{"a":1,"b":2}')


def test_a_list_of_types_asking_for_a_key_or_an_item_it_does_not_list_stays_open(manager):
    assert accepts(manager, StructuredOutputsParams(json={"type": ["object", "null"], "required": ["a"]}), '{"a":1}')
    assert accepts(manager, StructuredOutputsParams(json={"type": ["array", "null"], "minItems": 2}), "[1,2]")


# ---- the guidance backend ------------------------------------------------------------------------------------

@pytest.mark.parametrize("schema,text", [
    ({"type": "array", "maxItems": 3}, "[1,2]"),
    ({"type": ["array", "null"], "maxItems": 3}, '["a"]'),
    ({"type": ["object", "null"], "maxProperties": 3}, '{"x":1}'),
], ids=["array", "array-type-list", "object-type-list"])
def test_the_guidance_backend_keeps_llguidances_open_reading(manager, schema, text):
    default = StructuredOutputsConfig().applied(StructuredOutputsParams(json=schema), None)
    assert not accepts(manager, default, text)
    opened = guidance(schema)
    assert accepts(manager, opened, text) and json.loads(opened.key[1]) == schema
    closed = StructuredOutputsConfig(backend="guidance", disable_additional_properties=True).applied(
        StructuredOutputsParams(json=schema), None)
    assert not accepts(manager, closed, text)


def test_an_array_that_asks_for_an_item_by_contains_is_left_as_written():
    # llguidance refuses contains (so does the constraint, by name); closed it could not be met at all.
    schema = json.dumps({"type": "array", "maxItems": 3, "contains": {"type": "integer"}})
    assert _with_closed_objects(schema) == schema
