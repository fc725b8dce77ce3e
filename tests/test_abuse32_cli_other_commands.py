"""vLLM's and Ollama's commands minillm has under another name: `minillm run MODEL` (Ollama) and
`minillm complete` (vLLM) said only "No such command"; the error now names the minillm command."""
from __future__ import annotations

import pytest
from test_cli import minillm


@pytest.mark.parametrize("args, hint", [
    (["run", "m"], "Ollama's run is minillm chat MODEL (-q MESSAGE for one reply)"),
    (["complete", "-q", "x"], "vLLM's complete is minillm generate MODEL -p TEXT offline, or minillm chat --url "
                              "URL -q TEXT against a server (a model without a chat template continues the text)"),
])
def test_another_tools_command_names_minillms(args, hint):
    result = minillm(*args)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [f"minillm: error: No such command '{args[0]}': {hint} "
                                          f"(try 'minillm --help')"]


def test_any_other_unknown_command_is_said_as_before():
    result = minillm("nope")
    assert result.stderr.splitlines() == ["minillm: error: No such command 'nope'. (try 'minillm --help')"]
