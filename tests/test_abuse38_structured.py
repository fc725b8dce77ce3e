"""Structured outputs that no output satisfies, refused where the request enters (stories260K, CPU): the
Python API's ValueError and the CLI's usage error name the field, as the server's 400 does."""
from __future__ import annotations

import subprocess
import sys

import pytest

from minillm.structured_output import StructuredOutputsError, StructuredOutputsParams

LOOP = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize("kwargs,field", [
    (dict(regex=r"[^\s\S]"), "regex"),
    (dict(regex=r"a[^\s\S]|(b|c)*d[^\s\S]"), "regex"),
    (dict(grammar='start: a\na: a "x"\n'), "grammar"),        # only left-recursive
    (dict(grammar='start: start "a"'), "grammar"),
    (dict(json=LOOP), "json"),
], ids=["empty class", "dead ends", "lark rule", "lark start", "ref loop"])
def test_a_constraint_no_output_satisfies_is_a_value_error_naming_the_field(kwargs, field):
    # They passed the check (which had no tokenizer) and every request with them ended with
    # finish_reason "error"; the server's 400 came only after the engine's compile, and `minillm
    # generate` ran the model first. A byte-level first mask tells, whatever the tokenizer.
    with pytest.raises(StructuredOutputsError, match=f"^{field}: no output satisfies the ") as err:
        StructuredOutputsParams(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize("kwargs", [
    dict(regex=""), dict(grammar='start: ""'), dict(regex="a{1000000}"), dict(regex="(a{1000}){1000}x"),
    dict(regex="|".join(f"w{i}x{i * 7}" for i in range(3000))),          # past the probe's limits
    dict(grammar="start: <[5]>"), dict(grammar="start: <[^0-256]>"),       # token ids: the model's to judge
    dict(json={"$defs": {"N": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/N"},
                                                                                  {"type": "null"}]}}}},
               "$ref": "#/$defs/N"}),
], ids=["empty regex", "empty grammar", "long repeat", "nested repeat", "many words", "token", "token range",
        "recursive"])
def test_a_constraint_some_output_satisfies_passes_the_check(kwargs):
    assert StructuredOutputsParams(**kwargs).key


def test_generate_refuses_it_before_the_model_loads(stories_path):
    result = subprocess.run([sys.executable, "-m", "minillm", "generate", str(stories_path), "--device", "cpu",
                             "-p", "Once upon", "--regex", r"[^\s\S]"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "minillm generate: error: --regex: no output satisfies the regular expression" in result.stderr
    assert "KV pool" not in result.stderr and result.stdout == "", (result.stdout, result.stderr)
