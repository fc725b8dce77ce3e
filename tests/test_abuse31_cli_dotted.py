"""vLLM's dotted form of a JSON option (--speculative-config.method ngram): folded into the option."""
from __future__ import annotations

import json

import pytest
from test_abuse23_cli import run_bytes
from test_chat import STORIES, needs_stories

from minillm.cli import UsageError, dotted_json_options

OPTIONS = {"--speculative-config", "--kv-transfer-config"}


def test_dotted_keys_make_the_options_json_object():
    args = ["m", "--speculative-config.method", "ngram", "-p", "x", "--speculative-config.num_speculative_tokens=3"]
    out = dotted_json_options(args, OPTIONS)
    assert out[:3] == ["m", "--speculative-config", out[2]] and out[3:] == ["-p", "x"]
    assert json.loads(out[2]) == {"method": "ngram", "num_speculative_tokens": 3}


def test_dotted_keys_go_over_a_whole_object_given_too_and_nest_and_append():
    args = ["--kv-transfer-config", '{"kv_role": "kv_producer", "kv_port": 1}', "--kv-transfer-config.kv_port", "5",
            "--kv-transfer-config.extra.a+", "1", "--kv-transfer-config.extra.a+", "x"]
    out = dotted_json_options(args, OPTIONS)
    assert out[0] == "--kv-transfer-config" and len(out) == 2
    assert json.loads(out[1]) == {"kv_role": "kv_producer", "kv_port": 5, "extra": {"a": [1, "x"]}}


def test_without_dotted_keys_the_arguments_are_untouched():
    args = ["--speculative-config", "not json", "--", "--speculative-config.method", "x"]
    assert dotted_json_options(args, OPTIONS) == args


@pytest.mark.parametrize("args, message", [
    (["--speculative-config.method"], "--speculative-config.method needs a value"),
    (["--speculative-config.", "x", "--speculative-config.a..b", "1"], "an empty key"),
    (["--speculative-config", "[1]", "--speculative-config.method", "ngram"], "takes a JSON object"),
])
def test_bad_dotted_forms_are_usage_errors(args, message):
    with pytest.raises(UsageError, match=message):
        dotted_json_options(args, OPTIONS)


@needs_stories
def test_generate_takes_the_dotted_speculative_config_as_vllm_does():
    # "No such option: --speculative-config.method (Possible options: --speculative-config)", status 2.
    common = ("generate", str(STORIES), "--device", "cpu", "-p", "Once", "--max-tokens", "8", "--temperature", "0",
              "--json")
    dotted = run_bytes(*common, "--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "3")
    whole = run_bytes(*common, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert dotted.returncode == whole.returncode == 0, dotted.stderr
    assert dotted.stdout == whole.stdout
    bad = run_bytes(*common, "--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "-1")
    assert bad.returncode == 2 and "Invalid value for '--speculative-config': num_speculative_tokens" in bad.stderr
