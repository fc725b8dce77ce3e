"""What a user who reads only the README and each command's --help runs into: messages that name the
command they typed, options that cannot be combined refused by name, and vLLM's flags that behave as
vLLM's do."""
from __future__ import annotations

import pytest
from test_cli import STORIES, needs_stories, run_main

from minillm.benchmarks import serving as bench_serving
from minillm.benchmarks.cli_args import BenchUsageError


# ---- run-batch ---------------------------------------------------------------------------------------

@needs_stories
def test_run_batch_names_itself_when_served_model_name_took_the_model(capsys, tmp_path):
    # the advice read "give the model first: minillm serve MODEL ...", a command the user had not typed
    batch = tmp_path / "in.jsonl"
    batch.write_text("")
    status, _, err = run_main(capsys, "run-batch", "-i", str(batch), "-o", str(tmp_path / "out.jsonl"),
                              "--device", "cpu", "--served-model-name", "a", str(STORIES))
    assert status == 1, err
    assert err.strip().endswith(f"give the model first: minillm run-batch {STORIES} --served-model-name ..."), err


# ---- bench serving -------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--base-url", "--peer-base-url"])
def test_bench_serving_refuses_a_unix_socket_url_by_name(option):
    # taken by the URL check, then every request failed: "no server answers at unix:PATH (UnsupportedProtocol)"
    with pytest.raises(BenchUsageError) as info:
        bench_serving.parse_args([option, "unix:/tmp/minillm.sock"])
    assert info.value.message.startswith(f"{option} unix:/tmp/minillm.sock: the benchmark's clients connect "
                                         "over TCP"), info.value.message

