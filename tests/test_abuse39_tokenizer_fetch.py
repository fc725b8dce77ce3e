"""A tokenizer fetched apart from its model (--tokenizer ORG/NAME) brings the files its chat template can live in."""
import fnmatch
import json
import shutil
from pathlib import Path

from minillm import model_store
from minillm.tokenizer import Tokenizer

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"


def test_tokenizer_repo_fetch_brings_its_chat_template_json(tmp_path, monkeypatch):
    hub = tmp_path / "hub"                              # what the hub repo holds
    hub.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, hub / name)
    config = json.loads((hub / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (hub / "tokenizer_config.json").write_text(json.dumps(config))
    (hub / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!"}))
    (hub / "model.safetensors").write_bytes(b"not asked for")
    fetched = tmp_path / "snapshot"

    def fake_fetch(repo_id, download_dir, revision, could_be_path, patterns):
        """snapshot_download with allow_patterns: only the files the patterns match arrive."""
        fetched.mkdir()
        for f in hub.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in patterns):
                shutil.copy(f, fetched / f.name)
        return fetched

    monkeypatch.setattr(model_store, "_fetch", fake_fetch)
    monkeypatch.setattr(model_store, "cached_snapshot", lambda *a, **k: None)
    monkeypatch.setattr(model_store, "check_store", lambda *a, **k: None)
    path = model_store.resolve_tokenizer_path("someorg/sometokenizer", str(tmp_path / "store"))
    assert (path / "chat_template.json").is_file()
    assert not (path / "model.safetensors").exists()
    tok = Tokenizer.from_pretrained(path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"
