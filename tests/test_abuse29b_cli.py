"""The command line as vLLM users type it: option names with underscores, as vLLM's parser takes
them (--max_model_len), and unknown benchmark options answered with the close names."""
from __future__ import annotations

import json

import pytest
from test_abuse28_cli import started  # noqa: F401 - serve's run_server stubbed, as a fixture
from test_cli import STORIES, needs_stories, run_main


def one_line(err: str) -> str:
    """The single line a failed command printed (asserting there is one, and no traceback)."""
    assert "Traceback" not in err, err
    [line] = err.strip().splitlines()
    return line


# ---- option names with underscores, as vLLM's parser takes them -------------------------------------

@needs_stories
def test_serve_takes_vllms_option_names_with_underscores(capsys, started):  # noqa: F811
    # vLLM's FlexibleArgumentParser reads --max_model_len as --max-model-len; minillm said "No such option".
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--port", "0",
                              "--max_model_len", "64", "--gpu_memory_utilization=0.5",
                              "--served_model_name", "a", "b", "--enable_prefix_caching")
    assert status == 0, err
    assert (started["config"].max_model_len, started["config"].gpu_memory_utilization) == (64, 0.5)
    assert started["options"].served_model_name == ("a", "b")


@needs_stories
def test_generate_takes_underscores_in_option_names_and_leaves_values_alone(capsys):
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "--temperature=0",
                                "--max_tokens", "2", "-p", "--max_tokens", "--json")
    assert status == 0, err
    [record] = [json.loads(line) for line in out.splitlines()]
    assert record["prompt"] == "--max_tokens" and len(record["outputs"][0]["token_ids"]) == 2


def test_an_unknown_option_with_underscores_is_still_refused(capsys):
    status, _, err = run_main(capsys, "generate", str(STORIES), "-p", "x", "--max_tokenz", "2")
    assert status == 2
    assert "No such option: --max_tokenz (Possible options: --max-tokens" in one_line(err)   # as typed


@pytest.mark.parametrize("args, message", [
    (("--num_seqs", "0"), "--num-seqs must be in [1, 65536], got 0"),
    (("--max_input_len=0",), "--max-input-len must be in [1, 1048576], got 0"),
])
def test_bench_takes_underscores_in_option_names(capsys, args, message):
    status, _, err = run_main(capsys, "bench", "throughput", "--model", str(STORIES), "--device", "cpu", *args)
    assert status == 2 and message in one_line(err)


# ---- unknown benchmark options name the close ones, as click's commands do -----------------------------

@pytest.mark.parametrize("args, close", [
    (("--dataset-path", "x.json"), "--dataset-name"),   # vLLM's bench throughput name (minillm reads no dataset file)
    (("--input-length", "32"), "--input-len"),
    (("--tempreature", "0"), "--temperature"),
])
def test_an_unknown_bench_option_names_the_close_ones(capsys, args, close):
    status, _, err = run_main(capsys, "bench", "throughput", "--model", str(STORIES), "--device", "cpu", *args)
    line = one_line(err)
    assert status == 2
    assert f"unrecognized arguments: {' '.join(args)} (possible options: {close}" in line, line


def test_an_unknown_bench_option_with_nothing_close_is_named_alone(capsys):
    status, _, err = run_main(capsys, "bench", "throughput", "--frobnicate")
    assert status == 2
    assert one_line(err) == ("minillm bench throughput: error: unrecognized arguments: --frobnicate "
                             "(try 'minillm bench throughput --help')")


@pytest.mark.parametrize("args, matches", [
    (("bench", "throughput", "--temp", "0.5", "--max-n", "5"), "--max-num-batched-tokens, --max-num-seqs"),
    (("bench", "serving", "--num", "5"), "--num-client-processes, --num-prompts"),
])
def test_an_ambiguous_bench_option_prefix_names_what_it_could_match(capsys, args, matches):
    # As vLLM's bench parsers (argparse's allow_abbrev) and minillm's other commands (tests/test_abuse41_cli.py):
    # an unambiguous prefix is its option (--temp), an ambiguous one a usage error naming each it begins.
    status, _, err = run_main(capsys, *args)
    assert status == 2
    assert f"ambiguous option: {args[-2]} could match {matches} " in one_line(err), one_line(err)


def test_choices_keep_their_underscores_in_help_and_errors(capsys):
    # Reading option names with dashes for underscores also rewrote the choices click shows:
    # serve --help offered <hermes|llama3-json> and <deepseek-r1|qwen3>, vLLM's names spelt otherwise.
    status, out, _ = run_main(capsys, "serve", "--help")
    assert status == 0
    assert "--tool-call-parser <hermes|llama3_json>" in out and "--reasoning-parser <deepseek_r1|qwen3>" in out
    status, _, err = run_main(capsys, "serve", str(STORIES), "--tool-call-parser", "pythonic")
    assert status == 2 and "'hermes', 'llama3_json'" in one_line(err)
