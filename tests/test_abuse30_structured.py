"""Structured outputs abused as vLLM users do, through the Python API (stories260K, CPU): a constraint
as it crosses from an API server to the engine core."""
from __future__ import annotations

import json

import msgspec

from minillm.engine_core.core import sampling_fields
from minillm.engine_core.messages import encoder
from minillm.server.async_llm import _wire_constraint
from minillm.structured_output import MAX_CONSTRAINT_CHARS, StructuredOutputsParams


def across_the_wire(params: StructuredOutputsParams) -> StructuredOutputsParams:
    """params as the engine core rebuilds it from an API server's AddRequest."""
    wire = msgspec.msgpack.decode(encoder().encode(_wire_constraint(params)))
    return sampling_fields({"structured_outputs": wire})["structured_outputs"]


DATED = {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                          "day": {"type": "string", "format": "date"}}, "required": ["when"]}


def test_a_constraint_rebuilt_by_the_engine_core_is_the_same_constraint():
    # The core rebuilt a schema from its key's text, which held the strict date patterns already:
    # each got a second copy in allOf (compiled twice over).
    params = StructuredOutputsParams(json=DATED)
    assert across_the_wire(params).key == params.key


def test_a_schema_under_the_size_bound_is_taken_by_the_engine_core_too():
    # 150 date-time properties in 114,000 characters: within the bound where the request entered;
    # the core counted the strict date patterns added to it (173,000 characters) and refused it,
    # a 400 with no param that gave the client's schema a length it never had.
    properties = {f"p{i}": {"type": "string", "format": "date-time", "description": "x" * 700} for i in range(150)}
    schema = {"type": "object", "properties": properties, "required": ["p0"], "additionalProperties": False}
    assert len(json.dumps(schema, separators=(",", ":"))) < MAX_CONSTRAINT_CHARS
    params = StructuredOutputsParams(json=schema)
    assert across_the_wire(params).key == params.key
