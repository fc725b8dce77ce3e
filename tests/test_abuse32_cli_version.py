"""`minillm -v` prints the version, as `vllm -v` and `ollama -v` do (it was 'No such option: -v')."""
from __future__ import annotations

from test_cli import minillm

from minillm import __version__


def test_dash_v_is_version():
    for flag in ("-v", "--version"):
        result = minillm(flag)
        assert (result.returncode, result.stdout, result.stderr) == (0, f"minillm {__version__}\n", "")
