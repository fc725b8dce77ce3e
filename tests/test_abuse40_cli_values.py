"""An option's value is never read as an option name: the words the command line rewrites (underscores
in a name read as dashes, a JSON option's dotted form folded into its object, --config FILE, vLLM's flags
that minillm refuses) are only those where an option may stand, as the command's own parser reads them;
the value of the option before (-p --speculative-config.method) and every word after a bare "--" are
kept as they are."""
from __future__ import annotations

import json

import pytest
from test_abuse28_cli import started  # noqa: F401 - serve's run_server stubbed, as a fixture
from test_cli import STORIES, needs_stories, run_main

from minillm.argparse_utils import FlexibleArgumentParser, option_positions
from minillm.benchmarks import serving, serving_gaps
from minillm.cli import dotted_json_options, spread_option_values
from minillm.engine_args import EngineArgs

VALUES = ["--max_model_len", "--speculative-config.method", "--speculative_config.method=ngram", "-q", "--config",
          "--speculative_config.num_speculative_tokens 3"]


# ---- which words stand where an option may ----------------------------------------------------------------

def test_option_positions_skip_values_and_what_follows_a_double_dash():
    counts = {"-p": 1, "--prompt": 1, "--json": 0, "--speculative-config": 1, "--served-model-name": -1}
    args = ["m", "-p", "--json", "--json", "--speculative_config.method", "--x", "-p5", "--y",
            "--served-model-name", "a", "b", "--prompt=--z", "--", "--json"]
    assert option_positions(args, counts) == [True, True, False, True, True, False, True, True,
                                              True, False, False, True, True, False]


def test_a_dotted_word_that_is_an_options_value_is_not_folded():
    counts = {"-p": 1, "--stop": 1, "--json": 0}
    args = ["m", "-p", "--speculative-config.method", "--stop", "--speculative_config.x", "--json"]
    assert dotted_json_options(args, {"--speculative-config"}, counts) == args


def test_a_spread_option_that_is_an_options_value_is_not_spread():
    args = ["--response-role", "--served_model_name", "a", "b"]
    assert spread_option_values(args, ("--served-model-name",), {"--response-role": 1}) == args
    assert spread_option_values(["--served_model_name", "a", "b"], ("--served-model-name",), {}) == \
        ["--served-model-name", "a", "--served-model-name", "b"]


# ---- minillm generate ------------------------------------------------------------------------------------------

@needs_stories
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("flag", ["-p", "--prompt", "--stop"])
def test_generate_keeps_an_option_value_that_reads_like_an_option(capsys, flag, value):
    prompt = ["-p", "Once"] if flag == "--stop" else []
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "--temperature", "0",
                                *prompt, "--max_tokens", "2", flag, value, "--json")
    assert status == 0, err
    [record] = [json.loads(line) for line in out.splitlines()]
    assert record["prompt"] == ("Once" if flag == "--stop" else value)
    assert len(record["outputs"][0]["token_ids"]) == 2


@needs_stories
def test_generate_still_folds_the_dotted_form_after_a_value(capsys):
    # The value "-p X" is skipped as one, and the dotted key after it is still an option.
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "--temperature", "0",
                                "-p", "--speculative_config.method", "--speculative_config.method", "ngram",
                                "--speculative-config.num_speculative_tokens", "2", "--max-tokens", "2", "--json")
    assert status == 0, err
    assert json.loads(out)["prompt"] == "--speculative_config.method"


# ---- minillm serve and run-batch: --config, refused flags, the dotted form --------------------------------------

@needs_stories
@pytest.mark.parametrize("value", VALUES)
def test_serve_keeps_a_response_role_that_reads_like_an_option(capsys, started, value):  # noqa: F811
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--response-role", value,
                              "--served_model_name", "a", "b")
    assert status == 0, err
    assert started["options"].response_role == value and started["options"].served_model_name == ("a", "b")


@needs_stories
def test_serve_reads_a_config_file_named_after_an_option_whose_value_is_config(capsys, started, tmp_path):  # noqa: F811
    config = tmp_path / "options.yaml"
    config.write_text("max-model-len: 64\nresponse-role: from-file\n", encoding="utf-8")
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--response-role", "--config",
                              "--config", str(config))
    assert status == 0, err
    assert started["options"].response_role == "--config" and started["config"].max_model_len == 64


@pytest.fixture
def batch_run(monkeypatch, tmp_path):
    """run-batch's engine run stubbed: the options and the engine config it was given."""
    seen: dict = {}

    def fake_run_batch_engine(config, engine_core, options, lines, files):
        from minillm.run_batch import BatchSummary
        seen.update(config=config, options=options, files=files)
        return BatchSummary()

    monkeypatch.setattr("minillm.cli.run_batch_engine", fake_run_batch_engine)
    (tmp_path / "in.jsonl").write_text("", encoding="utf-8")
    return seen, ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]


@needs_stories
@pytest.mark.parametrize("value", VALUES)
def test_run_batch_keeps_option_values_that_read_like_options(capsys, batch_run, value, tmp_path, monkeypatch):
    seen, files = batch_run
    monkeypatch.chdir(tmp_path)
    (tmp_path / value).mkdir()          # the --output-tmp-dir named as the value
    status, _, err = run_main(capsys, "run-batch", str(STORIES), *files, "--device", "cpu",
                              "--response-role", value, "--output-tmp-dir", value, "--max_model_len", "64")
    assert status == 0, err
    assert (seen["options"].response_role, seen["files"].output_tmp_dir) == (value, value)
    assert seen["config"].max_model_len == 64


@needs_stories
def test_run_batch_still_refuses_vllms_flag_where_an_option_stands(capsys, batch_run):
    _, files = batch_run
    status, _, err = run_main(capsys, "run-batch", str(STORIES), *files, "--response-role", "-q", "-q", "x")
    assert status == 2 and "No such option: -q" in err


# ---- the benchmarks' and EngineArgs' argparse parsers ----------------------------------------------------------

def test_bench_serving_keeps_a_prompt_that_reads_like_an_option():
    # argparse takes a word with a space as a value; read as --num-prompts=5 it was an option.
    args = serving.parse_args(["--prompt", "--num_prompts=5 more", "--num_prompts", "3"])
    assert args.prompt == ["--num_prompts=5 more"] and args.num_prompts == 3


def test_bench_serving_gaps_keeps_a_file_named_after_a_double_dash():
    args = serving_gaps.parse_args(["--window_ms", "5", "--", "--window_ms"])
    assert args.result_file == "--window_ms" and args.window_ms == 5


def test_flexible_argument_parser_keeps_values_with_underscores():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="engine"))
    args = parser.parse_args(["--tokenizer", "--my_tokenizer dir", "--served_model_name", "a", "--b_c d",
                              "--max_model_len", "64"])
    assert args.tokenizer == "--my_tokenizer dir" and args.served_model_name == ["a", "--b_c d"]
    assert args.max_model_len == 64
