"""The large-body JSON parser (server/json_body.py): json.loads's value and errors, with a call into
Python (where the GIL can pass to the event loop) for every object and number it reads."""
from __future__ import annotations

import json
import sys

import pytest

from minillm.server.json_body import loads_yielding

BODIES = [
    b'{"model": "m", "prompt": [1, -2, 30000000000000000000000], "x": {"y": [{"z": null}, true, false]}}',
    b'{"t": 0.5, "e": -1.25e-7, "big": 1e400, "n": NaN, "inf": -Infinity, "zero": -0}',
    '{"text": "caf\\u00e9 \\ud83d\\ude00 \\n\\"quoted\\"", "raw": "naïve ünïcode"}'.encode(),
    b'{"dup": 1, "dup": 2}',
    b'  [ ]  ',
    b'"a lone string"',
    '{"utf16": "with a BOM"}'.encode("utf-16"),
    '\ufeff{"utf8": "with a BOM"}'.encode(),
    b'{"lone": "\\ud800"}',
]


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_the_value_is_json_loads_value(body):
    assert repr(loads_yielding(body)) == repr(json.loads(body))    # repr: NaN != NaN, -0.0 == 0


MALFORMED = [
    b'{"model": "m",}',
    b'{"model": "m"',
    b'{"model": "m"} trailing',
    b'\xff{"model": "m"}',
    b'{"model": "caf\xe9"}',
    b'{"n": ' + b"9" * 5000 + b"}",
    b"[" * 100_000 + b"]" * 100_000,
    b"",
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_body_raises_what_json_loads_raises(body):
    with pytest.raises(Exception) as expected:
        json.loads(body)
    with pytest.raises(type(expected.value)) as got:
        loads_yielding(body)
    assert str(got.value) == str(expected.value)


def _python_calls(fn, *args) -> int:
    """How many Python functions fn(*args) called (profiled on this thread)."""
    num_calls = 0

    def profile(frame, event, arg):
        nonlocal num_calls
        num_calls += event == "call"

    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return num_calls


@pytest.mark.parametrize("shape", ["token ids", "messages", "floats"])
def test_every_object_and_number_is_a_call_into_python(shape):
    # json's C scanner holds the GIL from the first byte to the last: on a thread it stalled the event
    # loop as long as on the loop. The GIL can pass to another thread only while Python code runs.
    num_items = 20_000
    value = {"token ids": [300, 301, 302] * num_items, "messages": [{"role": "user", "content": "hi"}] * num_items,
             "floats": [0.25] * num_items}[shape]
    body = json.dumps({"model": "m", "x": value}).encode()
    assert _python_calls(json.loads, body) < 100
    assert _python_calls(loads_yielding, body) >= len(value)
