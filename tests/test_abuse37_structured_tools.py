"""Structured outputs and forced tool calls abused as real clients send them (stories260K's tokenizer,
CPU): schemas whose $refs live inside an embedded resource ($id), as tool_choice "required" builds one."""
from __future__ import annotations

import pytest

from minillm.server.errors import APIError
from minillm.server.tool_calls import forced_tool_calls
from minillm.structured_output import StructuredOutputsError, StructuredOutputsParams

SELF = {"$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}},
        "$ref": "#/$defs/A"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_a_cycle_inside_an_embedded_resource_has_no_finite_instance():
    # "#/$defs/A" under an $id names that resource's A; the check read it from the root, found nothing
    # there, and passed a schema whose every request then ended "too large to match: Too many items".
    with pytest.raises(StructuredOutputsError, match=r'no finite instance: every instance of "#/\$defs/A"'):
        StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"$id": "urn:t", **SELF}})


def test_a_ref_inside_a_resource_that_ends_is_taken():
    optional = {"$id": "urn:t", "$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}},
                "$ref": "#/$defs/A"}
    StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": optional})


def test_required_tool_choice_names_the_tool_whose_parameters_never_end():
    # The other tool kept the array's schema finite, so it passed the check; the request was then taken
    # in and answered 200 with finish_reason "error" (llguidance: "Too many items (limit 50000; ff_tokens)").
    forced = forced_tool_calls("required", [tool("weather", CITY), tool("loop", SELF)], None)
    with pytest.raises(APIError, match="no finite instance") as info:
        forced.constraint()
    assert info.value.param == "tools.1.function.parameters"
