"""A seeded request fuzzer for `minillm serve`, for what test_fuzz29_server does not send.

It sends the fields added since that fuzzer (priority under --scheduling-policy priority and
fcfs; /v1/messages output_config.format and chat_template_kwargs; /v1/responses top_logprobs,
text.verbosity and metadata; structured_outputs' disable_additional_properties and
whitespace_pattern; kv_transfer_params, good and junk, to a server that takes part in KV
transfers; logit_bias with allowed_token_ids and bad_words; n up to --max-n with best_of;
stream_options on every route), and JSON at its edges at any level of a body: 10,000 levels of
nesting, and nesting just under the parser's limit inside a field; 1e400, -0.0 and 2**64; repeated
keys and keys holding NUL; an array where an object belongs and the reverse; BOMs, RTL marks,
U+FFFF and surrogate pairs in strings. Cases go out several at a time, streamed or not, and some
clients leave before the answer or in the middle of a stream.

For every answer: the checks of test_fuzz29_server.judge (no 5xx, no hang, a 4xx is an error in
the route's shape, a 200 is strict JSON or a stream to its last event); a 400 of a body that is a
JSON object names a param, a path into the request free of pydantic's internals; no lone surrogate
in a 200's strings; every one of n x prompts choices present and finished once, the usage chunk a
stream asked for (or none), a Responses stream numbered from 0 whose done text is its deltas, a
Messages stream whose blocks open and close in order; a non-zero priority refused under fcfs.
After the run: /health is 200, no request runs or waits, the KV pool is empty, no KV lease is held
and /load counts nothing. Streams of a text forced to characters of several bytes (each token one
byte) read as the same request answered whole, with no U+FFFD and no half of a surrogate pair.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_fuzz29_server import MODEL, QUIET_LOG, Answer, Case, LogWatch, Raw, judge, send, strict_json
from test_server_helpers import CHAT_TEMPLATE, started_url, wait_for

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120.0            # a request's answer (a stream's end): only a hang takes this long
NUM_CASES = {"priority": 400, "fcfs": 160}
NUM_WORKERS = 4
KV_LEASE_S = 2

# ---------------------------------------------------------------------------------------------
# JSON text: objects with repeated keys, numbers and strings json.dumps would not write.


class DupDict(dict):
    """A JSON object that also writes extra (key, value) pairs, repeating keys it holds."""

    extra: list

    def __init__(self, *args, extra=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.extra = list(extra)


def dumps(value: Any) -> str:
    """value as JSON text: Raw as is, a DupDict with its repeated keys, strings in UTF-8 (not escaped)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        pairs = list(value.items()) + list(getattr(value, "extra", []))
        return "{" + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{dumps(v)}" for k, v in pairs) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def nested(depth: int, kind: str) -> Raw:
    """JSON text of depth levels of objects ({"a": ...}) or arrays, around a 1."""
    if kind == "object":
        return Raw('{"a":' * depth + "1" + "}" * depth)
    return Raw("[" * depth + "1" + "]" * depth)


# ---------------------------------------------------------------------------------------------
# Valid requests of each route and the fields this fuzzer adds to them.

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
USER_HI = [{"role": "user", "content": "Hi"}]
BIG_INTS = [2**63 - 1, -2**63, 2**63, 2**64, -2**64 - 1]
ODD_NUMBERS = [Raw("1e400"), Raw("-1e400"), -0.0, Raw("-0"), Raw("1E2"), Raw("1e-400"), 2**64, 0.5]
ODD_UNICODE = ["\ufeffOnce\u202e upon\u200f", "\uffff\ufffe", "\U0001F600\U0001D11E", "a\u0000b", "e\u0301\u2028"]


def field(good: list, bad: list) -> tuple[list, list]:
    """A field's values: ones a request may carry, and ones it may not (or that sit at an edge)."""
    return good, bad


PRIORITY = field([0, 1, -1, 7, 2**63 - 1, -2**63], [-0.0, None, "1", True, 1.0, 2**63, 2**64, Raw("1e400")])
STREAM = field([True, False], [None, "true", 1])
STREAM_OPTIONS = field([{"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True},
                        {"include_usage": False}, {}],
                       [{"include_usage": None}, {"include_usage": "yes"}, {"x": 1}, [], "x", None])
STRUCTURED = field([{"json": SCHEMA, "disable_additional_properties": True},
                    {"json": SCHEMA, "disable_additional_properties": False},
                    {"json": {"type": "object"}, "disable_additional_properties": True},
                    {"json": SCHEMA, "whitespace_pattern": None}, {"choice": ["a", "b"], "disable_additional_properties": True},
                    {"json_object": True, "disable_additional_properties": True}],
                   [{"json": SCHEMA, "whitespace_pattern": "\\s*"}, {"json": SCHEMA, "whitespace_pattern": ""},
                    {"json": SCHEMA, "disable_additional_properties": "yes"}, {"regex": "[a-z]+", "whitespace_pattern": " "},
                    {"json": SCHEMA, "disable_any_whitespace": True, "whitespace_pattern": "\\s"},
                    {"structural_tag": "x"}, {"json": SCHEMA, "disable_additional_properties": -0.0}])
TOKEN_CONTROLS = field([  # logit_bias, allowed_token_ids and bad_words together
    {"logit_bias": {"13": 100}, "allowed_token_ids": [13, 29]}, {"logit_bias": {"13": -100}, "allowed_token_ids": [13]},
    {"logit_bias": {"500": 100}, "bad_words": ["the"]}, {"allowed_token_ids": [13, 29, 300], "bad_words": ["a", "the"]},
    {"logit_bias": {"13": 100, "29": 100}, "allowed_token_ids": [29], "bad_words": ["a"]},
    {"allowed_token_ids": [243, 162, 155, 131], "bad_words": ["\U0001F600"]}, {"bad_words": ["\ufeff", "\U0001F600"]},
    {"logit_bias": {"13": -0.0}, "allowed_token_ids": [13, 511]}],
    [{"logit_bias": {"13": Raw("1e400")}}, {"logit_bias": {"-0": 1}}, {"logit_bias": {"18446744073709551616": 1}},
     {"logit_bias": {"13": 101}}, {"allowed_token_ids": [2**64]}, {"allowed_token_ids": []},
     {"allowed_token_ids": [-0.0]}, {"bad_words": [""]}, {"allowed_token_ids": [512], "bad_words": ["a"]}])
N_BEST_OF = field([{"n": 128, "max_tokens": 1}, {"n": 128, "best_of": 128, "max_tokens": 1},
                   {"n": 8, "best_of": 8, "max_tokens": 2}, {"n": 4, "best_of": 4, "stream": True, "max_tokens": 3},
                   {"n": 2, "best_of": 2, "seed": 3}],
                  [{"n": 129}, {"n": 2, "best_of": 3}, {"n": 3, "best_of": 2}, {"n": 0}, {"n": -1}, {"best_of": 0},
                   {"n": 2**64}, {"n": -0.0}, {"n": Raw("1e400")}])
KV_TRANSFER = field([{"do_remote_decode": True}],
                    [{"do_remote_decode": True, "do_remote_prefill": True}, {}, {"do_remote_prefill": True},
                     {"do_remote_decode": "yes"}, {"do_remote_decode": 1}, {"remote_block_ids": [2**64]},
                     {"do_remote_prefill": True, "remote_block_ids": [-1]}, {"\u0000": True}, [], "x", 2**64])
GENERATION_FIELDS = {
    "priority": PRIORITY, "stream": STREAM, "stream_options": STREAM_OPTIONS, "kv_transfer_params": KV_TRANSFER,
    "structured_outputs": STRUCTURED, "max_tokens": field([1, 4, 8], [Raw("1e400"), -0.0, 2**64]),
    "temperature": field([0, Raw("-0"), 1.0], [Raw("1e400"), 2**64]), "seed": field([0, 2**63 - 1], [2**64, -0.0]),
    "request_id": field(["fuzz-30", "\ufeff\u202e\U0001F600", "a\u0000b"], [1, [], None]),   # one id in flight twice
}
COMPLETIONS = dict(GENERATION_FIELDS, prompt=field(["Once upon a time", ["a", "b"], [1, 243, 162, 155, 131],
                                                    *ODD_UNICODE], [[2**64], [[]], {"a": 1}]),
                   logprobs=field([0, 2, 5], [-0.0, 21]), echo=field([True, False], [-0.0]),
                   prompt_logprobs=field([0, 2], [Raw("1e400")]))
TEMPLATE_KWARGS = field([{"enable_thinking": False}, {"\u0000": 1}, {"tools": None}, {"bos_token": "\ufeff"}],
                        [{"messages": []}, {"add_generation_prompt": 1}, [], "x"])
CHAT = dict(GENERATION_FIELDS, logprobs=field([True], ["true"]), top_logprobs=field([0, 2, 20], [21, -0.0]),
            chat_template_kwargs=TEMPLATE_KWARGS,
            messages=field([USER_HI, [{"role": "user", "content": "\ufeff\u202eHi\uffff \U0001F600"}],
                            [{"role": "user", "content": [{"type": "text", "text": "\U0001F600"}]}]],
                           [[{"role": "\ufeffuser", "content": "Hi"}], [[]]]))
RESPONSES = {
    "priority": PRIORITY, "stream": STREAM, "stream_options": STREAM_OPTIONS,
    "top_logprobs": field([0, 2, 20, None], [21, -1, "2", True, -0.0, Raw("1e400"), 2**64]),
    "text": field([{"verbosity": v} for v in ["low", "medium", "high", None]]
                  + [{"format": {"type": "text"}, "verbosity": "high"},
                     {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}, "verbosity": "low"}],
                  [{"verbosity": v} for v in ["LOW", "", 1, [], "\u0000"]]),
    "metadata": field([{"k": "v"}, {"\u0000": "v"}, {"k": "\ufeff\u202e\uffff"}, {"k": "\U0001F600"}, {}, None],
                      [{"k": 1}, {"k": None}, [], "x", {str(i): "v" for i in range(20)}]),
    "include": field([["message.output_text.logprobs"], [], None], [["x"]]),
    "input": field(["Hi", *ODD_UNICODE, [{"role": "user", "content": "Hi"}]], [[], {}]),
    "temperature": field([0, Raw("-0")], [Raw("1e400")]), "max_output_tokens": field([1, 4], [2**64, Raw("1e400")]),
}
MESSAGES = {
    "priority": PRIORITY, "stream": STREAM, "stream_options": STREAM_OPTIONS,
    "output_config": field([{"format": {"type": "json_schema", "schema": SCHEMA}}, {"format": None}, {"effort": "high"}],
                           [{"format": {"type": "json_schema"}}, {"format": {"type": "json_object"}}, {"format": []},
                            {"format": {"type": "json_schema", "schema": {"type": "string", "pattern": "("}}}, [], "x"]),
    "chat_template_kwargs": TEMPLATE_KWARGS,
    "thinking": field([{"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}],
                      [{"type": "enabled", "budget_tokens": 2**64}]),
    "temperature": field([0, Raw("-0")], [Raw("1e400")]), "max_tokens": field([1, 4], [2**64, -0.0]),
    "messages": field([USER_HI, [{"role": "user", "content": "\ufeff\u202eHi\uffff \U0001F600"}]], [[{}]]),
}
COUNT_TOKENS = {k: MESSAGES[k] for k in ("output_config", "chat_template_kwargs", "messages", "priority")}
TOKENIZE = {"chat_template_kwargs": TEMPLATE_KWARGS, "add_generation_prompt": field([True, False], [-0.0]),
            "messages": CHAT["messages"], "priority": PRIORITY}

ROUTES: dict[str, tuple[dict, dict, float]] = {      # route: (base body, fields it may get, weight)
    "/v1/completions": ({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}, COMPLETIONS, 4),
    "/v1/chat/completions": ({"model": MODEL, "messages": USER_HI, "max_tokens": 4}, CHAT, 4),
    "/v1/responses": ({"model": MODEL, "input": "Hi", "max_output_tokens": 4}, RESPONSES, 3),
    "/v1/messages": ({"model": MODEL, "messages": USER_HI, "max_tokens": 4}, MESSAGES, 3),
    "/v1/messages/count_tokens": ({"model": MODEL, "messages": USER_HI}, COUNT_TOKENS, 1),
    "/tokenize#chat": ({"model": MODEL, "messages": USER_HI}, TOKENIZE, 1),
}
GROUPS = {"/v1/completions": [TOKEN_CONTROLS, N_BEST_OF], "/v1/chat/completions": [TOKEN_CONTROLS, N_BEST_OF]}
BAD_ODDS = 0.12              # a field's value is one it may not take
MUTATION_COUNTS = [0, 0, 0, 1, 1, 2, 3]

UNICODE = ["\ufeff", "a\ufeffb", "\u202eabc\u202c", "\u200f\u05e9", "\uffff", "\ufffe", "\U0001F600",
           "\U0010ffff", "\u0000", "\u2028\u2029", "e\u0301", "\r\n"]
UNICODE_RAW = ['"\\ud83d\\ude00"', '"\\ud83d"', '"x\\ude00"', '"\\ufeff\\u0000"', '"\\uFFFF"']


# ---------------------------------------------------------------------------------------------
# Cases.

def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into value's dicts and lists, at most 5 deep."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list) and len(value) <= 20:
        items = list(enumerate(value))
    else:
        return []
    out = []
    for key, item in items:
        out.append(prefix + (key,))
        if len(prefix) < 4:
            out.extend(_paths(item, prefix + (key,)))
    return out


def _parent(body: Any, path: tuple) -> Any:
    for key in path[:-1]:
        body = body[key]
    return body


def _at(body: Any, path: tuple) -> Any:
    for key in path:
        body = body[key]
    return body


def _copy(value: Any) -> Any:
    """A deep copy that keeps Raw leaves."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _short(value: Any) -> str:
    text = dumps(value)
    return text if len(text) <= 60 else f"{text[:50]}...({len(text)} chars)"


class Generator:
    """Cases drawn from one seed: the same seed gives the same cases (kv: a real lease's params)."""

    def __init__(self, seed: int, kv: dict | None = None) -> None:
        self.rng = random.Random(seed)
        self.kv = kv or {}

    def case(self) -> Case:
        """A request of one route with fields of this fuzzer and 0-3 mutations at any depth."""
        rng = self.rng
        route = rng.choices(list(ROUTES), [w for _, _, w in ROUTES.values()])[0]
        base, optional, _ = ROUTES[route]
        body = DupDict(_copy(base))
        notes = []
        for name in rng.sample(sorted(optional), rng.choice([1, 2, 3, 4])):
            body[name] = self._value(optional[name])
            notes.append(f"set {name}={_short(body[name])}")
        for group in GROUPS.get(route, []):
            if rng.random() < 0.25:
                extra = self._value(group)
                body.update(extra)
                notes.append(f"set {_short(extra)}")
        if "stream_options" in body and rng.random() < 0.8:
            body["stream"] = True
        if "kv_transfer_params" in body and self.kv and rng.random() < 0.5:
            body["kv_transfer_params"] = self._kv_junk()
            notes.append(f"set kv_transfer_params={_short(body['kv_transfer_params'])}")
        if body.get("n", 1) not in (1, None) and isinstance(body.get("n"), int) and body["n"] > 8:
            body["max_tokens"] = 1                      # 128 choices of one token each
        whole = False
        for _ in range(rng.choice(MUTATION_COUNTS)):
            note, whole_now = self._mutate(body)
            notes.append(note)
            whole |= whole_now
        return self._case(route, body, notes, whole)

    def _value(self, values: tuple[list, list]) -> Any:
        good, bad = values
        return _copy(self.rng.choice(bad if self.rng.random() < BAD_ODDS else good))

    def _kv_junk(self) -> dict:
        """A lease's remote-prefill params with one key junk (never another host or port: those wait 5 s)."""
        rng = self.rng
        params = {**self.kv, "do_remote_prefill": True, "do_remote_decode": False}
        key = rng.choice([k for k in params if k not in ("remote_host",)])
        junk = [None, "x", -1, 2**64, [], {}, "\u0000", Raw("1e400"), -0.0, True, [2**64]]
        if key == "remote_port":
            junk = [None, "x", 0, -1, 65536, 2**64, [], -0.0, True]
        params[key] = rng.choice(junk)
        return params

    def _mutate(self, body: dict) -> tuple[str, bool]:
        """One change at a random place of body (in place): what was done, and whether JSON itself refuses it."""
        rng = self.rng
        paths = [p for p in _paths(body) if p[0] != "model" or rng.random() < 0.05]
        path = rng.choice(paths)
        parent, key = _parent(body, path), path[-1]
        where = ".".join(map(str, path))
        kind = rng.choices(["number", "dup", "nul", "swap", "unicode", "deep", "near", "drop"],
                           [15, 12, 10, 18, 18, 4, 8, 5])[0]
        if kind == "number":
            parent[key] = rng.choice(ODD_NUMBERS + BIG_INTS)
            return f"number {where}={_short(parent[key])}", False
        if kind in ("dup", "nul"):
            at = rng.choice([()] + [p for p in paths if isinstance(_at(body, p), dict)])
            target = _at(body, at)
            names = list(target)
            if kind == "dup":
                name = rng.choice(names or ["a"])
                value = rng.choice([None, [], {}, "x", 2**64, Raw("1e400"), -0.0, True, [{"a": 1}]])
            else:
                name = rng.choice(["\u0000", "a\u0000", "\u0000model"] + [n + "\u0000" for n in names])
                value = rng.choice([1, "x", None, {}])
            if at:
                target = _parent(body, at)[at[-1]] = DupDict(target, extra=getattr(target, "extra", []))
            target.extra.append((name, value))
            return f"{kind} key {name!r}={_short(value)} at {'.'.join(map(str, at)) or 'top'}", False
        if kind == "swap":
            old = parent[key]
            if isinstance(old, dict):
                parent[key] = rng.choice([list(old.values()), [old], list(old)])
            elif isinstance(old, list):
                parent[key] = rng.choice([{str(i): v for i, v in enumerate(old)}, {"items": old}, {}])
            else:
                parent[key] = rng.choice([[old], {"value": old}, {}, []])
            return f"swap {where} to {_short(parent[key])}", False
        if kind == "unicode":
            strings = [p for p in paths if isinstance(_parent(body, p)[p[-1]], str)] or [path]
            path = rng.choice(strings)
            parent, key = _parent(body, path), path[-1]
            old = parent[key] if isinstance(parent[key], str) else ""
            if rng.random() < 0.3:
                parent[key] = Raw(rng.choice(UNICODE_RAW))
            else:
                cut = rng.randrange(len(old) + 1)
                parent[key] = old[:cut] + rng.choice(UNICODE) + old[cut:]
            return f"unicode {'.'.join(map(str, path))}={_short(parent[key])}", False
        if kind == "deep":
            parent[key] = nested(10_000, rng.choice(["object", "array"]))
            return f"deep {where}: 10000 levels", True
        if kind == "near":
            parent[key] = nested(max(1, 900 - 2 * len(path)), rng.choice(["object", "array"]))
            return f"near {where}: {900 - 2 * len(path)} levels", False
        del parent[key]
        return f"drop {where}", False

    def _case(self, route: str, body: DupDict, notes: list[str], whole: bool) -> Case:
        text = dumps(body)
        stream = _effective(text).get("stream") is True
        rng = self.rng
        leave = rng.choices(["read", "before", "headers", "midway"], [80, 7, 5, 8])[0]
        if leave == "midway" and not stream:
            leave = "read"
        if leave != "read":
            notes.append(f"client leaves {leave}")
        case = Case(route, "POST", route.split("#")[0], {"Content-Type": "application/json"},
                    text.encode("utf-8", "surrogatepass"), notes, whole, stream,
                    tuple(sorted(set(body) | {k for k, _ in body.extra if isinstance(k, str)})),
                    hang_up=leave != "read")
        case.leave = leave
        return case


# ---------------------------------------------------------------------------------------------
# Sending and judging.

def send_leaving(host: str, port: int, case: Case) -> Answer:
    """Send case and leave: before the answer, after its headers, or after a few lines of its stream."""
    answer = Answer()
    sock = socket.create_connection((host, port), timeout=TIMEOUT_S)
    try:
        head = (f"{case.method} {case.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(case.body)}\r\n\r\n").encode()
        sock.sendall(head + case.body)
        if case.leave == "before":
            return answer
        reader = sock.makefile("rb")
        status = reader.readline()
        answer.status = int(status.split()[1]) if status.startswith(b"HTTP/") else None
        if case.leave == "midway":
            for _ in range(random.Random(len(case.body)).choice([3, 8, 20])):
                if not reader.readline():
                    break
    except (OSError, ValueError, IndexError) as exc:
        answer.failure = f"dropped: {type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    return answer


PYDANTIC_INTERNALS = re.compile(r"^body\b|function-(after|before|wrap|plain)\[|tagged-union\[|json-or-python\["
                                r"|lax-or-strict\[|\b(list|dict|union)\[|\bint\]|\bstr\]")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
SSE_LINE_END = re.compile(r"\r\n|\r|\n")


def _strings(value: Any):
    """Every string of a JSON value, keys too."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _json_values(answer: Answer) -> list:
    """The JSON of a 200's body, or of each data line of its stream."""
    text = answer.body.decode("utf-8", "surrogatepass")
    if not answer.headers.get("content-type", "").startswith("text/event-stream"):
        return [strict_json(text)]
    return [strict_json(line[5:]) for line in SSE_LINE_END.split(text)
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def _is_in(param: str, body: dict) -> bool:
    """Whether param names a place in body: each step but the last (a field it lacks) is there."""
    steps = [s for s in re.split(r"[.\[\]]", param) if s]
    value: Any = body
    for i, step in enumerate(steps[:-1]):
        if isinstance(value, list) and step.isdigit() and int(step) < len(value):
            value = value[int(step)]
        elif isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, dict) and ".".join(steps[i:]) in value:   # a key holding a dot
            return True
        else:
            return False
    return True


def _effective(text: str | bytes) -> dict:
    """A body as the server reads it (the last of repeated keys), or {} if it is no JSON object."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return body if isinstance(body, dict) else {}


# Characters str.splitlines (which judge uses) ends a line at, where an event stream's lines end only at
# \r and \n; in a JSON document they can only stand inside a string, where their escapes mean the same.
SPLITLINES_ONLY = {"\u2028": b"\\u2028", "\u2029": b"\\u2029", "\x85": b"\\u0085"}


def _lines_as_sse_splits_them(answer: Answer) -> Answer:
    """answer with the characters only str.splitlines breaks at escaped (a stream's lines end at \r and \n)."""
    body = answer.body
    for char, escape in SPLITLINES_ONLY.items():
        body = body.replace(char.encode(), escape)
    return dataclasses.replace(answer, body=body)


def judge30(case: Case, answer: Answer, policy: str) -> list[str]:
    """test_fuzz29_server.judge, and this fuzzer's checks of params, surrogates and priority."""
    if case.hang_up:                 # a client that left reads no more than the status line
        return [answer.failure or f"status {answer.status}"] if answer.failure or (answer.status or 0) >= 500 else []
    problems = judge(case, _lines_as_sse_splits_them(answer))
    if problems:
        return problems
    if answer.status >= 400:
        param = strict_json(answer.body)["error"].get("param")
        if answer.status == 400 and param is None and not case.body_level:
            problems.append("400 naming no param")
        if isinstance(param, str) and PYDANTIC_INTERNALS.search(param):
            problems.append(f"param {param!r} holds pydantic's internals")
        elif isinstance(param, str) and not _is_in(param, _effective(case.body)):
            problems.append(f"param {param!r} is no path into the request")
        return problems
    try:
        values = _json_values(answer)
    except ValueError as exc:
        return [f"200 that is not JSON: {exc}"]
    lone = [s for v in values for s in _strings(v) if LONE_SURROGATE.search(s)]
    if lone:
        problems.append(f"200 with half a surrogate pair: {lone[0][:80]!r}")
    body = _effective(case.body)
    problems += shape_problems(case.path, body, values, answer.headers.get("content-type", "").startswith("text/"))
    priority = body.get("priority")
    if policy == "fcfs" and case.route in ("/v1/completions", "/v1/chat/completions", "/v1/responses") \
            and type(priority) is int and priority != 0:
        problems.append(f"priority {priority} taken under fcfs")
    return problems


def _choice_problems(body: dict, choices: list[dict], finished: dict) -> list[str]:
    """Each of the n x prompts choices present and finished once."""
    prompt = body.get("prompt")
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    expected = set(range((body.get("n") or 1) * num_prompts))
    if {c["index"] for c in choices} != expected or set(finished) != expected:
        return [f"choices {sorted({c['index'] for c in choices})[:5]}... finished {sorted(finished)[:5]}..., "
                f"not {len(expected)}"]
    twice = [i for i, reasons in finished.items() if len(reasons) != 1]
    return [f"choice {twice[0]} finished {finished[twice[0]]}"] if twice else []


def _openai_stream_problems(body: dict, events: list[dict]) -> list[str]:
    choices = [c for e in events for c in e.get("choices", [])]
    finished: dict = {}
    for c in choices:
        if c.get("finish_reason") is not None:
            finished.setdefault(c["index"], []).append(c["finish_reason"])
    problems = _choice_problems(body, choices, finished)
    options = body.get("stream_options")
    usages = [e for e in events if e.get("usage")]
    if isinstance(options, dict) and options.get("include_usage", True) is True:    # vLLM's default: true
        if not usages or usages[-1] is not events[-1] or events[-1].get("choices"):
            problems.append("include_usage without a last chunk of usage alone")
        if options.get("continuous_usage_stats") is True and any(e.get("usage") is None for e in events):
            problems.append("continuous_usage_stats with a chunk without usage")
    elif usages:
        problems.append("usage in a stream that did not ask for it")
    return problems


def _responses_stream_problems(events: list[dict]) -> list[str]:
    numbers = [e.get("sequence_number") for e in events]
    if numbers != list(range(len(events))):
        return [f"sequence numbers {numbers[:8]}..."]
    if events[0].get("type") != "response.created":
        return [f"first event {events[0].get('type')}"]
    deltas = "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    done = [e["text"] for e in events if e.get("type") == "response.output_text.done"]
    return [] if "".join(done) == deltas else [f"output_text.done {''.join(done)[:60]!r}, deltas {deltas[:60]!r}"]


def _messages_stream_problems(events: list[dict]) -> list[str]:
    kinds = [e.get("type") for e in events]
    if kinds[:1] != ["message_start"] or kinds[-2:] != ["message_delta", "message_stop"]:
        return [f"Messages events {kinds[:3]}...{kinds[-3:]}"]
    open_blocks = []
    for event in events:
        if event["type"] == "content_block_start":
            open_blocks.append(event["index"])
        elif event["type"] in ("content_block_delta", "content_block_stop") and open_blocks[-1:] != [event["index"]]:
            return [f"{event['type']} of block {event['index']}, open {open_blocks}"]
        if event["type"] == "content_block_stop":
            open_blocks.pop()
    return [f"blocks {open_blocks} never stopped"] if open_blocks else []


def shape_problems(path: str, body: dict, values: list, streamed: bool) -> list[str]:
    """What is wrong with the shape of a 200's answer: its choices, usage and events."""
    if streamed and path in ("/v1/completions", "/v1/chat/completions"):
        return _openai_stream_problems(body, values)
    if streamed and path == "/v1/responses":
        return _responses_stream_problems(values)
    if streamed and path == "/v1/messages":
        return _messages_stream_problems(values)
    if path in ("/v1/completions", "/v1/chat/completions"):
        payload = values[0]
        finished = {c["index"]: [c["finish_reason"]] for c in payload["choices"] if c.get("finish_reason")}
        problems = _choice_problems(body, payload["choices"], finished)
        use = payload.get("usage") or {}
        if use.get("total_tokens") != use.get("prompt_tokens", 0) + use.get("completion_tokens", 0):
            problems.append(f"usage {use}")
        return problems
    return []


def run_batch(host: str, port: int, cases: list[Case], policy: str) -> list[tuple[Case, Answer, list[str]]]:
    """Send cases NUM_WORKERS at a time; (case, answer, problems) of each case with a problem."""
    def one(case: Case) -> tuple[Case, Answer, list[str]]:
        answer = send_leaving(host, port, case) if case.hang_up else send(host, port, case, TIMEOUT_S)
        return case, answer, judge30(case, answer, policy)

    with concurrent.futures.ThreadPoolExecutor(NUM_WORKERS) as pool:
        return [result for result in pool.map(one, cases) if result[2]]


def report(findings: list[tuple[Case, Answer, list[str]]], log: list[str]) -> str:
    """Findings as text, one a distinct problem, and the log lines that were not the server's usual."""
    seen, parts = set(), []
    for case, answer, problems in findings:
        signature = (case.route, re.sub(r"\d+", "N", problems[0])[:80])
        if signature in seen:
            continue
        seen.add(signature)
        got = answer.failure or f"{answer.status} {answer.body[:400].decode('utf-8', 'replace')}"
        parts.append(f"{'; '.join(problems)}\n  mutations: {case.mutations}\n  request: {case.describe()}\n"
                     f"  answer: {got}")
    if log:
        parts.append("log:\n" + "\n".join(log[-40:]))
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------
# The servers: one under --scheduling-policy priority taking part in KV transfers, one under fcfs.

# The priority server's pool is small, so that n=128 and concurrent requests preempt one another.
SERVERS = {"priority": ["--scheduling-policy", "priority", "--kv-role", "both", "--kv-lease-s", str(KV_LEASE_S),
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--num-kv-blocks", "64",
                        "--max-num-seqs", "16"],
           "fcfs": ["--scheduling-policy", "fcfs"]}


def _launch(model: Path, log: Path, args: list[str]) -> subprocess.Popen:
    """`minillm serve` of model on a port the kernel picks (its log names the port once up)."""
    command = [sys.executable, "-m", "minillm.cli", "serve", str(model), "--device", "cpu", "--port", "0",
               "--served-model-name", MODEL, "--chat-template", CHAT_TEMPLATE, "--max-model-len", "256",
               "--enable-server-load-tracking", "--timeout-graceful-shutdown", "1", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                                stderr=subprocess.STDOUT)
    return proc


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _is_up(proc: subprocess.Popen, port: int, log: Path) -> bool:
    assert proc.poll() is None, log.read_text()
    try:
        return _get(port, "/health")[0] == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def servers(stories_path, tmp_path_factory):
    """{policy: (host, port, LogWatch)} of two `minillm serve` of stories260K on the CPU, started together."""
    folder = tmp_path_factory.mktemp("fuzz30")
    launched = {name: (_launch(stories_path, folder / f"{name}.log", args), folder / f"{name}.log")
                for name, args in SERVERS.items()}
    started = {}
    try:
        for name, (proc, log) in launched.items():
            started[name] = (proc, int(started_url(proc, log, timeout=120).rsplit(":", 1)[1]), log)
            assert _is_up(proc, started[name][1], log), log.read_text()
        yield {name: ("127.0.0.1", port, LogWatch(log)) for name, (_, port, log) in started.items()}
    finally:
        for proc, _ in launched.values():
            proc.terminate()
        for proc, _ in launched.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _post(port: int, path: str, body: dict) -> tuple[int, bytes, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read(), {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def lease_params(port: int) -> dict:
    """The kv_transfer_params of a real lease on the server (the template of the junk sent to it)."""
    status, body, _ = _post(port, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1,
                                                      "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, body
    return json.loads(body)["kv_transfer_params"]


# ---------------------------------------------------------------------------------------------
# The run.

QUIET_LOG_30 = re.compile(QUIET_LOG.pattern + r"|^minillm: KV transfer ")


def _anomalies(log: LogWatch) -> list[str]:
    return [line for line in log.new_lines() if line.strip() and not QUIET_LOG_30.match(line)]


@pytest.mark.parametrize("policy,seed", [("priority", 30), ("fcfs", 3030)])
def test_fuzzed_requests_get_no_5xx_no_hang_and_well_formed_answers(servers, policy, seed):
    host, port, log = servers[policy]
    _anomalies(log)
    generator = Generator(seed, lease_params(servers["priority"][1]) if policy == "priority" else None)
    cases = [generator.case() for _ in range(NUM_CASES[policy])]
    findings, lines = [], []
    for start in range(0, len(cases), 4 * NUM_WORKERS):
        findings += run_batch(host, port, cases[start:start + 4 * NUM_WORKERS], policy)
        lines += _anomalies(log)
    assert not findings and not lines, report(findings, lines)


def _stats(port: int) -> dict:
    status, body = _get(port, "/v1/stats?cells=1")
    assert status == 200, body
    return json.loads(body)


IDLE = {"num_running": 0, "num_waiting": 0, "kv_num_used_blocks": 0, "kv_transfer_num_leases": 0}


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.mark.parametrize("policy", list(SERVERS))
def test_after_the_run_the_server_is_idle_with_an_empty_kv_pool(servers, policy):
    _, port, log = servers[policy]
    idle = wait_for(lambda: {k: _stats(port)[k] for k in IDLE} == IDLE and _get(port, "/load")[1] == b'{"server_load":0}',
                    timeout=KV_LEASE_S + 30, interval=0.1)
    assert idle, (_stats(port), _get(port, "/load"))
    metrics = _get(port, "/metrics")[1].decode()
    assert _metric(metrics, "minillm:num_requests_running") == 0
    assert _metric(metrics, "minillm:num_requests_waiting") == 0
    assert _metric(metrics, "minillm:kv_cache_usage_perc") == 0
    assert _get(port, "/health")[0] == 200
    assert not _anomalies(log)


# ---------------------------------------------------------------------------------------------
# Text of several bytes a character, streamed a byte a token: each chunk whole characters.

FORCED = "\U0001F600\U0001D11E \ufeff\u202eab\u202c\uffff\u05e9"


def _routes_forcing(text: str) -> dict[str, dict]:
    """A greedy request of each generating route whose answer can only be text."""
    schema = {"type": "string", "const": text}
    return {
        "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 40, "temperature": 0, "logprobs": 2,
                            "structured_outputs": {"choice": [text]}},
        "/v1/chat/completions": {"model": MODEL, "messages": USER_HI, "max_tokens": 40, "temperature": 0,
                                 "logprobs": True, "top_logprobs": 2, "structured_outputs": {"choice": [text]}},
        "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 60, "temperature": 0, "top_logprobs": 2,
                          "text": {"format": {"type": "json_schema", "name": "t", "schema": schema}}},
        "/v1/messages": {"model": MODEL, "messages": USER_HI, "max_tokens": 60, "temperature": 0,
                         "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    }


def _whole_text(path: str, payload: dict) -> str:
    if path == "/v1/completions":
        return payload["choices"][0]["text"]
    if path == "/v1/chat/completions":
        return payload["choices"][0]["message"]["content"]
    if path == "/v1/responses":
        return "".join(part["text"] for item in payload["output"] if item["type"] == "message"
                       for part in item["content"])
    return "".join(block["text"] for block in payload["content"] if block["type"] == "text")


def _delta_text(path: str, event: dict) -> str:
    if path == "/v1/completions":
        return "".join(c["text"] for c in event.get("choices", []))
    if path == "/v1/chat/completions":
        return "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
    if path == "/v1/responses":
        return event["delta"] if event.get("type") == "response.output_text.delta" else ""
    delta = event.get("delta") or {}
    return delta.get("text", "") if event.get("type") == "content_block_delta" else ""


@pytest.mark.parametrize("path", list(_routes_forcing(FORCED)))
def test_a_stream_of_characters_split_into_byte_tokens_reads_as_the_answer_whole(servers, path):
    _, port, _ = servers["fcfs"]
    body = _routes_forcing(FORCED)[path]
    status, whole, _ = _post(port, path, body)
    assert status == 200, whole
    payload = strict_json(whole)
    text = _whole_text(path, payload)
    if "usage" in payload and "completion_tokens" in payload["usage"]:     # characters of several tokens each
        assert payload["usage"]["completion_tokens"] > len(FORCED)
    # The routes held to a JSON schema answer the text as a JSON string.
    assert (json.loads(text) if "schema" in json.dumps(body) else text) == FORCED
    status, streamed, headers = _post(port, path, {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), streamed
    events = _json_values(Answer(status, headers, streamed))
    deltas = [_delta_text(path, event) for event in events]
    assert "".join(deltas) == text
    assert not [d for d in deltas if "\ufffd" in d or LONE_SURROGATE.search(d)], deltas
    # A token of part of a character has no text of its own: its logprob's token may read U+FFFD, not half a pair.
    assert not [s for value in [strict_json(whole), *events] for s in _strings(value) if LONE_SURROGATE.search(s)]


# ---------------------------------------------------------------------------------------------
# The judge itself: each answer below breaks one of its checks.

def _answer(body: str, status: int = 200, ctype: str = "application/json") -> Answer:
    return Answer(status, {"content-type": ctype}, body.encode("utf-8", "surrogatepass"))


OK_COMPLETION = '{"choices":[{"index":0,"text":"a","finish_reason":"length"}],"usage":' \
                '{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
BAD_ANSWERS = {
    "a 500": ({}, _answer('{"error":{"message":"boom","type":"x","param":null,"code":null}}', 500)),
    "a lone surrogate": ({}, _answer(OK_COMPLETION.replace('"a"', '"\\ud83d"'))),
    "a 400 naming no param": ({"n": 2}, _answer('{"error":{"message":"no","type":"x","param":null,"code":null}}', 400)),
    "a param of pydantic's": ({"n": 2}, _answer('{"error":{"message":"no","type":"x","param":"body.n","code":null}}',
                                                400)),
    "a param naming nothing": ({"n": 2}, _answer('{"error":{"message":"no","type":"x","param":"n.a.b","code":null}}',
                                                 400)),
    "a choice missing": ({"n": 2}, _answer(OK_COMPLETION)),
    "priority under fcfs": ({"priority": 3}, _answer(OK_COMPLETION)),
    "a stream without its usage": ({"stream": True, "stream_options": {"include_usage": True}},
                                   _answer('data: {"choices":[{"index":0,"text":"a","finish_reason":"length"}]}\n\n'
                                           'data: [DONE]\n\n', ctype="text/event-stream")),
}


OK_STREAM = ('data: {"choices":[{"index":0,"text":"a","finish_reason":"length"}],"usage":null}\n\n'
             'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n'
             'data: [DONE]\n\n')


def _completion_case(fields: dict) -> Case:
    body = {"model": MODEL, "prompt": "Hi", **fields}
    case = Case("/v1/completions", "POST", "/v1/completions", {}, json.dumps(body).encode(), [], fields=tuple(body),
                stream=bool(fields.get("stream")))
    case.leave = "read"
    return case


@pytest.mark.parametrize("name", list(BAD_ANSWERS))
def test_the_judge_finds_each_kind_of_fault(name):
    fields, answer = BAD_ANSWERS[name]
    assert judge30(_completion_case(fields), answer, "fcfs")


def test_the_judge_passes_sound_answers():
    assert not judge30(_completion_case({"priority": 3}), _answer(OK_COMPLETION), "priority")
    assert not judge30(_completion_case({"stream": True, "stream_options": {}}),
                       _answer(OK_STREAM, ctype="text/event-stream"), "fcfs")
