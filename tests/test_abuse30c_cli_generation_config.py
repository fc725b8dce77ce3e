"""A model whose generation_config.json is not valid JSON loads without it, with a warning naming the
file, as transformers and vLLM load it (vLLM's try_get_generation_config catches the OSError that
transformers raises for it); it refused the whole model."""
from __future__ import annotations

import logging

import pytest
from test_cli import STORIES, needs_stories

from minillm.tokenizer import Tokenizer


def stories_with_generation_config(tmp_path, data: bytes):
    """stories260K (its files linked) with DATA as its generation_config.json."""
    for f in STORIES.iterdir():
        if f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").write_bytes(data)
    return tmp_path


@needs_stories
@pytest.mark.parametrize("data", [b"{bad", b'{"eos_token_id": 2,}', b'{"a": "\xff"}', b""])
def test_a_generation_config_that_is_not_json_is_a_warning_naming_it(tmp_path, caplog, data):
    path = stories_with_generation_config(tmp_path, data)
    with caplog.at_level(logging.WARNING, logger="minillm"):
        tokenizer = Tokenizer.from_pretrained(path)
    [warning] = [r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage()]
    assert f"{path / 'generation_config.json'} is not valid JSON" in warning and "without it" in warning, warning
    assert tokenizer.generation_defaults == {} and tokenizer.encode("Once upon a time")


@needs_stories
def test_a_model_with_such_a_file_generates(tmp_path, caplog):
    from minillm import LLM, SamplingParams
    path = stories_with_generation_config(tmp_path, b"{bad")
    with caplog.at_level(logging.WARNING, logger="minillm"):
        llm = LLM(str(path), device="cpu")
    [out] = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=3))
    assert out.outputs[0].token_ids
    assert any("generation_config.json is not valid JSON" in r.getMessage() for r in caplog.records)


@needs_stories
def test_one_that_holds_no_object_is_still_refused_naming_it(tmp_path):
    # transformers fails on it too (not an OSError vLLM catches): no defaults to guess from it.
    path = stories_with_generation_config(tmp_path, b"[1]")
    with pytest.raises(ValueError, match="generation_config.json must hold a JSON object"):
        Tokenizer.from_pretrained(path)
