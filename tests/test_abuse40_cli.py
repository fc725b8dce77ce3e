"""Option names with underscores wherever vLLM's parser takes them: a JSON option's dotted form
(--speculative_config.method ngram), and EngineArgs.add_cli_args on vLLM's FlexibleArgumentParser
(--max_model_len 512); the name before a "." or "=" is read with dashes, keys and values keep their own
spelling, and a misspelled name is still refused."""
from __future__ import annotations

import json

import pytest
from test_abuse29b_cli import one_line
from test_cli import STORIES, needs_stories, run_main

from minillm.argparse_utils import FlexibleArgumentParser, dashed_option_word
from minillm.cli import dotted_json_options
from minillm.engine_args import EngineArgs

OPTIONS = {"--speculative-config", "--kv-transfer-config"}


# ---- a JSON option's dotted form, its name with underscores ------------------------------------------------

def test_dotted_keys_under_an_underscored_name_make_the_options_json_object():
    # "No such option: --speculative_config.method (Possible options: --speculative-config)".
    args = ["m", "--speculative_config.method", "ngram", "-p", "x", "--speculative_config.num_speculative_tokens=3"]
    out = dotted_json_options(args, OPTIONS)
    assert out[:2] == ["m", "--speculative-config"] and out[3:] == ["-p", "x"]
    assert json.loads(out[2]) == {"method": "ngram", "num_speculative_tokens": 3}    # keys as they were written


def test_an_underscored_whole_object_merges_with_dotted_keys():
    args = ["--kv_transfer_config", '{"kv_role": "kv_producer", "kv_port": 1}', "--kv-transfer-config.kv_port", "5"]
    out = dotted_json_options(args, OPTIONS)
    assert out[0] == "--kv-transfer-config" and len(out) == 2
    assert json.loads(out[1]) == {"kv_role": "kv_producer", "kv_port": 5}


def test_words_after_a_bare_double_dash_keep_their_underscores():
    args = ["--speculative_config.method", "ngram", "--", "--speculative_config.method", "x"]
    out = dotted_json_options(args, OPTIONS)
    assert out[:2] == ["--speculative-config", '{"method": "ngram"}'] and out[2:] == args[2:]


@needs_stories
def test_generate_takes_the_dotted_form_under_an_underscored_name(capsys):
    common = ("generate", str(STORIES), "--device", "cpu", "-p", "Once", "--max_tokens", "6", "--temperature", "0",
              "--json")
    status, dotted, err = run_main(capsys, *common, "--speculative_config.method", "ngram",
                                   "--speculative_config.num_speculative_tokens=2")
    assert status == 0, err
    status, whole, err = run_main(capsys, *common, "--speculative_config",
                                  '{"method": "ngram", "num_speculative_tokens": 2}')
    assert status == 0, err
    assert dotted == whole and len(json.loads(dotted)["outputs"][0]["token_ids"]) == 6


def test_a_misspelled_dotted_name_is_still_refused_with_the_close_option(capsys):
    status, _, err = run_main(capsys, "serve", str(STORIES), "--speculative_confg.method", "ngram")
    line = one_line(err)
    assert status == 2 and "No such option: --speculative_confg.method" in line
    assert "--speculative-config" in line


# ---- EngineArgs.add_cli_args on FlexibleArgumentParser ------------------------------------------------------

@pytest.mark.parametrize("arg, dashed", [
    ("--max_model_len", "--max-model-len"),
    ("--max_model_len=1_024", "--max-model-len=1_024"),                 # the value keeps its spelling
    ("--speculative_config.num_speculative_tokens=3", "--speculative-config.num_speculative_tokens=3"),
    ("--no_enable_prefix_caching", "--no-enable-prefix-caching"),
    ("-tp", "-tp"), ("my_model", "my_model"), ("-", "-"),
])
def test_dashed_option_word_reads_the_name_as_vllm_does(arg, dashed):
    assert dashed_option_word(arg) == dashed


def test_engine_args_from_a_flexible_parser_take_underscored_names():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="engine"))
    args = parser.parse_args(["--model", "my_model", "--max_model_len", "512", "--max_num_seqs=4",
                              "--no_enable_prefix_caching", "--served_model_name", "a_b", "c_d", "--seed=7"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.model, engine_args.max_model_len, engine_args.max_num_seqs) == ("my_model", 512, 4)
    assert engine_args.enable_prefix_caching is False and engine_args.seed == 7
    assert args.served_model_name == ["a_b", "c_d"]


def test_a_flexible_parser_still_refuses_a_misspelled_name(capsys):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="engine"))
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--max_modle_len", "512"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --max-modle-len 512" in capsys.readouterr().err
