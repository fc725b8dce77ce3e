"""`vllm serve` command lines given to `minillm serve`: each vLLM flag is taken with vLLM's meaning or
refused as a usage error (status 2) that names it and says why; the help groups the options."""
from __future__ import annotations

import pytest
import test_abuse22_api_cli
from test_abuse29b_cli import one_line
from test_cli import STORIES, needs_stories, run_main

started = test_abuse22_api_cli.started      # a fixture


def serve(capsys, *flags: str) -> tuple[int, str]:
    """`minillm serve stories260K --device cpu FLAGS` in this process: (exit status, stderr)."""
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", *flags)
    return status, err



@needs_stories
@pytest.mark.parametrize("flags, message", [
    (("--enable-log-requests", "--disable-log-requests"), "--enable-log-requests and --disable-log-requests"),
    (("--no-enable-chunked-prefill", "--max-num-batched-tokens", "64", "--max-model-len", "128"),
     "--no-enable-chunked-prefill"),
    (("--monitor", "--enable-log-requests"), "--enable-log-requests would log over it"),
    (("--kv-lease-s", "3"), "--kv-lease-s needs --kv-role or --kv-transfer-config"),
    (("--kv-transfer-config", "{"), "'--kv-transfer-config': is not valid JSON"),
    (("--kv-transfer-config", "[1]"), "'--kv-transfer-config': must be a JSON object"),
    (("--kv-role", "producer", "--kv-transfer-config", '{"kv_role": "kv_consumer"}'),
     "--kv-role producer and --kv-transfer-config's kv_role kv_consumer disagree"),
    (("--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'),
     "'--kv-transfer-config': kv_connector must be one of PDConnector, got 'NixlConnector'"),
    (("--allowed-origins", "*"), "'--allowed-origins': takes a JSON list of strings"),
])
def test_a_vllm_flag_minillm_cannot_honour_is_a_usage_error(capsys, started, monkeypatch, flags, message):
    """These were status 1 ("minillm: error: ..."), as a failure of the machine is; a command line that
    cannot work is a usage error, status 2, as every other bad flag is."""
    monkeypatch.setattr("minillm.chat_terminal.is_terminal", lambda stream: True)
    status, err = serve(capsys, *flags)
    line = one_line(err)
    assert (status, started) == (2, {}), line
    assert line.startswith("minillm serve: error: ") and message in line, line


@needs_stories
def test_kv_cache_memory_bytes_beside_num_kv_blocks_says_it_is_not_used(capsys, started):
    """--num-kv-blocks sets the pool's size, as vLLM's --num-gpu-blocks-override does: the memory budget
    given beside it was dropped without a word."""
    status, err = serve(capsys, "--num-kv-blocks", "8", "--kv-cache-memory-bytes", "1M")
    assert status == 0
    assert ("minillm: --kv-cache-memory-bytes is not used: --num-kv-blocks sets the KV pool's size "
            "(8 blocks)") in err.splitlines()
    assert started["config"].num_kv_blocks == 8
