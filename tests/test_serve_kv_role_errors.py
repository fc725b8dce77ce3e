"""serve's --kv-role alone sets the engine's kv_transfer_config: an error about that config names
--kv-role, the flag the command line had (it named --kv-transfer-config, which was not given)."""
from __future__ import annotations

import pytest
from test_cli import STORIES, minillm, needs_stories


@needs_stories
@pytest.mark.parametrize("args, line", [
    (("-tp", "2", "--kv-role", "producer"), "Invalid value for '--kv-role': works with --tensor-parallel-size 1 only"),
    (("--kv-role", "producer", "--kv-offload-gib", "1"), "--kv-role and --kv-offload-gib cannot be combined"),
    (("-tp", "2", "--kv-transfer-config", '{"kv_role": "kv_producer"}'),
     "Invalid value for '--kv-transfer-config': works with --tensor-parallel-size 1 only"),
    (("-tp", "2", "--kv-role", "producer", "--kv-transfer-config", '{"kv_port": 14600}'),
     "Invalid value for '--kv-transfer-config': works with --tensor-parallel-size 1 only"),
])
def test_kv_transfer_errors_name_the_flag_given(args, line):
    result = minillm("serve", str(STORIES), "--device", "cpu", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert line in result.stderr.strip().splitlines()[-1], result.stderr
