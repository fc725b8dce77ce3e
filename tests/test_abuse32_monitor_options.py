"""`minillm monitor --demo --replay FILE`: two options that cannot be combined are a usage error (status 2
naming both), as every other such pair is; it was status 1."""
from __future__ import annotations

from test_cli import minillm


def test_demo_and_replay_together_are_a_usage_error(tmp_path):
    recording = tmp_path / "stats.jsonl"
    recording.write_text("")
    result = minillm("monitor", "--demo", "--replay", str(recording))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        "minillm monitor: error: --demo and --replay cannot be combined: give either --demo or --replay FILE "
        "(try 'minillm monitor --help')"]
