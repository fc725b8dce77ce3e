"""Abbreviated option names as vLLM's parsers take them (argparse's allow_abbrev, on in vLLM's
FlexibleArgumentParser): an unambiguous prefix of an option is that option (--max-model 512, --temp 0,
--max_model=512), an ambiguous one is a usage error naming the options it could be, and an option's value
that looks like an abbreviated flag is kept as written; the counts vLLM reads with its human_readable_int
(--max-num-batched-tokens 8K) as vLLM reads them."""
from __future__ import annotations

import json

import pytest
import typer.main
from test_abuse29b_cli import one_line
from test_cli import STORIES, needs_stories, run_main

from minillm.argparse_utils import AmbiguousOption, FlexibleArgumentParser, completed_option_words
from minillm.cli import app
from minillm.engine_args import EngineArgs

NAMES = {"--max-model-len", "--max-num-seqs", "--temperature", "--no-enable-prefix-caching", "--enable-prefix-caching",
         "--prompt"}
COUNTS = {"--max-model-len": 1, "--max-num-seqs": 1, "--temperature": 1, "--prompt": 1, "-p": 1,
          "--enable-prefix-caching": 0, "--no-enable-prefix-caching": 0}


def parsed(command: str, *args: str) -> dict:
    """The parameters minillm COMMAND parses ARGS into (parsing only: nothing is loaded or served)."""
    ctx = typer.main.get_command(app).commands[command].make_context(command, list(args))
    return ctx.params


# ---- completing an abbreviated option word ------------------------------------------------------------------

@pytest.mark.parametrize("args, completed", [
    (["--max-model", "5"], ["--max-model-len", "5"]),
    (["--max_model=5"], ["--max-model-len=5"]),
    (["--temp", "0", "--no-enable-pre"], ["--temperature", "0", "--no-enable-prefix-caching"]),
    (["-p", "--temp", "--temp", "--max-model"], ["-p", "--temp", "--temperature", "--max-model"]),   # values kept
    (["--prom", "--max-model"], ["--prompt", "--max-model"]),        # the completed option's value is a value
    (["--", "--temp"], ["--", "--temp"]),
    (["--frobnicate", "--max-model-len", "7"], ["--frobnicate", "--max-model-len", "7"]),
])
def test_an_unambiguous_prefix_is_completed_where_an_option_may_stand(args, completed):
    assert completed_option_words(args, NAMES, COUNTS) == completed


def test_an_ambiguous_prefix_names_every_option_it_could_be():
    with pytest.raises(AmbiguousOption, match="ambiguous option: --max could match --max-model-len, --max-num-seqs"):
        completed_option_words(["--max", "5"], NAMES, COUNTS)


# ---- minillm's commands --------------------------------------------------------------------------------------

def test_generate_takes_abbreviated_options_as_vllm_does():
    # "No such option: --max-model (Possible options: --max-model-len)", exit 2: vLLM takes it.
    params = parsed("generate", str(STORIES), "-p", "x", "--max-model", "64", "--temp", "0.5", "--max_tok=3",
                    "--no-enable-prefix")
    assert (params["max_model_len"], params["temperature"], params["max_tokens"]) == (64, 0.5, 3)
    assert params["enable_prefix_caching"] is False


def test_a_prompt_that_looks_like_an_abbreviated_flag_stays_the_prompt():
    params = parsed("generate", str(STORIES), "-p", "--temp", "-p", "--max_model")
    assert list(params["prompt"]) == ["--temp", "--max_model"] and params["temperature"] is None
    assert params["max_model_len"] is None


def test_an_ambiguous_prefix_is_a_usage_error(capsys):
    status, _, err = run_main(capsys, "generate", str(STORIES), "-p", "x", "--max", "64")
    line = one_line(err)
    assert status == 2 and line.startswith("minillm generate: error: ambiguous option: --max could match ")
    assert "--max-model-len" in line and "--max-tokens" in line


def test_a_prefix_of_a_vllm_flag_minillm_lacks_gets_its_reason(capsys):
    status, _, err = run_main(capsys, "generate", str(STORIES), "-p", "x", "--quant", "awq")
    assert status == 2 and "--quantization: minillm runs unquantized weights only" in one_line(err)


def test_serve_spreads_and_folds_abbreviated_options():
    params = parsed("serve", str(STORIES), "--served-model", "a", "b", "--api-k", "k1", "k2", "--max_num_s", "3",
                    "--speculative.method", "ngram", "--speculative.num_speculative_tokens", "2")
    assert params["served_model_name"] == ["a", "b"] and params["api_key"] == ["k1", "k2"]
    assert params["max_num_seqs"] == 3
    assert json.loads(params["speculative_config"]) == {"method": "ngram", "num_speculative_tokens": 2}


def test_a_config_file_key_may_be_a_prefix_and_the_command_line_still_wins(tmp_path, capsys):
    config = tmp_path / "options.yaml"
    config.write_text("max-model: 64\nmax_num_s: 3\n")
    params = parsed("serve", str(STORIES), "--config", str(config))
    assert (params["max_model_len"], params["max_num_seqs"]) == (64, 3)
    assert parsed("serve", str(STORIES), "--max-mod", "32", "--config", str(config))["max_model_len"] == 32
    config.write_text("max: 5\n")
    status, _, err = run_main(capsys, "serve", str(STORIES), "--config", str(config))
    assert status == 2 and "max: ambiguous option: --max could match" in one_line(err)


def test_a_flexible_parser_completes_an_underscored_prefix():
    args = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="engine")).parse_args(
        ["--max_model", "1k", "--max_num_batched=2K"])
    assert (args.max_model_len, args.max_num_batched_tokens) == (1000, 2048)


# ---- vLLM's human-readable counts ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, count", [("1K", 1024), ("2k", 2000), ("2.5k", 2500), ("8192", 8192)])
def test_max_num_batched_tokens_takes_vllms_suffixes(text, count):
    # "Invalid value for '--max-num-batched-tokens': ... unable to parse string as an integer": vLLM takes 1K.
    assert parsed("generate", str(STORIES), "-p", "x", "--max-num-batched-tokens", text)["max_num_batched_tokens"] == count


@pytest.mark.parametrize("option", ["--max-num-batched-tokens", "--max-model-len"])
def test_a_decimal_with_a_power_of_two_suffix_suggests_the_power_of_ten(capsys, option):
    status, _, err = run_main(capsys, "generate", str(STORIES), "-p", "x", option, "1.5K")
    line = one_line(err)
    assert status == 2 and f"Invalid value for '{option}'" in line and "did you mean 1.5k?" in line


@needs_stories
def test_generate_runs_with_abbreviated_options(capsys):
    common = ("generate", str(STORIES), "--device", "cpu", "-p", "Once", "--json")
    status, short, err = run_main(capsys, *common, "--max-tok", "4", "--temp", "0", "--max-model", "64",
                                  "--max-num-batched", "1K")
    assert status == 0, err
    status, full, err = run_main(capsys, *common, "--max-tokens", "4", "--temperature", "0", "--max-model-len", "64",
                                 "--max-num-batched-tokens", "1024")
    assert status == 0, err
    assert short == full and len(json.loads(short)["outputs"][0]["token_ids"]) == 4
