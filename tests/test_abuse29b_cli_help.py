"""Help as git, ollama and cargo users ask for it (`minillm help generate`), and an option missing its
value, or given one it does not take, named with its command as every other usage error is."""
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


@pytest.mark.parametrize("args, command", [
    (("generate", "m", "-p"), "minillm generate"),
    (("generate", "m", "--json=true"), "minillm generate"),
    (("bench", "serving", "--num-prompts"), "minillm bench serving"),
    (("--version=1",), "minillm"),
])
def test_an_option_missing_its_value_is_named_with_its_command(capsys, args, command):
    # "minillm: error: Option '-p' requires an argument.": the command and the hint to its help left out.
    status, _, err = run_main(capsys, *args)
    line = one_line(err)
    assert status == 2
    assert line.startswith(f"{command}: error: ") and line.endswith(f"(try '{command} --help')"), line
