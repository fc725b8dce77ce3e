"""Memory held by a long-running server: the tokenizers library's BPE word cache, which keeps each
distinct prompt of a tokenizer without a pre-tokenizer (10,000 a thread), is turned off there."""
import types

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

import minillm.tokenizer as tokenizer_module
from minillm.tokenizer import Tokenizer


class RecordingBPE:
    """Stands in for a backend's BPE model: forwards to it and records the cache capacities set."""

    def __init__(self, model):
        self.model, self.capacities = model, []

    def _resize_cache(self, capacity):
        self.capacities.append(capacity)
        self.model._resize_cache(capacity)

    def __getattr__(self, name):
        return getattr(self.model, name)


class RecordingBackend:
    """A real tokenizers.Tokenizer whose model is a RecordingBPE (a Rust model records nothing)."""

    def __init__(self, backend):
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "model", RecordingBPE(backend.model))

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def __setattr__(self, name, value):
        setattr(self.backend, name, value)


@pytest.fixture
def loaded(monkeypatch):
    """Tokenizer.from_pretrained that keeps each backend it built (as a RecordingBackend)."""
    built = []

    def from_file(path):
        built.append(RecordingBackend(tokenizers.Tokenizer.from_file(path)))
        return built[-1]
    fake = types.SimpleNamespace(**vars(tokenizers))
    fake.Tokenizer = types.SimpleNamespace(from_file=from_file)
    fake.models = types.SimpleNamespace(**vars(models))
    fake.models.BPE = RecordingBPE
    monkeypatch.setattr(tokenizer_module, "tokenizers", fake)
    return built


def test_a_bpe_tokenizer_without_pre_tokenizer_keeps_no_word_cache(loaded, stories_path):
    tok = Tokenizer.from_pretrained(stories_path)
    assert tok.backend.pre_tokenizer is None
    assert loaded[0].model.capacities == [0]
    assert tok.encode("Once upon a time", add_special_tokens=False)   # the backend still encodes


def test_a_pre_tokenized_bpe_tokenizer_keeps_its_word_cache(loaded, stories_path, tmp_path):
    # Words split by a pre-tokenizer repeat across prompts: that cache is bounded by the words seen.
    backend = tokenizers.Tokenizer.from_file(str(stories_path / "tokenizer.json"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    for name in ("tokenizer_config.json", "config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((stories_path / name).read_bytes())
    backend.save(str(tmp_path / "tokenizer.json"))
    Tokenizer.from_pretrained(tmp_path)
    assert loaded[0].model.capacities == []
