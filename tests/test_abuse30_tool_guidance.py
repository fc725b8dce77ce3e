"""tool_choice "required" puts every tool's parameters inside one array schema; a tool's llguidance
options ("x-guidance", read only at a schema's top level) move to the array's top,
so a tool whose oneOf needs coerce_one_of is taken there as it is under a named tool_choice."""
from __future__ import annotations

import pytest

from minillm.server.errors import APIError
from minillm.server.tool_calls import forced_tool_calls

ONE_OF = {"x-guidance": {"coerce_one_of": True}, "type": "object",
          "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "required": ["n"]}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_a_tools_x_guidance_reaches_the_required_arrays_top():
    # It stayed inside items.anyOf[0].properties.parameters, where llguidance does not read it:
    # a 400 asking to enable coerce_one_of, which the tool had done.
    tools = [tool("f", ONE_OF), tool("g", {"type": "object", "properties": {"s": {"type": "string"}}})]
    forced = forced_tool_calls("required", tools, None)
    assert forced.schema["x-guidance"] == {"coerce_one_of": True}
    assert all("x-guidance" not in item["properties"]["parameters"] for item in forced.schema["items"]["anyOf"])
    forced.constraint()                                   # compiles
    named = forced_tool_calls({"type": "function", "function": {"name": "f"}}, tools, None)
    named.constraint()                                    # as a named choice it always did


def test_tools_setting_one_option_differently_are_refused_naming_the_second():
    other = dict(ONE_OF, **{"x-guidance": {"coerce_one_of": False}})
    with pytest.raises(APIError) as info:
        forced_tool_calls("required", [tool("f", ONE_OF), tool("g", other)], None)
    assert info.value.param == "tools.1.function.parameters"
    assert "x-guidance 'coerce_one_of' twice, differently" in str(info.value)


def test_the_same_option_in_two_tools_is_one_option():
    forced = forced_tool_calls("required", [tool("f", ONE_OF), tool("g", ONE_OF)], None)
    assert forced.schema["x-guidance"] == {"coerce_one_of": True}
    forced.constraint()
