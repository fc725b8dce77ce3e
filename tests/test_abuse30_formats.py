"""A string format that llguidance does not know is an annotation, as JSON Schema reads it: the
schema is taken and the value is any string (pydantic's SecretStr writes "password", bytes
"binary"); the formats llguidance enforces stay enforced."""
from __future__ import annotations

import json

import llguidance
import pytest
from test_abuse19_schemas import Walker
from jsonschema import validate

from minillm.structured_output import (_LLGUIDANCE_FORMATS, StructuredOutputManager, StructuredOutputsParams,
                                       serialize_grammar)


@pytest.fixture(scope="module")
def walker(tok):
    manager = StructuredOutputManager.from_tokenizer(tok, tok.vocab_size, max_num_seqs=4)
    yield Walker(tok, manager)
    manager.shutdown()


def test_every_format_kept_is_one_llguidance_enforces():
    for name in _LLGUIDANCE_FORMATS:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "string", "format": name}))
        assert llguidance.LLMatcher.validate_grammar(grammar) == "", name


@pytest.mark.parametrize("name", ["password", "binary", "int32", "credit-card", "uri-reference", "regex"])
def test_an_unknown_string_format_is_taken_as_any_string(walker, name):
    # It was refused whole: "json: invalid JSON schema: Unknown format: password".
    schema = {"type": "object", "properties": {"secret": {"type": "string", "format": name}}, "required": ["secret"],
              "additionalProperties": False}
    params = StructuredOutputsParams(json=schema)
    assert json.loads(params.key[1]) == schema               # the key keeps what the client sent
    outs = walker.walks(params, n=6)
    assert any(end == "stop" for _, end in outs)
    for text, end in outs:
        if end == "stop":
            validate(json.loads(text), schema)


def test_a_known_format_is_still_enforced_beside_an_unknown_one(walker):
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                               "raw": {"type": "string", "format": "binary"}},
              "required": ["when", "raw"], "additionalProperties": False}
    grammar = json.loads(serialize_grammar(StructuredOutputsParams(json=schema).key))
    text = json.dumps(grammar)
    assert "binary" not in text and "date" in text
    for out, end in walker.walks(StructuredOutputsParams(json=schema), n=6):
        if end == "stop":
            value = json.loads(out)["when"]
            assert len(value) == 10 and value[4] == "-" and value[7] == "-", value


def test_a_format_inside_a_const_is_data_and_kept(walker):
    schema = {"const": {"format": "password"}}
    params = StructuredOutputsParams(json=schema)
    outs = walker.walks(params, n=2)
    assert [json.loads(t) for t, end in outs if end == "stop"] == [{"format": "password"}] * 2
