"""minillm bench throughput takes the engine flags `minillm generate` takes (vLLM's `vllm bench throughput`
takes its engine arguments): --num-gpu-blocks-override, --block-size, --enable-prefix-caching, --seed,
--load-format, --speculative-config, ...; a bad value is one line naming the flag."""
from __future__ import annotations

import json
import re

import pytest
from test_abuse29b_cli import one_line
from test_cli import STORIES, needs_stories, run_main

from minillm.benchmarks import throughput
from minillm.benchmarks.cli_args import BenchUsageError, run_main as run_bench_main
from minillm.benchmarks.workload import random_workload

MODEL = ("--model", str(STORIES), "--device", "cpu")
TINY = (*MODEL, "--num-prompts", "2", "--input-len", "4", "--output-len", "2")


@needs_stories
def test_generates_engine_flags_reach_the_engine(capsys, tmp_path):
    # each of these was 'unrecognized arguments'
    out_file = tmp_path / "figures.json"
    status, out, err = run_main(capsys, "bench", "throughput", *TINY, "--num-gpu-blocks-override", "40",
                                "--block-size", "8", "--max-model-len", "64", "--no-enable-prefix-caching", "--seed", "3",
                                "--load-format", "dummy", "--gpu-memory-utilization", "0.5",
                                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                                "--output-json", str(out_file))
    assert status == 0, err
    assert json.loads(out_file.read_text())["kv_blocks"] == 40


def test_the_engine_flags_are_parsed_under_generates_names_and_defaults():
    args = throughput.parse_args([*TINY, "--num_gpu_blocks_override", "40", "--block-size", "8", "--seed", "3",
                                  "--no-enable-prefix-caching", "--kv-offload-gib", "0", "--max-step-ms", "5",
                                  "--revision", "v1", "--download-dir", "/tmp/hub", "-tp", "1"])
    engine = throughput.engine_arguments(args)
    assert {k: engine[k] for k in ("num_kv_blocks", "block_size", "seed", "enable_prefix_caching", "max_step_ms",
                                   "revision", "download_dir", "tensor_parallel_size")} == {
        "num_kv_blocks": 40, "block_size": 8, "seed": 3, "enable_prefix_caching": False, "max_step_ms": 5.0,
        "revision": "v1", "download_dir": "/tmp/hub", "tensor_parallel_size": 1}
    defaults = throughput.engine_arguments(throughput.parse_args(list(TINY)))
    # the benchmark's own defaults where it has them, EngineConfig's for the rest
    assert (defaults["max_num_batched_tokens"], defaults["block_size"], defaults["enable_prefix_caching"],
            defaults["async_scheduling"], defaults["load_format"]) == (16384, 16, True, None, "auto")


@needs_stories
def test_the_seed_draws_the_random_dataset(capsys):
    lines = []
    for seed in ("0", "3"):
        status, out, err = run_main(capsys, "bench", "throughput", *MODEL, "--num-prompts", "4", "--input-len", "8",
                                    "--output-len", "2", "--random-range-ratio", "0.5", "--seed", seed)
        assert status == 0, err
        lines.append(out.splitlines()[0])
    drawn = [random_workload(4, 8, 2, 0.5, seed=seed) for seed in (0, 3)]
    counts = [f"{sum(map(len, w.prompts))} prompt tokens, {w.num_output_tokens} output tokens" for w in drawn]
    assert counts[0] != counts[1]       # the two seeds draw workloads told apart by the line
    assert counts[0] in lines[0] and counts[1] in lines[1], lines


@pytest.mark.parametrize("args, message", [
    (["--num-gpu-blocks-override", "0"], "--num-kv-blocks must be >= 1, got 0"),
    (["--block-size", "7"], "--block-size must be a power of two"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization must be in (0, 1], got nan"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**32 - 1], got -1"),
    (["--max-step-ms", "-1"], "--max-step-ms must be a finite number > 0 (or left out: off)"),
    (["--kv-offload-gib", "1", "--no-enable-prefix-caching"], "--kv-offload-gib needs --enable-prefix-caching"),
    (["--speculative-config", "[]"], "--speculative-config must be a dict"),
    (["--revision", ""], "argument --revision: is empty"),
    (["--load-format", "pt"], "argument --load-format: invalid choice: 'pt'"),
    (["--block-size", "x"], "argument --block-size: invalid int value: 'x'"),
])
def test_a_bad_engine_flag_is_a_usage_error_naming_it(args, message):
    with pytest.raises(BenchUsageError) as info:
        throughput.parse_args([*TINY, *args])
    assert message in info.value.message, info.value.message


@needs_stories
def test_a_setting_the_model_refuses_is_named_by_its_flags(capsys):
    # it was the engine's ValueError in its field names ("raise max_num_batched_tokens")
    status, _, err = run_main(capsys, "bench", "throughput", *TINY, "--no-enable-chunked-prefill",
                              "--max-num-batched-tokens", "64")
    assert status == 2
    assert ("error: --max-num-batched-tokens 64 is smaller than --max-model-len 512: with "
            "--no-enable-chunked-prefill") in one_line(err)


def test_a_model_that_is_not_there_is_one_line_from_the_script_too(capsys, tmp_path):
    # python3 -m minillm.benchmarks.throughput printed a FileNotFoundError's traceback
    status = run_bench_main(throughput.main, throughput.PROG, ["--model", str(tmp_path / "none"), "--device", "cpu"])
    assert status == 1
    assert one_line(capsys.readouterr().err) == f"minillm bench throughput: error: no such directory: {tmp_path}/none"


# bench serving: vLLM bench serve's --ignore-eos, --top-p / --top-k / --min-p and --burstiness were
# each 'unrecognized arguments'.

def test_serving_sends_vllms_sampling_options_with_each_request():
    from minillm.benchmarks import serving
    args = serving.parse_args(["--ignore-eos", "--top-p", "0.9", "--top-k", "5", "--min-p", "0.1"])
    body = serving.request_body(args, "m", "hi")
    assert (body["ignore_eos"], body["top_p"], body["top_k"], body["min_p"]) == (True, 0.9, 5, 0.1)
    assert "top_p" not in serving.request_body(serving.parse_args([]), "m", "hi")     # the server's default


@pytest.mark.parametrize("args, message", [
    (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["--top-k", "-3"], "--top-k must be -1 (off), 0 (off) or a positive integer, got -3"),
    (["--min-p", "nan"], "--min-p must be a finite number, got nan"),
    (["--burstiness", "0"], "--burstiness must be a finite number > 0, got 0.0"),
    (["--burstiness", "inf"], "--burstiness must be a finite number > 0, got inf"),
    (["--mixed-users", "2", "--burstiness", "2"], "--burstiness is not used by --mixed-users"),
])
def test_serving_refuses_a_bad_vllm_option_naming_it(args, message):
    from minillm.benchmarks import serving
    with pytest.raises(BenchUsageError) as info:
        serving.parse_args(args)
    assert message in info.value.message, info.value.message


@pytest.mark.parametrize("burstiness", [1.0, 0.25])
def test_burstiness_draws_gamma_gaps_of_the_rates_mean(monkeypatch, burstiness):
    import asyncio
    import random

    from minillm.benchmarks import serving
    gaps = []

    async def record(seconds):
        gaps.append(seconds)
    monkeypatch.setattr(serving.asyncio, "sleep", record)

    async def drain():
        return [i async for i in serving.arrivals(5, 4.0, random.Random(7), burstiness)]
    assert asyncio.run(drain()) == list(range(5))
    rng = random.Random(7)
    # a shape of 1 is the Poisson process's exponential gaps, as vLLM draws them
    expected = [rng.expovariate(4.0) if burstiness == 1 else rng.gammavariate(burstiness, 1 / (4.0 * burstiness))
                for _ in range(4)]
    assert gaps == expected


def test_help_shows_defaults_of_one_and_zero_but_not_of_switches(capsys):
    # 1 == True and 0 == False: a default of 1 or 0 was hidden as if it were a switch's
    status, out, err = run_main(capsys, "bench", "throughput", "--help")
    assert status == 0, err
    options = [" ".join(o.split()) for o in re.split(r"\n  --", out)]     # an option's line and its help
    seed = next(o for o in options if o.startswith("seed <int>"))
    assert "[default: 0]" in seed
    assert not [o for o in options if "[default: True]" in o or "[default: False]" in o]
