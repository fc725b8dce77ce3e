"""Length boundaries as vLLM users drive them: --max-model-len in vLLM's forms (1k, 1K, auto, -1)."""
from __future__ import annotations

import json

import pytest
from test_abuse29b_cli import one_line
from test_cli import STORIES, needs_stories, run_main

from minillm.config import EngineConfig, parse_max_model_len

WORDS = " ".join(["a"] * 120)      # 121 tokens of stories260K (BOS and one a word)


@pytest.mark.parametrize("text, expected", [
    ("2048", 2048), ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("2m", 2_000_000), ("1M", 2**20),
    (" 64 ", 64), ("auto", None), ("AUTO", None), ("-1", None),
])
def test_max_model_len_reads_vllms_human_readable_counts(text, expected):
    assert parse_max_model_len(text) == expected


@pytest.mark.parametrize("text", ["1.5K", "64.5", "abc", "-2", "", "1kk", "k"])
def test_a_max_model_len_of_no_such_form_names_the_forms(text):
    with pytest.raises(ValueError, match=r"max_model_len must be a token count \(2048, 1k = 1000"):
        parse_max_model_len(text)


def test_max_model_len_minus_one_in_the_python_api_is_the_models_length():
    assert EngineConfig(model="m", max_model_len=-1).max_model_len is None
    with pytest.raises(ValueError, match="max_model_len must be >= 1, got -2"):
        EngineConfig(model="m", max_model_len=-2)


@needs_stories
def test_generate_takes_a_max_model_len_with_a_suffix(capsys):
    status, _, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "--max-model-len", "0.1k",
                              "-p", WORDS, "--max-tokens", "1")
    assert status == 2 and "has 121 tokens, which leaves no room under --max-model-len 100" in err, err
    status, _, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "--max-model-len", "1K",
                              "-p", "Once")
    assert status == 2 and "'--max-model-len': 1024 exceeds the model's max_position_embeddings 512" in one_line(err)


@needs_stories
@pytest.mark.parametrize("value", ["auto", "-1"])
def test_generate_with_max_model_len_auto_takes_the_models_length(capsys, value):
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "--max-model-len", value,
                                "-p", WORDS, "--max-tokens", "2", "--ignore-eos", "--json")
    assert status == 0, err
    record = json.loads(out)
    assert len(record["prompt_token_ids"]) == 121 and len(record["outputs"][0]["token_ids"]) == 2
    assert "max_model_len 512" in err


def test_a_bad_max_model_len_is_a_usage_error_naming_the_option(capsys):
    status, _, err = run_main(capsys, "generate", "m", "-p", "x", "--max-model-len", "1.5K")
    assert status == 2
    assert one_line(err).startswith("minillm generate: error: Invalid value for '--max-model-len': must be a "
                                    "token count (2048, 1k = 1000, 1K = 1024, 25.6k), or auto"), err
