"""Engine option errors in the flags' words: --kv-cache-memory-bytes, --max-step-ms."""
from __future__ import annotations

import pytest

from test_abuse30b_cli import usage_error_line
from test_cli import minillm


# ---- messages in the flags' words -------------------------------------------------------------------

@pytest.mark.parametrize("command", [("generate", "-p", "Once"), ("serve",)])
def test_kv_cache_memory_bytes_errors_name_the_flag_not_the_field(tmp_path, command):
    name, *rest = command
    result = minillm(name, str(tmp_path / "no-model"), *rest, "--device", "cpu", "--kv-cache-memory-bytes", "0")
    assert usage_error_line(result) == (f"minillm {name}: error: Invalid value for '--kv-cache-memory-bytes': must "
                                        f"be >= 1 (or left out: sized by the engine), got 0 (try 'minillm {name} "
                                        "--help')")
    result = minillm(name, str(tmp_path / "no-model"), *rest, "--device", "cpu", "--kv-cache-memory-bytes", "1000T")
    line = usage_error_line(result)
    assert line.startswith(f"minillm {name}: error: Invalid value for '--kv-cache-memory-bytes': 1024000.0 GiB "
                           "exceeds the "), line
    assert line.endswith("GiB of memory available; lower --kv-cache-memory-bytes (try "
                         f"'minillm {name} --help')"), line
    assert "kv_cache_memory_bytes" not in line


def test_max_step_ms_says_how_to_turn_it_off_in_flag_words(tmp_path):
    result = minillm("generate", str(tmp_path / "no-model"), "-p", "Once", "--device", "cpu", "--max-step-ms", "-1")
    assert usage_error_line(result) == ("minillm generate: error: Invalid value for '--max-step-ms': must be a "
                                        "finite number > 0 (or left out: off), got -1.0 (try 'minillm generate "
                                        "--help')")
