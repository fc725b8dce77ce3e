"""minillm bench throughput driven with vLLM's `vllm bench throughput` command lines: --num-prompts,
--input-len / --output-len (every request of those lengths: vLLM's random dataset), --random-range-ratio,
--dataset-name random and --output-json."""
from __future__ import annotations

import json
import re

import pytest
from test_abuse29b_cli import one_line
from test_cli import STORIES, needs_stories, run_main

from minillm.benchmarks import throughput
from minillm.benchmarks.cli_args import BenchUsageError
from minillm.benchmarks.workload import random_workload

MODEL = ("--model", str(STORIES), "--device", "cpu")


@needs_stories
def test_a_vllm_bench_throughput_command_line_runs_with_fixed_lengths(capsys, tmp_path):
    # --num-prompts, --input-len, --output-len and --output-json were each 'unrecognized arguments'.
    out_file = tmp_path / "throughput.json"
    status, out, err = run_main(capsys, "bench", "throughput", *MODEL, "--dataset-name", "random",
                                "--num-prompts", "3", "--input-len", "5", "--output-len", "2",
                                "--output-json", str(out_file))
    assert status == 0, err
    assert re.search(r"^workload: 3 requests, 15 prompt tokens, 6 output tokens\b", out, re.M), out
    figures = json.loads(out_file.read_text())
    assert figures["output_tokens"] == 6
    # vLLM's keys of --output-json, beside minillm's own
    assert figures["num_requests"] == 3 and figures["total_num_tokens"] == 15 + 6
    assert figures["elapsed_time"] == figures["seconds"] > 0
    assert figures["requests_per_second"] == pytest.approx(3 / figures["seconds"])
    assert figures["tokens_per_second"] == pytest.approx(21 / figures["seconds"])


def test_fixed_lengths_are_every_requests_and_a_range_ratio_spreads_them_as_vllm_does():
    fixed = random_workload(50, 7, 3)
    assert {len(p) for p in fixed.prompts} == {7} and set(fixed.max_tokens) == {3}
    spread = random_workload(400, 10, 10, range_ratio=0.25)
    # vLLM's bounds: [floor(len * (1 - r)), ceil(len * (1 + r))]
    assert {len(p) for p in spread.prompts} == set(range(7, 14))
    assert set(spread.max_tokens) == set(range(7, 14))
    assert random_workload(400, 10, 1, range_ratio=0.9).max_tokens.count(0) == 0    # outputs of 1 token at least


@needs_stories
def test_the_random_names_of_the_lengths_are_taken_too():
    args = throughput.parse_args([*MODEL, "--random-input-len", "6", "--random-output-len", "4",
                                  "--random-range-ratio", "0.5"])
    throughput.resolve_defaults(args)
    assert (args.input_len, args.output_len, args.random_range_ratio) == (6, 4, 0.5)
    # the longest request (9 + 6 tokens) is held against the model's length
    with pytest.raises(throughput.BenchError, match=r"--input-len 300 \(up to 450 with --random-range-ratio 0.5\) "
                                                    r"\+ --output-len 100 \(up to 150\) = 600 tokens"):
        throughput.resolve_defaults(throughput.parse_args([*MODEL, "--input-len", "300", "--output-len", "100",
                                                           "--random-range-ratio", "0.5"]))


@needs_stories
def test_the_random_dataset_alone_fills_in_the_lengths():
    args = throughput.parse_args([*MODEL, "--dataset-name", "random"])
    throughput.resolve_defaults(args)
    assert (args.workload, args.input_len, args.output_len) == ("random", 128, 128)
    args = throughput.parse_args([*MODEL, "--num-seqs", "2"])
    throughput.resolve_defaults(args)
    assert (args.workload, args.max_input_len, args.max_output_len) == ("nano-vllm", 128, 128)


@pytest.mark.parametrize("args, message", [
    (["--num-seqs", "4", "--num-prompts", "5"], "--num-seqs 4 and --num-prompts 5"),
    (["--input-len", "8", "--random-input-len", "9"], "--input-len 8 and --random-input-len 9"),
    (["--output-len", "8", "--random-output-len", "9"], "--output-len 8 and --random-output-len 9"),
    (["--json", "a.json", "--output-json", "b.json"], "--json a.json and --output-json b.json"),
    (["--input-len", "8", "--max-input-len", "64"], "--input-len and --max-input-len"),
    (["--random-input-len", "8", "--max-output-len", "64"], "--random-input-len and --max-output-len"),
    (["--dataset-name", "random", "--max-input-len", "64"], "--dataset-name random and --max-input-len"),
    (["--random-range-ratio", "0.5", "--max-output-len", "64"], "--random-range-ratio and --max-output-len"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt: minillm bench throughput reads no dataset files; "
                                     "the one dataset it supports is random"),
    (["--dataset-name", "nope"], "--dataset-name nope: minillm bench throughput reads no dataset files"),
    (["--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1), got 1.0"),
    (["--random-range-ratio", "-0.1"], "--random-range-ratio must be in [0, 1), got -0.1"),
    (["--random-range-ratio", "nan"], "--random-range-ratio must be in [0, 1), got nan"),
    (["--num-prompts", "0"], "--num-prompts must be in [1, 65536], got 0"),
    (["--input-len", "0"], "--input-len must be in [1, 1048576], got 0"),
    (["--random-output-len", "0"], "--random-output-len must be in [1, 1048576], got 0"),
    (["--output-json", ""], "--output-json is empty"),
])
def test_conflicting_or_bad_vllm_options_are_usage_errors_naming_the_flags(args, message):
    with pytest.raises(BenchUsageError) as info:
        throughput.parse_args([*MODEL, *args])
    assert message in info.value.message, info.value.message


def test_agreeing_names_of_one_option_are_taken():
    args = throughput.parse_args([*MODEL, "--num-seqs", "4", "--num-prompts", "4", "--output-json", "f.json",
                                  "--json", "f.json", "--input-len", "3", "--random-input-len", "3"])
    assert (args.num_seqs, args.json, args.input_len) == (4, "f.json", 3)


@needs_stories
def test_a_prompt_drawn_empty_by_the_range_ratio_is_refused_naming_both(capsys):
    status, _, err = run_main(capsys, "bench", "throughput", *MODEL, "--input-len", "1", "--random-range-ratio", "0.5")
    assert status == 2
    assert ("--input-len 1 with --random-range-ratio 0.5 draws prompts of 0 tokens; raise --input-len or lower "
            "--random-range-ratio") in one_line(err)


@needs_stories
def test_the_workload_bound_names_the_flag_typed(capsys):
    status, _, err = run_main(capsys, "bench", "throughput", *MODEL, "--num-prompts", "65536", "--input-len", "1000")
    assert status == 2
    assert "--num-prompts 65536 x --input-len 1000 = 65536000 prompt tokens" in one_line(err)
    status, _, err = run_main(capsys, "bench", "throughput", *MODEL, "--output-json", str(STORIES / "none" / "x.json"))
    assert status == 1
    assert one_line(err).startswith("minillm bench throughput: error: --output-json ")
