"""Options a workload has no use for are usage errors naming them, not passed over in silence:
--mixed-users runs its own closed-loop users for --duration seconds (no --num-prompts, --request-rate,
--max-concurrency, prompts, client processes, detailed requests or step trace), and
--concurrency-sweep sets the concurrency of each run itself (no --max-concurrency)."""
from __future__ import annotations

import pytest

from minillm.benchmarks import serving as bench
from minillm.benchmarks.cli_args import BenchUsageError


@pytest.mark.parametrize("extra, flag", [
    (["--num-prompts", "50"], "--num-prompts"),
    (["--request-rate", "4"], "--request-rate"),
    (["--max-concurrency", "8"], "--max-concurrency"),
    (["--num-client-processes", "2"], "--num-client-processes"),
    (["--prompt", "Once upon a time"], "--prompt"),
    (["--save-detailed", "--result-file", "r.json"], "--save-detailed"),
    (["--step-trace", "--result-file", "r.json"], "--step-trace"),
])
def test_options_the_mixed_workload_does_not_use_are_usage_errors(extra, flag):
    with pytest.raises(BenchUsageError, match=rf"{flag} (is|are) not used by --mixed-users"):
        bench.parse_args(["--mixed-users", "2", *extra])


def test_the_mixed_workload_takes_its_own_options():
    args = bench.parse_args(["--mixed-users", "2", "--input-len", "8", "--output-len", "4", "--duration", "1",
                             "--result-file", "r.json", "--percentile-metrics", "ttft,itl"])
    assert args.mixed_users == 2


def test_max_concurrency_beside_a_concurrency_sweep_is_a_usage_error():
    with pytest.raises(BenchUsageError, match=r"--max-concurrency is not used by --concurrency-sweep"):
        bench.parse_args(["--concurrency-sweep", "1,4", "--max-concurrency", "8"])
    assert bench.parse_args(["--concurrency-sweep", "1,4"]).concurrency_sweep == [1, 4]
