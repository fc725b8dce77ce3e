"""A safetensors index whose shard names point out of the model directory."""
from __future__ import annotations

import json

import pytest
from test_abuse37_model_files import stories_copy

from minillm.loader import load_model_config, load_weights


def sharded_copy(stories_path, folder, shard_name):
    """A copy of stories260K whose index names every tensor in shard_name (written where it points)."""
    from safetensors.numpy import load_file, save_file
    folder = stories_copy(stories_path, folder)
    (folder / "model.safetensors").unlink()
    tensors = load_file(str(stories_path / "model.safetensors"))
    target = folder / shard_name
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard_name for n in tensors}}))
    return folder


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors"])
def test_a_shard_named_outside_the_model_directory_is_refused(stories_path, tmp_path, shard):
    # the loader read a file outside the directory the model was given as (vLLM reads only the
    # directory's own files)
    folder = sharded_copy(stories_path, tmp_path / "m", shard)
    with pytest.raises(ValueError, match="names shard .*outside.safetensors.*not a file of the model directory"):
        load_weights(folder, load_model_config(folder), "float32")


def test_a_shard_named_by_an_absolute_path_is_refused(stories_path, tmp_path):
    folder = sharded_copy(stories_path, tmp_path / "m", str(tmp_path / "elsewhere" / "all.safetensors"))
    with pytest.raises(ValueError, match="not a file of the model directory"):
        load_weights(folder, load_model_config(folder), "float32")


def test_a_shard_in_a_subfolder_of_the_model_directory_is_read(stories_path, tmp_path):
    folder = sharded_copy(stories_path, tmp_path / "m", "shards/./all.safetensors")
    weights = load_weights(folder, load_model_config(folder), "float32")
    assert weights["model.norm.weight"].shape == (64,)
