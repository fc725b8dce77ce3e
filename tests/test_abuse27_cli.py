"""The command line and the LLM API as vLLM, Ollama and transformers users drive them."""
from __future__ import annotations

import pytest

from test_cli import run_main

def one_line(err: str) -> str:
    """The single line a failed command printed (asserting there is one, and no traceback)."""
    assert "Traceback" not in err, err
    [line] = err.strip().splitlines()
    return line


# ---- serve's start-up flags --------------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ("serve", "./no/such/model", "--device", "cpu"),
    ("router", "--prefill", "ftp://x", "--decode", "http://127.0.0.1:9"),
])
def test_an_empty_host_is_named_not_read_as_every_interface(capsys, command):
    # --host "" (an unset variable in `--host "$HOST"`) served on 0.0.0.0, open to the network. (The
    # model and the prefill URL are bad too, so that a --host taken as it was fails after binding.)
    status, out, err = run_main(capsys, *command, "--host", "")
    assert status == 2 and out == ""
    line = one_line(err)
    assert "'--host'" in line and "0.0.0.0" in line, line
