"""Help as git, ollama and cargo users ask for it: `minillm help generate`."""
from __future__ import annotations

import pytest
from test_abuse29b_cli import one_line
from test_cli import run_main


@pytest.mark.parametrize("words", [(), ("generate",), ("bench",), ("bench", "throughput"), ("router",)])
def test_help_command_prints_the_commands_help(capsys, words):
    status, out, err = run_main(capsys, "help", *words)
    assert (status, err) == (0, "")
    assert run_main(capsys, *words, "--help") == (0, out, "")
    assert out.startswith(f"Usage: minillm {' '.join(words)}".rstrip() + " ")


@pytest.mark.parametrize("words, message", [
    (("genrate",), "No such command 'genrate'."),
    (("generate", "now"), "'minillm generate' has no subcommand 'now'."),
    (("bench", "throughputs"), "No such command 'bench throughputs'."),
])
def test_help_for_a_command_that_does_not_exist_is_a_usage_error(capsys, words, message):
    status, out, err = run_main(capsys, "help", *words)
    assert (status, out) == (2, "")
    assert one_line(err) == f"minillm help: error: {message} (try 'minillm help --help')"
