"""JSON schemas at the edges of what llguidance reads (stories260K's tokenizer, CPU): recursion with no
finite instance, `pattern` read as ECMA-262 (not Rust's regex), and number bounds below what llguidance
writes out."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import jsonschema
import pytest
import test_abuse30_structured

from minillm import SamplingParams
from minillm.structured_output import StructuredOutputsError, StructuredOutputsParams

accepts = test_abuse30_structured.accepts
manager = test_abuse30_structured.manager                  # a fixture


def defs(a: dict, **more: dict) -> dict:
    """A schema whose root is $defs A (a), with more $defs beside it."""
    return {"$defs": {"A": a, **more}, "$ref": "#/$defs/A"}


def ref(name: str) -> dict:
    return {"$ref": f"#/$defs/{name}"}


def requires(**properties: dict) -> dict:
    """An object with these properties, all required."""
    return {"type": "object", "properties": properties, "required": list(properties)}


NO_FINITE_INSTANCE = {
    "self": (defs(requires(a=ref("A"))), '"#/$defs/A"'),
    "A-B-A": (defs(requires(b=ref("B")), B=requires(a=ref("A"))), '"#/$defs/A", "#/$defs/B"'),
    "root": ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, '"#"'),
    "non-empty array": (defs({"type": "array", "items": ref("A"), "minItems": 1}), '"#/$defs/A"'),
    "prefixItems": (defs({"type": "array", "prefixItems": [ref("A")], "items": False, "minItems": 1}), '"#/$defs/A"'),
    "anyOf all recursive": (defs({"anyOf": [requires(a=ref("A")), {"type": "array", "items": ref("A"),
                                                                   "minItems": 2}]}), '"#/$defs/A"'),
    "additionalProperties": (defs({"type": "object", "required": ["a"], "additionalProperties": ref("A")}),
                             '"#/$defs/A"'),
    "patternProperties": (defs({"type": "object", "required": ["a"], "patternProperties": {"^a$": ref("A")}}),
                          '"#/$defs/A"'),
    "minProperties": (defs({"type": "object", "additionalProperties": ref("A"), "minProperties": 1}), '"#/$defs/A"'),
    "object or array": (defs({"type": ["object", "array"], "properties": {"a": ref("A")}, "required": ["a"],
                              "items": ref("A"), "minItems": 1}), '"#/$defs/A"'),
    "pointer": ({"type": "object", "properties": {"x": requires(y={"$ref": "#/properties/x"})}, "required": ["x"]},
                '"#/properties/x"'),
}


@pytest.mark.parametrize("schema,named", NO_FINITE_INSTANCE.values(), ids=NO_FINITE_INSTANCE)
def test_a_schema_with_no_finite_instance_is_a_value_error_naming_the_recursion(schema, named):
    # It passed the check, and every request then ended with finish_reason "error": "JSON schema too
    # large to match: parser error: Too many items" (or ran to its length, "[[[[{"a":[[[...").
    with pytest.raises(StructuredOutputsError, match=r"^json: the schema has no finite instance: every instance "
                                                     rf"of {re.escape(named)} holds another one") as err:
        StructuredOutputsParams(json=schema)
    assert err.value.field == "json"


FINITE = {
    "optional": (defs({"type": "object", "properties": {"a": ref("A")}}), "{}"),
    "array of any length": (defs({"type": "array", "items": ref("A")}), "[[],[[]]]"),
    "anyOf with a leaf": (defs({"anyOf": [{"type": "integer"}, requires(a=ref("A"))]}), '{"a":{"a":7}}'),
    "oneOf with null": (defs({"oneOf": [{"type": "null"}, requires(a=ref("A"))]}), '{"a":null}'),
    "or null": (defs({"type": ["object", "null"], "properties": {"a": ref("A")}, "required": ["a"]}),
                '{"a":{"a":null}}'),
    "no type": (defs({"properties": {"a": ref("A")}, "required": ["a"]}), "true"),
    "A-B optional": (defs(requires(b=ref("B")), B={"type": "object", "properties": {"a": ref("A")}}), '{"b":{}}'),
    "tree": (defs({"type": "object", "properties": {"value": {"type": "integer"},
                                                    "children": {"type": "array", "items": ref("A")}},
                   "required": ["value", "children"]}), '{"value":1,"children":[{"value":2,"children":[]}]}'),
    "prefixItems": (defs({"type": "array", "prefixItems": [ref("A")]}), "[[]]"),
}


@pytest.mark.parametrize("schema,instance", FINITE.values(), ids=FINITE)
def test_a_recursive_schema_with_a_finite_instance_is_taken_and_matches_it(manager, schema, instance):
    params = StructuredOutputsParams(json=schema)
    jsonschema.validate(json.loads(instance), schema)
    assert accepts(manager, params, instance)


def test_outputs_of_a_recursive_schema_finish_and_validate(llm):
    schema = FINITE["anyOf with a leaf"][0]
    constraint = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=96, structured_outputs=constraint)
              for seed in range(8)]
    outs = [out.outputs[0] for out in llm.generate(["Once upon a time"] * 8, params, use_tqdm=False)]
    assert {out.finish_reason for out in outs} <= {"stop", "length"}, [out.stop_reason for out in outs]
    finished = [out.text for out in outs if out.finish_reason == "stop"]
    assert finished
    for text in finished:
        jsonschema.validate(json.loads(text), schema)


# (pattern, text, whether ECMA-262 takes the whole text). JavaScript's RegExp agrees (with and without
# the `u` flag, except \p{L}: JSON Schema asks for `u`); test_the_table_is_ecma_262s checks it with node.
# Python's re differs on several of these: its \d, \w and \s are Unicode (\s takes U+0085, not U+FEFF),
# its `.` takes \r, U+2028 and U+2029, and it has no \cJ.
ECMA = [
    ("^.$", "\r", False), ("^.$", "\u2028", False), ("^.$", "\u2029", False), ("^.$", "é", True),
    ("^\\d$", "\u0661", False), ("^\\d$", "7", True), ("^\\D$", "\u0661", True),
    ("^\\w$", "é", False), ("^\\w$", "_", True), ("^\\W$", "é", True), ("^[\\w-]+$", "a-é", False),
    ("^\\s$", "\x85", False), ("^\\s$", "\ufeff", True), ("^\\s$", "\xa0", True), ("^\\S$", "\x85", True),
    ("^[\\s]$", "\ufeff", True), ("^[^\\s]$", "\x85", True), ("^[a\\S]$", "\x85", True), ("^[^\\d]$", "\u0661", True),
    ("^\\cJ$", "\n", True), ("^[\\b]$", "\b", True), ("^[^]$", "\n", True), ("^\\0$", "\0", True),
    ("^[a&&b]$", "&", True), ("^[a~~b]$", "~", True), ("^[[]$", "[", True),
    ("^\\p{L}$", "é", True), ("^\\p{L}+$", "p{L}", False),
]


@pytest.mark.parametrize("pattern,text,expected", ECMA, ids=[f"{p}~{t!r}" for p, t, _ in ECMA])
def test_a_pattern_takes_what_ecma_262_takes(manager, pattern, text, expected):
    # llguidance read patterns as Rust regex: `.` took "\r", \s took U+0085 and not U+FEFF, \cJ was an
    # error and [a&&b] an intersection that matched nothing.
    params = StructuredOutputsParams(json={"type": "string", "pattern": pattern})
    assert accepts(manager, params, json.dumps(text, ensure_ascii=False)) is expected


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_table_is_ecma_262s():
    script = ("const cases = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
              "console.log(JSON.stringify(cases.map(([p, t]) => new RegExp(p, 'u').test(t))));")
    out = subprocess.run(["node", "-e", script], input=json.dumps([[p, t] for p, t, _ in ECMA]),
                         capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == [expected for _, _, expected in ECMA]


@pytest.mark.parametrize("pattern,why", [
    ("^[[:alpha:]]+$", "POSIX class"), ("^[a--b]$", "class difference"), ("^a\\z", r"\z is not an ECMA-262 escape"),
    ("\\Aa", r"\A is not"), ("^\\x{41}$", r"\x takes two hex digits"), ("^\\pL$", r"\p takes a {name}"),
    ("(?s)^a.b$", "inline flags"), ("^\\Qa.b\\E$", r"\Q is not"),
])
def test_a_pattern_whose_ecma_262_meaning_cannot_be_kept_is_a_value_error_saying_why(pattern, why):
    for schema in ({"type": "string", "pattern": pattern}, {"type": "object", "patternProperties": {pattern: {}}},
                   {"type": "object", "propertyNames": {"pattern": pattern}}):
        with pytest.raises(StructuredOutputsError, match=rf"^json: the pattern {re.escape(json.dumps(pattern))} "
                                                         rf"is not supported: .*{re.escape(why)}"):
            StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("pattern,what", [("^(?=a)a$", "look-around"), ("^(a)\\1$", "backreferences")])
def test_look_arounds_and_backreferences_are_refused(pattern, what):
    with pytest.raises(StructuredOutputsError, match=rf"(?s)^json: invalid JSON schema: .*{what}.* not supported"):
        StructuredOutputsParams(json={"type": "string", "pattern": pattern})


def test_an_error_about_a_pattern_quotes_it_as_the_client_wrote_it():
    with pytest.raises(StructuredOutputsError) as err:
        StructuredOutputsParams(json={"type": "string", "pattern": "[^\\s\\S]"})
    assert "/[^\\s\\S]/" in str(err.value) and "x{FEFF}" not in str(err.value), err.value


def test_pattern_properties_are_read_as_ecma_262(manager):
    params = StructuredOutputsParams(json={"type": "object", "patternProperties": {"^\\d$": {"type": "integer"}},
                                           "additionalProperties": False})
    assert accepts(manager, params, '{"7":1}')
    assert not accepts(manager, params, '{"\u0661":1}')


def js_search(pattern: str, text: str) -> bool:
    """ECMA-262's search for the patterns of test_outputs_under_ecma_patterns_validate, in Python's re:
    \\d and \\w as ASCII (re.ASCII), `.` without \\r, U+2028 and U+2029."""
    return re.search(pattern.replace(".", "[^\n\r\u2028\u2029]"), text, re.ASCII) is not None


def test_outputs_under_ecma_patterns_validate(llm):
    patterns = {"word": "^\\w+ \\w+$", "code": "^[A-Z]\\d{2}-.{1,6}$", "free": "^.{3,12}$"}
    schema = {"type": "object", "properties": {name: {"type": "string", "pattern": p} for name, p in patterns.items()},
              "required": list(patterns), "additionalProperties": False}
    constraint = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=96, structured_outputs=constraint)
              for seed in range(8)]
    outs = [out.outputs[0] for out in llm.generate(["Once upon a time"] * 8, params, use_tqdm=False)]
    finished = [json.loads(out.text) for out in outs if out.finish_reason == "stop"]
    assert finished, [out.text for out in outs]
    for value in finished:
        assert all(js_search(p, value[name]) for name, p in patterns.items()), value


@pytest.mark.parametrize("bounds,shown", [
    ({"minimum": 1e-300, "maximum": 2e-300}, "minimum 1e-300 and maximum 2e-300"),
    ({"exclusiveMinimum": 0, "exclusiveMaximum": 1e-20}, "exclusiveMinimum 0 and exclusiveMaximum 1e-20"),
    ({"minimum": 0.12345678901234561, "maximum": 0.12345678901234567},
     "minimum 0.12345678901234561 and maximum 0.12345678901234566"),
])
def test_number_bounds_with_nothing_between_them_as_matched_are_refused_with_the_clients_numbers(bounds, shown):
    # They were refused as "minimum (0.00000000000001) is greater than maximum (0)", numbers the client never wrote.
    with pytest.raises(StructuredOutputsError, match=rf"^json: the bounds {re.escape(shown)} are not supported: "
                                                     r"a number bound is matched by its digits written out, at most 15"):
        StructuredOutputsParams(json={"type": "number", **bounds})


def test_crossed_number_bounds_are_refused_with_the_clients_numbers():
    with pytest.raises(StructuredOutputsError, match=r"^json: invalid JSON schema: no number lies between "
                                                     r"minimum 0.1234567890123456 and maximum 0.1$"):
        StructuredOutputsParams(json={"type": "number", "minimum": 0.1234567890123456, "maximum": 0.1})


@pytest.mark.parametrize("schema,instance", [
    ({"type": "number", "minimum": 1e-300, "maximum": 1e-10}, "0.00000000001"),
    ({"type": "number", "minimum": 0.5, "maximum": 0.5}, "0.5"),
    ({"type": "string", "minimum": 1e-300, "maximum": 2e-300}, '"a"'),           # bounds of no number: ignored
    ({"type": ["number", "null"], "minimum": 1e-300, "maximum": 2e-300}, "null"),
    ({"type": "object", "properties": {"a": {"const": {"type": "number", "minimum": 1e-300, "maximum": 2e-300}}}},
     "{}"),                                                                      # data, not a schema
])
def test_bounds_that_leave_an_instance_are_taken(manager, schema, instance):
    assert accepts(manager, StructuredOutputsParams(json=schema), instance)
