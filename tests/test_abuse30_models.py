"""Model directories as they are found in the wild: a config.json without "architectures" (older
exports and hand-written configs name only the model_type, which transformers' Auto classes read),
or with neither; a snapshot in the model store listed by `minillm list` the same way."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_chat import STORIES, needs_stories

from minillm.loader import load_model_config
from minillm.model_store import _runnable_note


def stories_copy(tmp_path: Path, name: str = "model", **config_changes) -> Path:
    """stories260K copied into tmp_path with config.json changed (None: the key removed)."""
    out = tmp_path / name
    shutil.copytree(STORIES, out)
    for path in [out, *out.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    config = json.loads((out / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


@needs_stories
@pytest.mark.parametrize("architectures", [None, []])
def test_a_config_with_only_its_model_type_loads_as_that_architecture(tmp_path, architectures):
    """{"model_type": "llama"} without "architectures" was "unsupported architecture none
    (model_type 'llama')", though llama is supported and transformers loads it by its model_type."""
    from minillm import LLM, SamplingParams
    path = stories_copy(tmp_path, architectures=architectures)
    assert load_model_config(path).architecture == "llama"
    assert _runnable_note(path) == ""
    reference = LLM(str(STORIES), device="cpu").generate(["Once upon"], SamplingParams(temperature=0, max_tokens=6))
    copied = LLM(str(path), device="cpu").generate(["Once upon"], SamplingParams(temperature=0, max_tokens=6))
    assert copied[0].outputs[0].text == reference[0].outputs[0].text


@needs_stories
@pytest.mark.parametrize("changes, message", [
    ({"architectures": None, "model_type": "gpt2"},
     "unsupported model_type 'gpt2' (config.json lists no architectures); supported: LlamaForCausalLM"),
    ({"architectures": None, "model_type": None},
     'config.json names no architecture (neither "architectures" nor "model_type"); supported: LlamaForCausalLM'),
    ({"architectures": ["FooForCausalLM"], "model_type": "llama"},
     "unsupported architecture FooForCausalLM; supported: LlamaForCausalLM"),
])
def test_a_config_naming_no_supported_architecture_says_what_it_names(tmp_path, changes, message):
    path = stories_copy(tmp_path, **changes)
    with pytest.raises(ValueError) as raised:
        load_model_config(path)
    assert message in str(raised.value)
    assert _runnable_note(path).endswith("not supported")
