"""A safetensors index whose shard names point out of the model directory; a torch_dtype that is no float dtype."""
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


@pytest.mark.parametrize("dtype", ["float8", "int8"])
def test_a_torch_dtype_that_is_no_float_dtype_is_warned_about(stories_path, tmp_path, caplog, dtype):
    # it fell back to bfloat16 (float32 on the CPU) without a word; transformers refuses such a config
    folder = stories_copy(stories_path, tmp_path / "m", torch_dtype=dtype)
    with caplog.at_level("WARNING", logger="minillm"):
        assert load_model_config(folder).torch_dtype == dtype
    assert f"torch_dtype '{dtype}' is no float dtype" in caplog.text


def test_a_float_torch_dtype_is_not_warned_about(stories_path, tmp_path, caplog):
    folder = stories_copy(stories_path, tmp_path / "m", torch_dtype="torch.bfloat16")
    with caplog.at_level("WARNING", logger="minillm"):
        assert load_model_config(folder).torch_dtype == "bfloat16"
    assert "float dtype" not in caplog.text
