"""The commands' help groups their options under headings (engine, sampling, server)."""
from __future__ import annotations

import pytest
from test_cli import run_main


def test_help_groups_the_options_under_their_headings(capsys):
    """The options carry their groups (engine, sampling, server), but the plain help listed all of them
    under one "Options:" heading, the engine's fifty among the command's own."""
    from minillm.cli import ENGINE_OPTIONS
    status, out, _ = run_main(capsys, "serve", "--help")
    assert status == 0
    headings = [line for line in out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert headings == ["Arguments:", "Options:", "Server options:", "KV transfer (prefill/decode disaggregation):",
                        "Engine options:"]
    engine = out.split("\nEngine options:\n")[1]
    for flag in ("--max-num-seqs", "--kv-cache-memory-bytes", "--scheduling-policy", "--kv-offload-gib"):
        assert f"  {flag}" in engine and f"  {flag}" not in out.split("\nEngine options:\n")[0]
    own = [line.split()[0] for line in out.split("\nServer options:\n")[0].splitlines() if line.startswith("  -")]
    assert own == ["--model", "--host", "--port", "--uds", "--api-key", "--served-model-name", "--config", "--monitor", "--seed", "-h,"]
    assert len(ENGINE_OPTIONS) == sum(1 for line in engine.splitlines() if line.startswith("  -"))
    status, out, _ = run_main(capsys, "generate", "--help")
    assert "\nSampling options:\n" in out and "\nStructured output (one of):\n" in out
    assert "  --temperature" in out.split("\nSampling options:\n")[1]


@pytest.mark.parametrize("command", ["chat", "generate", "serve", "router", "monitor", "pull", "list"])
def test_help_shows_a_value_as_one_value_of_its_type(capsys, command):
    """typer's metavars read as Python types: -p, --prompt <list[str]> (one prompt a flag), --port
    <int range>."""
    status, out, _ = run_main(capsys, command, "--help")
    assert status == 0
    assert "<list[" not in out and " range>" not in out, out


def test_every_option_says_what_it_does():
    """chat's --max-tokens and --seed, generate's --seed and --ignore-eos had no help text."""
    import typer

    from minillm.cli import app
    commands = typer.main.get_command(app).commands
    bare = [(name, p.opts[0]) for name, command in commands.items() for p in command.params
            if p.param_type_name == "option" and not (p.help or "").strip()]
    assert bare == []


def test_help_says_what_a_default_left_out_does(capsys):
    """--max-model-len is lowered to what the KV pool holds, and --host binds this machine alone where
    vLLM's binds every interface: the help said "the model's" and "0.0.0.0: every interface" only."""
    status, out, _ = run_main(capsys, "serve", "--help")
    flat = " ".join(out.split())
    assert status == 0
    assert "--max-model-len <int> Longest prompt + output (default: the model's, lowered to what the KV pool holds)" \
        in flat
    assert "this machine only by default, where vLLM binds every interface" in flat
