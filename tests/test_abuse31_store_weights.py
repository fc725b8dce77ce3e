"""Which weight files a pull fetches, from the Hub's list of the repo's files (no network: the Hub's
client is stood in for)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import minillm.model_store as store


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A Hub whose repo holds `files`; the snapshot_download calls made, and the folder each returns."""
    calls = []

    def model_info(self, repo_id, revision=None, timeout=None):
        return SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in hub.files])

    def snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, ignore_patterns=None,
                          local_files_only=False):
        calls.append({"allow": allow_patterns, "ignore": ignore_patterns})
        folder = tmp_path / "snap"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text("{}")
        return str(folder)

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub = SimpleNamespace(files=[], calls=calls)
    return hub


MISTRAL = ["config.json", "consolidated.safetensors", "model-00001-of-00003.safetensors",
           "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors", "model.safetensors.index.json",
           "params.json", "tokenizer.json", "tokenizer.model.v3"]


def test_a_mistral_repo_is_fetched_without_its_consolidated_copy_of_the_weights(hub, tmp_path):
    # consolidated.safetensors (Mistral's own format) was fetched beside the Hugging Face shards:
    # the weights twice (14 GB more for Mistral-7B), of which minillm reads one copy.
    hub.files = MISTRAL
    store.download_model("mistralai/Mistral-7B-Instruct-v0.3", str(tmp_path / "store"))
    [call] = hub.calls
    assert "consolidated*.safetensors" in call["ignore"] and "*.safetensors" in call["allow"]


@pytest.mark.parametrize("files", [["config.json", "model.safetensors", "tokenizer.json"],
                                   ["config.json", "consolidated.safetensors"]])
def test_other_repos_are_fetched_whole(hub, tmp_path, files):
    hub.files = files
    store.download_model("org/model", str(tmp_path / "store"))
    assert hub.calls == [{"allow": store.DOWNLOAD_PATTERNS, "ignore": None}]


def test_a_repo_of_bin_weights_is_named_before_anything_is_fetched(hub, tmp_path):
    # Only the json and tokenizer files came down; the load then said only "no *.safetensors weights".
    hub.files = ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                 "pytorch_model.bin.index.json", "tokenizer.json"]
    with pytest.raises(store.NoSafetensors, match=r"org/old has no safetensors weights \(pytorch_model-00001-of-00002"
                                                   r"\.bin, pytorch_model-00002-of-00002\.bin\); minillm reads "
                                                   r"safetensors"):
        store.download_model("org/old", str(tmp_path / "store"))
    assert hub.calls == []
