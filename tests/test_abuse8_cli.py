"""`minillm generate` as careless users run it: files with a byte-order mark, missing files, Ctrl-C."""
from __future__ import annotations

import json
import signal

import pytest

from test_abuse23_cli import read_until, start_long_generate
from test_cli import STORIES, minillm, needs_stories


@needs_stories
def test_a_prompts_file_with_a_byte_order_mark_reads_as_the_same_file_without_one(tmp_path):
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("Once upon\nLily\n", encoding="utf-8")
    marked.write_text("Once upon\nLily\n", encoding="utf-8-sig")
    args = ("generate", str(STORIES), "--device", "cpu", "--temperature", "0", "--max-tokens", "3", "--json")
    want = minillm(*args, "--prompts-file", str(plain))
    assert want.returncode == 0, want.stderr
    for got in (minillm(*args, "--prompts-file", str(marked)),
                minillm(*args, "--prompts-file", "-", stdin="\ufeffOnce upon\nLily\n")):
        assert got.returncode == 0, got.stderr
        records = [json.loads(line) for line in got.stdout.splitlines()]
        assert records[0]["prompt"] == "Once upon"
        assert got.stdout == want.stdout


def test_a_prompts_file_that_cannot_be_read_is_one_line_naming_the_option(tmp_path):
    for path, why in ((tmp_path / "missing.txt", "No such file or directory"), (tmp_path, "Is a directory")):
        result = minillm("generate", str(STORIES), "--device", "cpu", "--prompts-file", str(path))
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines() == [f"minillm: error: --prompts-file: cannot read {path}: {why}"]


@needs_stories
def test_ctrl_c_during_generate_exits_130_with_one_line_and_no_traceback(tmp_path):
    process = start_long_generate(tmp_path)
    # Interrupt once the progress bar is up: the batch is running then (it takes far longer than this).
    seen = read_until(process, process.stderr, b"req/s]")
    assert b"req/s]" in seen, seen
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    stderr = (seen + err).decode()
    assert process.returncode == 130 and "Traceback" not in stderr
    # The line is the last one; a Ctrl-C that lands while the bar is being drawn leaves it after the bar.
    assert stderr.rstrip().splitlines()[-1].endswith("minillm: interrupted")
    assert out == b""


def test_list_with_a_file_for_its_store_is_one_line_naming_the_option(tmp_path):
    store = tmp_path / "not-a-dir"
    store.write_text("x")
    result = minillm("list", "--download-dir", str(store))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"minillm: error: --download-dir {store} is not a directory"]


@pytest.mark.parametrize("args, message", [
    (("--request-rate", "0"), "--request-rate must be > 0 requests per second (inf: all at once), got 0.0"),
    (("--request-rate", "-2"), "--request-rate must be > 0 requests per second (inf: all at once), got -2.0"),
    (("--request-rate", "nan"), "--request-rate must be > 0 requests per second (inf: all at once), got nan"),
    (("--max-concurrency", "0"), "--max-concurrency must be >= 1 (leave it out for no cap), got 0"),
    (("--timeout", "-1"), "--timeout must be > 0 seconds, got -1.0"),
])
def test_bench_serving_refuses_rates_and_caps_it_cannot_use_before_connecting(args, message):
    # No server runs at this URL: an argument error must come first, not the connection failure.
    result = minillm("bench", "serving", "--base-url", "http://127.0.0.1:9", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"minillm bench serving: error: {message} (try 'minillm bench serving --help')"]


@needs_stories
def test_bench_output_files_that_cannot_be_written_fail_before_the_run(tmp_path):
    missing = tmp_path / "no" / "such" / "figures.json"
    result = minillm("bench", "throughput", "--model", str(STORIES), "--device", "cpu", "--json", str(missing))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stdout == ""                     # nothing ran: the workload line is not printed
    assert result.stderr.strip().splitlines() == [
        f"minillm bench throughput: error: --json {missing}: no such directory {missing.parent}"]
    result = minillm("bench", "serving", "--base-url", "http://127.0.0.1:9", "--result-file", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"minillm bench serving: error: --result-file {tmp_path} is a directory; give a file name"]


@pytest.mark.parametrize("args", [("generate", "", "-p", "Once"), ("chat", " "), ("serve", ""), ("pull", ""),
                                  ("pull", "  ")])
def test_an_empty_model_argument_is_named_not_read_as_the_current_directory(args):
    # It was "model directory . has no config.json", " is a local directory: there is nothing to
    # pull", or a fetch of the default model.
    result = minillm(*args, "--device", "cpu", stdin="") if args[0] != "pull" else minillm(*args)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "minillm: error: MODEL is empty: give a model directory or a Hugging Face repo id such as Qwen/Qwen3-0.6B"]
