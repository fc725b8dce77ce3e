"""Structured outputs as vLLM's users meet them (stories260K, CPU): an object schema that does not say
what other keys it takes takes none, as under vLLM's default backend (xgrammar in its strict mode), in
forced tool calls, response_format and structured_outputs alike; schemas as pydantic and the openai SDK
write them, sampled at temperature 1 over several seeds, each output valid."""
from __future__ import annotations

import datetime
import json
import uuid
from typing import Literal, Optional

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

from minillm.server.app import ServerOptions
from minillm.server.protocol import CompletionRequest
from minillm.server.structured import structured_outputs_params
from minillm.server.tool_calls import forced_tool_calls
from minillm.structured_output import (MAX_CONSTRAINT_CHARS, StructuredOutputManager, StructuredOutputsError,
                                       StructuredOutputsParams)
from test_abuse30_structured import across_the_wire
from test_server_helpers import chat_model_dir, running_server

MODEL = "stories"
MESSAGES = [{"role": "user", "content": "hi"}]
# Every key optional: open, the model writes any key it likes; closed, only these.
UNITS = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 7}}}
NESTED = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"type": "object", "properties": {"c": {"type": "integer"}}}}}
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    street: str = Field(max_length=12)
    zip: str = Field(pattern=r"^\d{5}$")


class Person(BaseModel):
    """pydantic v2's schema of it: $defs/$ref, anyOf with null, default, title, mixed enum, formats."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=10, title="The Name")
    age: Optional[int] = Field(default=None, ge=0, le=120)
    kind: Literal["a", 1, True, None] = "a"
    when: datetime.datetime
    day: Optional[datetime.date] = None
    id: uuid.UUID
    address: Optional[Address] = None
    pair: tuple[int, str]
    fixed: Literal["fixed"] = "fixed"


# ---- the Python API --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manager(tok):
    mgr = StructuredOutputManager.from_tokenizer(tok, 512, max_num_seqs=4)
    yield mgr
    mgr.shutdown()


def accepts(manager, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the constraint takes text as a whole output."""
    matcher = manager.grammar_init(params).result().new_matcher()
    return matcher.accept_tokens(manager.ll_tokenizer.tokenize_str(text)) and matcher.can_terminate()


def test_an_object_schema_takes_only_its_listed_keys_by_default(manager):
    # llguidance reads JSON Schema's way (other keys allowed); vLLM's default backend closes such
    # objects, and its users got {"a":1,"z":2} here for a schema that lists a and b.
    closed = StructuredOutputsParams(json=NESTED)
    assert accepts(manager, closed, '{"a":1,"b":{"c":2}}')
    assert not accepts(manager, closed, '{"a":1,"z":2}')
    assert not accepts(manager, closed, '{"b":{"c":2,"z":3}}')
    refs = Person.model_json_schema()
    refs["$defs"]["Address"].pop("additionalProperties")         # a $ref'd object that does not say
    person = StructuredOutputsParams(json=refs)
    address = '{"street":"x","zip":"12345"'
    head = '{"name":"x","when":"2024-01-02T03:04:05Z","id":"12345678-1234-1234-1234-123456789abc",'
    assert accepts(manager, person, head + f'"address":{address}}},"pair":[1,"x"]}}')
    assert not accepts(manager, person, head + f'"address":{address},"z":1}},"pair":[1,"x"]}}')


def test_a_schemas_own_word_on_other_keys_is_kept(manager):
    for said in (True, {}, {"type": "integer"}):
        schema = {**NESTED, "additionalProperties": said}
        assert accepts(manager, StructuredOutputsParams(json=schema), '{"a":1,"z":2}'), said
    assert not accepts(manager, StructuredOutputsParams(json={**NESTED, "additionalProperties": {"type": "integer"}}),
                       '{"z":"x"}')
    # disable_additional_properties false reads it as JSON Schema does (vLLM's guidance backend's default).
    assert accepts(manager, StructuredOutputsParams(json=NESTED, disable_additional_properties=False),
                   '{"a":1,"b":{"c":2,"z":3}}')


def test_a_tuple_takes_no_item_past_its_prefix_items_by_default(manager):
    for schema in ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
                   {"type": "array", "items": [{"type": "integer"}, {"type": "string"}]}):     # draft 7's
        params = StructuredOutputsParams(json=schema)
        assert accepts(manager, params, '[1,"x"]') and accepts(manager, params, "[1]")
        assert not accepts(manager, params, '[1,"x",3]')
    rest = {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}
    assert accepts(manager, StructuredOutputsParams(json=rest), '[1,"x","y"]')


@pytest.mark.parametrize("schema,taken,refused", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False}, '{"a":1}',
     '{"a":1,"b":2}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": {"type": "boolean"}},
     '{"a":1,"b":true}', '{"a":1,"b":2}'),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, "[1]", "[1,2]"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": {"type": "string"}}, '[1,"x"]',
     "[1,2]"),
], ids=["properties false", "properties schema", "items false", "items schema"])
def test_unevaluated_keywords_with_nothing_evaluated_in_place_are_read(manager, schema, taken, refused):
    # vLLM's default backend reads them; llguidance refused the schema ("Unimplemented keys"). With no
    # allOf, anyOf, $ref... beside them they mean what additionalProperties and items mean.
    params = StructuredOutputsParams(json=schema)
    assert accepts(manager, params, taken) and not accepts(manager, params, refused)


def test_unevaluated_properties_beside_an_allof_is_still_refused_by_name():
    with pytest.raises(StructuredOutputsError, match=r'^json: .*unevaluatedProperties'):
        StructuredOutputsParams(json={"allOf": [{"properties": {"a": {}}}], "unevaluatedProperties": False})


@pytest.mark.parametrize("schema,text", [
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"$ref": "#/$defs/B"}],
      "$defs": {"B": {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}}},
     '{"a":1,"b":2}'),
    ({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
      "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}]}, '{"kind":"k","x":1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, '{"a":1,"b":2}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 2},
     '{"a":1,"b":2}'),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "[1,2]"),
], ids=["allOf", "beside anyOf", "required unlisted", "minProperties", "minItems"])
def test_a_schema_that_closed_could_not_be_met_is_left_open(manager, schema, text):
    # Closed each, two schemas whose keys combine refuse each other's keys (required ones: no output
    # at all), and an object that asks for a key or a count of keys it does not list could not be met.
    assert accepts(manager, StructuredOutputsParams(json=schema), text)


def test_the_size_bound_counts_the_clients_schema_not_the_closed_one():
    # Closing adds `,"additionalProperties":false` to each object: a schema within the bound became
    # one past it (a 400 giving the schema a length it never had), in the API server and in the core.
    properties = {f"p{i}": {"properties": {}} for i in range(300)}
    schema = {"type": "object", "description": "", "properties": properties}
    schema["description"] = "x" * (MAX_CONSTRAINT_CHARS - 200 - len(json.dumps(schema, separators=(",", ":"))))
    params = StructuredOutputsParams(json=schema)
    assert len(params.key[1]) > MAX_CONSTRAINT_CHARS
    assert across_the_wire(params).key == params.key


def tool(name: str, parameters: dict | None) -> dict:
    function = {"name": name, "strict": True} | ({"parameters": parameters} if parameters is not None else {})
    return {"type": "function", "function": function}


def test_forced_tool_calls_close_each_tools_parameters(manager):
    named = forced_tool_calls({"type": "function", "function": {"name": "w"}}, [tool("w", UNITS)], None).constraint()
    assert accepts(manager, named, '{"unit":"c"}') and not accepts(manager, named, '{"unit":"c","z":1}')
    required = forced_tool_calls("required", [tool("w", UNITS), tool("none", None)], None).constraint()
    assert accepts(manager, required, '[{"name":"w","parameters":{"days":2}},{"name":"none","parameters":{}}]')
    assert not accepts(manager, required, '[{"name":"w","parameters":{"days":2,"z":1}}]')
    assert not accepts(manager, required, '[{"name":"none","parameters":{"z":1}}]')    # no parameters: {}
    opened = forced_tool_calls("required", [tool("w", UNITS)], None).constraint(disable_additional_properties=False)
    assert accepts(manager, opened, '[{"name":"w","parameters":{"days":2,"z":1}}]')


def test_a_server_on_vllms_guidance_backend_reads_schemas_as_it_does():
    # vLLM's guidance backend leaves objects open unless its disable_additional_properties is true, and a
    # request's own disable_additional_properties counts there only; the config's true was refused.
    assert ServerOptions().disable_additional_properties is None
    assert ServerOptions(structured_outputs_config={"backend": "auto"}).disable_additional_properties is None
    guidance = ServerOptions(structured_outputs_config={"backend": "guidance"})
    assert guidance.disable_additional_properties is False
    closing = ServerOptions(structured_outputs_config={"backend": "guidance", "disable_additional_properties": True})
    assert closing.disable_additional_properties is True

    def key(options: dict, default):
        req = CompletionRequest(model=MODEL, prompt="x", structured_outputs={"json": UNITS, **options})
        return structured_outputs_params(req, None, default).key

    closed, opened = StructuredOutputsParams(json=UNITS).key, StructuredOutputsParams(json=UNITS,
                                                                                      disable_additional_properties=False).key
    assert closed != opened
    assert key({}, None) == key({"disable_additional_properties": False}, None) == closed
    assert key({}, False) == opened and key({"disable_additional_properties": True}, False) == closed


# ---- through the server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=512) as running:
        yield running[0]


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def chat(client, **body) -> list[dict]:
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "temperature": 1.0,
                                                         "seed": 1, "n": 4, "max_tokens": 80, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def test_a_named_strict_tools_arguments_hold_only_its_parameters(client):
    choices = chat(client, tools=[tool("weather", UNITS)],
                   tool_choice={"type": "function", "function": {"name": "weather"}})
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice
        [call] = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, {**UNITS, "additionalProperties": False})


def test_required_tool_calls_hold_only_each_tools_parameters(client):
    choices = chat(client, tools=[tool("weather", UNITS), tool("now", None)], tool_choice="required",
                   parallel_tool_calls=False)
    for choice in choices:
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "now":
            assert arguments == {}
        else:
            jsonschema.validate(arguments, {**UNITS, "additionalProperties": False})


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "structured_outputs false"])
def test_response_format_and_structured_outputs_hold_only_the_listed_keys(client, field):
    # A request's disable_additional_properties false counts under vLLM's guidance backend only: here,
    # as under vLLM's default backend, the objects are closed whatever it says.
    if field == "response_format":
        body = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": UNITS}}}
    else:
        body = {"structured_outputs": {"json": UNITS} | ({"disable_additional_properties": False}
                                                         if field.endswith("false") else {})}
    for choice in chat(client, **body):
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), {**UNITS, "additionalProperties": False})


def test_pydantics_own_schema_gives_outputs_the_model_validates(client):
    # pydantic v2's own schema ($defs and $ref, anyOf with null, defaults, titles, a mixed enum, const,
    # prefixItems, formats, pattern, lengths) sampled freely: each finished output is a Person.
    schema = Person.model_json_schema()
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    choices = chat(client, response_format=response_format, max_tokens=200)
    finished = [choice for choice in choices if choice["finish_reason"] == "stop"]
    assert finished, choices
    for choice in finished:
        jsonschema.validate(json.loads(choice["message"]["content"]), schema, format_checker=FORMATS)
        Person.model_validate_json(choice["message"]["content"])


def test_completions_and_responses_take_a_schema_as_chat_does(client):
    for seed in range(3):
        response = client.post("/v1/completions", json={
            "model": MODEL, "prompt": "Once", "max_tokens": 80, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": UNITS}}})
        assert response.status_code == 200, response.text
        jsonschema.validate(json.loads(response.json()["choices"][0]["text"]), {**UNITS, "additionalProperties": False})
        response = client.post("/v1/responses", json={
            "model": MODEL, "input": "hi", "max_output_tokens": 80, "temperature": 1.0, "seed": seed,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": UNITS, "strict": True}}})
        assert response.status_code == 200, response.text
        [message] = response.json()["output"]
        jsonschema.validate(json.loads(message["content"][0]["text"]), {**UNITS, "additionalProperties": False})
