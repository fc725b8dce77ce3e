"""Which files name a model's EOS ids, as vLLM reads them: generation_config.json where the model has one,
config.json's eos_token_id only where it has none (transformers' GenerationConfig falls back to it)."""
from __future__ import annotations

import json

import pytest

from minillm import LLM, SamplingParams


def model_dir(stories_path, root, generation_config: dict | None):
    """stories260K with config.json naming EOS ids 2 and 1 (its stories end on 1), and the given
    generation_config.json (None: no such file)."""
    root.mkdir()
    for f in stories_path.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            (root / f.name).symlink_to(f)
    config = json.loads((stories_path / "config.json").read_text()) | {"eos_token_id": [2, 1]}
    (root / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (root / "generation_config.json").write_text(json.dumps(generation_config))
    return root


@pytest.mark.parametrize("generation_config, stops_on_1", [
    (None, True),                                             # no file: config.json's ids count
    ({"bos_token_id": 1, "eos_token_id": 2}, False),          # the file names EOS 2 only
    ({"bos_token_id": 1}, False),                             # a file without eos_token_id: the tokenizer's EOS
    ({"eos_token_id": [2, 1]}, True),                         # the file names both
])
def test_config_json_eos_ids_count_only_without_a_generation_config(stories_path, tmp_path, generation_config,
                                                                    stops_on_1):
    path = model_dir(stories_path, tmp_path / "model", generation_config)
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)
    try:
        assert (1 in llm.llm_engine.eos_token_ids) == stops_on_1
        out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=450))[0].outputs[0]
    finally:
        llm.shutdown()
    if stops_on_1:
        assert out.finish_reason == "stop" and out.token_ids[-1] == 1 and out.stop_reason == 1
    else:
        assert 1 in out.token_ids[:-1]          # the story's end token is text here, and the story goes on
