"""tool_choice "required" and a named tool, served as vLLM serves them without a tool-call parser:
structured outputs hold the output to JSON that is the call, and the reply carries it as
message.tool_calls (streamed: delta.tool_calls) instead of content.

    {"type": "function", "function": {"name": N}}   the output is N's arguments, under the schema of
                                                     its parameters (without one, no properties: {})
    "required"                                       the output is a JSON array of {"name", "parameters"}
                                                     objects, one a call of one of the tools (at least
                                                     one; one at most with parallel_tool_calls false)

Objects in the tools' parameters take only the keys they list unless they say otherwise, as under
vLLM's default structured-outputs backend (xgrammar in its strict mode), whatever a tool's "strict"
says. A named call ends with the output's finish reason; a required one with "tool_calls" once the
output is complete (its finish reason otherwise). Under --reasoning-parser the model reasons first, as
vLLM lets it: the grammar holds what follows </think>, and the reply carries the reasoning too.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from minillm.server.errors import APIError


class NumberText(str):
    """A JSON number (or NaN, Infinity) as its text."""


# Numbers as their text: a structure is read whatever its numbers (1e400, 5000 digits).
_DECODER = json.JSONDecoder(parse_int=NumberText, parse_float=NumberText, parse_constant=NumberText)
_WHITESPACE = " \t\n\r"


TOOL_CALL_ID_PREFIX = "chatcmpl-tool-"
TOOL_SCHEMA_ID = "urn:minillm:tool-parameters:"    # + the tool's index: its parameters' $id under "required"


def new_tool_call_id() -> str:
    """A tool call's id, as vLLM makes one."""
    return f"{TOOL_CALL_ID_PREFIX}{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """One entry of a message's tool_calls."""
    return {"id": call_id or new_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class ForcedToolCalls:
    """What a tool_choice that forces a call asks of the output: the JSON schema that holds it, the
    named tool (None: "required", any of the tools), and the field an error about the schema names."""

    schema: dict
    name: str | None = None
    param: str = "tools"
    tool_schemas: tuple[dict, ...] = ()     # "required": each tool's parameters, to name the one at fault

    def constraint(self, reasoning: tuple[int, int] | None = None, disable_additional_properties: bool | None = None):
        """The output's StructuredOutputsParams (held after a thinking block of those (start, end) ids, where
        given; objects closed unless disable_additional_properties is False, as for any JSON schema); a schema
        that does not compile is a 400 naming param (or the tool whose parameters make the array's schema fail)."""
        from minillm.server.structured import checked_params
        self._check_each_tool_ends()
        closing = {"disable_additional_properties": disable_additional_properties}
        try:
            return checked_params(lambda field: self.param, json=self.schema, reasoning=reasoning, **closing)
        except APIError:
            for i, schema in enumerate(self.tool_schemas):
                checked_params(lambda field: f"tools.{i}.function.parameters", json=schema, **closing)
            raise

    def _check_each_tool_ends(self) -> None:
        """A 400 naming the tool whose parameters have no finite instance: under "required" another tool's
        branch keeps the array's schema finite, and llguidance's parser then grows past its limits."""
        from minillm.structured_output import StructuredOutputsError, check_finite_instance
        for i, schema in enumerate(self.tool_schemas):
            try:
                check_finite_instance(schema)
            except StructuredOutputsError as exc:
                param = f"tools.{i}.function.parameters"
                raise APIError(400, f"{param}: {str(exc).split(': ', 1)[-1]}", param=param) from None

    def calls(self, text: str) -> list[dict]:
        """The tool_calls of a finished output's text (a required array cut short: its whole items)."""
        if self.name is not None:
            return [tool_call(self.name, text)]
        return [tool_call(*item) for item in ArrayItems().new_items(text)]

    def finish_reason(self, finish_reason: str | None, stop_reason: int | str | None = None) -> str | None:
        """The choice's finish reason: "tool_calls" for a whole required array, else the output's (a
        stop string cuts the array short: "stop", as for any output it ends)."""
        is_whole = finish_reason == "stop" and not isinstance(stop_reason, str)
        return "tool_calls" if self.name is None and is_whole else finish_reason

    def stream(self) -> "ToolCallStream":
        """The state of one streamed choice."""
        return ToolCallStream(self)


def forced_tool_calls(choice: Any, tools: list[dict], parallel_tool_calls: bool | None) -> ForcedToolCalls | None:
    """The ForcedToolCalls of a checked tool_choice ("required" or a named tool) over the request's
    tools (each a dict as the chat template reads it); None for a choice that forces no call."""
    functions = [tool["function"] for tool in tools]
    if isinstance(choice, dict):
        check_named_tool_choice(choice, [f["name"] for f in functions])   # also where a route skipped the request's check
        name = choice["function"]["name"]
        index = next(i for i, f in enumerate(functions) if f["name"] == name)
        return ForcedToolCalls(_parameters_schema(functions[index]), name, f"tools.{index}.function.parameters")
    if choice != "required" or not functions:
        return None
    # Each tool's parameters are a schema resource of their own ($id), so that their references
    # ("#/$defs/...", "#/definitions/...", "#/properties/...", "#") point inside them, as under a
    # named tool_choice, and two tools may define one name differently. Their llguidance options
    # ("x-guidance"), which only a schema's top level sets, move to the array's top.
    options: dict = {}
    parameters = [dict(_parameters_schema(f)) for f in functions]
    for i, params in enumerate(parameters):
        params.setdefault("$id", f"{TOOL_SCHEMA_ID}{i}")
        for name, value in (params.pop("x-guidance") if isinstance(params.get("x-guidance"), dict) else {}).items():
            if options.setdefault(name, value) != value:
                raise APIError(400, f"tools set x-guidance {name!r} twice, differently (tool_choice \"required\" "
                               f"puts every tool's x-guidance in one schema)", param=f"tools.{i}.function.parameters")
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": params},
              "required": ["name", "parameters"], "additionalProperties": False}
             for f, params in zip(functions, parameters)]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if options:
        schema["x-guidance"] = options
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    # An error names the tool whose parameters fail (tools.i.function.parameters).
    tool_schemas = tuple(_parameters_schema(f) for f in functions)
    return ForcedToolCalls(schema, tool_schemas=tool_schemas)


def _parameters_schema(function: dict) -> dict:
    """A tool's parameters schema; without one, an object of no properties (as vLLM writes it under
    "required"): with objects closed, the call's arguments are {}."""
    parameters = function.get("parameters")
    return parameters if parameters else {"type": "object", "properties": {}}


def check_named_tool_choice(choice: dict, tool_names: list[str]) -> None:
    """400 naming tool_choice unless it is {"type": "function", "function": {"name": one of the tools}}."""
    usage = 'use {"type": "function", "function": {"name": "my_function"}}'
    function = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(function, dict):
        raise APIError(400, f"tool_choice names a tool as an object with a function: {usage}", param="tool_choice")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"tool_choice.function.name must be a tool's name: {usage}", param="tool_choice")
    if name not in tool_names:
        raise APIError(400, "The tool specified in `tool_choice` does not match any of the specified `tools`",
                       param="tool_choice")


class JsonEnd:
    """Where a JSON object, array or string that arrives in pieces ends: each character is read once
    (the text inside a string is skipped by a regular expression), so a value of n characters costs
    O(n) however many pieces it comes in. It reads the structure only; whether the text is JSON is
    the decoder's to say, once, over the whole value (where it is JSON, it ends where this says)."""

    def __init__(self) -> None:
        self.is_container: bool | None = None   # None before the value's first character
        self.depth = 0
        self.in_string = False
        self.escape = False                      # a backslash in a string ended the last piece

    def feed(self, text: str, pos: int) -> int | None:
        """Where the value ends in text (just past it), reading text[pos:] as its next piece; None
        while it goes on, or where it is no object, array or string (is_container False)."""
        if self.is_container is None:
            pos = _skip(text, pos)
            if pos >= len(text):
                return None
            self.is_container = text[pos] in '{["'
        if not self.is_container:
            return None
        if self.escape and pos < len(text):
            pos, self.escape = pos + 1, False
        while (match := _STRUCTURE.search(text, pos)) is not None:
            char, pos = match.group(), match.end()
            if self.in_string:
                if char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return pos
                elif char == "\\":
                    if pos == len(text):
                        self.escape = True
                        return None
                    pos += 1
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return pos
        return None


_STRUCTURE = re.compile(r'["\\{}\[\]]')


def arguments_text(raw: str) -> str:
    """A call's arguments (JSON text as the model wrote it) as vLLM writes them, json.dumps of the value
    read; the text as written where Python reads no value it can write back the same (a number past
    a float's range, an integer past Python's digit limit, a lone surrogate such as "\\ud800", which
    no UTF-8 text holds): JSON as the model wrote it."""
    try:
        text = json.dumps(json.loads(raw), ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return raw
    return text if is_utf8(text) else raw


def is_utf8(text: str) -> bool:
    """False where text holds a lone surrogate (a "\\ud800" escape decoded), which UTF-8 cannot encode."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def object_members(text: str) -> dict[str, tuple[Any, str]]:
    """The members of the JSON object text: key -> (value read with every number as its text, the
    value's text). ValueError where text is no JSON object."""
    i = _skip(text, 0)
    if not text.startswith("{", i):
        raise ValueError("no object")
    members: dict[str, tuple[Any, str]] = {}
    i = _skip(text, i + 1)
    if text.startswith("}", i):
        return members
    while True:
        key, i = _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        if not isinstance(key, str) or not text.startswith(":", i):
            raise ValueError("no member")
        start = _skip(text, i + 1)
        value, i = _DECODER.raw_decode(text, start)
        members[key] = (value, text[start:i])
        i = _skip(text, i)
        if text.startswith("}", i):
            return members
        if not text.startswith(",", i):
            raise ValueError("no member")
        i = _skip(text, i + 1)


class ArrayItems:
    """The whole items of a JSON array as its text grows ("[{...}, {...}, {..."): each item once,
    each character read once (JsonEnd) however many times the text grows."""

    def __init__(self) -> None:
        self.pos: int | None = None      # where reading goes on; None before the "["
        self.after_item = False          # a "," (or the "]") comes next
        self.item_start: int | None = None
        self.item_end = JsonEnd()

    def new_items(self, text: str) -> list[tuple[str, str]]:
        """(name, arguments as JSON) of each item that is whole in text and was not returned before."""
        items: list[tuple[str, str]] = []
        if self.pos is None:
            start = _skip(text, 0)
            if start >= len(text) or text[start] != "[":
                return items
            self.pos = start + 1
        while True:
            if self.item_start is None:
                i = _skip(text, self.pos)
                if self.after_item:
                    if i >= len(text) or text[i] != ",":
                        self.pos = i
                        return items
                    self.after_item, i = False, _skip(text, i + 1)
                self.pos = i
                if i >= len(text) or text[i] == "]":
                    return items
                self.item_start, self.item_end = i, JsonEnd()
            end = self._item_end(text)
            if end is None:
                return items
            item = _item(text[self.item_start:end])
            if item is not None:
                items.append(item)
            self.pos, self.after_item, self.item_start = end, True, None

    def _item_end(self, text: str) -> int | None:
        """Where the item being read ends in text; None while it goes on."""
        end = self.item_end.feed(text, self.pos)
        self.pos = len(text)
        if self.item_end.is_container is False:      # a number or a literal: short, read whole each time
            try:
                return _DECODER.raw_decode(text, self.item_start)[1]
            except (ValueError, RecursionError):
                return None
        return end


def _item(text: str) -> tuple[str, str] | None:
    """(name, arguments) of one item {"name": ..., "parameters": ...}; None where it is none."""
    try:
        members = object_members(text)
    except (ValueError, RecursionError):
        return None
    name = members.get("name", (None, ""))[0]
    if not isinstance(name, str) or isinstance(name, NumberText):
        return None
    arguments = arguments_text(members["parameters"][1]) if "parameters" in members else "{}"
    return name, arguments


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


@dataclass
class ToolCallStream:
    """One streamed choice's tool calls: the deltas each new piece of output text makes."""

    forced: ForcedToolCalls
    num_sent: int = 0                  # tool calls opened so far
    items: ArrayItems = field(default_factory=ArrayItems)
    text: str = ""                     # the calls' text so far, where feed() is given it

    def feed(self, delta_text: str) -> list[dict]:
        """delta.tool_calls for more of the calls' text (the output's after its reasoning)."""
        self.text += delta_text
        return self.deltas(delta_text, self.text)

    def deltas(self, delta_text: str, text: str) -> list[dict]:
        """delta.tool_calls for the output's new text (text: all of it so far)."""
        if self.forced.name is not None:
            if not delta_text and self.num_sent:
                return []
            if self.num_sent:          # the call is open: its arguments go on
                return [{"index": 0, "function": {"arguments": delta_text}}]
            self.num_sent = 1
            return [{"index": 0, **tool_call(self.forced.name, delta_text)}]
        deltas = []
        for name, arguments in self.items.new_items(text):
            deltas.append({"index": self.num_sent, **tool_call(name, arguments)})
            self.num_sent += 1
        return deltas
