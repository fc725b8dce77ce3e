"""Bad values of --kv-lease-s: usage errors naming the flag, not status 1 (serve's other limits: test_abuse11_cli)."""
from __future__ import annotations

import subprocess

import pytest

from test_cli import minillm


def usage_error_line(result: subprocess.CompletedProcess) -> str:
    """The single stderr line of a command that failed with click's usage-error status."""
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    return line


# ---- --kv-lease-s (serve's other limits: test_abuse11_cli) ------------------------------------------

@pytest.mark.parametrize("value, shown", [("-1", "-1.0"), ("0", "0.0"), ("inf", "inf")])
def test_a_kv_lease_that_is_no_limit_is_a_usage_error_naming_the_flag(tmp_path, value, shown):
    result = minillm("serve", str(tmp_path / "no-model"), "--device", "cpu", "--kv-role", "producer",
                     "--kv-lease-s", value)
    assert usage_error_line(result) == (f"minillm serve: error: Invalid value for '--kv-lease-s': must be a finite "
                                        f"number > 0, got {shown} (try 'minillm serve --help')")
