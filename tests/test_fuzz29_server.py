"""A request fuzzer for `minillm serve`: valid requests of every route, mutated, must never get a 5xx.

Each case is a valid request of one route (completions, chat, responses, messages, count_tokens,
tokenize, detokenize and the GET routes) with a few mutations drawn from a seeded generator: a
field dropped, a value replaced by one of another type or an extreme one (NaN and 1e309 as bare
tokens, ints of 400 and 5000 digits, lone surrogates, NUL, RTL marks, 10k-item arrays, deep
nesting), duplicate keys, sampling fields combined, or the HTTP framing changed (method, content
type and encoding, chunked bodies, query strings), or a streaming client that hangs up. For every
answer the fuzzer checks: no 5xx and no dropped or hung connection; a 4xx is a JSON error in the
route's shape with a message, and a 400's param names a field of the request; a 200 is strict JSON
(no bare NaN), a stream to its last event; the server's log holds only its usual lines (access,
throughput, ignored fields, one-line refusals), never a traceback; /health stays 200; and a greedy
stream kept in flight beside the fuzzing ends with the text of the same request made alone.

The CI run below sends a fixed number of cases from fixed seeds to `minillm serve` with one and
with two API servers; a longer run imports Generator, serve, run_cases and judge from here.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import gzip
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from test_server_helpers import CHAT_TEMPLATE, HealthyStreams, started_url, stop_server, wait_for

REPO = Path(__file__).resolve().parents[1]
MODEL = "stories"
MAX_MODEL_LEN = 256
NUM_CI_CASES = 400            # per server; the whole module stays well under 30 s


# ---------------------------------------------------------------------------------------------
# JSON that json.dumps cannot write: bare tokens, repeated keys, lone surrogates.

@dataclasses.dataclass(frozen=True)
class Raw:
    """JSON text written as is (NaN, 1e309, a lone surrogate's escape, deep nesting)."""

    text: str


@dataclasses.dataclass(frozen=True)
class Dup:
    """A JSON object whose keys may repeat, as (key, value) pairs in order."""

    pairs: tuple


def dumps(value: Any) -> str:
    """value as JSON text, writing Raw as is and Dup with its repeated keys."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Dup):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.pairs) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


# ---------------------------------------------------------------------------------------------
# Valid requests of each route, and the valid optional fields each may carry.

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object",
                                                        "properties": {"city": {"type": "string"}}}}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}
MESSAGES_TOOL = {"name": "get_weather", "description": "Weather of a city",
                 "input_schema": TOOL["function"]["parameters"]}

SAMPLING = {
    "n": [1, 2, 3], "best_of": [1, 2], "temperature": [0, 0.7, 1.5], "top_p": [0.5, 1.0], "top_k": [-1, 1, 5],
    "min_p": [0.0, 0.1], "seed": [0, 7, 2**31], "presence_penalty": [-2.0, 0.5], "frequency_penalty": [0.5, 2.0],
    "repetition_penalty": [1.0, 1.3], "stop": ["the", [".", "Once"], []], "stop_token_ids": [[13], [2, 29]],
    "ignore_eos": [True, False], "min_tokens": [0, 2, 8], "max_tokens": [1, 4, 16, None],
    "skip_special_tokens": [False], "spaces_between_special_tokens": [False], "include_stop_str_in_output": [True],
    "stream": [True, False], "stream_options": [{"include_usage": True}, {"include_usage": True,
                                                                         "continuous_usage_stats": True}, {}],
    "logit_bias": [{"13": 5}, {"29": -100, "1": 2.5}], "user": ["u-1"],
    "structured_outputs": [{"choice": ["yes", "no"]}, {"regex": "[a-z]{1,6}"}, {"json": SCHEMA},
                           {"json_object": True}, {"grammar": 'root ::= "a" | "b"'}],
    "response_format": [{"type": "json_object"}, {"type": "text"},
                        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}],
    "kv_transfer_params": [{"do_remote_decode": True}], "truncate_prompt_tokens": [2, -1],
    "allowed_token_ids": [[13, 29, 100, 2]], "bad_words": [["the"], ["a b"]], "prompt_logprobs": [0, 2],
    "return_tokens_as_token_ids": [True], "return_token_ids": [True], "request_id": ["fuzz-1"],
    "cache_salt": ["salt"], "priority": [0, 1], "metadata": [{"k": "v"}], "store": [False],
    "use_beam_search": [False, True], "length_penalty": [1.0, 0.5], "guided_json": [SCHEMA],
    "extra_body": [{"top_k": 2}], "service_tier": ["auto"], "vllm_xargs": [{"a": 1}],
}
COMPLETION_ONLY = {"logprobs": [0, 1, 5], "echo": [True, False], "suffix": ["end"], "add_special_tokens": [False],
                   "prompt": ["", "Once upon a time", [1, 415, 29], ["A", "B"], [[1, 2], [3]], "\u202eabc\u202c"]}
CHAT_ONLY = {
    "logprobs": [True, False], "top_logprobs": [0, 2, 5], "echo": [True], "max_completion_tokens": [3, None],
    "tools": [[TOOL]], "tool_choice": ["auto", "none", "required", {"type": "function",
                                                                     "function": {"name": "get_weather"}}],
    "parallel_tool_calls": [True, False], "add_generation_prompt": [False], "continue_final_message": [True],
    "chat_template_kwargs": [{"enable_thinking": False}], "documents": [[{"title": "t", "text": "x"}]],
    "functions": [[TOOL["function"]]], "function_call": ["none", "auto"], "include_reasoning": [False],
    "add_special_tokens": [True], "chat_template": ["{{ messages[0]['content'] }}"],
    "messages": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                 [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                 [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                        "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                 [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once",
                                                      "reasoning": "think"}]],
}
RESPONSES_FIELDS = {
    "instructions": ["Be brief.", ""], "max_output_tokens": [1, 8, None], "temperature": [0, 1.0],
    "top_p": [0.9], "stream": [True, False], "tools": [[RESPONSES_TOOL]],
    "tool_choice": ["auto", "none", "required", {"type": "function", "name": "get_weather"}],
    "parallel_tool_calls": [False], "text": [{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                                             {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}}],
    "reasoning": [{"effort": "low"}, {"summary": "auto"}], "store": [False, True], "previous_response_id": ["resp_1"],
    "background": [False, True], "truncation": ["auto", "disabled"], "metadata": [{"k": "v"}], "user": ["u"],
    "include": [["message.output_text.logprobs"], ["reasoning.encrypted_content"]], "request_id": ["r"],
    "top_logprobs": [2], "prompt_cache_key": ["k"], "service_tier": ["auto"],
    "input": ["Hi", [{"role": "user", "content": "Hi"}],
              [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
              [{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                                    "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]],
}
MESSAGES_FIELDS = {
    "system": ["Be brief.", [{"type": "text", "text": "Be brief."}]], "stop_sequences": [["the"], []],
    "stream": [True, False], "temperature": [0, 1.0], "top_p": [0.9], "top_k": [5], "tools": [[MESSAGES_TOOL]],
    "tool_choice": [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "get_weather"}],
    "thinking": [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}], "metadata": [{"user_id": "u"}],
    "max_tokens": [1, 8],
    "messages": [[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                 [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
                     {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
                 [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]],
}
TOKENIZE_FIELDS = {"add_special_tokens": [False, True], "return_token_strs": [True], "add_generation_prompt": [False],
                   "prompt": ["", "Hi there", "\u0000"]}

USER_HI = [{"role": "user", "content": "Hi"}]
ROUTES: dict[str, tuple[dict, dict]] = {
    "/v1/completions": ({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8},
                        {**SAMPLING, **COMPLETION_ONLY}),
    "/v1/chat/completions": ({"model": MODEL, "messages": USER_HI, "max_tokens": 8}, {**SAMPLING, **CHAT_ONLY}),
    "/v1/responses": ({"model": MODEL, "input": "Hi", "max_output_tokens": 8}, RESPONSES_FIELDS),
    "/v1/messages": ({"model": MODEL, "messages": USER_HI, "max_tokens": 8}, MESSAGES_FIELDS),
    "/v1/messages/count_tokens": ({"model": MODEL, "messages": USER_HI},
                                  {k: MESSAGES_FIELDS[k] for k in ("system", "tools", "messages", "tool_choice")}),
    "/tokenize": ({"model": MODEL, "prompt": "Once upon a time"}, TOKENIZE_FIELDS),
    "/tokenize#chat": ({"model": MODEL, "messages": USER_HI}, {**TOKENIZE_FIELDS, "tools": [[TOOL]],
                                                                "continue_final_message": [True]}),
    "/detokenize": ({"model": MODEL, "tokens": [1, 415, 29, 2]}, {}),
}
GET_ROUTES = ["/v1/models", f"/v1/models/{MODEL}", "/health", "/ping", "/metrics", "/v1/stats", "/version", "/load",
              "/v1/responses/resp_123"]
MESSAGES_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")


def _huge_digits(n: int) -> Raw:
    return Raw("9" * n)


def weird_values(rng: random.Random) -> list[Callable[[], Any]]:
    """Makers of the values a mutation puts in place of a field's (each call a fresh one)."""
    nest = rng.choice([30, 200, 900])
    return [
        lambda: None, lambda: True, lambda: False, lambda: 0, lambda: -1, lambda: 1, lambda: 2, lambda: 3,
        lambda: 2**31, lambda: 2**63, lambda: -2**63 - 1, lambda: 2**64 + 1, lambda: _huge_digits(400),
        lambda: _huge_digits(5000), lambda: 1e308, lambda: -1e308, lambda: Raw("1e309"), lambda: Raw("-1e400"),
        lambda: -0.0, lambda: Raw("NaN"), lambda: Raw("Infinity"), lambda: Raw("-Infinity"), lambda: 0.5,
        lambda: 1.9999999, lambda: 5e-324, lambda: Raw("1E2"), lambda: Raw("-0"), lambda: 1.0,
        lambda: "", lambda: "x", lambda: MODEL, lambda: "1", lambda: "true", lambda: "null", lambda: "NaN",
        lambda: Raw('"\\ud800"'), lambda: Raw('"a\\udfff\\ud800b"'), lambda: Raw('"\\ud83d"'),
        lambda: "\u202eRTL\u202c \u200f\u05e9\u05dc\u05d5\u05dd", lambda: "\u0000", lambda: "a\u0000b",
        lambda: "\u200b\ufeff", lambda: "\U0001F600" * 3, lambda: "\uffff\ufffe", lambda: "</s><s><unk>",
        lambda: "x" * rng.choice([300, 5000, 100_000]), lambda: "\u00e9" * 3000,
        lambda: [], lambda: [1, 2], lambda: [None], lambda: [[]], lambda: ["a", 1, None, {}],
        lambda: list(range(10_000)), lambda: [rng.randrange(-5, 600) for _ in range(10_000)],
        lambda: ["a"] * 10_000, lambda: [{"role": "user", "content": "x"}] * rng.choice([2, 300, 10_000]),
        lambda: {}, lambda: {"a": 1}, lambda: {"type": None}, lambda: {"": ""},
        lambda: {str(i): i for i in range(10_000)}, lambda: Raw('{"\\ud800": 1}'),
        lambda: _nested_dict(nest), lambda: Raw("[" * nest + "]" * nest),
        lambda: Raw("[" * 100_000 + "]" * 100_000), lambda: Raw('{"a":' * 5000 + "1" + "}" * 5000),
    ]


def _nested_dict(depth: int) -> Raw:
    """A JSON schema of objects nested depth deep, as text (json.dumps would recurse as deep)."""
    return Raw('{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth)


# Values of the structured-output fields that stress their compilers (regexes, schemas, grammars).
STRUCTURE_STRESS = [
    {"regex": "(a*)*b"}, {"regex": "["}, {"regex": "a{1000000}"}, {"regex": "(?<=a)b"}, {"regex": ""},
    {"regex": "\\"}, {"regex": "(((((((((((((((((((((a)))))))))))))))))))))"}, {"regex": "[^\\x00-\\x{10FFFF}]"},
    {"choice": []}, {"choice": [""]}, {"choice": ["a"] * 5000}, {"choice": [Raw('"\\ud800"')]},
    {"json": {}}, {"json": True}, {"json": False}, {"json": "not a schema"}, {"json": {"type": "nope"}},
    {"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}, {"json": {"$ref": "http://x/y"}},
    {"json": _nested_dict(60)}, {"json": _nested_dict(900)}, {"json": {"type": "string", "pattern": "(a*)*b"}},
    {"json": {"type": "string", "minLength": 10**9}}, {"json": {"type": "array", "minItems": 10**9}},
    {"json": {"type": "integer", "minimum": 5, "maximum": 1}}, {"json": {"enum": []}},
    {"json": {"type": "string", "format": "date-time"}}, {"json": {"anyOf": []}}, {"json": {"not": {}}},
    {"json": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"],
              "additionalProperties": False}},
    {"grammar": ""}, {"grammar": "root ::= root"}, {"grammar": "root ::= \"a\" root"}, {"grammar": "???"},
    {"grammar": "start: \"a\""}, {"grammar": "root ::= [^]"}, {"json_object": False}, {"json_object": "yes"},
    {"regex": "a", "choice": ["b"]}, {"disable_any_whitespace": True}, {"json": SCHEMA, "disable_any_whitespace": 1},
]


# ---------------------------------------------------------------------------------------------
# Cases: one HTTP request each.

@dataclasses.dataclass
class Case:
    """One request to send, and what was done to make it."""

    route: str                   # the route it mutates ("/tokenize#chat" is /tokenize with messages)
    method: str
    path: str
    headers: dict
    body: bytes | None
    mutations: list[str]
    body_level: bool = False     # a mutation of the body as a whole (its JSON, type or encoding)
    stream: bool = False
    fields: tuple = ()           # the body's top-level keys, for the check of a 400's param
    hang_up: bool = False        # the client leaves after the answer's first line of body

    def describe(self) -> str:
        """The request as text: method, path, headers and body (cut short past 2000 characters)."""
        body = "" if self.body is None else self.body.decode("utf-8", "backslashreplace")
        if len(body) > 2000:
            body = body[:2000] + f"... ({len(self.body)} bytes)"
        return f"{self.method} {self.path} {self.headers}\n{body}"

    def to_json(self) -> dict:
        """The case as JSON (its body in base64 too, byte for byte)."""
        return {"route": self.route, "method": self.method, "path": self.path, "headers": self.headers,
                "body_b64": None if self.body is None else base64.b64encode(self.body).decode(),
                "mutations": self.mutations}


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into value's dicts and lists (at most 4 deep; a list of over 50 items is a leaf: its
    items may be one object repeated, which a change would change everywhere)."""
    out = []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list) and len(value) <= 50:
        items = list(enumerate(value))
    else:
        return out
    for key, item in items:
        path = prefix + (key,)
        out.append(path)
        if len(path) < 4:
            out.extend(_paths(item, path))
    return out


def _set(body: Any, path: tuple, value: Any) -> None:
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def _delete(body: Any, path: tuple) -> None:
    target = body
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]


def _get(body: Any, path: tuple) -> Any:
    for key in path:
        body = body[key]
    return body


INT_EXTREMES = [0, -1, 1, 2, 255, 256, 257, 511, 512, 513, 1000, 10**6, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63,
                -2**31, -2**63]
FLOAT_EXTREMES = [0.0, -0.0, 1e-300, 5e-324, 0.999999, 1.000001, 2.0, 100.0, 1e300, -1e300, -100.0]
TOKEN_LISTS = [[512], [-1], [0], [2**31], [511, 512], [1] * 300, [], [2] * 5, list(range(512))]


def _extreme_like(rng: random.Random, old: Any) -> Any:
    """A value of old's kind at an edge: a count, id or weight at or past its range; a list of ids
    out of the vocabulary; text of odd characters or lengths; a dict with odd keys."""
    if isinstance(old, bool):
        return rng.choice([0, 1, "true", None])
    if isinstance(old, int):
        return rng.choice(INT_EXTREMES + FLOAT_EXTREMES[:3])
    if isinstance(old, float):
        return rng.choice(FLOAT_EXTREMES + INT_EXTREMES[:4])
    if isinstance(old, str):
        return rng.choice(["", " ", "\n", "a" * 257, "\u0000" * 3, "<s>", "</s>", "\ufffd", "\U0010ffff",
                           "\u0301", "\r\n\r\n", "{{ 7*7 }}", "{% raw %}", "null", old * 50])
    if isinstance(old, list):
        if old and all(isinstance(v, int) for v in old):
            return list(rng.choice(TOKEN_LISTS))
        if len(dumps(old)) > 10_000:      # a list already long is not made longer
            return rng.choice([[], old[:1], old[::-1]])
        return rng.choice([[], old * 2, old[:1] * 300, [old[0] if old else 0] * 10_000, old[::-1]])
    if isinstance(old, dict):
        extra = rng.choice([{"": 1}, {" 13": 1}, {"512": 1}, {"-1": 1}, {"1e3": 1}, {"13": 1e308},
                            {"13": -1e308}, {"13": 101}, {"0x0d": 1}, {"\u0000": 1}, {"type": "x"},
                            {"x": Raw("NaN")}, {"x": Raw("-1e999")}, {"x": Raw('"\\udfff"')},
                            {"x": [Raw("Infinity")]}])
        return {**old, **extra}
    return rng.choice(INT_EXTREMES)


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


class Generator:
    """Cases drawn from one seed: the same seed gives the same cases."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.weird = weird_values(self.rng)

    def case(self) -> Case:
        """The next case: mostly a mutated body, sometimes a GET route or the HTTP framing changed."""
        roll = self.rng.random()
        if roll < 0.06:
            return self._get_case()
        case = self._body_case()
        if roll > 0.9:
            self._mutate_http(case)
        return case

    def _body_case(self) -> Case:
        rng = self.rng
        route = rng.choice(list(ROUTES))
        base, optional = ROUTES[route]
        body: Any = _copy(base)
        mutations: list[str] = []
        for name in rng.sample(sorted(optional), min(len(optional), rng.choice([0, 1, 2, 3, 5, 8]))):
            value = _copy(rng.choice(optional[name]))
            body[name] = value
            mutations.append(f"set {name}={json.dumps(value)[:80]}")
        body_level, fields = False, set(body)
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            if isinstance(body, dict):
                fields |= set(body)
            body, note, whole = self._mutate(body, route)
            body_level |= whole
            mutations.append(note)
        stream = isinstance(body, dict) and body.get("stream") is True
        text = dumps(body)
        encoded = text.encode("utf-8", "surrogatepass")
        path = route.split("#")[0]
        if isinstance(body, dict):
            fields |= set(body)
        if isinstance(body, Dup):
            fields |= {k for k, _ in body.pairs}
            stream = any(k == "stream" and v is True for k, v in body.pairs)
        fields = tuple(sorted(fields))
        hang_up = stream and rng.random() < 0.15
        if hang_up:
            mutations.append("hang up after the first line")
        return Case(route, "POST", path, {"Content-Type": "application/json"}, encoded, mutations, body_level,
                    stream, fields, hang_up)

    def _mutate(self, body: Any, route: str) -> tuple[Any, str, bool]:
        """One mutation of body: (the new body, what was done, whether it changed the body as a whole)."""
        rng = self.rng
        if not isinstance(body, dict):
            return body, "kept", False
        kind = rng.choices(["drop", "replace", "replace_top", "add", "dup", "wrap", "structure", "whole", "extreme",
                            "surrogate"], [10, 20, 25, 15, 8, 6, 6, 4, 15, 5])[0]
        paths = _paths(body)
        if kind == "extreme" and paths:
            path = rng.choice(paths)
            target = body
            for key in path[:-1]:
                target = target[key]
            value = _extreme_like(rng, target[path[-1]])
            target[path[-1]] = value
            return body, f"extreme {'.'.join(map(str, path))}={_short(value)}", False
        if kind == "surrogate":
            leaves = [p for p in paths if isinstance(_get(body, p), str)]
            if leaves:
                path = rng.choice(leaves)
                value = Raw(rng.choice(['"\\ud800"', '"a\\udc00"', '"\\ud83d"', '"\\udfff\\ud800x"']))
                _set(body, path, value)
                return body, f"surrogate {'.'.join(map(str, path))}={value.text}", False
        if kind == "drop" and paths:
            path = rng.choice(paths)
            _delete(body, path)
            return body, f"drop {'.'.join(map(str, path))}", False
        if kind in ("replace", "replace_top") and paths:
            path = rng.choice([p for p in paths if len(p) == 1] if kind == "replace_top" else paths)
            value = rng.choice(self.weird)()
            _set(body, path, value)
            return body, f"replace {'.'.join(map(str, path))} with {_short(value)}", False
        if kind == "add":
            name = rng.choice(sorted(set(SAMPLING) | set(COMPLETION_ONLY) | set(CHAT_ONLY) | set(RESPONSES_FIELDS)
                                     | set(MESSAGES_FIELDS) | {"model", "prompt", "messages", "input", "tokens"}))
            value = rng.choice(self.weird)()
            body[name] = value
            return body, f"add {name}={_short(value)}", False
        if kind == "dup" and body:
            name = rng.choice(list(body))
            value = rng.choice(self.weird)()
            pairs = [(k, v) for k, v in body.items()]
            index = next(i for i, (k, _) in enumerate(pairs) if k == name)
            pairs.insert(index + rng.choice([0, 1]), (name, value))
            return Dup(tuple(pairs)), f"duplicate {name} with {_short(value)}", False
        if kind == "wrap" and paths:
            path = rng.choice(paths)
            target = body
            for key in path[:-1]:
                target = target[key]
            old = target[path[-1]]
            target[path[-1]] = rng.choice([[old], {"value": old}, [old, old]])
            return body, f"wrap {'.'.join(map(str, path))}", False
        if kind == "structure" and route in ("/v1/completions", "/v1/chat/completions"):
            value = _copy_raw(rng.choice(STRUCTURE_STRESS))
            field = rng.choice(["structured_outputs", "response_format"])
            if field == "response_format":
                value = {"type": "json_schema", "json_schema": {"name": "x", "schema": value.get("json", value)}}
            body[field] = value
            return body, f"set {field}={_short(value)}", False
        if kind == "whole":
            value = rng.choice([lambda: [body], lambda: rng.choice(self.weird)(), lambda: Raw(dumps(body)[:-1]),
                                lambda: Raw(dumps(body) + "garbage"), lambda: Raw(dumps(body) + dumps(body)),
                                lambda: Raw(" \n\t" + dumps(body) + " \n"), lambda: Raw("")])()
            return value, f"whole body {_short(value)}", True
        return body, "kept", False

    def _mutate_http(self, case: Case) -> None:
        """Change how the request travels: its method, content type, encoding, framing or headers."""
        rng = self.rng
        kind = rng.choice(["method", "ctype", "encoding", "chunked", "header", "query", "path", "length"])
        if kind == "method":
            case.method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
        elif kind == "ctype":
            case.headers["Content-Type"] = rng.choice([
                "text/plain", "application/json; charset=utf-16", "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x", "application/vnd.api+json", "application/json, text/plain",
                "application/json; charset=latin-1", "APPLICATION/JSON", "", "*/*", "application/jsonx"])
            if not case.headers["Content-Type"]:
                del case.headers["Content-Type"]
            case.body_level = True
        elif kind == "encoding":
            how = rng.choice(["gzip", "utf16", "bom", "latin1", "bad-gzip"])
            if how == "gzip":
                case.body, case.headers["Content-Encoding"] = gzip.compress(case.body or b""), "gzip"
            elif how == "bad-gzip":
                case.headers["Content-Encoding"] = rng.choice(["gzip", "br", "deflate", "identity", "x"])
            elif how == "utf16":
                case.body = (case.body or b"").decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")
            elif how == "bom":
                case.body = b"\xef\xbb\xbf" + (case.body or b"")
            else:
                case.body = (case.body or b"") + b"\xff\xfe\xe9"
            case.body_level = True
        elif kind == "chunked":
            case.headers["Transfer-Encoding"] = "chunked"
        elif kind == "header":
            name, value = rng.choice([("X-Request-Id", "r" * 5000), ("X-Request-Id", "\u00e9t\u00e9"),
                                      ("X-Request-Id", ""), ("Authorization", "Bearer nope"),
                                      ("Accept", "text/event-stream"), ("Accept-Encoding", "gzip, br"),
                                      ("Expect", "100-continue"), ("Connection", "close"),
                                      ("X-Forwarded-For", "::1, 999.1.1.1"), ("Origin", "https://evil.example"),
                                      ("Content-Language", "\u00e9"), ("Cookie", "a=" + "b" * 4000),
                                      ("X-Data-Parallel-Rank", "-1"), ("traceparent", "00-zz-zz-01")])
            case.headers[name] = value
            case.mutations.append(f"header {name}: {value[:40]}")
        elif kind == "query":
            case.path += rng.choice(["?cells=0", "?stream=true", "?a=%00", "?" + "x=1&" * 500, "?model=%ff"])
        elif kind == "path":
            case.path = rng.choice([case.path + "/", "/" + case.path, case.path + "%00", case.path.upper(),
                                    case.path + "/../v1/models", case.path.replace("/v1/", "/v1//")])
            case.body_level = True
        elif kind == "length":
            case.headers["Content-Length"] = str(max(0, len(case.body or b"") - rng.choice([1, 10])))
            case.body_level = True
        if kind != "header":
            case.mutations.append(f"http {kind}: {case.method} {case.path} {case.headers}"[:200])

    def _get_case(self) -> Case:
        rng = self.rng
        path = rng.choice(GET_ROUTES)
        if path == "/v1/stats" or rng.random() < 0.3:
            path += "?" + rng.choice(["cells=1", "cells=0", "cells=-1", "cells=1e308", "cells=NaN",
                                      "cells=99999999999999999999999", "cells=%00", "cells=1&cells=2", "cells=",
                                      "cells=4096", "cells=64", "interval=0"])
        if path.startswith("/v1/models/") and rng.random() < 0.5:
            path = "/v1/models/" + rng.choice(["%00", "a" * 5000, "..%2f..%2fetc", "%ff%fe", "stories/x",
                                                "%F0%9F%98%80"])
        method = rng.choice(["GET", "GET", "GET", "HEAD", "POST", "DELETE"])
        return Case(path, method, path, {}, None, [f"get {method} {path[:80]}"], body_level=True)


def _short(value: Any) -> str:
    text = dumps(value)
    return text if len(text) <= 60 else f"{text[:50]}...({len(text)} chars)"


def _copy_raw(value: Any) -> Any:
    """A copy of value that keeps its Raw parts."""
    if isinstance(value, dict):
        return {k: _copy_raw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_raw(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Sending a case and judging the answer.

@dataclasses.dataclass
class Answer:
    """What came back: the status, headers and body, or why nothing (or only part of it) did."""

    status: int | None = None
    headers: dict = dataclasses.field(default_factory=dict)
    body: bytes = b""
    failure: str | None = None      # "dropped: ...", "hang: ..."
    seconds: float = 0.0


def send(host: str, port: int, case: Case, timeout: float) -> Answer:
    """Send case on a connection of its own and read the whole answer (a stream to its end)."""
    started = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    answer = Answer()
    try:
        conn.putrequest(case.method, case.path, skip_accept_encoding=True)
        headers = dict(case.headers)
        chunked = headers.get("Transfer-Encoding") == "chunked"
        if case.body is not None and not chunked and "Content-Length" not in headers:
            headers["Content-Length"] = str(len(case.body))
        for name, value in headers.items():
            conn.putheader(name, value.encode("utf-8") if isinstance(value, str) else value)
        conn.endheaders()
        if case.body is not None:
            if chunked:
                for i in range(0, len(case.body), 4096):
                    piece = case.body[i:i + 4096]
                    conn.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                conn.send(b"0\r\n\r\n")
            else:
                conn.send(case.body)
        response = conn.getresponse()
        answer.status, answer.headers = response.status, {k.lower(): v for k, v in response.getheaders()}
        if case.hang_up or case.path.startswith("/v1/stats/stream"):
            answer.body = response.readline()
        else:
            answer.body = response.read()
    except (socket.timeout, TimeoutError) as exc:
        answer.failure = f"hang: no answer in {timeout} s ({exc})"
    except (http.client.HTTPException, ConnectionError, OSError) as exc:
        answer.failure = f"dropped: {type(exc).__name__}: {exc}"
    finally:
        conn.close()
        answer.seconds = time.monotonic() - started
    return answer


def known_fields(route: str) -> set[str]:
    """The top-level fields a request of route may carry (a 400's param names one of them)."""
    from minillm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                         TokenizeChatRequest, TokenizeCompletionRequest)
    from minillm.server.serving_messages import MessagesRequest
    from minillm.server.serving_responses import ResponsesRequest
    models = {"/v1/completions": [CompletionRequest], "/v1/chat/completions": [ChatCompletionRequest],
              "/v1/responses": [ResponsesRequest], "/v1/messages": [MessagesRequest],
              "/v1/messages/count_tokens": [MessagesRequest],
              "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest],
              "/tokenize#chat": [TokenizeCompletionRequest, TokenizeChatRequest], "/detokenize": [DetokenizeRequest]}
    names = {"cells", "interval", "response_id", "model", "priority"}
    for model in models.get(route, []):
        names |= set(model.model_fields)
    return names


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: bytes | str) -> Any:
    """json.loads that refuses NaN and Infinity, as JSON (and a browser's JSON.parse) does."""
    return json.loads(text, parse_constant=_refuse_constant)


ROOT = re.compile(r"^[^.\[]+")
STRICT_PARAM = os.environ.get("FUZZ_STRICT_PARAM") == "1"    # a field's 400 must name a param


def judge(case: Case, answer: Answer) -> list[str]:
    """What is wrong with the answer to case (empty when nothing is)."""
    if answer.failure:
        return [answer.failure]
    status, body = answer.status, answer.body
    problems = []
    if status >= 500:
        problems.append(f"status {status}: {body[:300]!r}")
        return problems
    if case.method == "HEAD" or (case.hang_up and status < 400):
        return problems
    ctype = answer.headers.get("content-type", "")
    if status >= 400:
        try:
            payload = strict_json(body)
        except ValueError:
            return [f"status {status} with a body that is not JSON ({ctype}): {body[:200]!r}"]
        error = payload.get("error") if isinstance(payload, dict) else None
        anthropic = case.path.split("?")[0].rstrip("/") in MESSAGES_ROUTES
        if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error["message"].strip():
            return [f"status {status} whose body is no error with a message: {body[:200]!r}"]
        if anthropic and case.method == "POST" and payload.get("type") != "error":
            problems.append(f"status {status} on a Messages route, not in Anthropic's shape: {body[:200]!r}")
        if not anthropic and set(error) != {"message", "type", "param", "code"}:
            problems.append(f"status {status} error without OpenAI's four fields: {body[:200]!r}")
        param = error.get("param")
        if status == 400 and param is None and not case.body_level and STRICT_PARAM \
                and error.get("code") != "json_invalid":
            problems.append(f"400 naming no param: {error['message'][:200]}")
        if status == 400 and param is not None:
            root = ROOT.match(str(param))
            if root is None or (root.group(0) not in known_fields(case.route) and root.group(0) not in case.fields):
                problems.append(f"400 param {param!r} names no field of the request")
        return problems
    if status != 200 or case.method != "POST":
        return problems
    if ctype.startswith("text/event-stream"):
        problems += _judge_stream(case, body.decode("utf-8", "replace"))
    else:
        try:
            payload = strict_json(body)
        except ValueError:
            return [f"200 whose body is not JSON ({ctype}): {body[:200]!r}"]
        if isinstance(payload, dict) and payload.get("error") and case.route != "/v1/responses":
            problems.append(f"200 carrying an error: {body[:300]!r}")
        if case.route == "/v1/responses" and isinstance(payload, dict) and payload.get("status") == "failed":
            problems.append(f"200 for a failed response: {body[:300]!r}")
    return problems


def _judge_stream(case: Case, text: str) -> list[str]:
    events, names = [], []
    for line in text.splitlines():
        if line.startswith("event:"):
            names.append(line[6:].strip())
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            events.append("[DONE]")
            continue
        try:
            events.append(strict_json(data))
        except ValueError:
            return [f"stream event that is not JSON: {data[:200]!r}"]
    if not events:
        return [f"empty stream: {text[:200]!r}"]
    problems = []
    errors = [e for e in events if isinstance(e, dict) and (e.get("error") or e.get("type") in ("error",
                                                                                                "response.failed"))]
    if errors:
        problems.append(f"stream with an error event: {json.dumps(errors[0])[:300]}")
    path = case.path.split("?")[0]
    if path in ("/v1/completions", "/v1/chat/completions") and events[-1] != "[DONE]":
        problems.append(f"stream not ended by [DONE]: {text[-200:]!r}")
    if path == "/v1/messages" and (not names or names[-1] != "message_stop"):
        problems.append(f"Messages stream not ended by message_stop: {text[-200:]!r}")
    if path == "/v1/responses" and (not names or names[-1] not in ("response.completed", "response.incomplete")):
        problems.append(f"Responses stream not ended by response.completed: {text[-200:]!r}")
    return problems


# What the server's log may hold besides access lines: its start-up lines, the throughput line, the
# names of fields it ignored, a request refused with its reason (one line, no traceback), and
# uvicorn's note on bytes past a body's Content-Length.
QUIET_LOG = re.compile(r"^(INFO: |minillm: (engine core in process|API server \d+ in process|backend )"
                       r"|minillm: request \S+: [\w.\[\]]+: "
                       r"|INFO \d\d-\d\d [\d:]{8} Avg prompt throughput: "
                       r"|WARNING \d\d-\d\d [\d:]{8} The following fields were present in the request but ignored: "
                       r"|WARNING: +Invalid HTTP request received\.$)")


class LogWatch:
    """New lines of the server's log since the last look."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.lock = path, 0, threading.Lock()

    def new_lines(self) -> list[str]:
        """Lines written since the last call."""
        with self.lock, open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1          # a line still being written waits for the next look
        self.offset += end
        return data[:end].decode("utf-8", "replace").splitlines()

    def anomalies(self) -> list[str]:
        """New lines that are neither access lines nor the server's start-up lines."""
        return [line for line in self.new_lines() if line.strip() and not QUIET_LOG.match(line)]


# ---------------------------------------------------------------------------------------------
# The server.

@contextlib.contextmanager
def serve(model: Path, log: Path, extra_args: list[str] = ()):
    """`minillm serve` of model on the CPU on a port the kernel picks, its output to log: yield (host,
    port) once /health is 200."""
    command = [sys.executable, "-m", "minillm.cli", "serve", str(model), "--device", "cpu", "--port", "0",
               "--served-model-name", MODEL, "--chat-template", CHAT_TEMPLATE, "--max-model-len", str(MAX_MODEL_LEN),
               "--timeout-graceful-shutdown", "1", *extra_args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        host, port = started_url(proc, log, timeout=120).removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200, log.read_text()
        conn.close()
        yield host, int(port)
    finally:
        stop_server(proc)


def health(host: str, port: int) -> int | None:
    """The status of GET /health (None when nothing answers)."""
    answer = send(host, port, Case("/health", "GET", "/health", {}, None, []), timeout=30)
    return answer.status


@dataclasses.dataclass
class Finding:
    """One defect: the case, the answer, what is wrong and what the log said."""

    case: Case
    answer: Answer
    problems: list[str]
    log: list[str]

    def signature(self) -> str:
        """What makes two findings the same defect: the route and the problem, numbers and quotes blurred."""
        first = (self.problems or self.log or ["?"])[0]
        error = re.search(r"internal server error: (\w+)", first)
        if error:
            first = f"5xx {error.group(1)}"
        elif self.log and (not self.problems or self.answer.failure):
            first = next((line for line in reversed(self.log) if re.match(r"^\w+(Error|Exception)", line)),
                         self.log[-1])
        first = re.sub(r"\d+", "N", first)
        first = re.sub(r"'[^']*'|\"[^\"]*\"", "Q", first)[:120]
        return f"{self.case.route} {first}"

    def report(self) -> str:
        """The finding as text: the request, the answer and the log lines."""
        answer = self.answer
        got = answer.failure or f"{answer.status} {answer.body[:600].decode('utf-8', 'replace')}"
        log = "\n".join(self.log[-30:])
        return (f"{'; '.join(self.problems) or 'log'}\n  mutations: {self.case.mutations}\n"
                f"  request: {self.case.describe()}\n  answer: {got}\n  log:\n{log}")


def run_cases(host: str, port: int, log: LogWatch, cases, timeout: float = 60.0,
              on_case: Callable[[int], None] | None = None) -> list[Finding]:
    """Send each case in turn; the findings (a traceback in the log goes with the case just answered)."""
    findings = []
    for i, case in enumerate(cases):
        answer = send(host, port, case, timeout)
        problems = judge(case, answer)
        lines = log.anomalies()
        if answer.failure or (answer.status or 0) >= 500:
            # An error's traceback may be logged just after the answer: give the log a moment.
            wait_for(lambda: lines.extend(log.anomalies()) or lines, timeout=2)
        if problems or lines:
            findings.append(Finding(case, answer, problems, lines))
        if on_case is not None:
            on_case(i)
    return findings


# ---------------------------------------------------------------------------------------------
# CI: a bounded run from fixed seeds on one and on two API servers.

SERVERS = {"one API server": [], "two API servers": ["--api-server-count", "2", "--enable-auto-tool-choice",
                                                       "--tool-call-parser", "hermes", "--enable-request-id-headers",
                                                       "--enable-prompt-tokens-details"]}


@pytest.fixture(scope="module", params=list(SERVERS))
def fuzzed_server(request, stories_path, tmp_path_factory):
    """(host, port, LogWatch) of a `minillm serve` of stories260K on the CPU."""
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    with serve(stories_path, log, SERVERS[request.param]) as (host, port):
        yield host, port, LogWatch(log)


@pytest.fixture(scope="module")
def healthy(fuzzed_server):
    host, port, _ = fuzzed_server
    streams = HealthyStreams(f"http://{host}:{port}",
                             {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200})
    yield streams
    streams.check()


def _findings_text(findings: list[Finding]) -> str:
    distinct: dict[str, Finding] = {}
    for finding in findings:
        distinct.setdefault(finding.signature(), finding)
    return "\n\n".join(f.report() for f in distinct.values())


@pytest.mark.parametrize("seed", [29, 2029])
def test_mutated_requests_get_no_5xx_no_traceback_and_leave_the_server_serving(fuzzed_server, healthy, seed):
    host, port, log = fuzzed_server
    log.anomalies()                       # start-up lines are no concern here
    generator = Generator(seed)
    cases = [generator.case() for _ in range(NUM_CI_CASES // 2)]
    findings = []
    for start in range(0, len(cases), 10):
        with healthy.in_flight():
            findings += run_cases(host, port, log, cases[start:start + 10], timeout=30)
    assert not findings, _findings_text(findings)
    assert health(host, port) == 200



# ---------------------------------------------------------------------------------------------
# Defects the fuzzer found, each as the request that shows it (xfail while the server still fails it).

def _post(server, path: str, body: dict | str, timeout: float = 30) -> tuple[Answer, list[str]]:
    """POST body (a dict, or JSON text with bare tokens) to path: the answer and the log's new anomalies."""
    host, port, log = server
    text = body if isinstance(body, str) else json.dumps(body)
    fields = tuple(json.loads(text)) if text.startswith("{") else ()
    log.anomalies()
    case = Case(path, "POST", path, {"Content-Type": "application/json"}, text.encode(), ["fixed"], fields=fields,
                stream='"stream": true' in text)
    answer = send(host, port, case, timeout)
    lines = log.anomalies()
    if answer.failure or (answer.status or 0) >= 500:
        wait_for(lambda: lines.extend(log.anomalies()) or lines, timeout=2)
    return answer, judge(case, answer) + lines


NAMES_NO_TOOL = {"model": MODEL, "messages": USER_HI, "tool_choice": {"type": "tool", "name": "get_weather"}}


@pytest.mark.parametrize("tools", [None, [{**MESSAGES_TOOL, "name": "other"}]], ids=["no tools", "another tool"])
def test_count_tokens_of_a_tool_choice_naming_no_tool_of_the_request_is_a_400(fuzzed_server, tools):
    body = {**NAMES_NO_TOOL, **({"tools": tools} if tools else {})}
    # /v1/messages refuses it with a 400 naming tool_choice; count_tokens must too.
    answer, problems = _post(fuzzed_server, "/v1/messages", {**body, "max_tokens": 1})
    assert answer.status == 400 and json.loads(answer.body)["error"]["param"] == "tool_choice" and not problems
    answer, problems = _post(fuzzed_server, "/v1/messages/count_tokens", body)
    assert not problems, problems
    assert answer.status == 400 and json.loads(answer.body)["error"]["param"] == "tool_choice"


def test_a_large_count_tokens_body_naming_no_tool_is_answered(fuzzed_server):
    host, port, log = fuzzed_server
    log.anomalies()
    body = json.dumps({**NAMES_NO_TOOL, "system": "x" * 70_000}).encode()
    case = Case("/v1/messages/count_tokens", "POST", "/v1/messages/count_tokens",
                {"Content-Type": "application/json"}, body, ["fixed"], fields=tuple(NAMES_NO_TOOL) + ("system",))
    answers: list[Answer] = []
    threading.Thread(target=lambda: answers.append(send(host, port, case, timeout=120)), daemon=True).start()
    lines: list[str] = []
    # Either it is answered, or the log says the answer was lost (then it never comes).
    assert wait_for(lambda: answers or any("cannot be raised into a Future" in line
                                           for line in lines.extend(log.anomalies()) or lines), timeout=60)
    assert answers and not judge(case, answers[0]), lines


# Fields a Responses API response echoes as sent, with a value JSON cannot carry (the text of the field).
ECHOED = {"metadata surrogate value": '"metadata": {"k": "\\ud800"}',
          "metadata surrogate key": '"metadata": {"\\udfff": "v"}',
          "metadata NaN": '"metadata": {"k": NaN}', "metadata 1e999": '"metadata": {"k": 1e999}',
          "tools Infinity": '"tools": [{"type": "function", "name": "get_weather", "parameters": '
                            '{"type": "object", "properties": Infinity}}], "tool_choice": "none"',
          "reasoning NaN": '"reasoning": {"effort": "low", "x": NaN}',
          "text NaN": '"text": {"format": {"type": "text"}, "verbosity": NaN}'}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("field", list(ECHOED.values()), ids=list(ECHOED))
def test_a_responses_field_echoed_with_a_value_json_cannot_hold_gets_no_5xx_and_no_broken_stream(fuzzed_server,
                                                                                                 field, stream):
    body = (f'{{"model": "{MODEL}", "input": "Hi", "max_output_tokens": 2, "stream": {json.dumps(stream)}, '
            f'{field}}}')
    answer, problems = _post(fuzzed_server, "/v1/responses", body)
    assert not problems, problems      # refused with a 400 naming the field, or echoed as JSON can hold it
