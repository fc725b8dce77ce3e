"""Which weight files of a checkpoint directory are read: model.safetensors beside a stale
model.safetensors.index.json is the checkpoint, as transformers' from_pretrained takes it (its
local-directory rule tries SAFE_WEIGHTS_NAME before SAFE_WEIGHTS_INDEX_NAME); minillm read the index,
and loaded the stale shards or refused the directory for a shard gone. The store's list and a pull
follow the same rule."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import minillm.model_store as store
import test_abuse31_store_weights
from minillm.loader import load_model_config, load_weights

from test_cli import STORIES, needs_stories
from test_loader import save_numpy_checkpoint

hub = test_abuse31_store_weights.hub      # a Hub whose repo holds hub.files (fixture)


def stale_index(path, shards: dict[str, dict[str, np.ndarray]]) -> None:
    """Write these shards (file -> tensors; an empty dict: a shard named but not there) and an index naming them."""
    from safetensors.numpy import save_file
    weight_map = {}
    for file, tensors in shards.items():
        if tensors:
            save_file(tensors, str(path / file))
        weight_map.update(dict.fromkeys(tensors or ["model.norm.weight"], file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_model_safetensors_wins_over_a_stale_index_with_its_shards(tmp_path):
    path, state = save_numpy_checkpoint(tmp_path / "m", "llama")
    old = {name: np.zeros_like(value) for name, value in state.items()}
    stale_index(path, {"model-00001-of-00001.safetensors": old})
    weights = load_weights(path, load_model_config(path), "float32")
    assert set(weights) == set(state) and all(np.array_equal(weights[n], state[n]) for n in state)


def test_model_safetensors_wins_over_an_index_naming_a_missing_shard(tmp_path):
    path, state = save_numpy_checkpoint(tmp_path / "m", "llama")
    stale_index(path, {"model-00001-of-00002.safetensors": {}})
    weights = load_weights(path, load_model_config(path), "float32")
    assert all(np.array_equal(weights[n], state[n]) for n in state)


def test_transformers_reads_the_same_file(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path, state = save_numpy_checkpoint(tmp_path / "m", "llama", model_type="llama")
    stale_index(path, {"model-00001-of-00001.safetensors": {n: np.zeros_like(v) for n, v in state.items()}})
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    expected = model.state_dict()["model.norm.weight"].numpy()
    weights = load_weights(path, load_model_config(path), "float32")
    assert np.array_equal(weights["model.norm.weight"], expected)
    assert np.array_equal(expected, state["model.norm.weight"])


def test_a_sharded_checkpoint_still_reads_its_index(tmp_path):
    path, state = save_numpy_checkpoint(tmp_path / "m", "llama", shard_files=2)
    weights = load_weights(path, load_model_config(path), "float32")
    assert all(np.array_equal(weights[n], state[n]) for n in state)


@needs_stories
def test_the_store_lists_a_snapshot_with_model_safetensors_and_a_stale_index_as_runnable(tmp_path):
    folder = tmp_path / "store" / "models--org--stale"
    snap = folder / "snapshots" / "abc"
    shutil.copytree(STORIES, snap)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("abc")
    stale_index(snap, {"model-00001-of-00002.safetensors": {}})
    [model] = store.list_local_models(str(tmp_path / "store"))
    assert model.note == "" and model.path == snap
    assert store.cached_snapshot("org/stale", str(tmp_path / "store")) == snap


def test_a_pull_of_a_repo_with_model_safetensors_leaves_its_shards_out(hub, tmp_path):
    # transformers fetches model.safetensors alone from such a repo; the shards were fetched too
    # (the weights twice) and then read in its place.
    hub.files = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"]
    store.download_model("org/both", str(tmp_path / "store"))
    [call] = hub.calls
    assert set(call["ignore"]) >= {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert "model.safetensors" not in call["ignore"]


@needs_stories
def test_a_snapshot_whose_model_safetensors_links_to_nothing_is_not_runnable_beside_other_weights(tmp_path):
    # The loader (and transformers) reads model.safetensors alone when it is there, so another
    # *.safetensors beside a link to a deleted blob does not make the snapshot runnable; it was listed
    # as runnable and the load then failed.
    from safetensors.numpy import save_file
    folder = tmp_path / "store" / "models--org--gone"
    snap = folder / "snapshots" / "abc"
    shutil.copytree(STORIES, snap, ignore=shutil.ignore_patterns("model.safetensors"))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("abc")
    (snap / "model.safetensors").symlink_to("../../blobs/gone")
    save_file({"layers.0.attention.wq.weight": np.ones((4, 4), np.float32)}, str(snap / "consolidated.safetensors"))
    [model] = store.list_local_models(str(tmp_path / "store"))
    assert model.note == "incomplete download"
    assert store.cached_snapshot("org/gone", str(tmp_path / "store")) is None


@pytest.mark.parametrize("weights", [["model.safetensors"],
                                     ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                      "model.safetensors.index.json"]])
def test_a_pull_leaves_out_safetensors_in_subfolders(hub, tmp_path, weights):
    # The loader reads the weights at the top of the snapshot only (as transformers without
    # subfolder=): a repo's other copies in folders of their own (a quantized variant, an export)
    # were fetched too and never read.
    import fnmatch
    nested = ["gptq-4bit/model.safetensors", "onnx/sub/model-00001-of-00001.safetensors"]
    hub.files = ["config.json", "tokenizer.json", *weights, *nested]
    store.download_model("org/variants", str(tmp_path / "store"))
    [call] = hub.calls
    ignored = [f for f in hub.files if any(fnmatch.fnmatch(f, pattern) for pattern in call["ignore"] or [])]
    assert ignored == nested
